"""The output processor: each step's deltas, and stop strings that finish samples.

Oracles: `LLM.generate` (the deltas of `LLMEngine.step()` add up to its outputs), the same
request without a stop string (the text is cut exactly there), the reference path and the
engine without speculation (the same text and tokens when a stop string falls inside a
step's accepted drafts). Invariant: a sample a stop string ended frees its blocks in the
step that found it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_engine import assert_all_blocks_free
from test_speculative import NGRAM, repetitive_workload

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.engine import LLMEngine
from minserve.outputs import OutputAccumulator, RequestOutput


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), num_blocks=64)


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """Every step's deltas of one request, and its whole output."""
    engine.add_request(request_id, None, prompt, params)
    steps, whole = [], OutputAccumulator()
    while engine.has_unfinished_requests():
        deltas = engine.step()
        steps.append(deltas)
        for delta in deltas:
            whole.add(delta)
    return steps, whole.outputs[request_id]


def summary(output: RequestOutput) -> list[tuple]:
    return [
        (c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
        for c in output.outputs
    ]


def test_the_steps_deltas_add_up_to_generate(llm) -> None:
    """n = 2 seeded samples with logprobs: the same texts, tokens and logprobs either way."""
    prompt = list(range(300, 340))
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, logprobs=2)
    (expected,) = llm.generate([prompt], params, use_tqdm=False)
    steps, got = run(llm.engine, "a", prompt, params)
    assert summary(got) == summary(expected)
    assert got.finished and got.metrics.finished_time >= got.metrics.first_token_time
    deltas = [d for step in steps for d in step]
    assert all(len(c.token_ids) == 1 for d in deltas for c in d.outputs)  # one token a step
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert_all_blocks_free(llm.engine)


def test_a_stop_string_finishes_the_sample_in_the_step_that_found_it(llm) -> None:
    prompt = list(range(500, 520))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[6:9]  # three characters that may straddle tokens
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    steps, got = run(llm.engine, "b", prompt, params)
    (completion,) = got.outputs
    assert completion.text == full.text[: full.text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    kept = len(completion.token_ids)
    assert completion.token_ids == full.token_ids[:kept] and kept < len(full.token_ids)
    assert len(steps) == kept  # no step ran after the one that found the stop string
    assert not llm.engine.scheduler.seqs
    assert_all_blocks_free(llm.engine)
    reference = LLM(llm.loaded, engine="reference").generate([prompt], params, use_tqdm=False)
    assert summary(reference[0]) == summary(got)


def first_ending_at(text: str, end: int) -> str | None:
    """The shortest piece of `text` that ends at `end` and nowhere before it."""
    for length in range(1, end + 1):
        piece = text[end - length : end]
        if text.find(piece) + length == end and piece.strip():
            return piece
    return None


def test_a_stop_string_inside_accepted_drafts_drops_the_tokens_after_it(tiny_model) -> None:
    """With n-gram speculation a step appends several tokens; a stop string completed by the
    first of them ends the output there, as without speculation (the scheduler's extra
    token goes with the finished sequence)."""
    model = tiny_model("llama")
    prompts, _ = repetitive_workload(6, seed=5)
    plain, spec = LLM(model, num_blocks=128), LLM(model, num_blocks=128, speculative_config=NGRAM)
    tokenizer = spec.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cases = []  # (prompt, a stop string completed by the first token of a 2-token step)
    for i, prompt in enumerate(prompts):
        steps, whole = run(spec.engine, f"probe-{i}", prompt, greedy)
        tokens = whole.outputs[0].token_ids
        sizes = [len(d.outputs[0].token_ids) for step in steps for d in step]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        text = tokenizer.decode(tokens)
        for start, size in zip(starts, sizes):
            stop = first_ending_at(text, len(tokenizer.decode(tokens[: start + 1])))
            if size > 1 and stop is not None and "\ufffd" not in stop:
                cases.append((prompt, stop))
                break
    assert len(cases) >= 3
    params = [replace(greedy, stop=[stop]) for _, stop in cases]
    expected = plain.generate([p for p, _ in cases], params, use_tqdm=False)
    before = spec.get_metrics()["generation_tokens"]
    got = spec.generate([p for p, _ in cases], params, use_tqdm=False)
    assert [summary(o) for o in got] == [summary(o) for o in expected]
    assert all(o.outputs[0].stop_reason == stop for o, (_, stop) in zip(got, cases))
    shown = sum(len(o.outputs[0].token_ids) for o in got)
    assert spec.get_metrics()["generation_tokens"] - before > shown  # tokens after the stops
    assert_all_blocks_free(spec.engine)


def test_chapter_09s_solution_matcher_cuts_the_engines_text_as_minserves(llm) -> None:
    """`LLM(stop_matcher_cls=...)` with chapter 09's StopStringMatcher: the same outputs."""
    from solutions.ch09_server import StopStringMatcher as SolutionMatcher

    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [20, 21]]
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    texts = [out.outputs[0].text for out in llm.generate(prompts, free, use_tqdm=False)]
    stops = [t[6:9] for t in texts if len(t) > 9] + ["\n\n", "zz"]
    params = [replace(free, stop=stops, n=2, temperature=0.8, seed=1), replace(free, stop=stops)]
    solution = LLM(
        llm.loaded, num_blocks=64, plugins=CoursePlugins(stop_matcher_cls=SolutionMatcher)
    )
    for sp in params:
        want = llm.generate(prompts, sp, use_tqdm=False)
        got = solution.generate(prompts, sp, use_tqdm=False)
        assert [summary(o) for o in got] == [summary(o) for o in want]
        assert any(c.finish_reason == "stop" for o in want for c in o.outputs)


def test_a_stop_matcher_class_without_feed_and_flush_is_refused(tiny_model) -> None:
    with pytest.raises(TypeError, match="stop_matcher_cls must be a class with feed and flush"):
        LLM(tiny_model("llama"), plugins=CoursePlugins(stop_matcher_cls=dict))
