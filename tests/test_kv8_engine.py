"""The engine with an 8-bit KV cache (`kv_cache_dtype`): the bundled model's greedy tokens
against the fp32 cache, and every way blocks move (swap, prefix cache, host tier, the P/D
hand-off) giving the tokens of an 8-bit run where they do not move.

Oracles: the engine's own fp32-cache run (the bundled model agrees on its first tokens);
the same 8-bit engine with ample memory and no hand-off (moving stored bytes changes no
token); byte counts from the pool's block size.
"""

from __future__ import annotations

import pytest
import torch
from test_disagg import GREEDY, PROMPTS, _hand_off
from test_engine import assert_all_blocks_free, random_workload, token_ids
from test_prefix_caching import shared_prefix_workload
from test_prefix_policy import round_robin_workload

from minserve import LLM, SamplingParams
from minserve.disagg.pd_pair import PrefillDecodePair

PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
]
# How far the first step's log-probability of the greedy token moves from the fp32 cache's
# on PARITY_PROMPTS: measured 0.023 (int8), 0.061 (fp8_e4m3), 0.10 (fp8_e5m2); bounds with
# margin. Greedy tokens over 16 steps agree with fp32 for the first 16, 13, 16 (fp8_e4m3),
# 16, 13, 2 (int8: the bundled model's keys have outlier channels, which a per-token scale
# shares with every other channel) and 10, 15, 3 (fp8_e5m2: 2 mantissa bits).
FIRST_STEP_LOGPROB_BOUND = {"int8": 0.05, "fp8_e4m3": 0.1, "fp8_e5m2": 0.15}
FIRST_STEP = SamplingParams(temperature=0, max_tokens=1, logprobs=1)


@pytest.fixture(scope="module")
def smollm() -> LLM:
    return LLM(num_blocks=32)


def first_steps(llm: LLM) -> list[tuple[int, float]]:
    """Per prompt, the first greedy token and its log-probability."""
    outputs = llm.generate(PARITY_PROMPTS, FIRST_STEP, use_tqdm=False)
    return [next(iter(o.outputs[0].logprobs[0].items())) for o in outputs]


def test_the_bundled_model_s_first_step_stays_close_to_the_fp32_cache(smollm) -> None:
    fp32 = first_steps(smollm)
    for name, bound in FIRST_STEP_LOGPROB_BOUND.items():
        eight = first_steps(LLM(smollm.loaded, num_blocks=32, kv_cache_dtype=name))
        assert [token for token, _ in eight] == [token for token, _ in fp32], name
        for (_, got), (_, want) in zip(eight, fp32):
            assert abs(got - want) < bound, name


def test_fp8_e4m3_keeps_the_first_8_greedy_tokens_of_the_fp32_cache(smollm) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fp32 = token_ids(smollm.generate(PARITY_PROMPTS, params, use_tqdm=False))
    llm = LLM(smollm.loaded, num_blocks=32, kv_cache_dtype="fp8_e4m3")
    assert token_ids(llm.generate(PARITY_PROMPTS, params, use_tqdm=False)) == fp32
    assert llm.get_execution_config().kv_cache_dtype == "fp8_e4m3"


def test_fp8_is_e4m3_and_a_fixed_budget_holds_twice_the_tokens(smollm) -> None:
    budget = 8 << 20
    plain = LLM(smollm.loaded, kv_cache_memory_bytes=budget).engine.worker.pool
    fp8 = LLM(smollm.loaded, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    int8 = LLM(smollm.loaded, kv_cache_memory_bytes=budget, kv_cache_dtype="int8")
    assert fp8.engine.worker.pool.kv.dtype == torch.float8_e4m3fn
    assert "kv_cache=fp8_e4m3" in fp8.get_execution_config().summary()
    assert plain.kv.dtype == torch.float32  # on this CPU: 4 bytes a value, bfloat16 2
    assert fp8.engine.worker.pool.block_nbytes * 4 == plain.block_nbytes
    bf16_blocks = budget // (plain.block_nbytes // 2)
    assert fp8.engine.kv.allocator.num_blocks == budget // (plain.block_nbytes // 4)
    assert int8.engine.kv.allocator.num_blocks >= 1.9 * bf16_blocks


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
