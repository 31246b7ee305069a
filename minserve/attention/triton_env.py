"""Where minserve's Triton kernels run: compiled on a GPU, in Triton's interpreter on a CPU.

Triton reads `TRITON_INTERPRET=1` twice: when it is imported (its own helpers, such as
`tl.zeros` and `tl.sum`, become interpreted functions) and when each `@triton.jit` runs.
So the variable must be set before `import triton`. `minserve/__init__.py` imports this
module first; on a machine without CUDA it sets the variable unless someone already chose
(tests/conftest.py, a notebook's first cell, the shell).
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from typing import Any

import torch


def use_interpreter_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when there is no GPU and nobody chose; True if interpreting."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton.language" in sys.modules:
            warnings.warn(
                "triton was imported before minserve, without TRITON_INTERPRET=1; on this "
                "CPU-only machine its kernels cannot run. Import minserve first, or set "
                "TRITON_INTERPRET=1 before importing triton.",
                stacklevel=2,
            )
    return interpreting()


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_kernel_device(*tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors, interpreted ones CPU tensors: say which, plainly."""
    want = "cpu" if interpreting() else "cuda"
    for t in tensors:
        if t.device.type != want:
            mode = "in the interpreter (TRITON_INTERPRET=1)" if want == "cpu" else "compiled"
            raise ValueError(
                f"Triton kernels run {mode} here and need {want} tensors, got one on "
                f"{t.device}; use attention_backend='torch' for this device"
            )


use_interpreter_without_gpu()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact fp32 for fp32 data; tf32 holds bf16/fp16 exactly."""
    return "ieee" if dtype == torch.float32 else "tf32"


def compile_for_any(kernel: Any, *varying: str) -> Any:
    """`kernel` compiled once whatever the values of its integer arguments `varying`.

    Triton specialises an integer argument on whether it is 1 or a multiple of 16, so one
    that changes from step to step (a block table's row stride, a split count) would
    compile a new variant inside a request; `do_not_specialize` makes one serve them all.
    """
    import triton

    names = inspect.signature(kernel.fn).parameters
    unknown = [name for name in varying if name not in names]
    if unknown:
        raise ValueError(f"{kernel.fn.__name__} has no argument(s) {', '.join(unknown)}")
    return triton.jit(kernel.fn, do_not_specialize=list(varying))
