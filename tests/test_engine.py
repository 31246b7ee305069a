"""The paged engine produces exactly the reference path's tokens, under any scheduling.

Oracle: `LLM(engine="reference")` (contiguous KV, whole prompts), itself checked against
transformers in test_model_parity.py. Invariant: every block is free when work is done.
"""

from __future__ import annotations

import random

import pytest
import torch

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.engine import LLMEngine


def random_workload(count: int, seed: int, vocab: int = 49152, max_prompt: int = 48):
    """Prompts (token ids) and greedy params with random prompt and output lengths."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(count)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True)
        for _ in range(count)
    ]
    return prompts, params


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for out in outputs for c in out.outputs]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    allocator = engine.kv.allocator
    assert allocator.num_free == allocator.num_blocks
    assert all(allocator.refcount(b) == 0 for b in range(allocator.num_blocks))


@pytest.fixture(scope="module")
def workload():
    return random_workload(50, seed=0)


@pytest.fixture(scope="module")
def expected(tiny_model, workload) -> list[list[int]]:
    prompts, params = workload
    reference = LLM(tiny_model("llama"), engine="reference")
    return token_ids(reference.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_equals_reference_with_ample_memory(
    tiny_model, workload, expected, block_size: int, chunked: bool
) -> None:
    llm = LLM(
        tiny_model("llama"),
        block_size=block_size,
        num_blocks=4096 // block_size,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=96 if not chunked else 24,
    )
    prompts, params = workload
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.get_metrics()["num_preemptions"] == 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_equals_reference_under_preemption(
    tiny_model, workload, expected, block_size: int, chunked: bool
) -> None:
    """A pool of 80 tokens for 50 requests of up to 72 tokens: preemption all the time."""
    llm = LLM(
        tiny_model("llama"),
        block_size=block_size,
        num_blocks=80 // block_size,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=80 if not chunked else 32,
    )
    prompts, params = workload
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.get_metrics()["num_preemptions"] > 10
    assert_all_blocks_free(llm.engine)


def test_swapping_preemption_equals_reference(tiny_model, workload, expected) -> None:
    llm = LLM(tiny_model("llama"), block_size=4, num_blocks=20, swap_space=0.01)
    prompts, params = workload
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    assert (
        metrics["num_swapped_out"] > 0 and metrics["num_swapped_in"] == metrics["num_swapped_out"]
    )
    assert metrics["swap_bytes_in"] == metrics["swap_bytes_out"] > 0
    assert_all_blocks_free(llm.engine)


def test_n_samples_share_prompt_blocks_then_copy_on_write(tiny_model) -> None:
    """Greedy n=3: all three equal the single greedy continuation; blocks all freed."""
    llm = LLM(tiny_model("llama"), block_size=4, num_blocks=64)
    prompt = list(range(100, 110))  # 10 tokens: the last block is partly filled and shared
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single[0].outputs[0].token_ids] * 3
    assert_all_blocks_free(llm.engine)


def test_seeded_sampling_is_independent_of_batch_and_memory_pressure(tiny_model) -> None:
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=42, max_tokens=20, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompt = list(range(200, 230))
    alone = LLM(tiny_model("llama")).generate([prompt], seeded, use_tqdm=False)
    crowded_llm = LLM(tiny_model("llama"), block_size=2, num_blocks=40)
    crowd = [list(range(300 + i, 330 + i)) for i in range(6)]
    crowded = crowded_llm.generate(crowd + [prompt], [noise] * 6 + [seeded], use_tqdm=False)
    assert crowded_llm.get_metrics()["num_preemptions"] > 0
    assert crowded[-1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_n_seeded_samples_equal_the_reference_path(tiny_model) -> None:
    params = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    prompt = list(range(50, 70))
    ours = LLM(tiny_model("llama"), block_size=4).generate([prompt], params, use_tqdm=False)
    ref = LLM(tiny_model("llama"), engine="reference").generate([prompt], params, use_tqdm=False)
    assert token_ids(ours) == token_ids(ref)


def test_prompt_that_cannot_fit_the_pool_is_rejected_with_numbers(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), block_size=4, num_blocks=8)  # 32 tokens in all
    with pytest.raises(ValueError, match=r"prompt has 40 tokens; max_model_len is 32"):
        llm.generate([[5] * 40], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_max_model_len_larger_than_the_pool_is_rejected(tiny_model) -> None:
    with pytest.raises(
        ValueError, match=r"max_model_len 64 exceeds the KV pool's size in tokens \(32\)"
    ):
        LLM(tiny_model("llama"), block_size=4, num_blocks=8, max_model_len=64)


def test_abort_mid_chunked_prefill_frees_every_block(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), block_size=4, num_blocks=64, max_num_batched_tokens=8)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("long", None, list(range(10, 50)), params)  # 40 tokens: 5 chunks
    engine.add_request("short", None, [7, 8, 9], params)
    engine.step()
    engine.step()
    (long_seq,) = engine.scheduler.sequences_of("long")
    assert 0 < long_seq.num_computed_tokens < 40 and long_seq.block_table.blocks
    engine.abort_request("long")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)
    assert engine.get_metrics()["num_requests_aborted"] == 1


def test_abort_of_waiting_running_and_swapped_requests_frees_everything(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), block_size=2, num_blocks=24, swap_space=0.001)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(8):
        engine.add_request(str(i), None, list(range(20 + i, 32 + i)), params)
    for _ in range(12):
        engine.step()
    statuses = {s.status.value for s in engine.scheduler.seqs.values()}
    assert len(statuses) >= 2  # a mix of running, waiting and swapped
    for request_id in list(engine.output_processor.requests):
        engine.abort_request(request_id)
    assert_all_blocks_free(engine)
    assert not engine.has_unfinished_requests()


def test_priority_policy_serves_interactive_requests_first(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    outputs = llm.generate(
        prompts, params, priority=["batch", "standard", "interactive"], use_tqdm=False
    )
    finish = [o.metrics.finished_time for o in outputs]
    assert finish[2] < finish[1] < finish[0]


def test_fcfs_policy_serves_in_arrival_order(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([[10, 11], [20, 21], [30, 31]], params, use_tqdm=False)
    finish = [o.metrics.finished_time for o in outputs]
    assert finish[0] < finish[1] < finish[2]


def test_metrics_count_steps_tokens_and_timestamps(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([list(range(40, 80))], params, use_tqdm=False)  # 40 tokens, 3 chunks
    metrics = llm.get_metrics()
    assert metrics["prompt_tokens"] == 40 and metrics["generation_tokens"] == 3
    assert metrics["num_steps"] == 3 + 2  # three prefill chunks (the last samples), two decodes
    assert metrics["batched_tokens"] == 40 + 2
    m = outputs[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert outputs[0].num_cached_tokens == 0


def test_unknown_options_fail_with_a_clear_message(tiny_model) -> None:
    with pytest.raises(
        ValueError, match="unknown scheduling_policy 'lifo'; choose one of fcfs, priority"
    ):
        LLM(tiny_model("llama"), scheduling_policy="lifo")
    with pytest.raises(ValueError, match="unknown SLO class 'urgent'"):
        LLM(tiny_model("llama")).generate(["hi"], priority=["urgent"], use_tqdm=False)


def test_a_students_block_allocator_plugs_into_the_engine(tiny_model, workload, expected) -> None:
    import solutions.ch01_block_allocator as student

    llm = LLM(
        tiny_model("llama"),
        block_size=4,
        num_blocks=20,
        plugins=CoursePlugins(block_allocator_cls=student.BlockAllocator),
    )
    assert isinstance(llm.engine.kv.allocator, student.BlockAllocator)
    prompts, params = workload
    assert token_ids(llm.generate(prompts[:20], params[:20], use_tqdm=False)) == expected[:20]
    assert_all_blocks_free(llm.engine)


def test_a_students_kv_pool_plugs_into_the_engine(tiny_model, workload, expected) -> None:
    """The solution's PagedKVPool (exercise 1.3) is the worker's pool: sized from a byte
    budget, written by attention, swapped out and in under preemption (16 blocks of 4), and
    its copy-on-write copies serve n = 2 samples; the tokens are minserve's."""
    import solutions.ch01_block_allocator as student

    default = LLM(tiny_model("llama"), block_size=4, num_blocks=16, swap_space=0.001)
    one_block = student.PagedKVPool.bytes_per_block(default.loaded.config, 4, torch.float32)
    llm = LLM(
        default.loaded,  # the same model, loaded once
        block_size=4,
        kv_cache_memory_bytes=16 * one_block + one_block // 2,  # 16 whole blocks
        swap_space=0.001,
        plugins=CoursePlugins(kv_pool_cls=student.PagedKVPool),
    )
    pool = llm.engine.worker.pool
    assert isinstance(pool, student.PagedKVPool) and pool.num_blocks == 16
    prompts, params = workload
    assert token_ids(llm.generate(prompts[:8], params[:8], use_tqdm=False)) == expected[:8]
    assert llm.get_metrics()["num_swapped_out"] > 0
    assert_all_blocks_free(llm.engine)
    two = SamplingParams(n=2, temperature=0.8, max_tokens=9, seed=1)
    forked = [c.token_ids for c in llm.generate("Hello there", two, use_tqdm=False)[0].outputs]
    ours = [c.token_ids for c in default.generate("Hello there", two, use_tqdm=False)[0].outputs]
    assert forked == ours


def test_a_students_block_table_plugs_into_the_engine(tiny_model, workload, expected) -> None:
    """The solution's BlockTable (exercise 1.2) holds every sequence's blocks under
    preemption (20 blocks of 4), and the engine gives minserve's tokens and frees every
    block; n = 2 samples fork and copy-on-write exactly like the default table."""
    import solutions.ch01_block_allocator as student

    llm = LLM(
        tiny_model("llama"),
        block_size=4,
        num_blocks=20,
        plugins=CoursePlugins(block_table_cls=student.BlockTable),
    )
    assert isinstance(llm.engine.kv.new_table(), student.BlockTable)
    prompts, params = workload
    assert token_ids(llm.generate(prompts[:20], params[:20], use_tqdm=False)) == expected[:20]
    assert_all_blocks_free(llm.engine)
    two = SamplingParams(n=2, temperature=0.8, max_tokens=9, seed=1)
    default = LLM(tiny_model("llama"), block_size=4, num_blocks=20)
    forked = [c.token_ids for c in llm.generate("Hello there", two, use_tqdm=False)[0].outputs]
    ours = [c.token_ids for c in default.generate("Hello there", two, use_tqdm=False)[0].outputs]
    assert forked == ours
    assert_all_blocks_free(llm.engine)
