"""Every load and store of a kernel launch in Triton's interpreter: which program made it,
the addresses its lanes touched, and the lanes its mask turned off.

In the interpreter each `tl.load` and `tl.store` goes through one builder method with the
addresses and the mask (an unmasked one gets a mask of ones). `accesses_recorded` wraps the
two methods for the duration of a `with` block, on the builder instance only, so a picture
shows what a kernel did, not what it should have done.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Access:
    """One `tl.load` or `tl.store` of one program."""

    kind: Literal["load", "store"]
    program: tuple[int, int, int]  # the program's ids on the grid's three axes
    addresses: np.ndarray  # [lanes on] int64 byte addresses, in lane order
    masked: np.ndarray  # [lanes off] int64 addresses the mask kept it from touching


@contextmanager
def accesses_recorded() -> Iterator[list[Access]]:
    """Record every load and store the interpreter runs inside the block, in order."""
    from triton.runtime import interpreter  # the interpreter's module, only where it runs

    builder = interpreter.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store
    seen: list[Access] = []

    def record(kind: Literal["load", "store"], ptrs, mask) -> None:
        on = np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)
        addresses = ptrs.data.astype(np.int64)
        seen.append(Access(kind, builder.grid_idx, addresses[on].ravel(), addresses[~on].ravel()))

    def masked_load(ptrs, mask, *rest):
        record("load", ptrs, mask)
        return load(ptrs, mask, *rest)

    def masked_store(ptrs, value, mask, *rest):
        record("store", ptrs, mask)
        return store(ptrs, value, mask, *rest)

    builder.create_masked_load = masked_load  # this instance only; removed below
    builder.create_masked_store = masked_store
    try:
        yield seen
    finally:
        del builder.create_masked_load, builder.create_masked_store
