"""The C kernels (`minserve/kernels`) against their torch references, and how they are built.

Paged attention through the C backend is also run against the contiguous oracle in
`test_paged_attention.py`; greedy parity with transformers (test_model_parity, test_engine)
runs the engine's default CPU path, which is these kernels.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from teacher_forced import PROMPTS, assert_paths_agree

from minserve.attention.backends import get_attention_backend
from minserve.attention.metadata import AttentionMetadata
from minserve.attention.paged_cpu import CpuPagedAttention
from minserve.attention.paged_torch import TorchPagedAttention
from minserve.execution import resolve_execution
from minserve.kernels import build, cpu_ops
from minserve.llm import LLM
from minserve.model.llama import RMSNorm, RotaryEmbedding, Rotation
from minserve.model.ops import MODEL_OPS
from minserve.platforms.cpu.ops import C_KERNEL_OPS
from minserve.viz.kernel_timing import SMOLLM2_SHAPES

GEN = torch.Generator().manual_seed(0)
CONFIG = SMOLLM2_SHAPES


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=GEN) * scale


# --- building ------------------------------------------------------------------------------


def test_the_library_builds_here_and_shares_torchs_openmp() -> None:
    assert build.build_error() is None and build.cpu_kernels() is not None
    maps = Path(f"/proc/{os.getpid()}/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1 and "torch" in gomp.pop()  # one OpenMP runtime: torch's


def test_the_cache_name_follows_the_sources_and_the_cpu(monkeypatch) -> None:
    first = build.library_path("cc")
    monkeypatch.setattr(build, "cpu_features", lambda: "flags : another cpu")
    assert build.library_path("cc") != first
    assert build.library_path("cc").parent == build.cache_dir()


def test_no_compiler_means_torch_backend_and_says_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MINSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    build._build_and_load.cache_clear()
    try:
        assert build.cpu_kernels() is None
        assert "no-such-cc" in build.build_error()
        assert get_attention_backend("auto", "cpu") is TorchPagedAttention
        with pytest.raises(ValueError, match="attention backend 'cpu' is unavailable"):
            get_attention_backend("cpu")
        execution = resolve_execution("cpu")
        assert not execution.c_kernels and execution.attention == "torch"
        assert "no-such-cc" in execution.c_kernels_missing
        assert "c_kernels=off(" in execution.summary()
        assert not cpu_ops.applies(torch.ones(2))
        assert list(tmp_path.iterdir()) == []  # nothing half-written
    finally:
        monkeypatch.undo()
        build._build_and_load.cache_clear()
    assert build.cpu_kernels() is not None


def test_a_failed_compile_reports_the_compilers_message(tmp_path) -> None:
    with pytest.raises(build.KernelBuildError, match="failed"):
        build.build("false", tmp_path / "lib.so")
    assert not (tmp_path / "lib.so").exists()


# --- layer ops against torch ---------------------------------------------------------------


def test_applies_only_to_fp32_or_bf16_cpu_tensors_of_one_dtype_outside_autograd() -> None:
    x = torch.ones(3)
    assert cpu_ops.applies(x) and cpu_ops.applies(x.bfloat16(), x.bfloat16())
    assert not cpu_ops.applies(x.half()) and not cpu_ops.applies(x, x.bfloat16())
    w = torch.ones(3, requires_grad=True)
    assert not cpu_ops.applies(x, w)
    with torch.no_grad():
        assert cpu_ops.applies(x, w)


def torch_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, written out."""
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps))


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (40, 576), (7, 3, 64)])
def test_rms_norm_matches_hugging_faces(shape: tuple[int, ...]) -> None:
    norm = RMSNorm(shape[-1], 1e-5)
    norm.weight.data = randn(shape[-1])
    x = randn(*shape, scale=3.0)
    with torch.inference_mode():
        out = norm(x, C_KERNEL_OPS)
    assert out.shape == x.shape
    torch.testing.assert_close(out, torch_rms_norm(norm, x), rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_strided_rows() -> None:
    norm = RMSNorm(64, 1e-6)
    x = randn(6, 5, 64)[:, 1:4]  # [6, 3, 64], not contiguous
    with torch.inference_mode():
        out = norm(x, C_KERNEL_OPS)
    torch.testing.assert_close(out, torch_rms_norm(norm, x), rtol=1e-6, atol=1e-6)


def torch_rope(rotation: Rotation, x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * rotation.cos + torch.cat((-x2, x1), dim=-1) * rotation.sin


@pytest.mark.parametrize("num_tokens", [1, 17, 100])
def test_rope_matches_rotate_half_exactly(num_tokens: int) -> None:
    rotation = RotaryEmbedding(CONFIG)(torch.arange(num_tokens) * 7, torch.float32, C_KERNEL_OPS)
    fused = randn(num_tokens, 15, CONFIG.head_dim)  # q, k, v heads side by side
    qk = fused[:, :12]  # strided rows: the fused projection's q and k
    with torch.inference_mode():
        out = rotation.apply(qk)
    assert out.shape == qk.shape
    assert torch.equal(out, torch_rope(rotation, qk))  # the same products and sums


@pytest.mark.parametrize("num_tokens", [1, 16, 33])
def test_silu_and_mul_matches_torch(num_tokens: int) -> None:
    gate_up = randn(num_tokens, 2 * CONFIG.intermediate_size, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_the_fast_exp_inside_silu_holds_over_the_whole_float_range() -> None:
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([-1e30, 1e30, 0.0])])
    up = torch.ones_like(gate)
    out = cpu_ops.silu_mul(torch.cat([gate, up])[None])[0]
    torch.testing.assert_close(out, F.silu(gate), rtol=2e-6, atol=1e-30)
    assert out.isfinite().all()


def test_silu_and_mul_propagates_nan() -> None:
    gate_up = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])
    out = cpu_ops.silu_mul(gate_up)
    assert out[0, 0].isnan() and out[0, 1] == F.silu(torch.tensor(1.0)) * 3.0


# --- bfloat16: the fp32 arithmetic on the widened values, rounded once ---------------------


def bf16_step(value: torch.Tensor) -> torch.Tensor:
    """The gap between bfloat16 numbers at each value (8 significant bits)."""
    return 2.0 ** (torch.frexp(value.float().abs()).exponent - 8)


def assert_rounded_once(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got (bfloat16) is exact (fp32, computed on the same bfloat16 inputs) rounded to the
    nearest bfloat16: off by at most half a step, plus fp32's own rounding."""
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    err = (got.float() - exact).abs()
    assert (err <= 0.5 * bf16_step(exact) + 1e-6 * exact.abs() + 1e-30).all(), err.max()


@pytest.mark.parametrize("shape", [(1, 576), (40, 576), (7, 3, 64)])
def test_bfloat16_rms_norm_is_hugging_faces_on_bfloat16(shape: tuple[int, ...]) -> None:
    x, weight = randn(*shape, scale=3.0).bfloat16(), randn(shape[-1]).bfloat16()
    got = cpu_ops.rms_norm(x, weight, 1e-5)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()  # HF
    exact = weight.float() * normed.float()
    # the sum of squares is taken in another order, so a normed value lying near the middle
    # of two bfloat16s may round the other way: one step of it, times the weight
    err = (got.float() - exact).abs()
    bound = weight.float().abs() * bf16_step(normed) + 0.5 * bf16_step(exact)
    assert got.dtype == torch.bfloat16 and (err <= bound).all()
    assert (err <= 0.5 * bf16_step(exact)).float().mean() > 0.99  # nearly all: one rounding


def test_bfloat16_rope_is_the_fp32_rotation_rounded_to_nearest_even() -> None:
    rotation = RotaryEmbedding(CONFIG)(torch.arange(9) * 7, torch.bfloat16, C_KERNEL_OPS)
    qk = randn(9, 15, CONFIG.head_dim).bfloat16()[:, :12]  # strided rows
    with torch.inference_mode():
        got = rotation.apply(qk)
    exact = torch_rope(Rotation(rotation.cos.float(), rotation.sin.float()), qk.float())
    assert torch.equal(got, exact.bfloat16())  # the same fp32 products and sums, then torch's
    # rounding: ties to even (1.0625 * 1.0625 = 1.12890625 lies halfway between two
    # bfloat16s and goes to 1.125), NaN kept
    x = torch.tensor([[[1.0625, 1.0, 1.0, float("nan")]]], dtype=torch.bfloat16)
    cos = torch.full((1, 1, 4), 1.0625, dtype=torch.bfloat16)
    out = cpu_ops.rope(x, cos, torch.zeros_like(cos))
    assert out[0, 0, 0].item() == 1.125 and out[0, 0, 1].isnan()


def test_bfloat16_silu_and_mul_rounds_the_fp32_result_once() -> None:
    gate_up = randn(5, 2 * CONFIG.intermediate_size, scale=4.0).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert_rounded_once(cpu_ops.silu_mul(gate_up), F.silu(gate) * up)


# --- paged decode at real sizes --------------------------------------------------------------


class Pool:
    def __init__(
        self, num_blocks: int, block_size: int, heads: int, dim: int, dtype=torch.float32
    ) -> None:
        self.kv = randn(2, 2, num_blocks, block_size, heads, dim).to(dtype)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]


def random_decodes(num_seqs: int, max_context: int, block_size: int) -> tuple:
    """num_seqs decodes of random contexts, their blocks scattered over a pool: the
    metadata and the pool's size in blocks."""
    contexts = torch.randint(1, max_context, (num_seqs,), generator=GEN).tolist()
    needed = [-(-c // block_size) for c in contexts]
    order = torch.randperm(sum(needed), generator=GEN).tolist()
    tables = [[order.pop() for _ in range(n)] for n in needed]
    slots = [t[(c - 1) // block_size] * block_size + (c - 1) % block_size
             for t, c in zip(tables, contexts)]  # fmt: skip
    return AttentionMetadata.build([1] * num_seqs, contexts, tables, slots), sum(needed)


@pytest.mark.parametrize("block_size", [16, 5])  # 5: blocks end inside a chunk of 16 keys
@pytest.mark.parametrize(("num_seqs", "max_context"), [(1, 2000), (19, 300)])
def test_many_long_decodes_match_torch(num_seqs: int, max_context: int, block_size: int) -> None:
    """Long contexts and more (sequence, head) tasks than threads, SmolLM2's head shapes."""
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    metadata, num_blocks = random_decodes(num_seqs, max_context, block_size)
    pool, copy = Pool(num_blocks, block_size, num_kv_heads, head_dim), Pool(1, 1, 1, 1)
    copy.kv = pool.kv.clone()
    q = randn(num_seqs, num_heads, head_dim)
    k, v = randn(num_seqs, num_kv_heads, head_dim), randn(num_seqs, num_kv_heads, head_dim)
    out = CpuPagedAttention(pool, metadata)(1, q, k, v)
    expected = TorchPagedAttention(copy, metadata)(1, q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.kv, copy.kv)  # the same slots written


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (64, 5), (24, 4)])
def test_a_bfloat16_pool_gives_the_fp32_attention_of_its_values(
    head_dim: int, block_size: int
) -> None:
    """A bfloat16 pool, queries and new k/v: the kernel's output is the fp32 attention over
    those same values, rounded once to bfloat16 (head_dim 24: the one-key-at-a-time loops)."""
    num_seqs, num_heads, num_kv_heads = 7, 9, 3
    metadata, num_blocks = random_decodes(num_seqs, 300, block_size)
    pool = Pool(num_blocks, block_size, num_kv_heads, head_dim, torch.bfloat16)
    exact = Pool(1, 1, 1, 1)
    exact.kv = pool.kv.float()  # the same values in fp32
    q = randn(num_seqs, num_heads, head_dim).bfloat16()
    k = randn(num_seqs, num_kv_heads, head_dim).bfloat16()
    v = randn(num_seqs, num_kv_heads, head_dim).bfloat16()
    out = CpuPagedAttention(pool, metadata)(1, q, k, v)
    expected = TorchPagedAttention(exact, metadata)(1, q.float(), k.float(), v.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)
    assert torch.equal(pool.kv.float(), exact.kv)  # the same slots written, the same values


def test_a_bfloat16_model_scores_one_greedy_path_alike_on_the_c_kernels_and_on_torch() -> None:
    """C attention against torch's: teacher-forced along the C path's greedy tokens, every
    token's log-probability agrees within bfloat16's rounding (`teacher_forced.py`); the
    sums in another order may pick either of two near-tied candidates, so the free-running
    texts may part."""
    engines = {}
    for backend in ("cpu", "torch"):
        engines[backend] = LLM(dtype="bfloat16", attention_backend=backend, max_num_seqs=2)
        assert engines[backend].get_execution_config().attention == backend
    assert_paths_agree(engines["cpu"], engines["torch"], max_tokens=16, prompts=PROMPTS[:2])


def test_a_layer_computes_with_the_ops_it_is_given(monkeypatch) -> None:
    calls = []
    real = cpu_ops.rms_norm
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda *args: calls.append(1) or real(*args))
    c_ops = dataclasses.replace(C_KERNEL_OPS, rms_norm=cpu_ops.rms_norm)  # the counting kernel
    norm, x = RMSNorm(64, 1e-6), randn(3, 64)
    with torch.inference_mode():
        on = norm(x, c_ops)
        off = norm(x, MODEL_OPS)  # minserve's torch ops: no C call
    assert calls == [1]
    torch.testing.assert_close(on, off, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_c_swiglu_reads_a_fused_projections_halves_in_place_and_apart(num_tokens: int) -> None:
    gate_up = randn(num_tokens, 2 * 96, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)  # the two halves of one tensor, as the MLP splits it
    expected = F.silu(gate) * up
    torch.testing.assert_close(C_KERNEL_OPS.swiglu(gate, up), expected, rtol=2e-6, atol=1e-6)
    apart = (gate.clone(), up.clone())  # two tensors of their own
    torch.testing.assert_close(C_KERNEL_OPS.swiglu(*apart), expected, rtol=2e-6, atol=1e-6)
    swapped = C_KERNEL_OPS.swiglu(up, gate)  # not "gate then up" in memory: no in-place read
    torch.testing.assert_close(swapped, F.silu(up) * gate, rtol=2e-6, atol=1e-6)
