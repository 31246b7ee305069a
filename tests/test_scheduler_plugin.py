"""A scheduler class from the course (chapter 03) plugs into the engine and changes nothing."""

from __future__ import annotations

import pytest
from test_engine import assert_all_blocks_free, random_workload, token_ids

from minserve import LLM, CoursePlugins, SamplingParams


def test_the_solutions_scheduler_gives_the_default_engines_tokens(tiny_model) -> None:
    import solutions.ch03_scheduler as student

    prompts, params = random_workload(20, seed=3)
    options = dict(block_size=4, num_blocks=20, max_num_batched_tokens=32)
    default = LLM(tiny_model("llama"), **options)
    expected = token_ids(default.generate(prompts, params, use_tqdm=False))
    plugged = LLM(
        tiny_model("llama"), plugins=CoursePlugins(scheduler_cls=student.Scheduler), **options
    )
    assert isinstance(plugged.engine.scheduler, student.Scheduler)
    assert token_ids(plugged.generate(prompts, params, use_tqdm=False)) == expected
    metrics, default_metrics = plugged.get_metrics(), default.get_metrics()
    assert metrics["num_preemptions"] == default_metrics["num_preemptions"] > 0
    assert metrics["num_steps"] == default_metrics["num_steps"]
    assert_all_blocks_free(plugged.engine)


def test_the_solutions_step_update_gives_the_default_engines_outputs(tiny_model) -> None:
    """Exercise 3.2 drives every update: stop tokens, n > 1 forks, drafts, cached prefixes."""
    import solutions.ch03_scheduler as student

    prompts, _ = random_workload(12, seed=5, vocab=64)
    prompts = [p * 3 for p in prompts]  # repeats, so the n-gram proposer has drafts to offer
    params = [
        SamplingParams(temperature=0, max_tokens=12, n=1 + i % 2, stop_token_ids=[i % 7 + 3])
        for i in range(len(prompts))
    ]
    options = dict(
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )

    def outputs(llm: LLM) -> list[tuple]:
        results = llm.generate(prompts * 2, params * 2, use_tqdm=False)
        return [(c.token_ids, c.finish_reason) for out in results for c in out.outputs]

    default = LLM(tiny_model("llama"), **options)
    plugged = LLM(
        tiny_model("llama"), plugins=CoursePlugins(scheduler_cls=student.Scheduler), **options
    )
    assert outputs(plugged) == outputs(default)
    metrics, default_metrics = plugged.get_metrics(), default.get_metrics()
    for key in ("num_generation_tokens", "num_steps", "num_accepted_tokens"):
        if key in default_metrics:
            assert metrics[key] == default_metrics[key], key
    # the prefix cache keeps its blocks; the same ones are free either way
    free = [llm.engine.kv.allocator.num_free for llm in (plugged, default)]
    assert free[0] == free[1] and not plugged.engine.scheduler.has_unfinished


def test_the_solutions_flat_batch_lays_out_every_step_as_minserves(tiny_model) -> None:
    """Exercise 3.4 lays out every step: prefill chunks beside decodes, prompt-logprob rows
    (drafts to verify are the checks' part)."""
    import solutions.ch03_scheduler as student

    steps = []

    def flat_batch(*args):
        steps.append(len(args[0]))
        return student.flat_batch(*args)

    prompts, _ = random_workload(6, seed=7, vocab=64, max_prompt=40)
    params = [
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1 if i % 2 else None)
        for i in range(len(prompts))
    ]
    options = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16)

    def outputs(llm: LLM) -> list[tuple]:
        results = llm.generate(prompts, params, use_tqdm=False)
        return [(o.prompt_logprobs, [c.token_ids for c in o.outputs]) for o in results]

    default = LLM(tiny_model("llama"), **options)
    plugged = LLM(default.loaded, plugins=CoursePlugins(flat_batch=flat_batch), **options)
    assert outputs(plugged) == outputs(default)
    assert len(steps) == plugged.get_metrics()["num_steps"] and max(steps) > 1
    with pytest.raises(ValueError, match="flat_batch plugs into the paged engine"):
        LLM(tiny_model("llama"), engine="reference", plugins=CoursePlugins(flat_batch=flat_batch))


def test_an_llm_can_share_an_already_loaded_model(tiny_model) -> None:
    first = LLM(tiny_model("llama"))
    second = LLM(first.loaded, num_blocks=8)
    assert second.loaded is first.loaded and second.engine is not first.engine
    with pytest.raises(ValueError, match="loaded already"):
        LLM(first.loaded, dtype="bfloat16")


def test_the_solutions_budget_and_preemption_rules_give_the_default_engines_tokens(
    tiny_model,
) -> None:
    import solutions.ch04_chunked_prefill as student

    prompts, params = random_workload(20, seed=3)
    options = dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, swap_space=0.001)
    default = LLM(tiny_model("llama"), **options)
    expected = token_ids(default.generate(prompts, params, use_tqdm=False))
    plugged = LLM(
        tiny_model("llama"),
        plugins=CoursePlugins(
            chunk_rule=student.prefill_chunk, preemption_rule=student.preemption_mode
        ),
        **options,
    )
    assert plugged.engine.scheduler.chunk_rule is student.prefill_chunk
    assert token_ids(plugged.generate(prompts, params, use_tqdm=False)) == expected
    metrics, default_metrics = plugged.get_metrics(), default.get_metrics()
    assert metrics["num_swapped_out"] == default_metrics["num_swapped_out"] > 0
    assert metrics["num_steps"] == default_metrics["num_steps"]
    assert_all_blocks_free(plugged.engine)


def test_the_solutions_swap_space_gives_the_default_engines_tokens_and_bytes(tiny_model) -> None:
    import solutions.ch04_chunked_prefill as student

    prompts, params = random_workload(20, seed=3)
    options = dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, swap_space=0.001)
    default = LLM(tiny_model("llama"), **options)
    expected = token_ids(default.generate(prompts, params, use_tqdm=False))
    plugged = LLM(
        tiny_model("llama"), plugins=CoursePlugins(swap_space_cls=student.HostSwapSpace), **options
    )
    space, default_space = plugged.engine.kv.swap, default.engine.kv.swap
    assert isinstance(space, student.HostSwapSpace)
    assert token_ids(plugged.generate(prompts, params, use_tqdm=False)) == expected
    assert plugged.get_metrics()["num_swapped_out"] == default.get_metrics()["num_swapped_out"] > 0
    counters = ("used_bytes", "bytes_out", "bytes_in")
    assert [getattr(space, c) for c in counters] == [getattr(default_space, c) for c in counters]
    assert space.used_bytes == 0 and space.bytes_in == space.bytes_out > 0
    assert_all_blocks_free(plugged.engine)


def test_a_swap_space_class_needs_swap_space(tiny_model) -> None:
    import solutions.ch04_chunked_prefill as student

    with pytest.raises(ValueError, match="swap_space_cls is used only with swap_space > 0"):
        LLM(tiny_model("llama"), plugins=CoursePlugins(swap_space_cls=student.HostSwapSpace))
    with pytest.raises(ValueError, match="swap_space_cls plugs into the paged engine"):
        LLM(
            tiny_model("llama"),
            engine="reference",
            plugins=CoursePlugins(swap_space_cls=student.HostSwapSpace),
        )


def test_a_preemption_rule_that_never_swaps_recomputes_every_victim(tiny_model) -> None:
    prompts, params = random_workload(20, seed=3)
    options = dict(block_size=4, num_blocks=20, max_num_batched_tokens=32, swap_space=0.001)
    llm = LLM(
        tiny_model("llama"),
        plugins=CoursePlugins(preemption_rule=lambda *_: "recompute"),
        **options,
    )
    llm.generate(prompts, params, use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["num_swapped_out"] == 0


def test_scheduling_rules_are_refused_by_the_reference_engine(tiny_model) -> None:
    with pytest.raises(ValueError, match=r"chunk_rule plugs into the paged engine"):
        LLM(
            tiny_model("llama"),
            engine="reference",
            plugins=CoursePlugins(chunk_rule=lambda n, left, chunked: n),
        )
