"""Every way an 8-bit KV cache's blocks move (swap, prefix cache, host tier, the P/D hand-off
in one process and across two) gives the tokens of an 8-bit run where they do not move; the
Triton backend gives the torch backend's tokens; refused combinations say what to change.

Oracles: the same 8-bit engine with ample memory and no hand-off (moving stored bytes changes
no token); byte counts from the pool's block size. A tiny random Llama keeps this fast.
"""

from __future__ import annotations

import pytest
from test_disagg import GREEDY, PROMPTS, _hand_off
from test_engine import assert_all_blocks_free, random_workload, token_ids
from test_prefix_caching import shared_prefix_workload
from test_prefix_policy import round_robin_workload

from minserve import LLM, SamplingParams
from minserve.disagg.pd_pair import PrefillDecodePair

# --- blocks that move keep their bytes ---------------------------------------------------


@pytest.fixture(scope="module")
def workload():
    return random_workload(12, seed=0)


@pytest.fixture(scope="module")
def int8_ample(tiny_model, workload) -> list[list[int]]:
    llm = LLM(tiny_model("llama"), block_size=4, num_blocks=256, kv_cache_dtype="int8")
    return token_ids(llm.generate(*workload, use_tqdm=False))


def test_swapping_preemption_gives_the_int8_tokens(tiny_model, workload, int8_ample) -> None:
    llm = LLM(
        tiny_model("llama"), block_size=4, num_blocks=20, swap_space=0.01, kv_cache_dtype="int8"
    )
    assert token_ids(llm.generate(*workload, use_tqdm=False)) == int8_ample
    metrics = llm.get_metrics()
    assert metrics["num_swapped_out"] > 0
    block_bytes = llm.engine.worker.pool.block_nbytes
    assert metrics["swap_bytes_out"] % block_bytes == 0 and metrics["swap_bytes_in"] > 0
    assert_all_blocks_free(llm.engine)


def test_prefix_caching_under_eviction_and_swapping_gives_the_int8_tokens(tiny_model) -> None:
    prompts, params = shared_prefix_workload(16, seed=1)
    options = dict(block_size=4, max_num_batched_tokens=24, kv_cache_dtype="int8")
    ample = LLM(tiny_model("llama"), num_blocks=256, **options)
    expected = token_ids(ample.generate(prompts, params, use_tqdm=False))
    llm = LLM(
        tiny_model("llama"), num_blocks=16, swap_space=0.01, enable_prefix_caching=True, **options
    )
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_evicted_blocks"] > 0 and metrics["prefix_cache_hits"] > 0


def test_the_host_tier_brings_back_int8_blocks(tiny_model) -> None:
    prompts, params = round_robin_workload()
    options = dict(block_size=4, enable_prefix_caching=True, max_num_seqs=1, kv_cache_dtype="int8")
    ample = LLM(tiny_model("llama"), num_blocks=256, **options)
    expected = token_ids(ample.generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_model("llama"), num_blocks=12, kv_offloading_size=0.01, **options)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_promoted_blocks"] > 0
    block_bytes = llm.engine.worker.pool.block_nbytes
    assert metrics["host_tier_bytes_in"] == metrics["prefix_cache_promoted_blocks"] * block_bytes


@pytest.mark.parametrize("name", ["int8", "fp8_e5m2"])
def test_the_kv_hand_off_moves_8_bit_blocks_unchanged(tiny_model, name) -> None:
    model = tiny_model("llama")
    options = dict(block_size=4, num_blocks=64, kv_cache_dtype=name)
    alone = LLM(model, **options)
    expected = token_ids(alone.generate(PROMPTS, GREEDY, use_tqdm=False))
    prefill, decode = LLM(model, **options), LLM(model, **options)
    moved = [_hand_off(prefill, decode, prompt, with_kv=True) for prompt in PROMPTS]
    assert moved == expected
    bf16 = LLM(model, block_size=4, num_blocks=1, dtype="bfloat16").engine.worker.pool
    eight = prefill.engine.worker.pool
    assert eight.gather_blocks([0]).dtype == eight.kv.dtype  # the stored bytes travel
    head_dim = bf16.kv.shape[-1]
    row = head_dim + 2 if name == "int8" else head_dim  # bytes per token and head
    assert eight.block_nbytes * 2 * head_dim == bf16.block_nbytes * row


# --- refused combinations ----------------------------------------------------------------


def test_an_unknown_kv_cache_dtype_lists_the_choices(tiny_model) -> None:
    with pytest.raises(ValueError, match="choose one of auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        LLM(tiny_model("llama"), kv_cache_dtype="fp4")


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_the_triton_backend_gives_the_torch_backend_s_tokens(tiny_model, name) -> None:
    options = dict(block_size=4, num_blocks=64, kv_cache_dtype=name, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = PROMPTS[:2]
    torch_llm = LLM(tiny_model("llama"), attention_backend="torch", **options)
    triton_llm = LLM(tiny_model("llama"), attention_backend="triton", **options)
    expected = token_ids(torch_llm.generate(prompts, params, use_tqdm=False))
    assert token_ids(triton_llm.generate(prompts, params, use_tqdm=False)) == expected


def test_the_reference_engine_refuses_an_8_bit_cache(tiny_model) -> None:
    with pytest.raises(ValueError, match="stores the paged engine's KV pool"):
        LLM(tiny_model("llama"), engine="reference", kv_cache_dtype="int8")


def test_two_processes_hand_off_fp8_blocks_as_bytes(tiny_model) -> None:
    model = tiny_model("llama")
    options = dict(block_size=4, num_blocks=64, kv_cache_dtype="fp8_e4m3")
    expected = token_ids(LLM(model, **options).generate(PROMPTS, GREEDY, use_tqdm=False))
    with PrefillDecodePair(model, **options) as pair:
        pair.rule.policy = "transfer"
        assert token_ids(pair.generate(PROMPTS, GREEDY)) == expected
        outputs = pair.generate(PROMPTS, GREEDY)
        block_bytes = pair.llm.engine.worker.pool.block_nbytes  # a quarter of fp32's
        blocks = sum(-(-len(o.prompt_token_ids) // 4) for o in outputs)
        assert pair.transfer.stats.kv_bytes == 2 * blocks * block_bytes  # two rounds
