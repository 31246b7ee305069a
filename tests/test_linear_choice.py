"""The choice between oneDNN and the few-row C kernel for a decode's rows (`linear_choice.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minserve.kernels import cpu_ops
from minserve.kernels.build import cpu_kernels
from minserve.kernels.onednn import can_prepack
from minserve.platforms.cpu import linear_choice
from minserve.platforms.cpu.linear_choice import ChoiceCache, choose_kernel_rows, tune_kernel_rows
from minserve.platforms.cpu.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32) or cpu_kernels() is None,
    reason="oneDNN or the C kernels are not available",
)


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ({1: (1.0, 0.8), 4: (1.0, 0.9), 8: (1.0, 1.2)}, 4),
        ({1: (1.0, 0.97), 4: (1.0, 0.5)}, 0),  # within the margin at 1 row: never
        ({1: (1.0, 0.5), 4: (1.0, 0.5), 16: (1.0, 0.5)}, 16),
        ({1: (1.0, 1.5), 4: (1.0, 0.5)}, 0),  # a loss stops the count, later wins ignored
    ],
)
def test_kernel_rows_are_the_longest_run_of_clear_wins(times, expected) -> None:
    assert choose_kernel_rows(times) == expected


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(PackedLinear(nn.Linear(64, 64)) for _ in range(3)))


def rows_limit(layer: PackedLinear) -> int:
    """Up to how many rows the layer's plan sends to the few-row kernel."""
    return layer.plan.few_rows if layer.plan.few is not None else 0


@pytest.mark.parametrize("kernel_rows", [0, 2])
def test_either_path_computes_the_same_linear(kernel_rows: int) -> None:
    layer = stack()[0]
    layer.use_rows_kernel(kernel_rows)
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            out = layer(x)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_rows_up_to_kernel_rows_take_the_kernel(monkeypatch) -> None:
    layer = stack()[0]
    layer.use_rows_kernel(2)
    calls = []
    real = cpu_ops.linear_rows
    count = lambda x, *args: calls.append(x.shape[0]) or real(x, *args)  # noqa: E731
    monkeypatch.setattr(cpu_ops, "linear_rows", count)
    with torch.inference_mode():
        for rows in (1, 2, 3):
            layer(torch.randn(rows, 64))
        layer.use_rows_kernel(0)  # the C kernels off: oneDNN for every row count
        layer(torch.randn(1, 64))
    assert calls == [1, 2]


def test_a_3d_input_keeps_its_shape_through_the_kernel() -> None:
    layer = stack()[0]
    layer.use_rows_kernel(16)
    x = torch.randn(2, 3, 64)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_tuning_measures_once_per_machine_and_sets_every_layer(monkeypatch, tmp_path) -> None:
    measured = []
    monkeypatch.setattr(
        linear_choice, "measure", lambda linears, rows: measured.append(rows) or (1.0, 0.5)
    )
    first, second = stack(), stack()
    shape = (64, 64, torch.float32, True)
    cache = ChoiceCache(tmp_path / "linear_rows.json")
    assert tune_kernel_rows(first, cache=cache) == {shape: 16}
    # another process of this machine (a fresh cache object on the same file) reads it
    assert tune_kernel_rows(second, cache=ChoiceCache(cache.path)) == {shape: 16}
    assert measured == [1, 4, 8, 12, 16]  # the second model of the same shapes reuses it
    assert all(rows_limit(m) == 16 for m in [*first, *second])


def test_the_cache_keys_on_the_cpu_and_threads_and_survives_a_torn_file(tmp_path) -> None:
    key = linear_choice.choice_key((64, 96, torch.bfloat16, False))
    assert key.startswith(linear_choice.cpu_model())
    assert f"threads={torch.get_num_threads()}" in key and key.endswith("64x96:bfloat16:0")
    cache = ChoiceCache(tmp_path / "sub" / "linear_rows.json")
    assert cache.read() == {}  # no file yet
    cache.add(key, 8)
    cache.add("other", 4)
    assert ChoiceCache(cache.path).read() == {key: 8, "other": 4}
    cache.path.write_text("{not json")  # a file cut short: measured again, not an error
    assert cache.read() == {}


def test_each_layer_shape_is_measured_apart(monkeypatch) -> None:
    # the kernel wins on the wide layer at every row count, on the narrow one only at 1 row
    monkeypatch.setattr(
        linear_choice,
        "measure",
        lambda linears, rows: (1.0, 0.5 if linears[0].out_features == 96 or rows == 1 else 2.0),
    )
    torch.manual_seed(0)
    model = nn.Sequential(PackedLinear(nn.Linear(64, 96)), PackedLinear(nn.Linear(96, 64)))
    tune_kernel_rows(model)
    assert [rows_limit(m) for m in model] == [16, 1]


def test_bfloat16_layers_are_measured_as_fp32_ones_are(monkeypatch) -> None:
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU has no oneDNN bfloat16 path")
    measured = []
    monkeypatch.setattr(
        linear_choice, "measure", lambda linears, rows: measured.append(rows) or (1.0, 0.5)
    )
    layer = PackedLinear(nn.Linear(64, 64).to(torch.bfloat16))
    assert tune_kernel_rows(layer) == {(64, 64, torch.bfloat16, True): 16}
    assert measured == [1, 4, 8, 12, 16]


def test_the_kernel_takes_no_float16_weights(monkeypatch) -> None:
    monkeypatch.setattr(linear_choice, "measure", lambda linears, rows: pytest.fail("measured"))
    layer = nn.Linear(64, 64).to(torch.float16)
    assert not linear_choice.cpu_ops.linear_applies(layer.weight.detach(), layer.weight.detach())


def test_a_fixed_row_count_is_set_without_measuring(monkeypatch) -> None:
    # the execution config's linear_rows, from $MINSERVE_KERNEL_ROWS (test_execution_config)
    monkeypatch.setattr(linear_choice, "measure", lambda linears, rows: pytest.fail("measured"))
    model = stack()
    assert tune_kernel_rows(model, 1) == {(64, 64, torch.float32, True): 1}
    assert all(rows_limit(m) == 1 for m in model)


def test_measure_times_both_paths_on_real_layers() -> None:
    packed, kernel = linear_choice.measure(list(stack()), rows=2, passes=2)
    assert packed > 0 and kernel > 0


def test_a_widened_layer_is_timed_against_its_widened_product_and_cached_apart(monkeypatch):
    """The few-row limit of a bfloat16 layer that widens is measured against the widened
    fp32 product (not oneDNN's), and kept under a key of its own."""
    timed = []

    def fake_measure(linears, rows):
        x = torch.randn(rows, linears[0].in_features, dtype=torch.bfloat16)
        timed.append(linears[0].many_rows(x).dtype)  # what `measure` runs for many rows
        return (1.0, 0.5)

    monkeypatch.setattr(linear_choice, "measure", fake_measure)
    layer = PackedLinear(nn.Linear(64, 64).to(torch.bfloat16), widen=True)
    tune_kernel_rows(layer)
    assert timed == [torch.bfloat16] * 5
    shape = (64, 64, torch.bfloat16, True)
    assert linear_choice.choice_key(shape, "widen").endswith("|vs=widen")
    assert linear_choice.choice_key(shape) != linear_choice.choice_key(shape, "widen")
