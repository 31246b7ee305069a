"""Decode steps of one engine with an optimisation switched on and off in turns.

The machines are noisy and drift, so an A/B of whole steps is fairest inside one engine:
alternate steps run with the switch on and off, and neither side gets the quiet minutes.
A second engine on the same model, the switch always off, takes the same steps; the tokens
of both kinds of step must equal its tokens. Used by `benchmarks/greedy_head.py` and
`benchmarks/linear_rows.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from minserve.llm import LLM
from minserve.model.runner import ModelRunner
from minserve.sampling_params import SamplingParams

PROMPT_LEN = 128


def ab_decode_steps(
    base: LLM,
    batch: int,
    steps: int,
    switch: Callable[[ModelRunner, bool], None],
    names: tuple[str, str],
    fused_decode: bool = True,
) -> dict:
    """p10 / p50 ms of decode steps at `batch`, `switch(runner, True)` and `switch(runner,
    False)` in turns (the engine's model runner: switches of the CPU runner's own paths).

    names: (on, off) as the row's keys call them; the row also says whether every step's
    tokens equalled the switched-off reference engine's. `fused_decode=False`: both engines
    walk the layers in Python (to compare kernels on the same loop)."""
    on_name, off_name = names
    engines = {"ab": LLM(base.loaded).engine, "reference": LLM(base.loaded).engine}
    if not fused_decode:
        for engine in engines.values():
            engine.worker.runner.fused_decode = None
    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(100, 40000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)
    ]

    def step(name: str, on: bool) -> list[int]:
        switch(engines[name].worker.runner, on)
        return [o.outputs[0].token_ids[-1] for o in engines[name].step()]

    for name, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{name}-{i}", None, prompt, params)
        for _ in range(3):
            step(name, False)
    times: dict[str, list[float]] = {on_name: [], off_name: []}
    same = True
    for i in tqdm(range(steps), desc=f"engine steps, batch {batch}", leave=False):
        on = i % 2 == 0
        start = time.perf_counter()
        emitted = step("ab", on)
        times[on_name if on else off_name].append((time.perf_counter() - start) * 1e3)
        same &= emitted == step("reference", False)
    switch(True)
    row = {"batch": batch, "steps": steps, "same_tokens": same}
    for name, ms in times.items():
        ms.sort()
        row[f"{name}_p10_ms"] = round(ms[len(ms) // 10], 2)
        row[f"{name}_p50_ms"] = round(ms[len(ms) // 2], 2)
    row["speedup_p50"] = round(row[f"{off_name}_p50_ms"] / row[f"{on_name}_p50_ms"], 3)
    return row


def steps_table(rows: list[dict], names: tuple[str, str], labels: tuple[str, str]) -> list[str]:
    """`ab_decode_steps` rows as a markdown table: names as the rows' keys call the two
    sides (on, off), labels as the table's headers call them."""
    on, off = names
    on_label, off_label = labels
    return [
        f"| batch | {off_label} p10 | p50 | {on_label} p10 | p50 | speed-up (p50) | same tokens |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['batch']} | {r[f'{off}_p10_ms']} | {r[f'{off}_p50_ms']} | "
            f"{r[f'{on}_p10_ms']} | {r[f'{on}_p50_ms']} | {r['speedup_p50']}x | "
            f"{r['same_tokens']} |"
            for r in rows
        ),
    ]
