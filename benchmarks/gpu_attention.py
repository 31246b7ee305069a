"""minserve's Triton paged-attention kernels on a GPU: checked, then timed against peers.

    python -m benchmarks.gpu_attention             # on a CUDA machine, < 5 minutes
    python -m benchmarks.gpu_attention --dry-run   # on a CPU: tiny shapes, interpreter

1. Checks: store, decode, split-K decode and prefill/extend against their plain-torch
   references (minserve/attention/paged_torch.py) in bf16 and fp32, on shuffled blocks.
2. Decode: batch 1-256, contexts 512-32k, SmolLM2's heads (9 q / 3 kv / 64) and an 8B-like
   layout (32 q / 8 kv / 128), bf16, block_size 16: minserve's kernel (split-K chosen
   automatically), torch SDPA on the same KV already gathered dense, FlashInfer if present.
   Achieved bandwidth = bytes of K, V, q and out / time, as a fraction of `--peak-tbps`.
3. Prefill: one or more chunks, fresh and over a cached prefix, against SDPA (causal).
Writes JSON and a markdown table (default: beside this file).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
LAYOUTS = {"smollm2": (9, 3, 64), "8b": (32, 8, 128)}  # query heads, KV heads, head_dim
DECODE = [(1, 512), (1, 8192), (1, 32768), (16, 4096), (16, 32768), (64, 8192), (256, 512),
          (256, 4096)]  # (batch, context)  # fmt: skip
PREFILL = [(1, 512, 0), (1, 4096, 0), (4, 2048, 2048), (8, 512, 8192)]  # (chunks, len, prefix)
DRY_DECODE, DRY_PREFILL = [(2, 5), (3, 37)], [(2, 5, 0), (1, 7, 9)]
BLOCK_SIZE = 16


def paged_kv(
    contexts: list[int], layout: tuple, dtype, device, block_size: int = BLOCK_SIZE
) -> dict[str, torch.Tensor]:
    """Random K/V for each context in shuffled blocks of a pool padded with spare blocks."""
    _, kv_heads, dim = layout
    blocks = [-(-c // block_size) for c in contexts]
    total = sum(blocks) + 4
    shape = (total, block_size, kv_heads, dim)
    perm = torch.randperm(total, device=device).to(torch.int32)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    return {
        "k_cache": torch.randn(shape, device=device).to(dtype),
        "v_cache": torch.randn(shape, device=device).to(dtype),
        "block_tables": tables,  # [S, max_blocks]
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=device),
    }


def metadata_for(kv: dict, query_lens: list[int]):
    from minserve.attention.metadata import AttentionMetadata

    contexts = kv["context_lens"].tolist()
    starts = torch.tensor([0, *query_lens], device=kv["context_lens"].device).cumsum(0)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),  # unused by attention
        query_start_loc=starts.to(torch.int32),
        context_lens=kv["context_lens"],
        block_tables=kv["block_tables"],
        max_query_len=max(query_lens),
        max_context_len=max(contexts),
    )


def run_decode(q: torch.Tensor, kv: dict, num_splits: int | None = None) -> torch.Tensor:
    from minserve.attention.triton_decode import paged_decode

    max_context = int(kv["context_lens"].max())
    return paged_decode(q, kv["k_cache"], kv["v_cache"], kv["block_tables"], kv["context_lens"],
                        max_context, num_splits=num_splits)  # fmt: skip


def run_prefill(q: torch.Tensor, kv: dict, query_lens: list[int]) -> torch.Tensor:
    from minserve.attention.triton_prefill import paged_prefill

    md = metadata_for(kv, query_lens)
    return paged_prefill(q, kv["k_cache"], kv["v_cache"], md.block_tables,
                         md.query_start_loc[:-1].contiguous(), md.query_lens.contiguous(),
                         md.context_lens, md.max_query_len, torch.empty_like(q))  # fmt: skip


def check_kernels(device: str, layouts: dict, dry: bool) -> list[dict]:
    """Every kernel against its reference; returns one record per check."""
    from minserve.attention.paged_torch import paged_attention_reference, paged_store_reference
    from minserve.attention.triton_store import paged_store

    records = []
    for dtype in (torch.bfloat16, torch.float32):
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        for name, layout in layouts.items():
            contexts = [1, 15, 16, 17, 60 if dry else 3000]
            kv = paged_kv(contexts, layout, dtype, device)
            q = torch.randn(len(contexts), layout[0], layout[2], device=device).to(dtype)
            ref = paged_attention_reference(
                q, kv["k_cache"], kv["v_cache"], metadata_for(kv, [1] * 5)
            )
            for label, splits in (("decode", 1), ("decode_split_k", 4)):
                got = run_decode(q, kv, num_splits=splits)
                records.append(_record(label, name, dtype, got, ref, tol))
            query_lens = [1, 15, 16, 17, 40]  # fresh prefills, then a chunk over a cached prefix
            q = torch.randn(sum(query_lens), layout[0], layout[2], device=device).to(dtype)
            md = metadata_for(kv, query_lens)
            ref = paged_attention_reference(q, kv["k_cache"], kv["v_cache"], md)
            records.append(
                _record("prefill", name, dtype, run_prefill(q, kv, query_lens), ref, tol)
            )
            new = torch.randn(7, layout[1], layout[2], device=device).to(dtype)
            slots = torch.randperm(kv["k_cache"].shape[0] * BLOCK_SIZE, device=device)[:7]
            want_k, want_v = kv["k_cache"].clone(), kv["v_cache"].clone()
            paged_store_reference(want_k, want_v, new, new * 2, slots)
            paged_store(kv["k_cache"], kv["v_cache"], new, new * 2, slots)
            same = torch.equal(kv["k_cache"], want_k) and torch.equal(kv["v_cache"], want_v)
            records.append({"kernel": "store", "layout": name, "dtype": str(dtype), "ok": same})
    return records


def _record(kernel: str, layout: str, dtype, got, ref, tol: float) -> dict:
    """Relative to 1 + |ref|: a bf16 output is off by up to one rounding of its own size."""
    err = ((got.float() - ref.float()).abs() / (1 + ref.float().abs())).max().item()
    return {
        "kernel": kernel,
        "layout": layout,
        "dtype": str(dtype),
        "max_err": err,
        "ok": err < tol,
    }


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Seconds per call: CUDA events through triton's do_bench, or one wall-clock run on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=40) / 1e3

    def once(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return once


def dense(kv: dict, cache: str, context: int) -> torch.Tensor:
    """The cache gathered per sequence, cut to `context` tokens: [S, Hkv, context, D]."""
    blocks = kv[cache][kv["block_tables"].long()]  # [S, max_blocks, bs, Hkv, D]
    return blocks.flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


def decode_row(device, name, layout, batch, context, measure, peak) -> dict:
    """One decode shape: minserve, SDPA on the KV gathered dense, FlashInfer if present."""
    heads, _, dim = layout
    kv = paged_kv([context] * batch, layout, torch.bfloat16, device)
    q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
    k, v = dense(kv, "k_cache", context), dense(kv, "v_cache", context)
    seconds = {
        "minserve": measure(lambda: run_decode(q, kv)),
        "sdpa_gathered": measure(
            lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
        ),
    }
    seconds.update(flashinfer_decode(q, kv, layout, measure))
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
    return _timing("decode", name, batch, context, 1, seconds, nbytes, peak)


def prefill_row(device, name, layout, shape, measure, peak) -> dict:
    """One prefill shape: `chunks` chunks of `length` queries over `prefix` cached tokens."""
    (heads, _, dim), (chunks, length, prefix) = layout, shape
    kv = paged_kv([prefix + length] * chunks, layout, torch.bfloat16, device)
    q = torch.randn(chunks * length, heads, dim, device=device, dtype=torch.bfloat16)
    k, v = (dense(kv, c, prefix + length) for c in ("k_cache", "v_cache"))
    qd = q.view(chunks, length, heads, dim).transpose(1, 2)  # [chunks, Hq, length, D]
    keys = torch.arange(prefix + length, device=device)
    mask = keys[None, :] <= (prefix + torch.arange(length, device=device))[:, None]
    seconds = {
        "minserve": measure(lambda: run_prefill(q, kv, [length] * chunks)),
        "sdpa_gathered": measure(
            lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, enable_gqa=True)
        ),
    }
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
    row = _timing("prefill", name, chunks, prefix + length, length, seconds, nbytes, peak)
    flops = 4 * chunks * heads * dim * (length * prefix + length * (length + 1) / 2)
    row["minserve_tflops"] = flops / seconds["minserve"] / 1e12
    return row


def flashinfer_decode(q, kv, layout, measure) -> dict[str, float]:
    """FlashInfer's paged decode on the same pool, if it is installed; else nothing."""
    try:
        import flashinfer
    except ImportError:
        return {}
    try:
        batch, (_, kv_heads, dim) = q.shape[0], layout
        lens = kv["context_lens"].long()
        pages = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
        indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).int()
        indices = torch.cat([kv["block_tables"][i, : pages[i]] for i in range(batch)]).int()
        last = ((lens - 1) % BLOCK_SIZE + 1).int()
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(indptr, indices, last, q.shape[1], kv_heads, dim, BLOCK_SIZE,
                     q_data_type=q.dtype, kv_data_type=q.dtype)  # fmt: skip
        return {"flashinfer": measure(lambda: wrapper.run(q, (kv["k_cache"], kv["v_cache"])))}
    except Exception as error:  # an API drift must not cost the whole GPU run
        print(f"flashinfer skipped: {error!r}", file=sys.stderr)
        return {}


def _timing(kind, layout, batch, context, query_len, seconds, nbytes, peak) -> dict:
    row = {"kind": kind, "layout": layout, "batch": batch, "context": context,
           "query_len": query_len, "seconds": seconds, "bytes": nbytes}  # fmt: skip
    row["minserve_bw_fraction"] = nbytes / seconds["minserve"] / peak
    row["speedup_vs_sdpa"] = seconds["sdpa_gathered"] / seconds["minserve"]
    return row


def markdown(result: dict) -> str:
    lines = [f"# Triton paged attention on {result['device_name']}", "",
             f"`{result['command']}` ({result['date']}); checks passed: "
             f"{result['checks_passed']}/{len(result['checks'])}.", "",
             "| kind | layout | batch | context | q len | minserve us | SDPA us | "
             "FlashInfer us | x SDPA | BW / peak |", "|---" * 10 + "|"]  # fmt: skip
    for r in result["timings"]:
        s = {k: f"{v * 1e6:.1f}" for k, v in r["seconds"].items()}
        lines.append(
            f"| {r['kind']} | {r['layout']} | {r['batch']} | {r['context']} | {r['query_len']} "
            f"| {s['minserve']} | {s['sdpa_gathered']} | {s.get('flashinfer', '-')} "
            f"| {r['speedup_vs_sdpa']:.2f} | {r['minserve_bw_fraction']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--out", type=Path, help="JSON path (markdown beside it)")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak (H200: 4.8)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before minserve defines kernels
    elif not torch.cuda.is_available():
        parser.error("no CUDA device; use --dry-run to check the plumbing on a CPU")
    device = "cpu" if args.dry_run else "cuda"
    layouts = LAYOUTS
    if args.dry_run:  # the same GQA ratios (3, 4) with fewer heads and head_dim / 4
        layouts = {n: (h // kv * 2, 2, d // 4) for n, (h, kv, d) in LAYOUTS.items()}
    torch.manual_seed(0)
    checks = check_kernels(device, layouts, args.dry_run)
    measure, peak = timer(device), args.peak_tbps * 1e12
    decode_shapes, prefill_shapes = (DRY_DECODE, DRY_PREFILL) if args.dry_run else (DECODE, PREFILL)
    result = {
        "command": shlex.join(
            ["python", "-m", "benchmarks.gpu_attention", *(argv or sys.argv[1:])]
        ),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)",
        "peak_bytes_per_s": peak,
        "checks": checks,
        "checks_passed": sum(c["ok"] for c in checks),
        "timings": [
            decode_row(device, name, layout, batch, context, measure, peak)
            for name, layout in layouts.items()
            for batch, context in decode_shapes
        ]
        + [
            prefill_row(device, name, layout, shape, measure, peak)
            for name, layout in layouts.items()
            for shape in prefill_shapes
        ],
    }
    out = args.out or HERE / (
        "gpu_attention_dry_run.json" if args.dry_run else "gpu_attention.json"
    )
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
