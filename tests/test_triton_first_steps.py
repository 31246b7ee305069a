"""Chapter 02's first kernels: the checks reject the usual wrong answers with a message that
names the mistake, and the pictures record what each program really read and wrote."""

from __future__ import annotations

import types

import pytest
import torch
import triton
import triton.language as tl

from minserve.attention import triton_first_steps as first_steps
from minserve.course import checks_ch02_first_steps as checks
from minserve.viz.program_reads import plot_programs, record_programs


@triton.jit
def _scale_without_program_id(x_ptr, out_ptr, factor, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)  # every program on block 0
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * factor)


@triton.jit
def _add_with_an_unmasked_store(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside)
    y = tl.load(y_ptr + offsets, mask=inside)
    tl.store(out_ptr + offsets, x + y)


@triton.jit
def _add_with_unmasked_loads(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets)
    y = tl.load(y_ptr + offsets)
    tl.store(out_ptr + offsets, x + y, mask=inside)


@triton.jit
def _copy_assuming_contiguous(
    x_ptr, out_ptr, rows, cols, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (r < rows)[:, None] & (c < cols)[None, :]
    tile = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=inside)
    tl.store(out_ptr + r[:, None] * cols + c[None, :], tile, mask=inside)


def _module(**kernels) -> types.SimpleNamespace:
    reference = {
        "scale_kernel": first_steps.scale_kernel,
        "add_kernel": first_steps.add_kernel,
        "copy_tile_kernel": first_steps.copy_tile_kernel,
    }
    return types.SimpleNamespace(**{**reference, **kernels})


@pytest.mark.parametrize(
    ("check", "kernels", "says"),
    [
        (
            checks.check_scale_one_program_per_block,
            {"scale_kernel": _scale_without_program_id},
            "were never written: program p owns elements",
        ),
        (
            checks.check_add_masks_the_last_block,
            {"add_kernel": _add_with_an_unmasked_store},
            "program 2: a store with 2 lane(s) outside the data",
        ),
        (
            checks.check_add_masks_the_last_block,
            {"add_kernel": _add_with_unmasked_loads},
            "program 2: a load with 2 lane(s) outside the data",
        ),
        (
            checks.check_copy_tile_follows_strides,
            {"copy_tile_kernel": _copy_assuming_contiguous},
            "strides (12, 1), where none of its elements lies",
        ),
    ],
    ids=["no program id", "unmasked store", "unmasked loads", "contiguous input"],
)
def test_the_checks_name_the_usual_mistakes(check, kernels, says) -> None:
    check(_module())  # the reference passes
    with pytest.raises(AssertionError, match=None) as failure:
        check(_module(**kernels))
    assert says in str(failure.value)


def test_the_picture_records_which_program_read_and_wrote_each_element() -> None:
    x, y, out = torch.arange(10.0), torch.ones(10), torch.empty(10)
    recorded = record_programs(
        lambda: first_steps.add_vectors(x, y, block=4, out=out), {"x": x, "y": y, "out": out}
    )
    assert recorded.programs == ((0, 0, 0), (1, 0, 0), (2, 0, 0))
    for touched in recorded.tensors:
        owner = touched.by_program[0].tolist()
        assert owner == [i // 4 for i in range(10)] + [-1, -1]  # lanes 10, 11 drawn past x
        assert touched.masked == frozenset({10, 11})
    assert [t.kind for t in recorded.tensors] == ["load", "load", "store"]
    plot_programs(recorded)  # draws without error


def test_the_picture_of_a_view_shows_only_the_views_elements_read() -> None:
    buffer = torch.arange(60.0).reshape(6, 10)
    x, out = buffer[1:6, 2:9], torch.empty(5, 7)
    recorded = record_programs(
        lambda: first_steps.copy_tile(x, 4, 4, out=out), {"buffer": buffer, "out": out}
    )
    read = recorded.tensors[0].by_program >= 0
    expected = torch.zeros(6, 10, dtype=torch.bool)
    expected[1:6, 2:9] = True
    assert (torch.from_numpy(read) == expected).all() and torch.equal(out, x)
    assert {(flat // 10, flat % 10) for flat in recorded.tensors[0].masked if flat < 60} == {
        (r, 9) for r in range(1, 6)
    }  # the right-hand tiles' masked column, inside the buffer
