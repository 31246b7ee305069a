"""Launching a student's Triton kernel from a check: where its tensors live, and what a
failed launch raised.

In Triton's interpreter (a CPU) a stub raises its NotImplementedError inside the kernel and
the interpreter wraps it; compiled (a GPU), Triton rejects the stub's `raise` statement at
compile time. `launched` turns both back into what the kernel meant, so a report reads the
same on either.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import InterpreterError

from minserve.attention.triton_env import interpreting

T = TypeVar("T")

_STUB = re.compile(r'raise NotImplementedError\("(?P<label>Exercise [^"]+)"\)')


def kernel_device() -> torch.device:
    """Where Triton kernels run here: the CPU in the interpreter, else the GPU."""
    return torch.device("cpu") if interpreting() else torch.device("cuda")


def launched(launch: Callable[..., T], *args, **kwargs) -> T:
    """Run a kernel launch; what the kernel raised comes out as itself. In the interpreter a
    stub raises its NotImplementedError; compiled, Triton rejects the `raise` statement."""
    try:
        with np.errstate(all="ignore"):  # the interpreter's numpy: NaN is the report's to name
            return launch(*args, **kwargs)
    except InterpreterError as error:  # the interpreter wraps what the kernel raised
        raised = error.__cause__ or error
        raise raised from raised.__cause__  # `from None` would drop what it wraps in turn
    except CompilationError as error:
        if stub := _STUB.search(str(error)):
            raise NotImplementedError(stub["label"]) from None
        raise
