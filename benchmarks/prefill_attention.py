"""A prompt's attention on a CPU: the paged C kernel, one query per row, against torch's flash.

    .venv/bin/python -m benchmarks.prefill_attention [--prompts 64] [--long 512,1024,2048]

The CPU backend (`attention/paged_cpu.py`) attends the rows of a step through the paged
kernel (`kernels/paged_attention.c`): a prompt's row reads the keys up to its own position
through the block table, so each key is read once per later row (from cache: a short
prompt's keys fit in it). The alternative is torch's `scaled_dot_product_attention` (its
flash kernel for CPUs) on the chunk's own k/v; the backend keeps it for first chunks of
`FLASH_FROM` rows and more, which these measurements choose. Here the kernel takes every
row (`FLASH_FROM` lifted). Per dtype (bfloat16, fp32), SmolLM2's heads (9 query heads, 3
KV heads, head_dim 64), blocks of 16 shuffled in a pool:

1. the offline benchmark's prompts: `--prompts` random lengths in [32, 256] (seed 0), all
   in one step, as the offline benchmark's prefill runs them;
2. four prompts of each `--long` length, one step each length.

One layer's attention of the step: the backend's call (store, then the kernel over every
row) against SDPA on each prompt's own k/v, in turns, best of 5; both checked against
float64 attention. Writes prefill_attention.json and prefill_attention.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.run_env import RunRecord, command_line
from minserve.attention import paged_cpu
from minserve.attention.metadata import AttentionMetadata
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.viz.kernel_timing import SMOLLM2_SHAPES

HERE = Path(__file__).parent
SHAPES = SMOLLM2_SHAPES  # one layer of SmolLM2's heads
HEADS, KV_HEADS, HEAD_DIM = SHAPES.num_heads, SHAPES.num_kv_heads, SHAPES.head_dim
BLOCK = 16
REPEATS = 5


def prompt_step(lengths: list[int], dtype: torch.dtype) -> tuple[paged_cpu.CpuPagedAttention, list]:
    """A step of fresh prompts over a pool with shuffled blocks: the backend, and per prompt
    its (q [n, H, D], k, v [n, Hkv, D])."""
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-n // BLOCK) for n in lengths]
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, slots, first = [], [], 0
    for n, b in zip(lengths, blocks):
        table = order[first : first + b]
        first += b
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    metadata = AttentionMetadata.build(lengths, lengths, tables, slots)
    every_row = dict.fromkeys(paged_cpu.FLASH_FROM, max(lengths) + 1)  # the kernel's, all
    with mock.patch.dict(paged_cpu.FLASH_FROM, every_row):
        pool = PagedKVPool(SHAPES, sum(blocks), BLOCK, dtype, "cpu")
        attention = paged_cpu.CpuPagedAttention(pool, metadata)
    assert not attention.flash
    prompts = [
        tuple(
            torch.randn(n, h, HEAD_DIM, generator=gen).to(dtype)
            for h in (HEADS, KV_HEADS, KV_HEADS)
        )
        for n in lengths
    ]
    return attention, prompts


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What the backend runs for a long first chunk: torch's flash kernel on its own k/v."""
    return paged_cpu.fresh_prefill(q, k, v, scale=None)


def best_ms(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(min(times) * 1e3, 2)


def compare(lengths: list[int], dtype: torch.dtype) -> dict:
    """Both paths on one step of `lengths`: ms, and each one's largest error against float64."""
    attention, prompts = prompt_step(lengths, dtype)
    q, k, v = (torch.cat([p[i] for p in prompts]) for i in range(3))  # [T, heads, D]

    def kernel() -> torch.Tensor:
        return attention(0, q, k, v)

    def torch_flash() -> list[torch.Tensor]:
        return [sdpa(*p) for p in prompts]

    exact = torch.cat([sdpa(*(t.double() for t in p)) for p in prompts])
    errors = {
        "kernel": (kernel().double() - exact).abs().max().item(),
        "sdpa": (torch.cat(torch_flash()).double() - exact).abs().max().item(),
    }
    kernel_ms, sdpa_ms = [], []
    for _ in range(2):  # in turns
        kernel_ms.append(best_ms(kernel))
        sdpa_ms.append(best_ms(torch_flash))
    return {
        "dtype": str(dtype).removeprefix("torch."), "prompts": len(lengths),
        "tokens": sum(lengths), "longest": max(lengths),
        "kernel_ms": min(kernel_ms), "sdpa_ms": min(sdpa_ms),
        "speedup": round(min(sdpa_ms) / min(kernel_ms), 2),
        "kernel_max_error": float(f"{errors['kernel']:.2g}"),
        "sdpa_max_error": float(f"{errors['sdpa']:.2g}"),
    }  # fmt: skip


def write(rows: list[dict], run: RunRecord) -> None:
    record = {"command": run.command, "date": run.date, "machine": run.machine, "rows": rows}
    (HERE / "prefill_attention.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        *run.header_lines("A prompt's attention on a CPU: the paged C kernel vs torch's flash"),
        f"- one layer, SmolLM2's heads ({HEADS} query, {KV_HEADS} KV, head_dim {HEAD_DIM}), "
        f"blocks of {BLOCK}; best of {REPEATS}, the two in turns; errors against float64",
        "- the backend runs torch's flash kernel for a first chunk of "
        + ", ".join(
            f"{n} rows ({str(d).removeprefix('torch.')})" for d, n in paged_cpu.FLASH_FROM.items()
        )
        + " and more (`FLASH_FROM`), the kernel for every other row",
        "",
        "| dtype | prompts | tokens | longest | C kernel (ms) | torch SDPA (ms) | speedup "
        "| kernel error | SDPA error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['dtype']} | {r['prompts']} | {r['tokens']} | {r['longest']} | "
            f"{r['kernel_ms']} | {r['sdpa_ms']} | {r['speedup']}x | {r['kernel_max_error']} | "
            f"{r['sdpa_max_error']} |"
            for r in rows
        ),
    ]
    (HERE / "prefill_attention.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--long", default="512,1024,2048")
    args = parser.parse_args()
    run = RunRecord.start(command_line(__spec__.name), threads=None, max_load=1.0, max_wait_s=60)
    gen = torch.Generator().manual_seed(0)
    offline = torch.randint(32, 257, (args.prompts,), generator=gen).tolist()
    steps = [offline] + [[int(n)] * 4 for n in args.long.split(",")]
    dtypes = (torch.bfloat16, torch.float32)
    rows = [compare(lengths, dtype) for dtype in dtypes for lengths in steps]
    run.finish()
    write(rows, run)
    print((HERE / "prefill_attention.md").read_text())


if __name__ == "__main__":
    main()
