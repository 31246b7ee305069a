"""The C kernels (minserve/kernels) against plain torch on this CPU, side by side.

    .venv/bin/python -m benchmarks.cpu_kernels [--batches 1,5,16] [--steps 120]

1. One layer's decode attention (store + attend), SmolLM2's shapes, context 512: the
   torch backend against the C backend, alternating (minserve.viz.kernel_timing).
2. Whole engine decode steps of the bundled SmolLM2 (fp32): the plain-torch path
   (the model loaded with MINSERVE_C_KERNELS=0: torch attention, ops and oneDNN linears)
   against the default ("cpu": C attention, C RMSNorm / RoPE / SiLU, few-row linears, the
   C decode loop and the head's screen), two engines in one process taking steps in turns
   so that the machine's drift favours neither; the two must emit the same tokens.
   Writes cpu_kernels.json and cpu_kernels.md here.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.run_env import RunRecord, command_line
from minserve.environment import C_KERNELS
from minserve.llm import LLM
from minserve.sampling_params import SamplingParams
from minserve.viz.kernel_timing import time_decode_backends

HERE = Path(__file__).parent
PROMPT_LEN = 128


def engine_steps(batch: int, steps: int, bases: dict[str, LLM]) -> dict:
    """p10 / p50 decode step time of the torch path and the C path at `batch` sequences."""
    engines = {name: LLM(base.loaded).engine for name, base in bases.items()}
    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(100, 40000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)
    ]

    def step(name: str) -> tuple[float, list[int]]:
        start = time.perf_counter()
        outputs = engines[name].step()
        return time.perf_counter() - start, [o.outputs[0].token_ids[-1] for o in outputs]

    for name, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{name}-{i}", None, prompt, params)
        for _ in range(3):  # the prefill, then warm decode steps
            step(name)
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {name: [] for name in engines}
    for _ in tqdm(range(steps), desc=f"engine steps, batch {batch}", leave=False):
        for name in engines:
            seconds, emitted = step(name)
            times[name].append(seconds * 1e3)
            tokens[name].append(emitted)
    row = {"batch": batch, "steps": steps, "same_tokens": tokens["torch"] == tokens["cpu"]}
    for name, ms in times.items():
        ms.sort()
        row[f"{name}_p10_ms"] = round(ms[len(ms) // 10], 2)
        row[f"{name}_p50_ms"] = round(ms[len(ms) // 2], 2)
    row["speedup_p50"] = round(row["torch_p50_ms"] / row["cpu_p50_ms"], 3)
    return row


def torch_path() -> LLM:
    """The bundled model loaded with the C kernels off: the CPU platform's torch paths."""
    saved = os.environ.get(C_KERNELS)
    os.environ[C_KERNELS] = "0"
    try:
        return LLM()
    finally:
        os.environ.pop(C_KERNELS) if saved is None else os.environ.__setitem__(C_KERNELS, saved)


def write(attention: dict, steps: list[dict], run: RunRecord) -> None:
    record = {"command": run.command, "date": run.date, "machine": run.machine,
              "attention_us": attention, "engine_steps": steps}  # fmt: skip
    (HERE / "cpu_kernels.json").write_text(json.dumps(record, indent=2) + "\n")
    names = list(attention)
    lines = [
        *run.header_lines("C kernels against plain torch (CPU, fp32)"),
        "",
        "One layer's decode attention (store + attend), SmolLM2 shapes, context 512, "
        "median microseconds per call:",
        "",
        "| batch | " + " | ".join(names) + " | speed-up |",
        "|---" * (len(names) + 2) + "|",
    ]
    for batch in attention[names[0]]:
        us = [attention[n][batch] for n in names]
        lines.append(
            f"| {batch} | " + " | ".join(f"{u:.0f}" for u in us) + f" | {us[0] / us[-1]:.2f}x |"
        )
    lines += [
        "",
        "Engine decode steps, bundled SmolLM2-135M fp32, prompts of 128 tokens, the two paths "
        "taking steps in turns in one process (ms):",
        "",
        "| batch | torch p10 | torch p50 | cpu p10 | cpu p50 | speed-up (p50) | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in steps:
        lines.append(
            f"| {r['batch']} | {r['torch_p10_ms']} | {r['torch_p50_ms']} | {r['cpu_p10_ms']} | "
            f"{r['cpu_p50_ms']} | {r['speedup_p50']}x | {r['same_tokens']} |"
        )
    (HERE / "cpu_kernels.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,5,16")
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    command = command_line(__spec__.name)
    run = RunRecord.start(command, threads=None, max_load=1.0, max_wait_s=60)
    attention = time_decode_backends(batch_sizes=(1, 4, 16, 64), context=512)
    bases = {"torch": torch_path(), "cpu": LLM()}
    steps = [engine_steps(b, args.steps, bases) for b in batches]
    run.finish()
    write(attention, steps, run)
    print((HERE / "cpu_kernels.md").read_text())


if __name__ == "__main__":
    main()
