"""Chapter 02's checks build their tensors where the kernels run (`kernel_device`): the CPU
in Triton's interpreter, the GPU when Triton compiles. With the kernel device swapped for
"meta", every tensor a check hands to a launcher must be on "meta". A stub compiled on a GPU
reads as not implemented, as it does in the interpreter."""

from __future__ import annotations

import ast

import pytest
import torch
from triton.compiler.errors import CompilationError

import solutions.ch02_paged_attention as solutions
from minserve.course import checks_ch02, checks_ch02_first_steps
from minserve.course.chapters import REPO_ROOT

LAUNCHERS = (
    "paged_decode",
    "gather_kv",
    "tile_attention",
    "combine_splits",
    "paged_store",
    "paged_prefill",
    "scale_vector",
    "add_vectors",
    "copy_tile",
)


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

    for module in (checks_ch02, checks_ch02_first_steps):
        monkeypatch.setattr(module, "kernel_device", lambda: torch.device("meta"))
        for name in LAUNCHERS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, launcher)
    with pytest.raises(Launched):
        check(solutions)
    assert devices, "the check launched nothing"
    assert {d.type for d in devices} == {"meta"}, devices


def test_a_compiled_stub_counts_as_not_implemented():
    """On a GPU Triton compiles the stub and rejects its `raise`: still "not implemented"."""
    source = (REPO_ROOT / "exercises" / "ch02_paged_attention.py").read_text()
    stub = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Raise))

    def compile_stub():
        raise CompilationError(source, stub, "unsupported AST node type: Raise")

    with pytest.raises(NotImplementedError, match=r"^Exercise 2\.1: one program per block"):
        checks_ch02.launched(compile_stub)
