"""The decode loop in C (`platforms/cpu/fused_decode.py`) against the Python loop over the layers.

    .venv/bin/python -m benchmarks.fused_decode [--batches 1,4,16,32,64] [--steps 60]

Whole engine decode steps (greedy, prompts of 128 tokens) of the bundled SmolLM2 in
bfloat16, and in bfloat16 with the GGUF blocks kept (`quantization="gguf"`): one engine
whose model runs its decode steps from one C call and walks its layers in Python on
alternate steps; a second engine on the Python loop takes the same steps and says whether
the tokens stayed the same (`benchmarks/ab_steps.py`). Writes fused_decode.json and .md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.ab_steps import ab_decode_steps, steps_table
from benchmarks.run_env import RunRecord, command_line
from minserve.llm import LLM
from minserve.model.runner import ModelRunner

HERE = Path(__file__).parent
MODELS = {"bf16": {"dtype": "bfloat16"}, "gguf bf16": {"dtype": "bfloat16", "quantization": "gguf"}}


def decode_steps(options: dict, batches: list[int], steps: int) -> list[dict]:
    """A/B rows of decode steps at each batch, the C loop on and off in turns."""
    base = LLM(device="cpu", **options)
    if getattr(base.engine.worker.runner, "fused_decode", None) is None:
        raise SystemExit("no decode loop in C here: it needs the C kernels built")
    loops = {}  # each engine's runner -> its own loop

    def switch(runner: ModelRunner, on: bool) -> None:
        loop = loops.setdefault(id(runner), runner.fused_decode)
        runner.fused_decode = loop if on else None

    return [ab_decode_steps(base, b, steps, switch, names=("c", "python")) for b in batches]


def write(results: dict[str, list[dict]], run: RunRecord) -> None:
    run.finish()
    record = {"command": run.command, "date": run.date, "machine": run.machine,
              "engine_steps": results}  # fmt: skip
    (HERE / "fused_decode.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        *run.header_lines("Decode steps: the layers from one C call against the Python loop"),
        "",
        "Engine decode steps of the bundled SmolLM2-135M, greedy, prompts of 128 tokens, the "
        "C loop and the Python loop on alternate steps of one engine (ms; same tokens: every "
        "step's tokens equal a Python-loop engine's).",
    ]
    for name, rows in results.items():
        lines += ["", f"{name}:", "", *steps_table(rows, ("c", "python"), ("C loop", "Python"))]
    (HERE / "fused_decode.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    run = RunRecord.start(command_line(__spec__.name), threads=None, max_load=1.0, max_wait_s=60)
    batches = [int(b) for b in args.batches.split(",")]
    results = {name: decode_steps(options, batches, args.steps) for name, options in MODELS.items()}
    write(results, run)
    print((HERE / "fused_decode.md").read_text())


if __name__ == "__main__":
    main()
