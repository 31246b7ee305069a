"""The Triton kernels (store, decode, split-K decode, prefill/extend) match their plain-torch
references, run through Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is defined).

Steps come from `make_step` (tests/test_paged_attention.py): every sequence's prefix sits in
shuffled blocks of a pool whose other slots hold a large garbage value, so a kernel that
reads one slot too many, or the wrong block, is far off. Context lengths cover 1,
block_size - 1, block_size, block_size + 1 and several blocks, the cases that prove masks.
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import Seq, Step, edge_lengths, make_step

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.attention.backends import choose_attention, get_attention_backend
from minserve.attention.paged_torch import (
    TorchPagedAttention,
    paged_attention_reference,
    paged_store_reference,
)
from minserve.attention.triton_backend import TritonPagedAttention
from minserve.attention.triton_decode import (
    DecodeKernels,
    combine_splits_kernel,
    paged_decode,
    paged_decode_kernel,
)
from minserve.attention.triton_env import interpreting
from minserve.attention.triton_prefill import paged_prefill
from minserve.attention.triton_store import paged_store

BLOCK_SIZE = 4
TOLERANCE = {  # fp32 math inside the kernels; the output is rounded to the input's dtype
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
GQA = [(2, 2), (6, 2), (8, 2)]  # (query heads, KV heads): ratios 1, 3 and 4
interpreted_only = pytest.mark.skipif(
    not interpreting(),
    reason="the kernels run compiled here: `make_step` builds CPU tensors, and these tests "
    "use 4-token tiles, which the interpreter takes and the GPU compiler refuses (tl.dot "
    "needs 16); on a GPU the kernels are checked by benchmarks/gpu_check.py (CUDA tensors, "
    "tiles of 16 and more)",
)


def stored(step: Step, layer: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's caches with the step's own k/v stored by the reference."""
    k_cache, v_cache = step.pool.k_cache(layer), step.pool.v_cache(layer)
    paged_store_reference(k_cache, v_cache, step.k, step.v, step.metadata.slot_mapping)
    return k_cache, v_cache


def decode_step(heads: tuple[int, int], head_dim: int, dtype: torch.dtype) -> Step:
    """One decode per edge context length, plus a sequence of several blocks."""
    seqs = [Seq(cached=n - 1, new=1) for n in edge_lengths(BLOCK_SIZE)]
    return make_step(seqs, BLOCK_SIZE, *heads, head_dim=head_dim, dtype=dtype)


def run_decode(step: Step, **options) -> torch.Tensor:
    k_cache, v_cache = stored(step)
    md = step.metadata
    return paged_decode(
        step.q, k_cache, v_cache, md.block_tables, md.context_lens, md.max_context_len, **options
    )


def assert_matches_reference(step: Step, got: torch.Tensor) -> None:
    k_cache, v_cache = stored(step)
    expected = paged_attention_reference(step.q, k_cache, v_cache, step.metadata)
    assert got.dtype == step.q.dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[step.q.dtype])


# --- store ----------------------------------------------------------------------------------


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_exactly_the_mapped_slots(dtype: torch.dtype) -> None:
    step = make_step([Seq(2, 3), Seq(0, 5)], BLOCK_SIZE, dtype=dtype)
    qkv = torch.cat([step.k, step.v], dim=1)  # k and v as strided views, as in the model
    k, v = qkv.split(step.k.shape[1], dim=1)
    expected_k, expected_v = step.pool.k[1].clone(), step.pool.v[1].clone()
    paged_store_reference(expected_k, expected_v, step.k, step.v, step.metadata.slot_mapping)
    paged_store(step.pool.k[1], step.pool.v[1], k, v, step.metadata.slot_mapping)
    assert torch.equal(step.pool.k[1], expected_k) and torch.equal(step.pool.v[1], expected_v)


@interpreted_only
def test_store_skips_negative_slots() -> None:
    step = make_step([Seq(0, 3)], BLOCK_SIZE)
    before = step.pool.k[0].clone()
    slots = step.metadata.slot_mapping.clone()
    slots[1] = -1  # padding
    paged_store(step.pool.k[0], step.pool.v[0], step.k, step.v, slots)
    expected = before.clone()
    paged_store_reference(expected, expected.clone(), step.k[[0, 2]], step.v[[0, 2]], slots[[0, 2]])
    assert torch.equal(step.pool.k[0], expected)


# --- decode ---------------------------------------------------------------------------------


@interpreted_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa3", "gqa4"])
def test_decode_matches_reference_at_edge_lengths(heads: tuple[int, int], head_dim: int) -> None:
    step = decode_step(heads, head_dim, torch.float32)
    assert_matches_reference(step, run_decode(step))


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_upcasts_half_precision_inputs(dtype: torch.dtype) -> None:
    step = decode_step((8, 2), 64, dtype)
    assert_matches_reference(step, run_decode(step))


@interpreted_only
@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_k_decode_matches_reference_with_empty_splits(num_splits: int) -> None:
    # 4-token tiles: the short sequences leave later splits empty, the long one fills them
    step = decode_step((6, 2), 64, torch.float32)
    assert_matches_reference(step, run_decode(step, num_splits=num_splits, block_n=4))


@interpreted_only
def test_decode_walks_many_tiles_of_one_sequence() -> None:
    step = make_step([Seq(cached=37, new=1), Seq(cached=0, new=1)], BLOCK_SIZE, 4, 2, 64)
    assert_matches_reference(step, run_decode(step, block_n=16))


@interpreted_only
def test_decode_scale_replaces_one_over_sqrt_head_dim() -> None:
    step = decode_step((4, 2), 64, torch.float32)
    k_cache, v_cache = stored(step)
    expected = paged_attention_reference(step.q, k_cache, v_cache, step.metadata, scale=0.05)
    torch.testing.assert_close(run_decode(step, scale=0.05), expected, **TOLERANCE[torch.float32])


def test_decode_rejects_uneven_query_groups() -> None:
    step = decode_step((4, 2), 64, torch.float32)
    q = torch.cat([step.q, step.q[:, :1]], dim=1)  # 5 query heads over 2 KV heads
    with pytest.raises(ValueError, match="5 query heads cannot share 2 KV heads evenly"):
        paged_decode(q, step.pool.k[1], step.pool.v[1], step.metadata.block_tables,
                     step.metadata.context_lens, step.metadata.max_context_len)  # fmt: skip


# --- prefill / extend -----------------------------------------------------------------------


def run_prefill(step: Step, block_m: int = 16, block_n: int = 64) -> torch.Tensor:
    k_cache, v_cache = stored(step)
    md = step.metadata
    out = torch.zeros_like(step.q)
    return paged_prefill(
        step.q, k_cache, v_cache, md.block_tables, md.query_start_loc[:-1], md.query_lens,
        md.context_lens, md.max_query_len, out, block_m=block_m, block_n=block_n,
    )  # fmt: skip


@interpreted_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa3", "gqa4"])
def test_extend_over_cached_prefix_matches_reference(heads: tuple[int, int], head_dim: int) -> None:
    lengths = edge_lengths(BLOCK_SIZE)  # chunk lengths and prefix lengths both at the edges
    seqs = [Seq(cached=c, new=n) for c, n in zip(lengths, reversed(lengths))]
    step = make_step(seqs, BLOCK_SIZE, *heads, head_dim=head_dim)
    assert_matches_reference(step, run_prefill(step))


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_upcasts_half_precision_inputs(dtype: torch.dtype) -> None:
    step = make_step([Seq(0, 9), Seq(5, 4)], BLOCK_SIZE, 8, 2, head_dim=64, dtype=dtype)
    assert_matches_reference(step, run_prefill(step))


@interpreted_only
def test_prefill_tiles_queries_and_keys() -> None:
    # 4x4 tiles: chunks span several query tiles, prefixes several key tiles
    step = make_step([Seq(cached=9, new=11), Seq(cached=0, new=6)], BLOCK_SIZE, 6, 2, 64)
    assert_matches_reference(step, run_prefill(step, block_m=4, block_n=4))


# --- the backend ----------------------------------------------------------------------------


@interpreted_only
@pytest.mark.parametrize("order", ["decodes_first", "interleaved"])
def test_backend_matches_torch_backend_on_a_mixed_step(order: str) -> None:
    seqs = [Seq(4, 1), Seq(0, 7), Seq(9, 1), Seq(5, 3)]  # decodes, a prefill, an extend
    if order == "decodes_first":
        seqs = [seqs[0], seqs[2], seqs[1], seqs[3]]
    step = make_step(seqs, BLOCK_SIZE, 6, 2, head_dim=64)
    torch_pool = make_step(seqs, BLOCK_SIZE, 6, 2, head_dim=64).pool  # same seed, same pool
    got = TritonPagedAttention(step.pool, step.metadata)(1, step.q, step.k, step.v)
    expected = TorchPagedAttention(torch_pool, step.metadata)(1, step.q, step.k, step.v)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    assert torch.equal(step.pool.k, torch_pool.k) and torch.equal(step.pool.v, torch_pool.v)


def test_backend_is_registered_as_triton() -> None:
    assert get_attention_backend("triton") is TritonPagedAttention


@interpreted_only
def test_backend_rejects_a_step_of_another_size() -> None:
    step = make_step([Seq(0, 3)], BLOCK_SIZE)
    with pytest.raises(ValueError, match="step has 2 tokens but the attention metadata maps 3"):
        TritonPagedAttention(step.pool, step.metadata)(0, step.q[:2], step.k[:2], step.v[:2])


def test_engine_greedy_outputs_equal_the_torch_backends(tiny_model) -> None:
    """Chunked prefill (8-token budget) next to decodes, on a tiny random Llama."""
    prompts = [[5, 17, 300, 42, 9, 77, 1200, 3, 8, 61, 14], [400, 2, 19], [7] * 6]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model("llama"), block_size=4, num_blocks=32,
                  max_num_batched_tokens=8, attention_backend=backend)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["triton"] == outputs["torch"]


def test_engine_runs_the_decode_kernels_it_is_given(tiny_model) -> None:
    """`decode_kernels` (chapter 02's hook): the engine launches them at every decode step."""
    launches = []

    def counting(kernel):
        class Counted:  # `kernel[grid](...)`, counted
            def __getitem__(self, grid):
                launches.append(grid)
                return kernel[grid]

        return Counted()

    kernels = DecodeKernels(counting(paged_decode_kernel), combine_splits_kernel)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 300]}]
    tokens = {}
    for backend, chosen in (("torch", None), ("triton", kernels)):
        llm = LLM(tiny_model("llama"), block_size=4, num_blocks=16, attention_backend=backend,
                  plugins=CoursePlugins(decode_kernels=chosen))  # fmt: skip
        tokens[backend] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["triton"] == tokens["torch"]
    assert launches, "the engine never launched the kernel it was given"


def test_engine_on_chapter_02_solutions_gives_the_torch_backends_tokens(tiny_model) -> None:
    """Chapter 02's solution kernels (decode, combine, store, prefill) drive the engine: the
    torch backend's tokens, through chunked prefill (a budget of 4 tokens)."""
    import solutions.ch02_paged_attention as ch02

    stores = []

    class CountedStore:  # `kernel[grid](...)`, counted
        def __getitem__(self, grid):
            stores.append(grid)
            return ch02.paged_store_kernel[grid]

    kernels = DecodeKernels.from_module(ch02)
    assert kernels.store is ch02.paged_store_kernel
    assert kernels.prefill is ch02.paged_prefill_kernel
    kernels = DecodeKernels(kernels.decode, kernels.combine, CountedStore(), kernels.prefill)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 300, 42, 9]}, {"prompt_token_ids": [400, 2]}]
    tokens = {}
    for backend, chosen in (("torch", None), ("triton", kernels)):
        llm = LLM(tiny_model("llama"), block_size=4, num_blocks=16, attention_backend=backend,
                  max_num_batched_tokens=4,
                  plugins=CoursePlugins(decode_kernels=chosen))  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["triton"] == tokens["torch"]
    assert stores, "the engine never launched the store kernel it was given"


def test_decode_kernels_need_the_triton_backend() -> None:
    with pytest.raises(ValueError, match="pass attention_backend='triton'"):
        choose_attention("torch", decode_kernels=DecodeKernels())
