"""Build and load the C kernels (`*.c` here): compiled once per machine with the system's C
compiler into one shared library.

The library is cached in the execution config's `kernel_cache` (`~/.cache/minserve/kernels`
unless the environment moves it), named by a hash of the source, the flags and this CPU's
features, so an edit or another CPU rebuilds it (about a second). It is linked with
`-fopenmp`: torch has already loaded its own `libgomp.so.1`, which the library then shares,
so both use one pool of threads.

No compiler, or a failed build, is not an error here: `cpu_kernels()` returns None, says why
in `build_error()`, and the engine keeps the plain-torch backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from minserve.environment import kernel_cache_dir

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
# no -ffast-math: linked into a shared library, GCC 12 would set flush-to-zero for the whole
# process; the reductions are marked `omp simd reduction`, which allows reordering anyway
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
FLAGS += ("-shared", "-fPIC", "-std=c11")
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {  # C function -> (restype, argtypes)
    "store_kv": (None, [_ptr] * 5 + [_i64] * 4),
    "store_kv_int8_f32": (None, [_ptr] * 5 + [_i64] * 5),
    "store_kv_int8_bf16": (None, [_ptr] * 5 + [_i64] * 5),
    "paged_decode_f32": (ctypes.c_int, [_ptr] * 8 + [_i64] * 8 + [ctypes.c_float, _i64]),
    "paged_decode_bf16": (ctypes.c_int, [_ptr] * 8 + [_i64] * 8 + [ctypes.c_float, _i64]),
    "paged_decode_e4m3": (ctypes.c_int, [_ptr] * 8 + [_i64] * 8 + [ctypes.c_float, _i64]),
    "paged_decode_e5m2": (ctypes.c_int, [_ptr] * 8 + [_i64] * 8 + [ctypes.c_float, _i64]),
    "paged_decode_i8": (ctypes.c_int, [_ptr] * 8 + [_i64] * 8 + [ctypes.c_float, _i64]),
    "rms_norm_f32": (None, [_ptr] * 3 + [_i64] * 4 + [ctypes.c_float]),
    "rms_norm_bf16": (None, [_ptr] * 3 + [_i64] * 4 + [ctypes.c_float]),
    "rope_f32": (None, [_ptr] * 4 + [_i64] * 4),
    "rope_bf16": (None, [_ptr] * 4 + [_i64] * 4),
    "silu_mul_f32": (None, [_ptr] * 2 + [_i64] * 4),
    "silu_mul_bf16": (None, [_ptr] * 2 + [_i64] * 4),
    "draw_rows": (None, [_ptr] * 3 + [_i64] * 3 + [_ptr] * 2),
    "mask_rows": (None, [_ptr] * 2 + [_i64] * 4),
    "linear_rows_f32": (None, [_ptr] * 4 + [_i64] * 3),
    "linear_rows_bf16": (ctypes.c_int, [_ptr] * 4 + [_i64] * 3),
    "bf16_panels_native": (ctypes.c_int, []),
    "linear_panels_bf16": (ctypes.c_int, [_ptr] * 4 + [_i64] * 3),
    "quant_rows_q8_0": (ctypes.c_int, [_ptr] * 4 + [_i64] * 4),
    "quant_rows_q4_0": (ctypes.c_int, [_ptr] * 4 + [_i64] * 4),
    "quant_rows_q4_1": (ctypes.c_int, [_ptr] * 4 + [_i64] * 4),
    "int8_rows": (ctypes.c_int, [_ptr] * 5 + [_i64] * 4),
    "quant_panels_q8_0": (ctypes.c_int, [_ptr] * 4 + [_i64] * 3),
    "quant_panels_q4_0": (ctypes.c_int, [_ptr] * 4 + [_i64] * 3),
    "quant_panels_q4_1": (ctypes.c_int, [_ptr] * 4 + [_i64] * 3),
    "dequantize_q8_0": (None, [_ptr] * 2 + [_i64] * 2),
    "dequantize_q4_0": (None, [_ptr] * 2 + [_i64] * 2),
    "dequantize_q4_1": (None, [_ptr] * 2 + [_i64] * 2),
    "dequantize_q8_0_bf16": (None, [_ptr] * 2 + [_i64] * 2),
    "dequantize_q4_0_bf16": (None, [_ptr] * 2 + [_i64] * 2),
    "dequantize_q4_1_bf16": (None, [_ptr] * 2 + [_i64] * 2),
    "bf16_logits_f32": (None, [_ptr] * 3 + [_i64] * 3),
    "screen_candidates_f32": (None, [_ptr] * 6 + [_i64] * 2),
    "decode_layers": (ctypes.c_int, [_ptr, _ptr, _i64, _ptr, _i64]),
}


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded on this machine."""


def cache_dir() -> Path:
    """Where the compiled library is kept (set in the environment: `minserve/environment.py`)."""
    return kernel_cache_dir()


def cpu_features() -> str:
    """This CPU's feature flags (what -march=native compiles for); '' where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def library_path(compiler: str) -> Path:
    digest = hashlib.sha256(" ".join((compiler, *FLAGS, cpu_features())).encode())
    for source in sorted(Path(__file__).parent.glob("*.[ch]")):
        digest.update(source.read_bytes())
    key = digest.hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def build(compiler: str, target: Path) -> None:
    """Compile the sources into `target` (written whole or not at all)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelBuildError(f"`{' '.join(cmd)}` failed:\n{done.stderr.strip()}")
        os.replace(out, target)


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def _build_and_load() -> ctypes.CDLL | KernelBuildError:
    import torch  # noqa: F401  (its libgomp must be loaded before ours binds to one)

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return KernelBuildError("no C compiler found (looked for $CC, cc, gcc)")
    path = library_path(compiler)
    try:
        if not path.exists():
            build(compiler, path)
        return load(path)
    except (OSError, KernelBuildError) as e:
        return e if isinstance(e, KernelBuildError) else KernelBuildError(str(e))


def cpu_kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None where it cannot be built."""
    lib = _build_and_load()
    return None if isinstance(lib, KernelBuildError) else lib


def build_error() -> str | None:
    """Why `cpu_kernels()` is None (None when the library loaded)."""
    lib = _build_and_load()
    return str(lib) if isinstance(lib, KernelBuildError) else None
