"""Chapter 02's checks build their tensors where the kernels run (`kernel_device`): the CPU
in Triton's interpreter, the GPU when Triton compiles. With the kernel device swapped for
"meta", every tensor a check hands to a launcher must be on "meta"."""

from __future__ import annotations

import pytest
import torch

import solutions.ch02_paged_attention as solutions
from minserve.course import checks_ch02
from minserve.course.chapters import REPO_ROOT  # noqa: F401  (solutions/ importable from it)

LAUNCHERS = ("paged_decode", "gather_kv", "tile_attention", "combine_splits")


class Launched(Exception):
    """Raised by the stand-in launchers once they have seen the tensors."""


def test_the_interpreter_runs_kernels_on_the_cpu():
    assert checks_ch02.kernel_device() == torch.device("cpu")


@pytest.mark.parametrize("check", checks_ch02.CHECKS, ids=lambda c: c.__name__)
def test_every_check_hands_the_launcher_tensors_on_the_kernel_device(check, monkeypatch):
    devices: list[torch.device] = []

    def launcher(*args, **kwargs):
        devices.extend(a.device for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor))
        raise Launched

    monkeypatch.setattr(checks_ch02, "kernel_device", lambda: torch.device("meta"))
    for name in LAUNCHERS:
        monkeypatch.setattr(checks_ch02, name, launcher)
    with pytest.raises(Launched):
        check(solutions)
    assert devices, "the check launched nothing"
    assert {d.type for d in devices} == {"meta"}, devices
