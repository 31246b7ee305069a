"""The GPU check's machine stages: environment, kernels and bandwidth (benchmarks/gpu_check.py).

Each stage takes the `Rows` it reports into and whether this is a dry run (tiny sizes on the
CPU, Triton's interpreter); a row with `ok: False` fails the stage. The kernel shapes and
timings reuse benchmarks/gpu_attention.py's pools (shuffled blocks) and decode timing.
"""

from __future__ import annotations

import importlib
import platform
import subprocess
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchmarks.gpu_check import Rows

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # vs 1 + |ref|
PACKAGES = ("torch", "triton", "transformers", "safetensors", "tokenizers", "gguf", "numpy")


def device_name(dry_run: bool) -> str:
    return "cpu" if dry_run else "cuda"


# ---------------------------------------------------------------- 1. environment


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"


def driver_version() -> str:
    """The NVIDIA driver, as nvidia-smi reports it ("unknown" without nvidia-smi)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 else "unknown"


def environment(rows: Rows, dry_run: bool) -> str:
    """Versions, devices, and the execution config minserve resolves here."""
    rows.add(name="python", value=platform.python_version())
    for package in PACKAGES:
        rows.add(name=package, value=package_version(package))
    rows.add(name="cuda (torch build)", value=str(torch.version.cuda))
    rows.add(name="driver", value=driver_version())
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        rows.add(name=f"cuda:{index}", value=f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                 f"compute capability {props.major}.{props.minor}")  # fmt: skip
    from minserve.device import choose_device
    from minserve.execution import resolve_execution

    choice = choose_device("auto")
    rows.add(name="choose_device('auto')", value=f"{choice.device} ({choice.why})")
    rows.add(name="resolve_execution()", value=resolve_execution().summary())
    if not dry_run:  # a dry run runs on the CPU wherever it is
        rows.add(
            name="auto chose the GPU", value=str(choice.device), ok=choice.device.type == "cuda"
        )
    return f"{torch.cuda.device_count()} CUDA device(s)"


# ---------------------------------------------------------------- 2. kernels


def kernel_grid(dry_run: bool) -> list[tuple[torch.dtype, int, int]]:
    """(dtype, block_size, head_dim) cases: half precision everywhere, fp32 at block 16."""
    if dry_run:
        return [(torch.float32, 16, 32), (torch.bfloat16, 16, 32)]
    half = [(d, b, h) for d in (torch.float16, torch.bfloat16) for b in (16, 32) for h in (64, 128)]
    return half + [(torch.float32, 16, 64), (torch.float32, 16, 128)]


def error_row(rows: Rows, kernel: str, case: dict, got: torch.Tensor, ref: torch.Tensor) -> None:
    """The largest error relative to 1 + |ref|, within the case dtype's tolerance or not."""
    err = ((got.float() - ref.float()).abs() / (1 + ref.float().abs())).max().item()
    rows.add(kernel=kernel, **case, max_err=err, ok=err < TOLERANCE[got.dtype])


def kernels(rows: Rows, dry_run: bool) -> str:
    """Store, decode (one split, four splits) and prefill/extend against the torch references."""
    importlib.import_module("triton")  # a clear "missing package" before any kernel
    from benchmarks.gpu_attention import metadata_for, paged_kv, run_decode, run_prefill
    from minserve.attention.paged_torch import paged_attention_reference, paged_store_reference
    from minserve.attention.triton_store import paged_store

    device = device_name(dry_run)
    torch.manual_seed(0)
    for dtype, block_size, head_dim in kernel_grid(dry_run):
        layout = (8, 2, head_dim)  # query heads, KV heads (a group of 4), head_dim
        case = {"dtype": str(dtype).removeprefix("torch."), "block_size": block_size,
                "head_dim": head_dim}  # fmt: skip
        contexts = [1, block_size - 1, block_size, block_size + 1, 60 if dry_run else 3000]
        kv = paged_kv(contexts, layout, dtype, device, block_size)
        q = torch.randn(len(contexts), 8, head_dim, device=device).to(dtype)  # [S, Hq, D]
        ref = paged_attention_reference(q, kv["k_cache"], kv["v_cache"], metadata_for(kv, [1] * 5))
        for splits in (1, 4):
            error_row(rows, f"decode splits={splits}", case, run_decode(q, kv, splits), ref)
        query_lens = [1, block_size - 1, block_size, block_size + 1, 40]  # the last extends
        q = torch.randn(sum(query_lens), 8, head_dim, device=device).to(dtype)  # [T, Hq, D]
        ref = paged_attention_reference(
            q, kv["k_cache"], kv["v_cache"], metadata_for(kv, query_lens)
        )
        error_row(rows, "prefill/extend", case, run_prefill(q, kv, query_lens), ref)
        new = torch.randn(7, 2, head_dim, device=device).to(dtype)  # [T, Hkv, D]
        slots = torch.randperm(kv["k_cache"].shape[0] * block_size, device=device)[:7]
        want_k, want_v = kv["k_cache"].clone(), kv["v_cache"].clone()
        paged_store_reference(want_k, want_v, new, new * 2, slots)
        paged_store(kv["k_cache"], kv["v_cache"], new, new * 2, slots)
        same = torch.equal(kv["k_cache"], want_k) and torch.equal(kv["v_cache"], want_v)
        rows.add(kernel="store", **case, max_err=0.0 if same else None, ok=same)
    return f"{len(rows.rows)} kernel cases"


# ---------------------------------------------------------------- 4. bandwidth


def copy_bandwidth(device: str, nbytes: int, measure: Callable) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / measure(lambda: dst.copy_(src))


def bandwidth(rows: Rows, dry_run: bool) -> str:
    """Decode time over a grid of batch x context, its bytes / time against the copy's."""
    importlib.import_module("triton")
    from benchmarks.gpu_attention import decode_row, timer

    device = device_name(dry_run)
    measure = timer(device)
    peak = copy_bandwidth(device, (1 << 20) if dry_run else (4 << 30), measure)
    rows.add(measured="copy bandwidth", bytes_per_s=peak)
    layout = (8, 2, 32) if dry_run else (32, 8, 128)  # Llama-3-8B's attention heads
    contexts, batches = ([5, 37], [1, 2]) if dry_run else ([512, 2048, 8192], [1, 16, 64, 256])
    torch.manual_seed(0)
    for context in contexts:
        for batch in batches:
            row = decode_row(device, "8b", layout, batch, context, measure, peak)
            row["share_of_copy_bandwidth"] = row.pop("minserve_bw_fraction")
            rows.add(**row)
    best = max(r.get("share_of_copy_bandwidth", 0) for r in rows.rows)
    return f"copy {peak / 1e12:.2f} TB/s; best decode {best:.0%} of it"


STAGES = {"environment": environment, "kernels": kernels, "bandwidth": bandwidth}
