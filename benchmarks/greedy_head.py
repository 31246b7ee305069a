"""Greedy decoding through the bfloat16 screen of the output head, against the fp32 head.

    .venv/bin/python -m benchmarks.greedy_head [--batches 1,2,3,4] [--steps 120]

1. The head alone, SmolLM2's (49152 x 576), cold (a 400 MB read in between evicts it, as a
   decode step's other weights do): the model's own head (PackedLinear: the few-row kernel
   up to `kernel_rows` rows, oneDNN above) + argmax against `GreedyScreen.tokens`,
   alternating, median milliseconds; the tokens must agree.
2. Whole engine decode steps of the bundled SmolLM2 (fp32, greedy, prompts of 128 tokens):
   one engine, its model's screen switched on and off for alternate steps, so that the
   machine's drift favours neither; the tokens of the two kinds of step must agree with a
   second engine that never uses the screen. Writes greedy_head.json and greedy_head.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.ab_steps import ab_decode_steps, steps_table
from benchmarks.run_env import RunRecord, command_line
from minserve.llm import LLM
from minserve.model.runner import ModelRunner
from minserve.platforms.cpu.greedy_head import GreedyScreen

HERE = Path(__file__).parent


def head_alone(lm_head: torch.nn.Module, screen: GreedyScreen, batches: list[int]) -> list[dict]:
    """Median ms of the model's own head + argmax and of the screen, cold, per batch size."""
    flush = torch.empty(100 * 2**20).normal_()  # 400 MB: more than the head, less than RAM
    dense = {"dense": lambda x: lm_head(x).argmax(dim=1), "screen": screen.tokens}
    rows = []
    for batch in batches:
        x = torch.empty(batch, screen.weight.shape[1]).normal_(std=3.0)
        if not torch.equal(dense["screen"](x), dense["dense"](x)):
            raise AssertionError(f"screen and dense head disagree at batch {batch}")
        times: dict[str, list[float]] = {name: [] for name in dense}
        for _ in range(15):
            for name, run in dense.items():
                flush.sum()
                start = time.perf_counter()
                run(x)
                times[name].append((time.perf_counter() - start) * 1e3)
        row = {"batch": batch}
        row.update({f"{n}_ms": round(statistics.median(t), 2) for n, t in times.items()})
        row["speedup"] = round(row["dense_ms"] / row["screen_ms"], 2)
        rows.append(row)
    return rows


def engine_steps(batch: int, steps: int, base: LLM) -> dict:
    """p10 / p50 decode step times with the screen on and off, alternating steps."""
    screen = base.engine.worker.runner.screen

    def switch(runner: ModelRunner, on: bool) -> None:
        runner.screen = screen if on else None

    return ab_decode_steps(base, batch, steps, switch, names=("screen", "dense"))


def write(head: list[dict], steps: list[dict], run: RunRecord) -> None:
    record = {"command": run.command, "date": run.date, "machine": run.machine,
              "head_alone": head, "engine_steps": steps}  # fmt: skip
    (HERE / "greedy_head.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        *run.header_lines("Greedy decoding through the bfloat16 screen of the head (CPU, fp32)"),
        "",
        "SmolLM2's head alone (49152 x 576; the model's own fp32 head, as the engine runs it), "
        "cold, median ms (same tokens checked). The hidden states are random (std 3): their "
        "logits lie closer together than a trained model's, so more rows need the fp32 re-check "
        "than in the engine steps below.",
        "",
        "| batch | fp32 head + argmax | screen | speed-up |",
        "|---|---|---|---|",
        *(f"| {r['batch']} | {r['dense_ms']} | {r['screen_ms']} | {r['speedup']}x |" for r in head),
        "",
        "Engine decode steps, bundled SmolLM2-135M fp32, greedy, prompts of 128 tokens, the "
        "screen on and off for alternate steps of one engine (ms):",
        "",
        *steps_table(steps, ("screen", "dense"), ("screen", "fp32 head")),
    ]
    (HERE / "greedy_head.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,3,4")
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    command = command_line(__spec__.name)
    run = RunRecord.start(command, threads=None, max_load=1.0, max_wait_s=60)
    base = LLM()
    screen = getattr(base.engine.worker.runner, "screen", None)
    if screen is None:
        raise SystemExit("no greedy screen on this model (needs fp32 on a CPU with the C kernels)")
    with torch.inference_mode():
        head = head_alone(base.loaded.model.lm_head, screen, batches)
    steps = [engine_steps(b, args.steps, base) for b in batches]
    run.finish()
    write(head, steps, run)
    print((HERE / "greedy_head.md").read_text())


if __name__ == "__main__":
    main()
