"""Checks for chapter 06 (speculative decoding), run against any module that defines
`residual_distribution`, `rejection_sample`, `latest_earlier_match` and `NgramProposer`:
minserve's own, the solutions, or a student's exercise file.

Edge cases are chosen so that the answer is forced (a residual with one token left, a draft
the target never picks); the distribution checks draw thousands of verifications with a
fixed seed and bound the total-variation distance to the target, so they are stable.
"""

from __future__ import annotations

from types import ModuleType

import torch
from hypothesis import HealthCheck, Verbosity, given, settings
from hypothesis import strategies as st

from minserve.course.nonfinite import lead_with_nonfinite
from minserve.speculative import draft_length as reference_lengths
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.ngram import NgramProposer, latest_earlier_match

NUM_SAMPLES = 6000
TV_BOUND = 0.03  # TV of 6000 draws over 4 tokens is about 0.01; a wrong rule is off by >0.1
P = torch.tensor([0.5, 0.3, 0.15, 0.05])  # the target
Q = torch.tensor([0.1, 0.6, 0.1, 0.2])  # a draft that over-proposes tokens 1 and 3


def _rounded(values: torch.Tensor) -> list[float]:
    return [round(float(v), 4) for v in values]


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _first_token_frequencies(
    impl: ModuleType, target: torch.Tensor, draft: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Frequencies of the first token returned over NUM_SAMPLES one-draft verifications,
    the draft itself drawn from `draft`, and the fraction of drafts accepted."""
    generator = _generator()
    counts = torch.zeros(len(target))
    accepted = 0
    target_rows = torch.stack([target, target])  # [k + 1 = 2, vocab]
    for _ in range(NUM_SAMPLES):
        proposal = int(torch.multinomial(draft, 1, generator=generator))
        tokens = impl.rejection_sample(target_rows, draft[None], [proposal], generator)
        counts[tokens[0]] += 1
        accepted += len(tokens) == 2
    return counts / NUM_SAMPLES, accepted / NUM_SAMPLES


def check_the_residual_keeps_only_what_the_target_wants_more_of(impl: ModuleType) -> None:
    """max(0, p - q) normalised: p = [0.5, 0.3, 0.15, 0.05], q = [0.1, 0.6, 0.1, 0.2]."""
    got = impl.residual_distribution(P, Q)
    expected = torch.tensor([0.4, 0.0, 0.05, 0.0]) / 0.45
    assert torch.allclose(got, expected, atol=1e-6), lead_with_nonfinite(
        got,
        f"residual_distribution(p={_rounded(P)}, q={_rounded(Q)}): expected "
        f"{_rounded(expected)}, got {_rounded(got)}",
    )


def check_the_residual_of_a_one_hot_draft_is_the_target_without_it(impl: ModuleType) -> None:
    """A deterministic draft (q one-hot at token 1): the residual is p with token 1 removed."""
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0])
    got = impl.residual_distribution(P, one_hot)
    expected = torch.tensor([0.5, 0.0, 0.15, 0.05]) / 0.7
    assert torch.allclose(got, expected, atol=1e-6), lead_with_nonfinite(
        got,
        f"residual_distribution(p={_rounded(P)}, q={_rounded(one_hot)}): expected "
        f"{_rounded(expected)}, got {_rounded(got)}",
    )


def check_the_residual_of_equal_distributions_is_the_target(impl: ModuleType) -> None:
    """p == q leaves no excess mass: return p itself (no NaN from 0 / 0), row by row."""
    rows = torch.stack([P, Q])  # [2, vocab]
    got = impl.residual_distribution(rows, rows)
    assert torch.equal(got, rows), lead_with_nonfinite(
        got,
        f"residual_distribution(p, p) for rows {[_rounded(r) for r in rows]}: expected p "
        f"itself, got {[_rounded(r) for r in got]}",
    )


def check_drafts_equal_to_the_target_are_all_kept_plus_a_bonus(impl: ModuleType) -> None:
    """q == p at every position: all 3 drafts are kept, then the bonus from row k (one-hot)."""
    target = torch.stack([P, Q, P, torch.tensor([0.0, 0.0, 1.0, 0.0])])  # [k + 1 = 4, vocab]
    got = impl.rejection_sample(target, target[:3], [0, 1, 3], _generator())
    assert got == [0, 1, 3, 2], (
        "3 drafts [0, 1, 3] with q == p at each position and row 3 one-hot at token 2: "
        f"expected [0, 1, 3, 2], got {got}"
    )


def check_a_draft_the_target_never_picks_is_replaced_from_the_residual(impl: ModuleType) -> None:
    """p(d) = 0 rejects d at once; the residual leaves one token, which ends the output."""
    target = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4])  # [k + 1 = 3, vocab]
    draft = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4])  # [k = 2, vocab]
    for seed in range(5):
        got = impl.rejection_sample(target, draft, [1, 0], _generator(seed))
        assert got == [2], (
            f"seed {seed}: the target gives draft 1 probability 0 and all its mass to token 2: "
            f"expected [2] (reject, resample, stop), got {got}"
        )


def check_a_rejection_stops_the_walk(impl: ModuleType) -> None:
    """Draft 0 kept (p = q), draft 1 rejected (p(d) = 0): two tokens, the second resampled."""
    target = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.25] * 4])
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    got = impl.rejection_sample(target, draft, [0, 1], _generator())
    assert got == [0, 3], (
        "draft 0 where p = q = one-hot, draft 1 where p gives it 0 and token 3 all: "
        f"expected [0, 3], got {got}"
    )


def check_the_first_token_is_distributed_as_the_target(impl: ModuleType) -> None:
    """Drafts drawn from q, verified against p: the first token's frequencies match p."""
    freqs, accepted = _first_token_frequencies(impl, P, Q)
    tv = 0.5 * float((freqs - P).abs().sum())
    assert tv < TV_BOUND, (
        f"{NUM_SAMPLES} verifications of one draft from q={_rounded(Q)}: expected token "
        f"frequencies close to p={_rounded(P)} (total variation < {TV_BOUND}), got "
        f"{_rounded(freqs)} (total variation {tv:.3f})"
    )
    expected = float(torch.minimum(P, Q).sum())  # 1 - TV(p, q)
    assert abs(accepted - expected) < 0.03, (
        f"acceptance rate: expected sum(min(p, q)) = {expected:.3f}, got {accepted:.3f}"
    )


def check_a_one_hot_draft_also_leaves_the_target_unchanged(impl: ModuleType) -> None:
    """Always proposing token 0 (a deterministic draft, q one-hot): still distributed as p."""
    one_hot = torch.tensor([1.0, 0.0, 0.0, 0.0])
    freqs, accepted = _first_token_frequencies(impl, P, one_hot)
    tv = 0.5 * float((freqs - P).abs().sum())
    assert tv < TV_BOUND, (
        f"{NUM_SAMPLES} verifications of the draft token 0 (q one-hot): expected frequencies "
        f"close to p={_rounded(P)} (total variation < {TV_BOUND}), got {_rounded(freqs)}"
    )


def check_each_position_is_verified_against_its_own_row(impl: ModuleType) -> None:
    """Each position has its own p: after a kept first draft, the second follows p's row 1.

    Two drafts from q's rows 0 and 1; the second token's frequencies must match row 1 of p
    (a walk that reuses row 0 fails)."""
    target = torch.stack([P, P.flip(0), P])  # [k + 1 = 3, vocab]: row 1 is p reversed
    draft = torch.stack([Q, Q.flip(0)])  # [k = 2, vocab]
    generator, counts = _generator(), torch.zeros(len(P))
    for _ in range(NUM_SAMPLES):
        drafts = [int(torch.multinomial(row, 1, generator=generator)) for row in draft]
        tokens = impl.rejection_sample(target, draft, drafts, generator)
        if tokens[0] == drafts[0] and len(tokens) >= 2:  # the first draft was kept
            counts[tokens[1]] += 1
    freqs, expected = counts / counts.sum(), target[1]
    tv = 0.5 * float((freqs - expected).abs().sum())
    assert tv < 2 * TV_BOUND, (
        f"second token after a kept first draft: expected frequencies close to row 1 of p, "
        f"{_rounded(expected)} (total variation < {2 * TV_BOUND}), got {_rounded(freqs)}"
    )


# Exercises 6.3 and 6.4: prompt lookup, on hand-made and random histories.
def check_the_latest_earlier_match_wins(impl: ModuleType) -> None:
    """[1, 2, 1, 2, 1, 2]: [1, 2] last occurred earlier at 2 (0 is older; 4 is the pattern)."""
    cases = [
        ([1, 2, 1, 2, 1, 2], 2, 2),
        ([1, 2, 1, 2, 1, 2], 1, 3),
        ([5, 6, 7, 5, 6], 2, 0),
        ([5, 6, 7, 5, 6], 3, None),
        ([1, 1, 1], 2, 0),  # overlaps the pattern, still followed by a token
        ([4, 3, 2, 1], 1, None),
    ]
    for history, n, expected in cases:
        got = impl.latest_earlier_match(history, n)
        assert got == expected, (
            f"latest_earlier_match({history}, n={n}): expected {expected}, got {got}"
        )


def _proposer(impl: ModuleType, max_n: int, min_n: int = 1):
    config = SpeculativeConfig("ngram", 4, prompt_lookup_max=max_n, prompt_lookup_min=min_n)
    return impl.NgramProposer(config)


def check_lookup_prefers_the_longest_matching_context(impl: ModuleType) -> None:
    """[1, 2, 9, 1, 2, 7, 8, 1, 2], max_n=2: the 2-gram [1, 2] at 3 gives [7, 8, 1]."""
    cases = [
        (2, 1, [1, 2, 9, 1, 2, 7, 8, 1, 2], 3, [7, 8, 1]),
        (3, 1, [1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 2, [9, 2]),  # the 3-gram beats the later 2-gram
        (2, 1, [5, 6, 7, 5], 2, [6, 7]),  # no 2-gram match: n = 1
        (2, 2, [5, 6, 7, 5], 2, []),  # min_n = 2: no match at all
        (4, 1, [1, 2, 3], 4, []),
        (2, 1, [3, 4, 5, 3], 9, [4, 5, 3]),  # fewer than k tokens follow
    ]
    for max_n, min_n, history, k, expected in cases:
        got = _proposer(impl, max_n, min_n).lookup(history, k)
        assert got == expected, (
            f"lookup({history}, k={k}) with prompt_lookup_max={max_n}, prompt_lookup_min="
            f"{min_n}: expected {expected}, got {got}"
        )


_SETTINGS = settings(
    max_examples=150, deadline=None, database=None, derandomize=True, report_multiple_bugs=False
)
_histories = st.lists(st.integers(0, 3), min_size=1, max_size=14)


def check_random_histories_match_minserves_lookup(impl: ModuleType) -> None:
    """Random histories over 4 tokens, random k and n range: the same drafts as minserve's."""

    @_SETTINGS
    @given(_histories, st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
    def run(history: list[int], k: int, max_n: int, extra: int) -> None:
        min_n = max(1, max_n - extra)
        for n in range(1, len(history)):
            got, expected = impl.latest_earlier_match(history, n), latest_earlier_match(history, n)
            assert got == expected, (
                f"latest_earlier_match({history}, n={n}): expected {expected}, got {got}"
            )
        ours = NgramProposer(SpeculativeConfig("ngram", k, max_n, min_n))
        got, expected = _proposer(impl, max_n, min_n).lookup(history, k), ours.lookup(history, k)
        assert got == expected, (
            f"lookup({history}, k={k}) with prompt_lookup_max={max_n}, prompt_lookup_min="
            f"{min_n}: expected {expected}, got {got}"
        )

    run()


# --- exercise 6.5: the adaptive draft length, against minserve's -------------------------

_QUIET = dict(
    report_multiple_bugs=False,
    deadline=None,
    database=None,
    derandomize=True,
    verbosity=Verbosity.quiet,
    suppress_health_check=list(HealthCheck),
)


def check_the_best_draft_length_follows_the_acceptance_rate(impl: ModuleType) -> None:
    """Useless drafts (a = 0) get 1, free perfect ones (a = 1, c = 0) get k; else minserve's g"""
    for a, c, k, expected in [(0.0, 0.1, 5, 1), (1.0, 0.0, 5, 5), (0.9, 0.05, 8, None)]:
        expected = expected or reference_lengths.best_draft_length(a, c, k)
        got = impl.best_draft_length(a, c, k)
        assert got == expected, (
            f"best_draft_length(a={a}, c={c}, k={k}): expected {expected}, got {got}"
        )

    @settings(max_examples=300, **_QUIET)
    @given(st.floats(0, 1), st.floats(0, 1.5), st.integers(1, 10))
    def agree(a: float, c: float, k: int) -> None:
        expected = reference_lengths.best_draft_length(a, c, k)
        got = impl.best_draft_length(a, c, k)
        assert got == expected, (
            f"best_draft_length(a={a}, c={c}, k={k}): expected {expected} (the shortest g "
            f"within {reference_lengths.TOLERANCE:.0%} of the best speedup), got {got}"
        )

    agree()


def check_the_acceptance_estimate_counts_tested_drafts(impl: ModuleType) -> None:
    """3 drafts, 1 accepted: 2 were tested (the rejected one too); counts decay by DECAY"""
    estimate = impl.AcceptanceEstimate()
    estimate.observe(3, 1)
    ref = reference_lengths.AcceptanceEstimate()
    ref.observe(3, 1)
    got, expected = (estimate.accepted, estimate.tested), (ref.accepted, ref.tested)
    assert got == expected, (
        "a fresh estimate (prior 1 accepted of 2 tested) after 3 drafts, 1 accepted: expected "
        f"(accepted, tested) == {expected}, got {got}"
    )

    @settings(max_examples=200, **_QUIET)
    @given(
        st.lists(
            st.integers(1, 6).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
            max_size=12,
        )
    )
    def agree(steps: list[tuple[int, int]]) -> None:
        yours, ours = impl.AcceptanceEstimate(), reference_lengths.AcceptanceEstimate()
        for drafts, accepted in steps:
            yours.observe(drafts, accepted)
            ours.observe(drafts, accepted)
        got, expected = (yours.accepted, yours.tested), (ours.accepted, ours.tested)
        assert abs(got[0] - expected[0]) < 1e-9 and abs(got[1] - expected[1]) < 1e-9, (
            f"after observing (drafts, accepted) {steps}: expected (accepted, tested) == "
            f"{expected}, got {got}"
        )

    agree()


def check_draft_lengths_per_sequence_match_minserves(impl: ModuleType) -> None:
    """Fixed mode always gives k; adaptive gives each sequence minserve's length as it learns"""
    fixed = impl.DraftLengths("fixed", 4)
    fixed.observe("a", 4, 0)
    got = (fixed.length("a", 0.1), len(fixed.estimates))
    assert got == (4, 0), (
        "mode 'fixed', k=4, after a step with every draft rejected: expected length 4 and no "
        f"estimates kept, got length {got[0]} and {got[1]} estimates"
    )
    step = st.tuples(st.sampled_from("abc"), st.integers(0, 5), st.integers(0, 5), st.floats(0, 1))

    def play(steps: list[tuple[str, int, int, float]]) -> None:
        yours = impl.DraftLengths("adaptive", 5)
        ours = reference_lengths.DraftLengths("adaptive", 5)
        for i, (seq, drafts, accepted, cost) in enumerate(steps):
            accepted = min(accepted, drafts)
            expected, got = ours.length(seq, cost), yours.length(seq, cost)
            assert got == expected, (
                f"adaptive, k=5, steps (sequence, drafts, accepted, cost ratio) {steps}: at "
                f"step {i}, length({seq!r}, {cost}): expected {expected}, got {got}"
            )
            ours.observe(seq, drafts, accepted)
            yours.observe(seq, drafts, accepted)

    play([("a", 5, 0, 0.1), ("a", 5, 0, 0.1), ("b", 0, 0, 0.1), ("a", 2, 2, 0.1)])

    @settings(max_examples=150, **_QUIET)
    @given(st.lists(step, max_size=15))
    def agree(steps: list[tuple[str, int, int, float]]) -> None:
        play(steps)

    agree()


CHECKS = [
    check_the_residual_keeps_only_what_the_target_wants_more_of,
    check_the_residual_of_a_one_hot_draft_is_the_target_without_it,
    check_the_residual_of_equal_distributions_is_the_target,
    check_drafts_equal_to_the_target_are_all_kept_plus_a_bonus,
    check_a_draft_the_target_never_picks_is_replaced_from_the_residual,
    check_a_rejection_stops_the_walk,
    check_the_first_token_is_distributed_as_the_target,
    check_a_one_hot_draft_also_leaves_the_target_unchanged,
    check_each_position_is_verified_against_its_own_row,
    check_the_latest_earlier_match_wins,
    check_lookup_prefers_the_longest_matching_context,
    check_random_histories_match_minserves_lookup,
    check_the_best_draft_length_follows_the_acceptance_rate,
    check_the_acceptance_estimate_counts_tested_drafts,
    check_draft_lengths_per_sequence_match_minserves,
]

HINTS: dict[str, tuple[str, str, str]] = {
    "6.1": (
        "After a rejection, the output must make up for what the draft under-proposed: the "
        "tokens where the target p has more mass than the draft q.",
        "Take the positive part of p - q and divide by its sum. When p == q the sum is 0: "
        "there is nothing to make up, so return p itself rather than dividing 0 by 0.",
        "`excess = (p - q).clamp(min=0)`, `total = excess.sum(-1, keepdim=True)`, then "
        "`torch.where(total > 0, excess / total.clamp(min=tiny), p)`.",
    ),
    "6.2": (
        "Keep draft d with probability min(1, p(d) / q(d)); at the first rejection, draw "
        "the replacement from the residual and stop; if every draft is kept, the target's "
        "last row gives one bonus token.",
        "Loop over positions i: draw u uniform with the generator, keep d while "
        "u * q_i(d) < p_i(d), else append a draw from residual_distribution(p_i, q_i) and "
        "return. After the loop, append a draw from target_probs[k].",
        "u is a 0-d torch.rand drawn with the generator; keep d when u times "
        "draft_probs[i, d] is below target_probs[i, d]; otherwise torch.multinomial on the "
        "residual (one sample, the same generator) gives the replacement.",
    ),
    "6.3": (
        "Prompt lookup guesses that what followed an earlier occurrence of the context "
        "follows it again. Search for the last n tokens earlier in the history, newest first.",
        "Walk candidate end positions from the second-to-last token down to n - 1; the first "
        "window of n tokens equal to the pattern wins. Its start is end - n + 1. The pattern "
        "itself (ending at the last token) is not a match: nothing follows it.",
        "`pattern = token_ids[-n:]`; `for end in range(len(token_ids) - 2, n - 2, -1):` and "
        "compare `token_ids[end - n + 1 : end + 1]` with the pattern (checking the last "
        "token first is a cheap filter).",
    ),
    "6.4": (
        "A longer matching context predicts better, so try the longest n first and fall "
        "back to shorter ones; propose at most k of the tokens that followed the match.",
        "For n from min(max_n, len - 1) down to min_n: find the latest earlier match; on "
        "the first hit, return the slice after it, at most k long. No hit at any n: [].",
        "Ask latest_earlier_match for the start of the match at this n; when there is one, "
        "the draft is the slice of token_ids that begins n tokens after it, cut to k.",
    ),
}

HINTS["6.5"] = (
    "Speculation pays only while drafts are accepted: g drafts cost g c + 1 target forwards "
    "and yield 1 + a + ... + a^g tokens. Each sequence keeps discounted counts of its drafts "
    "tested and accepted, so its rate a follows what its text does now, and gets the g "
    "with the best expected speedup at that rate, preferring a shorter g when it is nearly "
    "as good.",
    "best_draft_length: the speedups for g = 1..k, their maximum, then the first g that "
    "reaches (1 - TOLERANCE) of it. AcceptanceEstimate.observe: work out how many drafts "
    "were tested, then decay both counts and add this step's. DraftLengths.length: k in "
    "fixed mode; else the sequence's estimate (made on first use) gives the rate for "
    "best_draft_length. DraftLengths.observe: only in adaptive mode, and only when the "
    "sequence drafted.",
    "expected_speedup(a, g, c) gives S(g); enumerate the list from 1 to pair each S with "
    "its g. A rejection tests one more draft than were accepted, which happened exactly "
    "when fewer were accepted than drafted (a bool adds as 0 or 1). dict.setdefault with "
    "a fresh AcceptanceEstimate() makes the estimate on first use.",
)
PROGRESS = {"6.5": "best_draft_length must visit each g from 1 to k once"}
