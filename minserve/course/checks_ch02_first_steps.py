"""Checks for chapter 02's first three kernels (2.1-2.3): `scale_kernel`, `add_kernel` and
`copy_tile_kernel`, launched through minserve's launchers and compared with torch exactly.

Every tensor a kernel reads sits inside a larger buffer of NaN, and every output inside a
buffer of a sentinel value: a lane that reads past its data brings NaN into the result, a
lane that writes past it changes the sentinel. In Triton's interpreter each launch is also
recorded (`kernel_access.accesses_recorded`), so a lane that touches memory outside the
data it was given is named with its program, even when the value it read went unused.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from minserve.attention.triton_env import interpreting
from minserve.attention.triton_first_steps import add_vectors, copy_tile, scale_vector
from minserve.course.triton_launch import kernel_device, launched

SENTINEL = -777.0  # what every output buffer holds outside the output
GUARD = 8  # elements of NaN (inputs) or SENTINEL (outputs) on each side


def guarded(values: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): `values` copied into the middle of a flat buffer of `fill`."""
    flat = values.reshape(-1)
    buffer = torch.full((flat.numel() + 2 * GUARD,), fill, dtype=values.dtype)
    buffer[GUARD : GUARD + flat.numel()] = flat
    buffer = buffer.to(kernel_device())
    return buffer, buffer[GUARD : GUARD + flat.numel()].view(values.shape)


def assert_guards_kept(buffer: torch.Tensor, n: int, what: str) -> None:
    """The sentinel on both sides of an output of n elements is untouched."""
    before, after = buffer[:GUARD].cpu(), buffer[GUARD + n :].cpu()
    for side, guard, lane0 in (("before", before, -GUARD), ("past the end of", after, n)):
        changed = [lane0 + i for i, v in enumerate(guard.tolist()) if v != SENTINEL]
        assert not changed, (
            f"{what}: a store wrote {side} the output, at element(s) {changed} of an output "
            f"of {n}; mask every store with the lanes inside the data"
        )


def outside_lanes(launch: Callable[[], object], allowed: list[torch.Tensor]) -> list[str]:
    """In the interpreter: run `launch` and describe each access whose lanes (mask on)
    touched memory outside the elements of `allowed` (views); elsewhere, just run it."""
    if not interpreting():
        launch()
        return []
    from minserve.viz.kernel_access import accesses_recorded

    with accesses_recorded() as seen:
        launch()
    inside = set(torch.cat([_addresses(t) for t in allowed]).tolist())
    two_d = any(access.program[1] for access in seen)
    problems = []
    for access in seen:
        stray = sorted(set(access.addresses.tolist()) - inside)
        if stray:
            program = access.program[:2] if two_d else access.program[0]
            problems.append(
                f"program {program}: a {access.kind} with {len(stray)} lane(s) outside the "
                f"data, the first {_describe(stray[0], allowed)}"
            )
    return problems


def _addresses(view: torch.Tensor) -> torch.Tensor:
    """The byte address of every element of a view, flat."""
    grids = torch.meshgrid(*(torch.arange(n) for n in view.shape), indexing="ij")
    offset = sum(g * s for g, s in zip(grids, view.stride(), strict=True))
    return (view.data_ptr() + offset * view.element_size()).reshape(-1).to(torch.int64)


def _describe(address: int, allowed: list[torch.Tensor]) -> str:
    """Where a stray address lies, counted in elements from the nearest tensor's first."""
    view = min(allowed, key=lambda t: abs(address - t.data_ptr()))
    element = (address - view.data_ptr()) // view.element_size()
    shape = "x".join(map(str, view.shape))
    strides = f", strides {tuple(view.stride())}" if view.dim() > 1 else ""
    return (
        f"{element} elements past the first element of a tensor of shape {shape}{strides}, "
        "where none of its elements lies"
    )


def _first_wrong(got: torch.Tensor, expected: torch.Tensor) -> str:
    wrong = (got != expected).nonzero()
    index = tuple(wrong[0].tolist())
    return (
        f"{len(wrong)} of {expected.numel()} elements wrong, the first at {index}: "
        f"expected {expected[index].item():g}, got {got[index].item():g}"
    )


def assert_scale(impl: ModuleType, n: int, block: int) -> None:
    what = f"scale, n={n}, BLOCK={block} ({n // block} programs)"
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + block))
    _, x_view = guarded(x, float("nan"))
    out_buffer, out = guarded(torch.full((n,), SENTINEL), SENTINEL)

    def launch() -> None:
        launched(scale_vector, x_view, 3.0, block, kernel=impl.scale_kernel, out=out)

    stray = outside_lanes(launch, [x_view, out])
    assert not stray, f"{what}: " + "; ".join(stray[:3])
    assert_guards_kept(out_buffer, n, what)
    got, expected = out.cpu(), 3.0 * x
    if not torch.equal(got, expected):
        untouched = (got == SENTINEL).nonzero().flatten().tolist()
        note = (
            f"; elements {untouched[:8]} were never written: program p owns elements "
            "p * BLOCK to p * BLOCK + BLOCK - 1, so its offsets start at tl.program_id(0) * BLOCK"
            if untouched
            else ""
        )
        raise AssertionError(f"{what}: {_first_wrong(got, expected)}{note}")


def check_scale_one_program_per_block(impl: ModuleType) -> None:
    """Scale: 16, 8 and 32 elements in blocks of 4 and 8, one program per block, NaN around x"""
    for n, block in ((16, 4), (8, 8), (32, 8)):
        assert_scale(impl, n, block)


def assert_add(impl: ModuleType, n: int, block: int) -> None:
    programs = -(-n // block)
    tail = n - (programs - 1) * block  # lanes of the last block inside the vector
    what = f"add, n={n}, BLOCK={block} ({programs} programs, the last with {tail} lanes inside)"
    gen = torch.Generator().manual_seed(n * 31 + block)
    x, y = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    _, x_view = guarded(x, float("nan"))
    _, y_view = guarded(y, float("nan"))
    out_buffer, out = guarded(torch.full((n,), SENTINEL), SENTINEL)

    def launch() -> None:
        launched(add_vectors, x_view, y_view, block, kernel=impl.add_kernel, out=out)

    stray = outside_lanes(launch, [x_view, y_view, out])
    assert not stray, (
        f"{what}: "
        + "; ".join(stray[:3])
        + (": lanes at offsets >= n must be masked off (mask=offsets < n) in every load and store")
    )
    assert_guards_kept(out_buffer, n, what)
    got, expected = out.cpu(), x + y
    assert torch.equal(got, expected), f"{what}: {_first_wrong(got, expected)}"


def check_add_masks_the_last_block(impl: ModuleType) -> None:
    """Add: 10, 1, 13, 16 and 17 elements in blocks of 4 and 8, lanes past n masked off"""
    for n, block in ((10, 4), (1, 8), (13, 8), (16, 8), (17, 4)):
        assert_add(impl, n, block)


def _views() -> list[tuple[str, torch.Tensor]]:
    """Matrices with unusual strides, each a view into a buffer of NaN."""
    gen = torch.Generator().manual_seed(2)
    buffer = torch.full((8, 12), float("nan"))
    buffer[1:6, 2:9] = torch.randn(5, 7, generator=gen)
    square = torch.randn(7, 5, generator=gen)
    guard = torch.full((9, 7), float("nan"))
    guard[1:8, 1:6] = square
    buffer, guard = buffer.to(kernel_device()), guard.to(kernel_device())
    return [
        ("a slice buffer[1:6, 2:9] of an 8x12 buffer", buffer[1:6, 2:9]),
        ("a transpose (strides 1 and 7)", guard[1:8, 1:6].T),
        ("a contiguous 3x9", torch.randn(3, 9, generator=gen).to(kernel_device())),
    ]


def check_copy_tile_follows_strides(impl: ModuleType) -> None:
    """Copy a tile: a slice, a transpose and a contiguous matrix in tiles of 4x4 and 2x8"""
    for name, view in _views():
        for block_r, block_c in ((4, 4), (2, 8)):
            rows, cols = view.shape
            what = f"copy_tile of {name} ({rows}x{cols}), tiles of {block_r}x{block_c}"
            out_buffer, out = guarded(torch.full((rows, cols), SENTINEL), SENTINEL)

            def launch(view=view, block_r=block_r, block_c=block_c, out=out) -> None:
                launched(copy_tile, view, block_r, block_c, kernel=impl.copy_tile_kernel, out=out)

            stray = outside_lanes(launch, [view, out])
            assert not stray, (
                f"{what}: "
                + "; ".join(stray[:3])
                + (
                    ": element (r, c) of x is at r * stride_r + c * stride_c, and rows >= rows or "
                    "columns >= cols must be masked off"
                )
            )
            assert_guards_kept(out_buffer, rows * cols, what)
            got, expected = out.cpu(), view.contiguous().cpu()
            assert torch.equal(got, expected), f"{what}: {_first_wrong(got, expected)}"


FIRST_STEP_CHECKS = [
    check_scale_one_program_per_block,
    check_add_masks_the_last_block,
    check_copy_tile_follows_strides,
]

HINTS: dict[str, tuple[str, str, str]] = {
    "2.1": (
        "Every program runs the same code; only tl.program_id(0) differs. Program p owns the "
        "elements p * BLOCK up to p * BLOCK + BLOCK - 1.",
        "Three lines: the program's offsets (its id times BLOCK, plus tl.arange(0, BLOCK)); "
        "one tl.load of x at those offsets; one tl.store of factor times it into out.",
        "Program p's first element is p * BLOCK; add tl.arange(0, BLOCK) to it for the "
        "whole block. x_ptr plus that vector is a vector of BLOCK pointers: one tl.load "
        "reads them all, one tl.store writes factor times them to the same offsets of out.",
    ),
    "2.2": (
        "The last program's block sticks out past n when n is not a multiple of BLOCK. Its "
        "lanes past n must neither read nor write: that memory belongs to something else.",
        "A boolean vector, one per lane: offsets < n. Pass it as mask= to both loads and to "
        "the store; masked loads return `other` (0 by default) in the lanes that are off.",
        "The mask is the comparison of the offsets with n, a [BLOCK] vector of booleans; "
        "give it as mask= to tl.load (for x and for y) and to tl.store (for out), the same "
        "vector each time.",
    ),
    "2.3": (
        "A tile is rows times columns: a [BLOCK_R] vector of rows and a [BLOCK_C] vector of "
        "columns, each from its own program id, broadcast into a [BLOCK_R, BLOCK_C] grid.",
        "r from tl.program_id(0) and BLOCK_R, c from tl.program_id(1) and BLOCK_C; the "
        "pointers x_ptr + r[:, None] * stride_r + c[None, :] * stride_c; the mask "
        "(r < rows)[:, None] & (c < cols)[None, :]; out is contiguous: r * cols + c.",
        "The input's pointers: x_ptr, plus r[:, None] times stride_r, plus c[None, :] times "
        "stride_c; the output's: out_ptr, plus r[:, None] times cols, plus c[None, :]. "
        "Load with the 2-D mask and store the tile with the same mask.",
    ),
}
