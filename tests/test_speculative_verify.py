"""Rejection sampling against a draft distribution (minserve/speculative/verify.py).

Oracles: the closed form max(0, p - q) / sum, the target distribution p itself (total
variation over fixed-seed draws), and Leviathan et al.'s expected tokens per verification
(1 - a^(k+1)) / (1 - a) with a = sum(min(p, q)). Budget: about 3 s on one thread.
"""

from __future__ import annotations

import pytest
import torch

from minserve.speculative.verify import rejection_sample, residual_distribution

NUM_SAMPLES = 4000


def _distribution(vocab: int, seed: int) -> torch.Tensor:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    return logits.softmax(-1)  # [vocab]


def _verify_many(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
    """First-token frequencies and output lengths of NUM_SAMPLES verifications of k drafts
    drawn from q (the same p and q at every position)."""
    generator = torch.Generator().manual_seed(0)
    target, draft = p.expand(k + 1, -1), q.expand(k, -1)  # [k + 1, vocab], [k, vocab]
    counts, lengths = torch.zeros(len(p)), []
    for _ in range(NUM_SAMPLES):
        drafts = torch.multinomial(q, k, replacement=True, generator=generator).tolist()
        tokens = rejection_sample(target, draft, drafts, generator)
        counts[tokens[0]] += 1
        lengths.append(len(tokens))
    return counts / NUM_SAMPLES, lengths


def test_residual_is_the_normalised_positive_part_of_p_minus_q_row_by_row():
    p = torch.stack([_distribution(8, seed) for seed in range(3)])  # [3, 8]
    q = torch.stack([_distribution(8, seed + 10) for seed in range(3)])
    excess = torch.maximum(p - q, torch.zeros(()))
    expected = excess / excess.sum(-1, keepdim=True)
    got = residual_distribution(p, q)
    torch.testing.assert_close(got, expected)
    assert got.shape == (3, 8) and not torch.equal(got, p)  # q really changes the draw


def test_residual_of_identical_distributions_is_the_target_not_nan():
    p = _distribution(5, 1)
    assert torch.equal(residual_distribution(p, p.clone()), p)


@pytest.mark.parametrize("k", [1, 3])
def test_first_token_follows_the_target_whatever_the_draft(k):
    p, q = _distribution(6, 2), _distribution(6, 3)
    freqs, _ = _verify_many(p, q, k)
    assert 0.5 * float((freqs - p).abs().sum()) < 0.035
    assert 0.5 * float((q - p).abs().sum()) > 0.2  # the draft alone would fail the bound


def test_mean_tokens_per_verification_matches_the_closed_form():
    p, q, k = _distribution(6, 4), _distribution(6, 5), 3
    a = float(torch.minimum(p, q).sum())  # acceptance probability of one draft
    _, lengths = _verify_many(p, q, k)
    expected = (1 - a ** (k + 1)) / (1 - a)
    assert abs(sum(lengths) / len(lengths) - expected) < 0.05


def test_a_one_hot_draft_is_kept_with_probability_p_of_it():
    """The engine's deterministic rule: keep d with probability p(d), else p without d."""
    p = _distribution(6, 6)
    draft = int(p.argmin())
    one_hot = torch.nn.functional.one_hot(torch.tensor(draft), 6).float()
    freqs, lengths = _verify_many(p, one_hot, 1)
    kept = sum(n == 2 for n in lengths) / len(lengths)
    assert abs(kept - float(p[draft])) < 0.02
    assert 0.5 * float((freqs - p).abs().sum()) < 0.035
