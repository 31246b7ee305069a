"""`LLM(tensor_parallel_size=N)`: N gloo processes on 127.0.0.1 give TP=1's greedy tokens.

Every test is bounded: `deadline` aborts the whole run with a traceback if it hangs.
"""

from __future__ import annotations

import faulthandler
import time

import pytest

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.distributed.launcher import WorkerFailedError
from minserve.distributed.layout import TensorParallelError
from minserve.distributed.shard_model import parameter_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture
def deadline():
    """No test here may hang: after 120 s the run stops with every thread's traceback."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[list[int]]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_tp2_tiny_model_equals_tp1_and_reference_and_a_dead_worker_is_a_clear_error(
    tiny_model, deadline
) -> None:
    path = tiny_model("llama")  # 4 heads, 2 KV heads: 2 heads and 1 KV head per rank
    sampled = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6)  # forks: copy-on-write
    single = LLM(path, num_blocks=64, block_size=4)
    expected = _tokens(single, PROMPTS)
    expected_sampled = _tokens(single, PROMPTS[:1], sampled)
    assert expected == _tokens(LLM(path, engine="reference"), PROMPTS)

    llm = LLM(path, num_blocks=64, block_size=4, tensor_parallel_size=2)
    try:
        assert _tokens(llm, PROMPTS) == expected
        assert _tokens(llm, PROMPTS[:1], sampled) == expected_sampled

        llm.engine.tensor_parallel.procs[0].kill()  # rank 1 dies between requests
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1: exit code -9"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()


def test_tp3_smollm2_equals_tp1_with_a_third_of_the_weights_per_rank(deadline) -> None:
    """SmolLM2: 9 query heads and 3 KV heads, 3 and 1 per rank; vocab 49152 in 3 blocks."""
    single = LLM(num_blocks=32)
    expected = _tokens(single, PROMPTS[:2])
    full_bytes = parameter_bytes(single.loaded.model)
    llm = LLM(num_blocks=32, tensor_parallel_size=3)
    try:
        assert _tokens(llm, PROMPTS[:2]) == expected
        rank0_bytes = parameter_bytes(llm.loaded.model)
        replicated = 2 * 30 * 576 * 4 + 576 * 4  # RMSNorm weights: every rank holds them
        assert rank0_bytes == (full_bytes - replicated) / 3 + replicated
    finally:
        llm.shutdown()


def test_a_model_that_does_not_split_is_refused_before_any_process_starts(tiny_model) -> None:
    with pytest.raises(TensorParallelError, match="must divide the model's 4 query heads"):
        LLM(tiny_model("llama"), tensor_parallel_size=3)


def test_tp2_swaps_each_ranks_heads_and_gives_tp1s_tokens(tiny_model, deadline) -> None:
    """Preempted sequences swap out and back in on every rank (its own heads, its own host
    memory), driven by the block operations rank 0 broadcasts."""
    path = tiny_model("llama")
    options = dict(num_blocks=12, block_size=2, swap_space=0.001)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [list(range(20 + i, 28 + i)) for i in range(5)]
    single = LLM(path, **options)
    expected = _tokens(single, prompts, params)
    assert single.get_metrics()["num_swapped_out"] > 0  # the workload does swap
    llm = LLM(path, tensor_parallel_size=2, **options)
    try:
        assert _tokens(llm, prompts, params) == expected
        assert llm.get_metrics()["num_swapped_in"] > 0
    finally:
        llm.shutdown()


def test_options_tensor_parallel_cannot_honour_are_refused(tiny_model) -> None:
    path = tiny_model("llama")
    with pytest.raises(ValueError, match="not engine='reference'"):
        LLM(path, engine="reference", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_layers applies with"):
        LLM(path, plugins=CoursePlugins(tensor_parallel_layers="minserve.distributed.layers"))


def test_tp2_built_from_the_chapter_07_solutions_gives_tp1s_tokens(tiny_model, deadline) -> None:
    """Chapter 07's solutions (parallel layers, vocabulary blocks, layout) in every rank."""
    path = tiny_model("llama")
    expected = _tokens(LLM(path, num_blocks=64, block_size=4), PROMPTS)
    llm = LLM(
        path, num_blocks=64, block_size=4, tensor_parallel_size=2,
        plugins=CoursePlugins(tensor_parallel_layers="solutions.ch07_parallel_linear"),
    )  # fmt: skip
    try:
        assert _tokens(llm, PROMPTS) == expected
    finally:
        llm.shutdown()
