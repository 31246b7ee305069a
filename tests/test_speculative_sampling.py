"""Speculative sampling keeps the target's distribution exactly (temperature, top-k, top-p).

Oracle: the exact probability of every 3-token continuation, from transformers' logits on
the same weights, filtered as the sampler filters them. A stub proposer guesses the most
likely path, so drafts are accepted about half the time; the token frequencies of many
seeded speculative samples must pass a chi-square test (p = 0.001) against the oracle.
"""

from __future__ import annotations

import collections
import math
from dataclasses import replace

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.model.sampler import apply_top_k, apply_top_p
from minserve.speculative.draft import Draft

PROMPT = [5, 900, 77, 1234, 5, 900, 77]
LENGTH, NUM_SAMPLES = 3, 600


class PathProposer:
    """Proposes the most likely continuation under the oracle (a stand-in draft model)."""

    def __init__(self, best_next: dict[tuple[int, ...], int]) -> None:
        self.best_next = best_next

    def propose(self, chunks, limits: list[int]) -> list[Draft]:
        guesses = []
        for chunk, k in zip(chunks, limits):
            path, guess = tuple(chunk.history()[len(PROMPT) :]), []
            while len(guess) < k and path in self.best_next:
                guess.append(self.best_next[path])
                path += (guess[-1],)
            guesses.append(Draft(guess))  # deterministic: q one-hot
        return guesses


def exact_distribution(hf_model, params: SamplingParams):
    """P(continuation) for every continuation of LENGTH tokens, and each prefix's argmax."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    best_next: dict[tuple[int, ...], int] = {}
    for _ in range(LENGTH):
        grown = {}
        for path, p in probs.items():
            with torch.no_grad():
                logits = hf_model(torch.tensor([PROMPT + list(path)])).logits[0, -1:]
            logits = apply_top_k(logits / params.temperature, torch.tensor([params.top_k]))
            q = apply_top_p(logits, torch.tensor([params.top_p])).softmax(-1)[0]  # [vocab]
            best_next[path] = int(q.argmax())
            grown |= {path + (t,): p * float(q[t]) for t in q.nonzero().flatten().tolist()}
        probs = grown
    return probs, best_next


def chi_square(counts: collections.Counter, probs: dict, total: int) -> tuple[float, int]:
    """Pearson's statistic over outcomes expected at least 5 times (the rest pooled)."""
    big = {k: p for k, p in probs.items() if p * total >= 5}
    bins = [(counts[k], p * total) for k, p in big.items()]
    rest = total - sum(counts[k] for k in big), total * (1 - sum(big.values()))
    if rest[1] >= 1e-9:
        bins.append(rest)
    return sum((o - e) ** 2 / e for o, e in bins), len(bins) - 1


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The p = 0.001 quantile (z of 0.999), by the Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=2, max_tokens=LENGTH, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=3, top_p=0.8, max_tokens=LENGTH, ignore_eos=True),
    ],
    ids=["top_k", "top_p"],
)
def test_speculative_sampling_matches_target_distribution(tiny_model, params) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_model("llama")
    probs, best_next = exact_distribution(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), params
    )
    llm = LLM(
        folder,
        max_num_batched_tokens=8192,
        speculative_config={"method": "ngram", "num_speculative_tokens": LENGTH - 1},
    )
    llm.engine.worker.speculator.proposer = PathProposer(best_next)
    seeded = [replace(params, seed=seed) for seed in range(NUM_SAMPLES)]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, seeded, use_tqdm=False)
    counts = collections.Counter(tuple(out.outputs[0].token_ids) for out in outputs)
    assert set(counts) <= set(probs)  # nothing outside the filtered support
    rate = llm.get_metrics()["spec_decode_acceptance_rate"]
    assert 0.2 < rate < 0.95  # both branches (accept, reject) are exercised
    statistic, dof = chi_square(counts, probs, NUM_SAMPLES)
    assert statistic < chi_square_critical(dof), (statistic, dof, counts.most_common(4))
