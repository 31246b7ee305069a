"""The choice between oneDNN and MKL for a decode's few rows (`linear_choice.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minserve.model import linear_choice
from minserve.model.linear_choice import choose_plain_rows, tune_plain_rows
from minserve.model.packed_linear import PackedLinear, can_prepack

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32), reason="oneDNN is not available"
)


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ({1: (1.0, 0.8), 2: (1.0, 0.9), 3: (1.0, 1.2)}, 2),
        ({1: (1.0, 0.97), 2: (1.0, 0.5)}, 0),  # within the margin at 1 row: never
        ({1: (1.0, 0.5), 2: (1.0, 0.5), 3: (1.0, 0.5)}, 3),
        ({1: (1.0, 1.5), 2: (1.0, 0.5)}, 0),  # a loss stops the count, later wins ignored
    ],
)
def test_plain_rows_are_the_longest_run_of_clear_wins(times, expected) -> None:
    assert choose_plain_rows(times) == expected


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(PackedLinear(nn.Linear(64, 64)) for _ in range(3)))


@pytest.mark.parametrize("plain_rows", [0, 2])
def test_either_path_computes_the_same_linear(plain_rows: int) -> None:
    layer = stack()[0]
    layer.plain_rows = plain_rows
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            out = layer(x)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_rows_up_to_plain_rows_take_f_linear(monkeypatch) -> None:
    layer = stack()[0]
    layer.plain_rows = 2
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for rows in (1, 2, 3):
            layer(torch.randn(rows, 64))
    assert calls == [1, 2]


def test_tuning_measures_once_per_process_and_sets_every_layer(monkeypatch) -> None:
    monkeypatch.delenv("MINSERVE_PLAIN_ROWS", raising=False)
    monkeypatch.setattr(linear_choice, "_chosen", {})
    measured = []
    monkeypatch.setattr(
        linear_choice, "measure", lambda linears, rows: measured.append(rows) or (1.0, 0.5)
    )
    first, second = stack(), stack()
    assert tune_plain_rows(first) == 3 and tune_plain_rows(second) == 3
    assert measured == [1, 2, 3]  # the second model of the same shapes reuses the answer
    assert all(m.plain_rows == 3 for m in [*first, *second])


def test_the_environment_can_fix_the_choice(monkeypatch) -> None:
    monkeypatch.setenv("MINSERVE_PLAIN_ROWS", "1")
    monkeypatch.setattr(linear_choice, "_chosen", {})
    model = stack()
    assert tune_plain_rows(model) == 1 and all(m.plain_rows == 1 for m in model)


def test_measure_times_both_paths_on_real_layers() -> None:
    packed, plain = linear_choice.measure(list(stack()), rows=2, passes=2)
    assert packed > 0 and plain > 0
