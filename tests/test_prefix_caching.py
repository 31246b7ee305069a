"""The engine with the prefix cache on gives exactly the reference path's greedy tokens.

Oracle: `LLM(engine="reference")` (contiguous KV, whole prompts, no cache). Workloads share
prefixes heavily, prefixes end inside blocks, pools are small enough to force eviction
and preemption. Invariant at the end of every run: no request holds a block, every block
is either free or cached once, and nothing in the cache is locked.
"""

from __future__ import annotations

import random

import pytest
from test_engine import token_ids

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.engine import LLMEngine


def shared_prefix_workload(count: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts = one of three system prefixes (13, 16 and 21 tokens) + a 1..10-token question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 49152) for _ in range(n)] for n in (13, 16, 21)]
    prompts = [
        rng.choice(systems) + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 10))]
        for _ in range(count)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)
        for _ in range(count)
    ]
    return prompts, params


def assert_only_cached_blocks_remain(engine: LLMEngine) -> None:
    """Nothing leaked: each block is free or held once by the (unlocked) prefix cache."""
    allocator, cache = engine.kv.allocator, engine.kv.prefix_cache
    cached = [b for node in _nodes(cache.root) for b in node.blocks]
    assert len(cached) == len(set(cached)) == cache.num_cached_blocks
    assert allocator.num_free + len(cached) == allocator.num_blocks
    assert all(allocator.refcount(b) == 1 for b in cached)
    assert cache.num_evictable_blocks == cache.num_cached_blocks  # no request holds a lock


def _nodes(root):
    stack, nodes = [root], []
    while stack:
        nodes.append(stack.pop())
        stack.extend(nodes[-1].children.values())
    return nodes


@pytest.fixture(scope="module")
def workload():
    return shared_prefix_workload(30, seed=1)


@pytest.fixture(scope="module")
def expected(tiny_model, workload) -> list[list[int]]:
    reference = LLM(tiny_model("llama"), engine="reference")
    return token_ids(reference.generate(*workload, use_tqdm=False))


def cached_llm(tiny_model, **options) -> LLM:
    return LLM(tiny_model("llama"), enable_prefix_caching=True, **options)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_equals_reference_with_the_cache_on(
    tiny_model, workload, expected, block_size: int, chunked: bool
) -> None:
    llm = cached_llm(
        tiny_model,
        block_size=block_size,
        num_blocks=2048 // block_size,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=16 if chunked else 64,
        max_num_seqs=4,
    )
    outputs = llm.generate(*workload, use_tqdm=False)
    assert token_ids(outputs) == expected
    hits = [o.num_cached_tokens for o in outputs]
    assert all(h % block_size == 0 and h < len(o.prompt_token_ids) for h, o in zip(hits, outputs))
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits"] == sum(hits) > 0
    assert metrics["prefix_cache_queries"] == sum(len(p) for p in workload[0])
    assert metrics["prefix_cache_hit_rate"] == sum(hits) / metrics["prefix_cache_queries"]
    assert_only_cached_blocks_remain(llm.engine)


def test_greedy_equals_reference_with_the_triton_backend(tiny_model, workload, expected) -> None:
    """Caching blocks as they are scheduled relies on a step storing all its KV before any
    attention reads it: the Triton kernels (interpreted here) do, like the torch backend."""
    llm = cached_llm(tiny_model, attention_backend="triton", block_size=4, num_blocks=64)
    prompts, params = workload  # the first 6 are admitted together, in one step
    outputs = llm.generate(prompts[:6], params[:6], use_tqdm=False)
    assert token_ids(outputs) == expected[:6]
    assert sum(o.num_cached_tokens for o in outputs) > 0


def test_greedy_equals_reference_under_eviction_and_preemption(
    tiny_model, workload, expected
) -> None:
    """A pool of 64 tokens for prompts of up to 31 + 12: the cache is evicted all the time."""
    llm = cached_llm(tiny_model, block_size=4, num_blocks=16, max_num_batched_tokens=24)
    assert token_ids(llm.generate(*workload, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_evicted_blocks"] > 20 and metrics["prefix_cache_hits"] > 0
    assert metrics["num_preemptions"] > 0
    assert_only_cached_blocks_remain(llm.engine)


def test_greedy_equals_reference_with_swapping(tiny_model, workload, expected) -> None:
    llm = cached_llm(tiny_model, block_size=4, num_blocks=16, swap_space=0.01)
    assert token_ids(llm.generate(*workload, use_tqdm=False)) == expected
    assert llm.get_metrics()["num_swapped_in"] > 0
    assert_only_cached_blocks_remain(llm.engine)


def test_cached_tokens_are_the_whole_blocks_of_the_shared_prefix(tiny_model) -> None:
    llm = cached_llm(tiny_model, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = list(range(100, 120))  # 20 tokens: 5 full blocks
    llm.generate([first], params, use_tqdm=False)
    again, shared, parted = llm.generate(
        [first, first[:14] + [7, 7, 7], first[:3] + [9] * 10], params, use_tqdm=False
    )
    assert again.num_cached_tokens == 16  # the last token is always recomputed: 19 -> 16
    assert shared.num_cached_tokens == 12  # 14 shared tokens = 3 whole blocks
    assert parted.num_cached_tokens == 0  # not even one whole block in common


def test_a_follow_up_turn_reuses_the_previous_prompt_and_answer(tiny_model) -> None:
    llm = cached_llm(tiny_model, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    turn1 = list(range(300, 315))
    answer = llm.generate([turn1], params, use_tqdm=False)[0].outputs[0].token_ids
    turn2 = turn1 + answer + [5, 6, 7]
    out = llm.generate([turn2], params, use_tqdm=False)[0]
    # 15 + 9 tokens; the last answer token was sampled but never computed: 23 -> 20
    assert out.num_cached_tokens == 20
    reference = LLM(tiny_model("llama"), engine="reference")
    assert token_ids([out]) == token_ids(reference.generate([turn2], params, use_tqdm=False))


def test_n_samples_with_the_cache_share_and_free_everything(tiny_model) -> None:
    llm = cached_llm(tiny_model, block_size=4, num_blocks=24)
    prompt = list(range(100, 110))
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    cold, warm = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert warm.num_cached_tokens == 8 and cold.num_cached_tokens == 0
    assert token_ids([warm]) == token_ids([cold])  # seeded samples do not depend on the cache
    assert_only_cached_blocks_remain(llm.engine)


def test_aborts_anywhere_leave_only_cached_blocks(tiny_model) -> None:
    llm = cached_llm(tiny_model, block_size=2, num_blocks=24, swap_space=0.001)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(8):
        engine.add_request(str(i), None, [5, 6, 7, 8] + list(range(20 + i, 30 + i)), params)
    for _ in range(12):
        engine.step()
    for request_id in list(engine.output_processor.requests):
        engine.abort_request(request_id)
    assert_only_cached_blocks_remain(engine)
    cache = engine.kv.prefix_cache
    cached = cache.num_cached_blocks
    assert cached > 0 and cache.evict(24) == cached
    assert engine.kv.allocator.num_free == 24


def test_the_cache_is_off_by_default(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), num_blocks=64)
    assert llm.engine.kv.prefix_cache is None
    prompt = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=2)
    outputs = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0, 0]


@pytest.mark.slow
def test_smollm2_chat_with_a_shared_system_prompt_equals_reference(smollm_gguf) -> None:
    base = LLM(smollm_gguf, engine="reference")
    tokenizer = base.get_tokenizer()
    system = {"role": "system", "content": "You are a concise geography tutor. Answer briefly."}
    questions = ["Capital of France?", "Capital of Japan?", "Longest river?"]
    prompts = [
        tokenizer.apply_chat_template([system, {"role": "user", "content": q}]) for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = token_ids(base.generate(prompts, params, use_tqdm=False))
    llm = LLM(base.loaded, enable_prefix_caching=True, max_num_seqs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert outputs[0].num_cached_tokens == 0 and min(o.num_cached_tokens for o in outputs[1:]) >= 16


def test_prefix_cache_options_without_the_cache_are_refused(tiny_model) -> None:
    import solutions.ch05_radix_cache as student

    with pytest.raises(ValueError, match="kv_offloading_size .* needs enable_prefix_caching=True"):
        LLM(tiny_model("llama"), num_blocks=8, kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="prefix_cache_cls is used only with enable_prefix_cach"):
        LLM(
            tiny_model("llama"),
            num_blocks=8,
            plugins=CoursePlugins(prefix_cache_cls=student.RadixCache),
        )
    with pytest.raises(ValueError, match="'lpm' ranks requests by their cached prefix"):
        LLM(tiny_model("llama"), num_blocks=8, scheduling_policy="lpm")
