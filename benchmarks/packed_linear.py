"""Decode step time with prepacked oneDNN linears against plain `F.linear`, same run.

    .venv/bin/python -m benchmarks.packed_linear [--threads 2] [--max-load 1.5]

Two engines share nothing but the checkpoint: one loads SmolLM2 with `prepack=False`
(`F.linear` on row-major weights), one with the loader's default (weights reordered once
for oneDNN, `minserve/platforms/cpu/packed_linear.py`, every row count on oneDNN: the loader's
choice of F.linear for a decode's few rows, `linear_choice.py`, is turned off here, so the
two rows compare the two GEMMs); both fuse q/k/v and gate/up. For each
dtype and batch size, both get the same requests (128-token prompts, greedy), then their
decode steps alternate, so machine noise falls on both alike. Reports the median step
time of each, the ratio, and whether the two engines' greedy tokens were identical.
Writes packed_linear.json/.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.run_env import RunRecord, command_line, write_results
from minserve.kernels.onednn import can_prepack
from minserve.llm import LLM
from minserve.loader import LoadedModel, load_model
from minserve.platforms.cpu.packed_linear import PackedLinear
from minserve.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent
PROMPT_LEN = 128


def add_requests(llm: LLM, batch: int, tag: str) -> list[str]:
    """`batch` greedy requests with distinct 128-token prompts; returns their ids."""
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = [(100 + 37 * i + j) % 40000 + 10 for j in range(PROMPT_LEN)]
        llm.engine.add_request(request_id, None, prompt, params)
    return ids


def time_steps(engines: dict[str, LLM], batch: int, steps: int) -> dict[str, object]:
    """Median decode-step seconds per engine, steps interleaved; and the tokens each made."""
    ids = {name: add_requests(llm, batch, f"{name}-{batch}") for name, llm in engines.items()}
    for llm in engines.values():
        while llm.engine.scheduler.waiting or any(
            not s.is_decode for s in llm.engine.scheduler.running
        ):
            llm.engine.step()  # prefill everything first
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list] = {name: [] for name in engines}
    for _ in range(steps):
        for name, llm in engines.items():
            start = time.perf_counter()
            outputs = llm.engine.step()
            seconds[name].append(time.perf_counter() - start)
            step_tokens = sorted((o.request_id.rsplit("-", 1)[1], o.outputs[0].token_ids[-1])
                                 for o in outputs)  # fmt: skip
            tokens[name].append(step_tokens)
    for name, llm in engines.items():
        for request_id in ids[name]:
            llm.engine.abort_request(request_id)
    same = [[t for _, t in step] for step in tokens["plain"]] == [
        [t for _, t in step] for step in tokens["packed"]
    ]
    return {
        "plain_ms": 1e3 * statistics.median(seconds["plain"]),
        "packed_ms": 1e3 * statistics.median(seconds["packed"]),
        "identical_tokens": same,
    }


def packable(dtype: str) -> bool:
    """Whether oneDNN can pack this dtype here; a dtype it cannot is left out, said once."""
    if can_prepack(torch.device("cpu"), getattr(torch, dtype)):
        return True
    print(f"skipping {dtype}: oneDNN cannot prepack it on this CPU", file=sys.stderr)
    return False


def all_rows_packed(loaded: LoadedModel) -> LoadedModel:
    """Send every row count to oneDNN (`plain_rows = 0`)."""
    for module in loaded.model.modules():
        if isinstance(module, PackedLinear):
            module.plain_rows = 0
    return loaded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-load", type=float, default=None)
    parser.add_argument("--max-wait", type=float, default=600.0)
    parser.add_argument("--batches", default="1,4,8,16,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--output", type=Path, default=HERE / "packed_linear")
    args = parser.parse_args()
    command = command_line(__spec__.name)
    record = RunRecord.start(command, args.threads, args.max_load, args.max_wait)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    dtypes = [d for d in args.dtypes.split(",") if packable(d)]
    cells = [(d, b) for d in dtypes for b in batches]
    engines: dict[str, LLM] = {}
    loaded_dtype = None
    for dtype, batch in tqdm(cells, desc="packed vs plain"):
        if dtype != loaded_dtype:
            engines = {
                "plain": LLM(load_model(None, dtype=dtype, prepack=False)),
                "packed": LLM(all_rows_packed(load_model(None, dtype=dtype))),
            }
            loaded_dtype = dtype
        result = time_steps(engines, batch, args.steps)
        rows.append({"dtype": dtype, "batch": batch, **result})
        rows[-1]["speedup"] = rows[-1]["plain_ms"] / rows[-1]["packed_ms"]
    record.finish()
    report = {"run": record.__dict__, "rows": rows}
    write_results(report, args.output, markdown(report, record))
    return 0


def markdown(report: dict, record: RunRecord) -> str:
    lines = [
        "# Prepacked oneDNN linears vs F.linear: SmolLM2 decode step",
        "",
        f"- command: `{record.command}`",
        f"- date: {record.date}",
        record.load_line(),
        f"- prompts of {PROMPT_LEN} tokens, greedy; steps of the two engines alternate",
        "",
        "| dtype | batch | F.linear step (ms) | packed step (ms) | speed-up | same tokens |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {r['plain_ms']:.1f} | {r['packed_ms']:.1f} "
            f"| {r['speedup']:.2f}x | {r['identical_tokens']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
