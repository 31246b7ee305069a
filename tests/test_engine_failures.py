"""One request's failure fails that request alone; a failure of the step fails its batch.

Failures are injected: a sampler that turns one request's logits row into NaN, a tokenizer
that cannot decode one request's tokens, a decoder pass that raises. Oracles: the same
requests generated without the failing one (token for token), and the invariant that every
KV block is free once the engine is idle.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_engine import assert_all_blocks_free, token_ids

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.errors import RequestsFailedError, StepFailedError
from minserve.model.sampler import Sampler, SampleResult, SamplingRow

POISON_SEED = 666  # a row seeded with this gets NaN logits
MARK = 4321  # a prompt ending in this token cannot be decoded
GOOD_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
POISONED = SamplingParams(temperature=0.8, seed=POISON_SEED, max_tokens=8)


class PoisoningSampler(Sampler):
    """The engine's sampler, except that rows seeded with POISON_SEED see NaN logits."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.params.seed == POISON_SEED:
                logits[i] = math.nan
        return super().__call__(logits, rows)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(
        tiny_model("llama"),
        plugins=CoursePlugins(sampler=PoisoningSampler()),
        num_blocks=128,
        block_size=4,
    )


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[list[int]]:
    """The good prompts' tokens, generated without a failing request beside them."""
    return token_ids(llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False))


def test_a_nan_logits_row_fails_its_request_and_the_others_finish_unchanged(
    llm: LLM, expected: list[list[int]]
) -> None:
    aborted = llm.get_metrics()["num_requests_aborted"]
    prompts = [GOOD_PROMPTS[0], [20, 21], *GOOD_PROMPTS[1:]]
    with pytest.raises(RequestsFailedError) as failed:
        llm.generate(prompts, [GREEDY, POISONED, GREEDY, GREEDY], use_tqdm=False)
    assert str(failed.value).startswith(
        "prompt 1 failed: the sampler could not draw a token: its logits hold NaN"
    )
    assert token_ids(failed.value.outputs) == expected
    assert all(out.finished for out in failed.value.outputs)
    assert llm.get_metrics()["num_requests_aborted"] == aborted + 1
    assert_all_blocks_free(llm.engine)


def test_step_aborts_the_failed_request_before_it_returns_the_others_deltas(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("good", None, GOOD_PROMPTS[0], GREEDY)
    engine.add_request("bad", None, [20, 21], POISONED)
    with pytest.raises(RequestsFailedError) as failed:
        engine.step()  # both prefill and sample in this first step
    assert failed.value.request_ids == ["bad"]
    assert failed.value.reasons == {
        "bad": "the sampler could not draw a token: its logits hold NaN"
    }
    assert [out.request_id for out in failed.value.outputs] == ["good"]
    assert engine.scheduler.sequences_of("bad") == []
    assert "bad" not in engine.output_processor.requests
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_tokens_the_tokenizer_cannot_decode_fail_their_request_alone(
    llm: LLM, expected: list[list[int]], monkeypatch
) -> None:
    tokenizer = llm.get_tokenizer()
    decode = tokenizer.decode

    def decode_unless_marked(ids, skip_special_tokens=True) -> str:
        if MARK in ids:
            raise ValueError(f"cannot decode {MARK}")
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", decode_unless_marked)
    prompts = [GOOD_PROMPTS[0], GOOD_PROMPTS[1], [30, 31, MARK], GOOD_PROMPTS[2]]
    with pytest.raises(RequestsFailedError) as failed:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert str(failed.value).startswith(
        f"prompt 2 failed: its new tokens could not be processed (ValueError: cannot decode {MARK})"
    )
    assert token_ids(failed.value.outputs) == expected
    assert_all_blocks_free(llm.engine)


def test_a_failed_step_fails_its_batch_and_the_engine_serves_on(
    llm: LLM, expected: list[list[int]], monkeypatch
) -> None:
    engine = llm.engine
    runner = engine.worker.runner
    forward = runner.sampled_hidden
    calls = []

    def fails_on_the_third_step(inputs):
        calls.append(None)
        if len(calls) == 3:
            raise RuntimeError("injected: out of memory")
        return forward(inputs)

    monkeypatch.setattr(runner, "sampled_hidden", fails_on_the_third_step)
    engine.add_request("a", None, GOOD_PROMPTS[0], GREEDY)
    engine.add_request("b", None, GOOD_PROMPTS[1], GREEDY)
    engine.step()  # both prefill
    engine.step()  # both decode
    with pytest.raises(StepFailedError, match="RuntimeError: injected: out of memory") as failed:
        engine.step()
    assert failed.value.request_ids == ["a", "b"]
    for request_id in failed.value.request_ids:
        engine.abort_request(request_id)
    assert_all_blocks_free(engine)
    assert token_ids(llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_generate_leaves_nothing_queued_after_a_failed_step(llm: LLM, monkeypatch) -> None:
    def broken(inputs):
        raise RuntimeError("injected: a kernel error")

    monkeypatch.setattr(llm.engine.worker.runner, "sampled_hidden", broken)
    with pytest.raises(RuntimeError, match="injected: a kernel error"):
        llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm.engine)


def test_stop_token_ids_outside_the_vocabulary_are_refused_before_any_work(llm: LLM) -> None:
    bad = SamplingParams(stop_token_ids=[7, 10**30])
    message = r"^stop_token_ids must be in \[0, 49152\), the model's vocabulary; got \[10{30}\]"
    with pytest.raises(ValueError, match=message):
        llm.generate(GOOD_PROMPTS[:2], [GREEDY, bad], use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("x", None, GOOD_PROMPTS[0], bad)
    assert not llm.engine.has_unfinished_requests()


def test_seeds_past_int64_sample_as_their_value_modulo_2_64(llm: LLM) -> None:
    def sample(seed: int) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
        return token_ids(llm.generate(GOOD_PROMPTS[:1], params, use_tqdm=False))

    assert sample(-1) == sample(2**64 - 1) == sample(2**65 - 1)
    assert sample(10**30) == sample(10**30 % 2**64)
