"""The KV cache formats (`kv_cache_dtype`): encode/decode round trips, the pool's sizes, and
attention over an 8-bit cache against the contiguous oracle on the same stored values.

Oracles: int8 dequantizes within half a scale step of every value; fp8 equals torch's own
conversion to float8 and back (after clamping to the format's largest value); attention
over an 8-bit pool equals `contiguous.attend` over the decoded keys and values.
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import FP32_TOL, Seq, Step, TensorPool, edge_lengths, make_step

from minserve.attention.backends import get_attention_backend
from minserve.attention.contiguous import attend
from minserve.attention.metadata import AttentionMetadata
from minserve.attention.paged_cpu import CpuPagedAttention
from minserve.attention.paged_torch import TorchPagedAttention, paged_store_reference
from minserve.attention.per_sequence import PerSequenceAttention
from minserve.attention.triton_kv8 import int8_store
from minserve.config import CacheConfig
from minserve.kvcache.kv_format import (
    KV_FORMATS,
    attention_dtype,
    dequantize_int8,
    kv_format,
    quantize_int8,
    stored_format,
)
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.model_config import ModelConfig

INT8, E4M3, E5M2 = KV_FORMATS["int8"], KV_FORMATS["fp8_e4m3"], KV_FORMATS["fp8_e5m2"]
FP8 = [E4M3, E5M2]


def rows(seed: int = 0, shape: tuple[int, ...] = (7, 3, 64)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


# --- encode / decode ---------------------------------------------------------------------


def test_int8_round_trip_is_within_half_a_scale_step() -> None:
    x = rows()  # [T, Hkv, D]
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (7, 3, 1) and scale.dtype == torch.float16
    expected_scale = (x.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    assert torch.equal(scale, expected_scale)
    error = (x - dequantize_int8(q, scale)).abs()
    assert (error <= scale.float() / 2 + 1e-6).all()
    assert int(q.abs().max()) == 127  # each row's largest value uses the whole range


def test_int8_stores_values_then_the_scale_in_one_row() -> None:
    x = rows()
    stored = INT8.encode(x)  # [T, Hkv, D + 2] uint8
    assert stored.dtype == torch.uint8 and stored.shape == (7, 3, 66)
    q, scale = quantize_int8(x)
    assert torch.equal(stored[..., :64].view(torch.int8), q)
    assert torch.equal(stored[..., 64:].contiguous().view(torch.float16), scale)
    assert torch.equal(INT8.decode(stored), dequantize_int8(q, scale))


def test_int8_zero_rows_decode_to_zero_not_nan() -> None:
    x = rows()
    x[2, 1] = 0
    decoded = INT8.decode(INT8.encode(x))
    assert not decoded.isnan().any()
    assert torch.equal(decoded[2, 1], torch.zeros(64))


@pytest.mark.parametrize("fmt", FP8, ids=lambda f: f.name)
def test_fp8_round_trip_is_torchs_own_conversion(fmt) -> None:
    x = rows()
    stored = fmt.encode(x)
    assert stored.dtype == fmt.storage_dtype and stored.shape == x.shape
    assert torch.equal(fmt.decode(stored), x.to(fmt.storage_dtype).float())


@pytest.mark.parametrize("fmt", FP8, ids=lambda f: f.name)
def test_fp8_saturates_at_its_largest_value(fmt) -> None:
    largest = torch.finfo(fmt.storage_dtype).max  # e4m3: 448, e5m2: 57344
    x = torch.tensor([1e6, -1e6, float(largest), 0.0]).view(1, 1, 4)
    decoded = fmt.decode(fmt.encode(x)).flatten().tolist()
    assert decoded == [largest, -largest, largest, 0.0]


def test_int8_large_values_keep_their_relative_precision() -> None:
    x = rows() * 1e3
    q, scale = quantize_int8(x)
    error = (x - dequantize_int8(q, scale)).abs()
    assert (error <= scale.float() / 2 * (1 + 1e-3)).all()


def test_int8_rows_past_fp16_s_range_saturate_instead_of_overflowing() -> None:
    x = torch.tensor([1e9, -2e9, 1.0]).view(1, 1, 3)
    decoded = INT8.decode(INT8.encode(x)).flatten()
    largest = 127 * torch.finfo(torch.float16).max
    assert decoded.isfinite().all()
    assert decoded.tolist()[:2] == [largest, -largest]


def test_names_resolve_and_fp8_means_e4m3() -> None:
    assert kv_format("fp8", torch.bfloat16) is E4M3
    assert kv_format("auto", torch.bfloat16).storage_dtype == torch.bfloat16
    assert not kv_format("auto", torch.float32).quantized
    assert stored_format(torch.uint8) is INT8 and stored_format(torch.float8_e5m2) is E5M2
    assert attention_dtype(torch.uint8) == torch.float32
    assert attention_dtype(torch.bfloat16) == torch.bfloat16


def test_an_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        kv_format("int4", torch.float32)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp16'"):
        CacheConfig(kv_cache_dtype="fp16")


# --- the pool ----------------------------------------------------------------------------

SMOLLM = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=1e5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)  # the bundled SmolLM2-135M's shapes; fmt: skip


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_fixed_budget_holds_at_least_1_9x_the_blocks_of_bfloat16(name) -> None:
    config = CacheConfig(block_size=16, kv_cache_memory_bytes=64 << 20)
    bf16 = PagedKVPool.num_blocks_for(config, SMOLLM, torch.bfloat16)
    eight = PagedKVPool.num_blocks_for(config, SMOLLM, KV_FORMATS[name])
    assert eight >= 1.9 * bf16
    expected = {"int8": 2 * 64 / 66, "fp8_e4m3": 2.0, "fp8_e5m2": 2.0}[name]
    assert eight / bf16 == pytest.approx(expected, rel=0.01)


def test_the_pool_holds_int8_rows_of_head_dim_plus_two_bytes() -> None:
    pool = PagedKVPool(SMOLLM, num_blocks=2, block_size=4, dtype=INT8, device="cpu")
    assert pool.kv.shape == (30, 2, 2, 4, 3, 66) and pool.kv.dtype == torch.uint8
    assert pool.block_nbytes == pool.nbytes // 2 == 30 * 2 * 4 * 3 * 66


def test_a_budget_too_small_says_the_format() -> None:
    config = CacheConfig(block_size=16, kv_cache_memory_bytes=1000)
    with pytest.raises(ValueError, match="66 bytes per token and head: head_dim 64 in int8"):
        PagedKVPool.num_blocks_for(config, SMOLLM, INT8)


def test_writing_other_bytes_into_an_8_bit_pool_is_refused() -> None:
    pool = PagedKVPool(SMOLLM, num_blocks=2, block_size=4, dtype=E4M3, device="cpu")
    data = torch.zeros(pool.gather_blocks([0]).shape)  # fp32, not the stored bytes
    with pytest.raises(ValueError, match="fp8_e4m3 pool must hold its stored bytes"):
        pool.write_blocks([1], data)


# --- attention over an 8-bit cache -------------------------------------------------------


def encoded(step: Step, fmt) -> Step:
    """The step over a pool holding `fmt`'s bytes, and an oracle over the decoded values."""
    pool = TensorPool(encode_pool(step.pool.k, fmt), encode_pool(step.pool.v, fmt))
    round_trip = [fmt.decode(fmt.encode(x)) for x in step.full_k + step.full_v]
    half = len(round_trip) // 2
    return Step(
        pool, step.metadata, step.q, step.k, step.v, step.seqs, round_trip[:half],
        round_trip[half:],
    )  # fmt: skip


def encode_pool(cache: torch.Tensor, fmt) -> torch.Tensor:
    """[layers, blocks, block_size, Hkv, D] -> the same slots encoded: [..., Hkv, row]."""
    *lead, heads, dim = cache.shape
    return fmt.encode(cache.reshape(-1, heads, dim)).view(*lead, heads, fmt.row_size(dim))


FORMATS = [INT8, E4M3, E5M2]
BACKENDS = ["torch", "cpu", "triton"]  # triton: in the interpreter on a CPU


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decodes_over_an_8_bit_cache_match_the_oracle(fmt, backend) -> None:
    seqs = [Seq(cached=n, new=1) for n in edge_lengths(4)]
    step = encoded(make_step(seqs, block_size=4, num_heads=6, num_kv_heads=2), fmt)
    out = step.run(backend=get_attention_backend(backend))
    torch.testing.assert_close(out, step.expected(), **FP32_TOL)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_extend_over_an_8_bit_cache_match_the_oracle(fmt, backend) -> None:
    seqs = [Seq(cached=0, new=9), Seq(cached=6, new=5), Seq(cached=11, new=1)]
    step = encoded(make_step(seqs, block_size=4, num_heads=4, num_kv_heads=2), fmt)
    out = step.run(backend=get_attention_backend(backend))
    torch.testing.assert_close(out, step.expected(), **FP32_TOL)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_per_sequence_path_decodes_the_cache_too(fmt) -> None:
    seqs = [Seq(cached=5, new=1), Seq(cached=0, new=3)]
    step = encoded(make_step(seqs, block_size=4), fmt)
    out = PerSequenceAttention(step.pool, step.metadata, attend)(1, step.q, step.k, step.v)
    torch.testing.assert_close(out, step.expected(), **FP32_TOL)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_bfloat16_queries_over_an_8_bit_cache_come_back_in_bfloat16(fmt) -> None:
    seqs = [Seq(cached=5, new=1), Seq(cached=2, new=3)]
    step = encoded(make_step(seqs, block_size=4, dtype=torch.bfloat16), fmt)
    out = step.run(backend=get_attention_backend("cpu"))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), step.expected(), atol=2e-2, rtol=2e-2)


def widened_by_the_c_kernel(v_row: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The decode kernel's output for one key whose value row is `v_row` [row]: the softmax
    of a single score is 1, so the output is that value row widened to fp32 [head_dim]."""
    cache = torch.zeros((1, 1, 1, v_row.shape[0]), dtype=v_row.dtype)  # [blocks, bs, Hkv, row]
    values = cache.clone()
    values[0, 0, 0] = v_row
    metadata = AttentionMetadata.build(
        query_lens=[1], context_lens=[1], block_tables=[[0]], slot_mapping=[0]
    )
    attention = CpuPagedAttention(TensorPool(cache[None], values[None]), metadata)
    assert attention.lib is not None  # the C kernels, not the torch fallback
    q, out = torch.ones(1, 1, head_dim), torch.zeros(1, 1, head_dim)
    attention.decode(out, q, cache, values)
    return out[0, 0]


@pytest.mark.parametrize("fmt", FP8, ids=lambda f: f.name)
def test_the_c_kernel_widens_every_finite_fp8_byte_as_torch_does(fmt) -> None:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = every[every.view(fmt.storage_dtype).float().isfinite()]  # e4m3: 254, e5m2: 248
    row = torch.zeros(256, dtype=torch.uint8)
    row[: finite.numel()] = finite
    stored = row.view(fmt.storage_dtype)
    assert torch.equal(widened_by_the_c_kernel(stored, 256), fmt.decode(stored))


def test_the_c_kernel_applies_each_int8_row_s_scale() -> None:
    x = rows(shape=(1, 1, 24))  # head_dim 24: the kernels' path for any head_dim
    stored = INT8.encode(x)[0, 0]  # [26] uint8
    torch.testing.assert_close(
        widened_by_the_c_kernel(stored, 24), INT8.decode(stored), atol=0, rtol=0
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("head_dim", [8, 64])
def test_the_c_decode_matches_the_torch_reference_at_any_head_dim(fmt, head_dim) -> None:
    seqs = [Seq(cached=n, new=1) for n in edge_lengths(4)]
    step = encoded(
        make_step(seqs, block_size=4, num_heads=6, num_kv_heads=3, head_dim=head_dim), fmt
    )
    c = step.run(backend=CpuPagedAttention)
    step = encoded(
        make_step(seqs, block_size=4, num_heads=6, num_kv_heads=3, head_dim=head_dim), fmt
    )
    reference = step.run(backend=TorchPagedAttention)
    torch.testing.assert_close(c, reference, **FP32_TOL)


@pytest.mark.parametrize(("head_dim", "num_kv_heads"), [(16, 2), (24, 3)])
def test_the_triton_int8_store_writes_the_reference_s_bytes(head_dim, num_kv_heads) -> None:
    k, v = rows(1, (7, num_kv_heads, head_dim)), rows(2, (7, num_kv_heads, head_dim))
    k[2, 1] = 0  # a zero row: scale 0
    slots = torch.tensor([0, 5, 9, 3, -1, 11, 2])  # -1: padding, stores nothing
    expected = [torch.zeros(3, 4, num_kv_heads, head_dim + 2, dtype=torch.uint8) for _ in "kv"]
    kept = slots >= 0
    paged_store_reference(*expected, k[kept], v[kept], slots[kept])
    got = [torch.zeros_like(expected[0]) for _ in "kv"]
    int8_store(*got, k, v, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_int8_store_writes_the_reference_s_bytes(dtype) -> None:
    """The store kernel encodes int8 rows itself: the same bytes as `kv_format`'s encode,
    on a zero row, halves, fp16-subnormal scales and a row whose scale saturates."""
    k, v = rows(3, (9, 3, 64)), rows(4, (9, 3, 64))
    k[0, 0] = 0  # scale 0, q 0
    k[1, 1] = torch.arange(64) - 63.5  # absmax 63.5: scale 0.5, every x / scale a half
    v[2, 2] = rows(5, (64,)) * 1e-4  # scale below fp16's smallest normal
    v[3, 0] = rows(6, (64,)) * 1e9  # absmax / 127 past fp16's largest: it saturates
    k, v = k.to(dtype), v.to(dtype)
    slots = [4, 0, 11, 7, 2, 9, 5, 1, 10]
    expected = [torch.zeros(3, 4, 3, 66, dtype=torch.uint8) for _ in "kv"]
    paged_store_reference(*expected, k, v, torch.tensor(slots))
    got = [torch.zeros_like(expected[0]) for _ in "kv"]
    metadata = AttentionMetadata.build(
        query_lens=[9], context_lens=[9], block_tables=[[0, 1, 2]], slot_mapping=slots
    )
    attention = CpuPagedAttention(TensorPool(got[0][None], got[1][None]), metadata)
    assert attention.lib is not None  # the C kernels, not the torch fallback
    attention.store(*got, k, v)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
