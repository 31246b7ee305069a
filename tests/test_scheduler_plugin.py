"""A scheduler class from the course (chapter 03) plugs into the engine and changes nothing."""

from __future__ import annotations

import pytest
from test_engine import assert_all_blocks_free, random_workload, token_ids

from minserve import LLM


def test_the_solutions_scheduler_gives_the_default_engines_tokens(tiny_model) -> None:
    import solutions.ch03_scheduler as student

    prompts, params = random_workload(20, seed=3)
    options = dict(block_size=4, num_blocks=20, max_num_batched_tokens=32)
    default = LLM(tiny_model("llama"), **options)
    expected = token_ids(default.generate(prompts, params, use_tqdm=False))
    plugged = LLM(tiny_model("llama"), scheduler_cls=student.Scheduler, **options)
    assert isinstance(plugged.engine.scheduler, student.Scheduler)
    assert token_ids(plugged.generate(prompts, params, use_tqdm=False)) == expected
    metrics, default_metrics = plugged.get_metrics(), default.get_metrics()
    assert metrics["num_preemptions"] == default_metrics["num_preemptions"] > 0
    assert metrics["num_steps"] == default_metrics["num_steps"]
    assert_all_blocks_free(plugged.engine)


def test_an_llm_can_share_an_already_loaded_model(tiny_model) -> None:
    first = LLM(tiny_model("llama"))
    second = LLM(first.loaded, num_blocks=8)
    assert second.loaded is first.loaded and second.engine is not first.engine
    with pytest.raises(ValueError, match="loaded already"):
        LLM(first.loaded, dtype="bfloat16")
