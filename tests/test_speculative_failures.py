"""Speculative decoding fails one request alone, and a draft that cannot be sampled is
no failure at all.

Injected: the target's logits turn NaN for one seeded request once it has a few tokens
(so its drafts are being verified: greedy agreement or rejection sampling); the draft's
logits turn NaN (the proposer then drafts nothing and the target decides alone).
Oracles: the same requests generated without speculation and without the failing one,
token for token; every KV block free once the engine is idle.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_engine import assert_all_blocks_free, token_ids
from test_speculative import EARLY_EXIT, NGRAM, repetitive_workload

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.errors import RequestsFailedError
from minserve.model.sampler import Sampler, SampleResult, SamplingRow
from minserve.speculative.distributions import choose_drafts
from minserve.speculative.sampled import verify_sampled
from minserve.speculative.verify import rejection_sample

POISON_SEED = 666  # rows seeded with this see NaN logits once they have POISON_AFTER tokens
POISON_AFTER = 3


def poison(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row.params.seed == POISON_SEED and len(row.output_token_ids) >= POISON_AFTER:
            logits[i] = math.nan
    return logits


class PoisoningSampler(Sampler):
    """The engine's sampler, except that poisoned rows see NaN logits, in both of the
    verifier's paths: sampling every row (greedy agreement) and the processed p of
    rejection sampling."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        return super().__call__(poison(logits, rows), rows)

    def filtered(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return super().filtered(poison(logits, rows), rows)


@pytest.fixture(scope="module")
def workload():
    return repetitive_workload(6, seed=3)


@pytest.fixture(scope="module")
def expected(tiny_model, workload) -> list[list[int]]:
    """The workload's tokens without speculation and without a failing request."""
    prompts, params = workload
    return token_ids(LLM(tiny_model("llama")).generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "rejection-sampled"])
def test_nan_target_logits_fail_one_speculating_request_and_the_others_match(
    tiny_model, workload, expected, temperature: float
) -> None:
    prompts, params = workload
    llm = LLM(
        tiny_model("llama"),
        speculative_config=NGRAM,
        plugins=CoursePlugins(sampler=PoisoningSampler()),
    )
    bad = SamplingParams(temperature=temperature, seed=POISON_SEED, max_tokens=30, ignore_eos=True)
    with pytest.raises(RequestsFailedError) as failed:
        llm.generate([*prompts, prompts[0] * 3], [*params, bad], use_tqdm=False)
    assert str(failed.value).startswith(
        f"prompt {len(prompts)} failed: the sampler could not draw a token: its logits hold NaN"
    )
    assert token_ids(failed.value.outputs) == expected
    metrics = llm.get_metrics()
    assert metrics["spec_decode_num_draft_tokens"] > 0  # the others kept speculating
    assert metrics["num_requests_aborted"] == 1
    assert_all_blocks_free(llm.engine)


def test_rejection_sampling_reports_an_unsampleable_sequence_and_verifies_the_others() -> None:
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, seed=1)
    logits = torch.randn(5, 16)  # two sequences: 1 draft (rows 0-1), 2 drafts (rows 2-4)
    logits[3, 7] = math.nan
    rows = [SamplingRow(params, [1], [], generator) for _ in range(5)]
    outcomes = verify_sampled(
        rejection_sample, Sampler(), logits, rows, [[2], [4, 5]], [None, None]
    )
    tokens, logprobs = outcomes[0]
    assert 1 <= len(tokens) <= 2 and len(logprobs) == len(tokens)
    assert all(0 <= t < 16 for t in tokens)
    assert outcomes[1] == "its logits hold NaN"


def test_a_draft_row_that_cannot_be_sampled_drafts_nothing() -> None:
    logits = torch.randn(3, 16)
    logits[1] = math.nan
    logits[2, 3] = math.inf
    greedy, sampling = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=2)
    rows = [
        SamplingRow(p, [1], [], torch.Generator().manual_seed(0))
        for p in (sampling, greedy, sampling)
    ]
    tokens, qs = choose_drafts(Sampler(), logits, rows)
    assert tokens[1:] == [None, None] and qs[1:] == [None, None]
    assert 0 <= tokens[0] < 16
    assert torch.allclose(qs[0].sum(), torch.tensor(1.0))


def test_nan_draft_logits_leave_the_target_to_decide_alone(
    tiny_model, workload, expected, monkeypatch
) -> None:
    prompts, params = workload
    llm = LLM(tiny_model("llama"), speculative_config=EARLY_EXIT)
    proposer = llm.engine.worker.speculator.proposer
    draft_logits = proposer._draft_logits
    monkeypatch.setattr(
        proposer, "_draft_logits", lambda *args: torch.full_like(draft_logits(*args), math.nan)
    )
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] == 0
    assert_all_blocks_free(llm.engine)
