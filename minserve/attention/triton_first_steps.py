"""Triton's first moves, before the attention kernels: three kernels of a few lines each.

Chapter 02 starts here (exercises 2.1-2.3). Every attention kernel of the chapter is made
of the same moves:

- a *program* is one instance of a kernel; the launcher starts a grid of them, and each
  asks `tl.program_id(axis)` which one it is (2.1);
- `tl.arange(0, BLOCK)` is the vector [0, 1, ..., BLOCK - 1]; a pointer plus a vector of
  offsets is a vector of pointers, and `tl.load` / `tl.store` move a whole vector (2.1);
- a *mask* turns off the lanes that fall outside the data: they read nothing (`other`
  instead) and write nothing (2.2);
- a 2-D tile is a column of row offsets plus a row of column offsets, broadcast; with
  strides, the same code reads any view torch can make: a transpose, a slice (2.3).

The paged kernels add one indirection to 2.3: a token's row comes from the block table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.attention import triton_env  # noqa: F401  (TRITON_INTERPRET on a CPU)


# >>> exercise 2.1: one program per block (tl.program_id and tl.arange)
@triton.jit
def scale_kernel(
    x_ptr,  # [n]: n a multiple of BLOCK
    out_ptr,  # [n]
    factor,
    BLOCK: tl.constexpr,  # elements per program
):
    """out = factor * x, one program per block of BLOCK elements.

    The launcher starts n // BLOCK programs; program p owns elements p * BLOCK up to
    p * BLOCK + BLOCK - 1. Build the program's offsets from its id and `tl.arange`, load its
    block of x, and store factor times it at the same offsets of out.
    """
    # >>> solution
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, x * factor)
    # <<< solution


# <<< exercise


# >>> exercise 2.2: a masked load and store (vectors of any length)
@triton.jit
def add_kernel(
    x_ptr,  # [n]
    y_ptr,  # [n]
    out_ptr,  # [n]
    n,
    BLOCK: tl.constexpr,
):
    """out = x + y for any n: cdiv(n, BLOCK) programs, so the last block may stick out.

    Lanes at offsets >= n lie past the vectors: memory that belongs to something else. Mask
    them off in both loads and in the store, so they read and write nothing.
    """
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    # >>> solution
    inside = offsets < n  # [BLOCK]
    x = tl.load(x_ptr + offsets, mask=inside)
    y = tl.load(y_ptr + offsets, mask=inside)
    tl.store(out_ptr + offsets, x + y, mask=inside)
    # <<< solution


# <<< exercise


# >>> exercise 2.3: a 2-D tile with strides
@triton.jit
def copy_tile_kernel(
    x_ptr,  # [rows, cols], any strides: element (r, c) is at x_ptr + r * stride_r + c * stride_c
    out_ptr,  # [rows, cols], contiguous: element (r, c) is at out_ptr + r * cols + c
    rows,
    cols,
    stride_r,
    stride_c,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Copy x into a contiguous out, one program per [BLOCK_R, BLOCK_C] tile.

    Program (i, j) = (`tl.program_id(0)`, `tl.program_id(1)`) copies rows i * BLOCK_R ...
    and columns j * BLOCK_C ...: a [BLOCK_R] vector of rows and a [BLOCK_C] vector of
    columns, broadcast into a [BLOCK_R, BLOCK_C] tile of pointers (`r[:, None]`,
    `c[None, :]`). Mask the tiles that stick out past the last row or column.
    """
    # >>> solution
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    inside = (r < rows)[:, None] & (c < cols)[None, :]  # [BLOCK_R, BLOCK_C]
    tile = tl.load(x_ptr + r[:, None] * stride_r + c[None, :] * stride_c, mask=inside)
    tl.store(out_ptr + r[:, None] * cols + c[None, :], tile, mask=inside)
    # <<< solution


# <<< exercise


def scale_vector(
    x: torch.Tensor,
    factor: float,
    block: int = 4,
    kernel: triton.JITFunction = scale_kernel,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch `kernel` on x [n] (n a multiple of `block`): factor * x, into `out` if given."""
    if x.dim() != 1 or x.numel() % block:
        raise ValueError(f"scale takes a vector whose length is a multiple of {block}")
    out = torch.empty_like(x) if out is None else out
    kernel[(x.numel() // block,)](x, out, factor, BLOCK=block)
    return out


def add_vectors(
    x: torch.Tensor,
    y: torch.Tensor,
    block: int = 4,
    kernel: triton.JITFunction = add_kernel,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch `kernel` on two vectors of one length: x + y, into `out` if given."""
    if x.dim() != 1 or x.shape != y.shape:
        raise ValueError(f"add takes two vectors of one length, got {x.shape} and {y.shape}")
    out = torch.empty_like(x) if out is None else out
    kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
    return out


def copy_tile(
    x: torch.Tensor,
    block_r: int = 4,
    block_c: int = 4,
    kernel: triton.JITFunction = copy_tile_kernel,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch `kernel` on a 2-D view x (any strides): a contiguous copy of it, into `out`
    (contiguous) if given."""
    if x.dim() != 2:
        raise ValueError(f"copy_tile takes a matrix, got {x.dim()} dimensions")
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device) if out is None else out
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    kernel[grid](x, out, rows, cols, x.stride(0), x.stride(1), BLOCK_R=block_r, BLOCK_C=block_c)
    return out
