"""PagedAttention in plain torch matches the contiguous oracle, `contiguous.attend`.

Each step scatters every sequence's cached prefix into shuffled blocks of a pool whose other
slots hold a large garbage value (stale memory: attending to one would wreck the output),
runs the step through `TorchPagedAttention`, and compares each sequence's rows with
`attend` over its own contiguous K/V. The last test runs a tiny random Llama both ways.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from minserve.attention.backends import get_attention_backend
from minserve.attention.contiguous import (
    ContiguousAttention,
    ContiguousSlice,
    SequenceKV,
    attend,
)
from minserve.attention.metadata import AttentionMetadata
from minserve.attention.paged_cpu import FLASH_FROM, CpuPagedAttention
from minserve.attention.paged_plan import length_buckets
from minserve.attention.paged_torch import (
    TorchPagedAttention,
    paged_attention_reference,
    paged_store_reference,
)
from minserve.model.llama import CausalLM
from minserve.model_config import ModelConfig

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


GARBAGE = 1e4  # finite (the engine's pool starts zeroed), far from any real k or v


class TensorPool:
    """The `PagedKVCache` protocol over plain tensors [layers, num_blocks, block_size, Hkv, D]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    @classmethod
    def of_garbage(cls, layers: int, num_blocks: int, block_size: int, heads: int, dim: int, dtype):
        shape = (layers, num_blocks, block_size, heads, dim)
        return cls(torch.full(shape, GARBAGE, dtype=dtype), torch.full(shape, GARBAGE, dtype=dtype))

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.v[layer]


@dataclass(frozen=True)
class Seq:
    """One sequence of a test step: `cached` tokens already in the pool, `new` arriving now."""

    cached: int
    new: int


def slot(table: list[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


@dataclass
class Step:
    """A ready-to-run step and, per sequence, the contiguous K/V the oracle attends over."""

    pool: TensorPool
    metadata: AttentionMetadata
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    seqs: list[Seq]
    full_k: list[torch.Tensor]  # per sequence [cached + new, Hkv, D]
    full_v: list[torch.Tensor]

    def run(
        self,
        layer: int = 1,
        scale: float | None = None,
        backend: type = TorchPagedAttention,
        q: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step through `backend`, with the step's queries or `q`."""
        attention = backend(self.pool, self.metadata, scale)
        return attention(layer, self.q if q is None else q, self.k, self.v)

    def expected(self, q_scale: float = 1.0) -> torch.Tensor:
        """The oracle, in fp32, one sequence at a time on contiguous K/V."""
        outs, start = [], 0
        for s, k, v in zip(self.seqs, self.full_k, self.full_v):
            q = self.q[start : start + s.new].float() * q_scale
            outs.append(attend(q, k.float(), v.float(), s.cached))
            start += s.new
        return torch.cat(outs)


def make_step(
    seqs: list[Seq],
    block_size: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layers: int = 2,
) -> Step:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    needed = [math.ceil((s.cached + s.new) / block_size) for s in seqs]
    free = torch.randperm(sum(needed) + 3, generator=gen).tolist()  # 3 blocks stay unused
    tables = [[free.pop() for _ in range(n)] for n in needed]
    pool = TensorPool.of_garbage(layers, sum(needed) + 3, block_size, num_kv_heads, head_dim, dtype)
    full_k = [randn(s.cached + s.new, num_kv_heads, head_dim) for s in seqs]
    full_v = [randn(s.cached + s.new, num_kv_heads, head_dim) for s in seqs]
    slot_mapping: list[int] = []
    for s, table, k, v in zip(seqs, tables, full_k, full_v):
        for pos in range(s.cached):  # the prefix earlier steps stored
            b, o = divmod(slot(table, pos, block_size), block_size)
            for layer in range(layers):
                pool.k[layer, b, o], pool.v[layer, b, o] = k[pos], v[pos]
        slot_mapping += [slot(table, p, block_size) for p in range(s.cached, s.cached + s.new)]
    metadata = AttentionMetadata.build(
        query_lens=[s.new for s in seqs],
        context_lens=[s.cached + s.new for s in seqs],
        block_tables=tables,
        slot_mapping=slot_mapping,
    )
    q = randn(sum(s.new for s in seqs), num_heads, head_dim)
    k = torch.cat([k[s.cached :] for s, k in zip(seqs, full_k)])
    v = torch.cat([v[s.cached :] for s, v in zip(seqs, full_v)])
    return Step(pool, metadata, q, k, v, seqs, full_k, full_v)


def edge_lengths(block_size: int) -> list[int]:
    """1, block_size - 1, block_size, block_size + 1 and several blocks, without repeats."""
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]
    return sorted({n for n in lengths if n >= 1})


@pytest.fixture(params=["torch", "cpu"])
def backend(request: pytest.FixtureRequest) -> type:
    """Each CPU backend: plain torch, and the C kernels (`minserve/kernels`)."""
    return get_attention_backend(request.param)


# --- AttentionMetadata ---------------------------------------------------------------------


def test_build_packs_lists_into_tensors() -> None:
    md = AttentionMetadata.build(
        query_lens=[1, 3, 1],
        context_lens=[6, 3, 9],
        block_tables=[[7, 2], [5], [1, 4, 3]],
        slot_mapping=[9, 20, 21, 22, 13],
    )
    assert md.slot_mapping.dtype == torch.int64
    assert md.slot_mapping.tolist() == [9, 20, 21, 22, 13]
    assert md.query_start_loc.dtype == torch.int32
    assert md.query_start_loc.tolist() == [0, 1, 4, 5]
    assert md.context_lens.dtype == torch.int32
    assert md.context_lens.tolist() == [6, 3, 9]
    assert md.block_tables.dtype == torch.int32
    assert md.block_tables.tolist() == [[7, 2, 0], [5, 0, 0], [1, 4, 3]]
    assert (md.max_query_len, md.max_context_len) == (3, 9)
    assert (md.num_seqs, md.num_tokens) == (3, 5)
    assert md.query_lens.tolist() == [1, 3, 1]


def test_num_decodes_counts_single_token_queries_wherever_they_sit() -> None:
    md = AttentionMetadata.build([4, 1, 2, 1], [4, 8, 9, 3], [[0], [1, 2], [3, 4], [5]], [0] * 8)
    assert md.num_decodes == 2


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "tables", "slots", "message"),
    [
        ([1, 1], [3], [[0], [1]], [0, 1], "one of each per sequence"),
        ([2], [3], [[0]], [0], "one slot per new token"),
        ([4], [3], [[0]], [0, 1, 2, 3], "query length 4 and context length 3"),
        ([0], [3], [[0]], [], "query length 0"),
    ],
)
def test_build_rejects_inconsistent_lists(query_lens, context_lens, tables, slots, message) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(query_lens, context_lens, tables, slots)


# --- store -----------------------------------------------------------------------------------


def test_store_writes_exactly_the_mapped_slots_of_its_layer() -> None:
    gen = torch.Generator().manual_seed(1)
    pool = TensorPool(
        torch.randn(2, 6, 4, 2, 8, generator=gen), torch.randn(2, 6, 4, 2, 8, generator=gen)
    )
    before_k, before_v = pool.k.clone(), pool.v.clone()
    slots = torch.tensor([5, 0, 23, 14, 9])
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    paged_store_reference(pool.k_cache(1), pool.v_cache(1), k, v, slots)
    flat_k, flat_v = pool.k[1].view(24, 2, 8), pool.v[1].view(24, 2, 8)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(2, 24, dtype=torch.bool)
    untouched[1, slots] = False
    assert torch.equal(pool.k.view(2, 24, 2, 8)[untouched], before_k.view(2, 24, 2, 8)[untouched])
    assert torch.equal(pool.v.view(2, 24, 2, 8)[untouched], before_v.view(2, 24, 2, 8)[untouched])


def test_backend_stores_the_step_before_attending(backend: type) -> None:
    step = make_step([Seq(cached=5, new=1), Seq(cached=0, new=3)], block_size=2)
    step.run(layer=1, backend=backend)
    table0 = step.metadata.block_tables[0].tolist()
    b, o = divmod(slot(table0, 5, 2), 2)
    assert torch.equal(step.pool.k[1, b, o], step.full_k[0][5])
    assert torch.equal(step.pool.v[1, b, o], step.full_v[0][5])
    assert (step.pool.k[0, b, o] == GARBAGE).all()  # layer 0 was not asked for


# --- attention against the oracle --------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 2)])
def test_decodes_match_oracle(
    block_size: int, num_heads: int, num_kv_heads: int, backend: type
) -> None:
    seqs = [Seq(cached=n - 1, new=1) for n in edge_lengths(block_size)]
    step = make_step(seqs, block_size, num_heads, num_kv_heads)
    torch.testing.assert_close(step.run(backend=backend), step.expected(), **FP32_TOL)


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 2)])
def test_prefill_from_empty_cache_matches_oracle(
    block_size: int, num_heads: int, num_kv_heads: int, backend: type
) -> None:
    for n in edge_lengths(block_size):
        step = make_step([Seq(cached=0, new=n)], block_size, num_heads, num_kv_heads, seed=n)
        torch.testing.assert_close(step.run(backend=backend), step.expected(), **FP32_TOL)


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_extend_over_cached_prefix_matches_oracle(block_size: int, backend: type) -> None:
    for cached in edge_lengths(block_size):
        for new in (2, block_size + 1):
            step = make_step([Seq(cached, new)], block_size, num_heads=6, num_kv_heads=2)
            torch.testing.assert_close(step.run(backend=backend), step.expected(), **FP32_TOL)


MIXED = {
    "decodes_first": [Seq(6, 1), Seq(16, 1), Seq(0, 11), Seq(17, 9)],
    "prefill_first": [Seq(0, 11), Seq(6, 1), Seq(17, 9), Seq(16, 1)],
    "interleaved": [Seq(6, 1), Seq(17, 9), Seq(16, 1), Seq(0, 11), Seq(32, 1)],
    "decodes_last": [Seq(17, 9), Seq(0, 11), Seq(16, 1), Seq(6, 1)],
    "two_new_prompts": [Seq(0, 5), Seq(3, 1), Seq(0, 7)],  # prompts with nothing cached
}


@pytest.mark.parametrize("order", MIXED)
@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_mixed_batch_matches_oracle_in_any_order(
    order: str, block_size: int, backend: type
) -> None:
    step = make_step(MIXED[order], block_size, num_heads=6, num_kv_heads=2)
    torch.testing.assert_close(step.run(backend=backend), step.expected(), **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_first_chunk_takes_torch_flash_beside_the_kernels_rows(dtype: torch.dtype) -> None:
    """A prompt's first chunk of FLASH_FROM rows runs torch's flash kernel on its own k/v;
    the step's other rows (a decode, an extend, a shorter prompt) stay with the C kernel."""
    long = FLASH_FROM[dtype]
    seqs = [Seq(6, 1), Seq(0, long), Seq(17, 9), Seq(0, long - 1)]
    step = make_step(seqs, 16, num_heads=6, num_kv_heads=2, dtype=dtype)
    attention = CpuPagedAttention(step.pool, step.metadata)
    assert attention.flash == [slice(1, 1 + long)]
    assert attention.rows.numel() == step.q.shape[0] - long
    out = attention(1, step.q, step.k, step.v)
    tolerance = FP32_TOL if dtype is torch.float32 else BF16_TOL
    torch.testing.assert_close(out.float(), step.expected(), **tolerance)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (9, 3), (8, 2), (14, 2)])
def test_real_head_dims_match_oracle(
    head_dim: int, num_heads: int, num_kv_heads: int, backend: type
) -> None:
    step = make_step(MIXED["interleaved"], 16, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(step.run(backend=backend), step.expected(), **FP32_TOL)


@pytest.mark.parametrize("block_size", [2, 16])
def test_bf16_stays_close_to_fp32_oracle(block_size: int, backend: type) -> None:
    step = make_step(MIXED["interleaved"], block_size, 9, 3, 64, dtype=torch.bfloat16)
    out = step.run(backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), step.expected(), **BF16_TOL)


@pytest.mark.parametrize("contexts", [[37], [5, 40, 17]])  # a task per KV head, per sequence
def test_the_c_kernel_decodes_bf16_rows_within_a_rounding_of_the_fp32_kernel(
    contexts: list[int],
) -> None:
    """A bfloat16 step's queries go to the C decode as they are: each task reads them as
    stored (products in pairs, where the CPU has AVX512-BF16) or widens them, and rounds its
    outputs once, so each output is the fp32 kernel's on the widened queries, rounded, give or
    take that one rounding (the fp32 sums differ only in order)."""
    step = make_step([Seq(n, 1) for n in contexts], 16, 9, 3, 64, dtype=torch.bfloat16)
    got = step.run(backend=CpuPagedAttention)  # [T, Hq, D] bf16
    widened = step.run(backend=CpuPagedAttention, q=step.q.float())  # fp32 queries, same pool
    assert got.dtype == torch.bfloat16 and widened.dtype == torch.float32
    one_rounding = widened.abs() * 2.0**-7 + 1e-6  # a bf16 step at |x|, and the sums' order
    assert ((got.float() - widened).abs() <= one_rounding).all()
    assert (got == widened.to(torch.bfloat16)).float().mean() > 0.99  # most round alike


def test_stale_slots_past_each_context_are_never_read(backend: type) -> None:
    # Every slot outside the sequences' contexts, table padding included, holds GARBAGE.
    step = make_step([Seq(0, 3), Seq(1, 1), Seq(30, 1), Seq(5, 1)], block_size=16)
    assert (step.pool.k == GARBAGE).any()
    out = step.run(backend=backend)
    assert out.isfinite().all()
    torch.testing.assert_close(out, step.expected(), **FP32_TOL)


def test_explicit_scale_replaces_one_over_sqrt_head_dim(backend: type) -> None:
    step = make_step(MIXED["decodes_first"], block_size=2, head_dim=16)
    expected = step.expected(q_scale=0.3 * math.sqrt(16))  # attend divides by sqrt(16)
    torch.testing.assert_close(step.run(scale=0.3, backend=backend), expected, **FP32_TOL)


def test_reference_functions_compose_into_the_backend() -> None:
    step = make_step(MIXED["interleaved"], block_size=2)
    k_cache, v_cache = step.pool.k_cache(0), step.pool.v_cache(0)
    paged_store_reference(k_cache, v_cache, step.k, step.v, step.metadata.slot_mapping)
    out = paged_attention_reference(step.q, k_cache, v_cache, step.metadata)
    torch.testing.assert_close(out, step.run(layer=1), atol=0, rtol=0)


def test_rejects_a_step_of_another_size() -> None:
    step = make_step([Seq(0, 4)], block_size=2)
    with pytest.raises(ValueError, match="step has 3 tokens but the attention metadata maps 4"):
        TorchPagedAttention(step.pool, step.metadata)(0, step.q[:3], step.k[:3], step.v[:3])


def test_rejects_block_tables_too_short_for_the_context() -> None:
    pool = TensorPool.of_garbage(1, 4, 2, 1, 8, torch.float32)
    md = AttentionMetadata.build([1], [5], [[0, 1]], [4])
    with pytest.raises(ValueError, match="2 blocks of 2 tokens, too few for a context of 5"):
        TorchPagedAttention(pool, md)


def test_backend_registry_names_the_available_backends() -> None:
    assert get_attention_backend("torch") is TorchPagedAttention
    assert get_attention_backend("cpu") is CpuPagedAttention
    assert get_attention_backend("auto", "cpu") is CpuPagedAttention  # where the C kernels build
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'; available: auto"):
        get_attention_backend("cuda")


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        ([4, 4, 4], [[0, 1, 2]]),
        ([1, 8, 6, 2, 5], [[1, 2], [4], [3], [0]]),  # 6 >= 0.75 * 8; 5 < 6; 2 < 0.75 * 5
        ([3, 12, 9, 10], [[1, 3, 2], [0]]),
    ],
)
def test_decodes_are_bucketed_by_length_longest_first(blocks, expected) -> None:
    buckets = length_buckets(list(range(len(blocks))), blocks)
    assert buckets == expected
    for bucket in buckets:  # every member fills at least 3/4 of the bucket's padded length
        assert all(blocks[i] >= 0.75 * blocks[bucket[0]] for i in bucket)


# --- end to end: a tiny Llama, chunked through the paged pool ----------------------------------


def tiny_llama() -> CausalLM:
    config = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def contiguous_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    n = ids.shape[0]
    kv = SequenceKV(model.config, n, torch.float32, torch.device("cpu"))
    hidden = model(ids, torch.arange(n), ContiguousAttention([ContiguousSlice(kv, 0, n)]))
    return model.compute_logits(hidden)  # [n, vocab]


# (sequence, first token, end) chunks per step: prefill chunks, an extend next to a decode,
# decodes in both orders.
SCHEDULE = [
    [(0, 0, 9)],
    [(0, 9, 17), (1, 0, 6)],
    [(0, 17, 18), (1, 6, 13)],
    [(1, 13, 14), (0, 18, 19)],
    [(0, 19, 20), (1, 14, 15)],
]


@torch.inference_mode()
def test_chunked_paged_run_of_tiny_llama_matches_contiguous_logits() -> None:
    model, block_size = tiny_llama(), 4
    cfg = model.config
    prompts = [torch.randint(0, 64, (20,)), torch.randint(0, 64, (15,))]
    pool = TensorPool.of_garbage(
        cfg.num_layers, 12, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32
    )
    free = torch.randperm(12).tolist()
    tables: list[list[int]] = [[], []]
    logits: list[list[torch.Tensor]] = [[], []]
    for step in SCHEDULE:
        slots: list[int] = []
        for seq, start, end in step:
            while len(tables[seq]) * block_size < end:
                tables[seq].append(free.pop())
            slots += [slot(tables[seq], p, block_size) for p in range(start, end)]
        md = AttentionMetadata.build(
            query_lens=[end - start for _, start, end in step],
            context_lens=[end for _, _, end in step],
            block_tables=[tables[seq] for seq, _, _ in step],
            slot_mapping=slots,
        )
        ids = torch.cat([prompts[seq][start:end] for seq, start, end in step])
        positions = torch.cat([torch.arange(start, end) for _, start, end in step])
        out = model.compute_logits(model(ids, positions, TorchPagedAttention(pool, md)))
        for (seq, _, _), rows in zip(step, out.split([e - s for _, s, e in step])):
            logits[seq].append(rows)
    for seq, prompt in enumerate(prompts):
        expected = contiguous_logits(model, prompt)
        torch.testing.assert_close(torch.cat(logits[seq]), expected, atol=1e-5, rtol=0)


def test_one_selector_chooses_by_device_codec_and_plug_ins() -> None:
    from minserve.attention.backends import choose_attention
    from minserve.attention.per_sequence import PerSequenceAttention

    assert choose_attention("auto", "cpu", c_kernels=True).name == "cpu"
    assert choose_attention("auto", "cpu", c_kernels=False).name == "torch"
    assert choose_attention("auto", "cuda", c_kernels=False).name == "triton"
    # a kv_codec is called by the torch backend only: "auto" goes there on any device
    assert choose_attention("auto", "cuda", kv_cache_dtype="int8", kv_codec=True).name == "torch"
    student = choose_attention(attend=lambda *args: None)
    assert student.name == "per-sequence" and student.backend.func is PerSequenceAttention
    with pytest.raises(ValueError, match="'cpu' runs on cpu, not cuda"):
        choose_attention("cpu", "cuda")
    with pytest.raises(ValueError, match="give attention_backend or attend, not both"):
        choose_attention("torch", attend=lambda *args: None)
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not served"):
        choose_attention("torch", kv_cache_dtype="int4")
