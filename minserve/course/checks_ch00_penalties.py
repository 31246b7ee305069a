"""Checks for chapter 00's penalties (exercise 0.8), run against any module that defines
`apply_penalties(logits, rows)`: the solutions, or a student's exercise file.

The repetition penalty is compared with transformers' `RepetitionPenaltyLogitsProcessor`;
frequency and presence with OpenAI's formula written out token by token; then hypothesis
draws random batches of rows (prompts, outputs, the three penalties) and compares the
whole batch with that token-by-token reference.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import ModuleType

import torch
from hypothesis import Verbosity, given, settings
from hypothesis import strategies as st

from minserve.course.nonfinite import lead_with_nonfinite
from minserve.model.sampler import SamplingRow
from minserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _row(prompt: list[int], output: list[int], **params: float) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt, output, None)


def _describe(row: SamplingRow) -> str:
    p = row.params
    return (
        f"prompt {list(row.prompt_token_ids)}, output {list(row.output_token_ids)}, "
        f"repetition {p.repetition_penalty:g}, frequency {p.frequency_penalty:g}, "
        f"presence {p.presence_penalty:g}"
    )


def _reference(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The penalties written out row by row, token by token."""
    out = logits.clone()
    for i, row in enumerate(rows):
        p = row.params
        for token in set(row.prompt_token_ids) | set(row.output_token_ids):
            value = out[i, token].item()
            if value != NEG_INF:
                r = p.repetition_penalty
                out[i, token] = value / r if value > 0 else value * r
        for token, count in Counter(row.output_token_ids).items():
            out[i, token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def _assert_rows(
    fn: Callable[[torch.Tensor, list[SamplingRow]], torch.Tensor],
    logits: torch.Tensor,
    rows: list[SamplingRow],
    expected: torch.Tensor,
) -> None:
    got = fn(logits.clone(), rows)
    assert isinstance(got, torch.Tensor) and got.shape == logits.shape, (
        f"apply_penalties must return a tensor shaped like logits {tuple(logits.shape)}, "
        f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))}"
    )
    for i, row in enumerate(rows):
        if not torch.allclose(got[i], expected[i], rtol=1e-5, atol=1e-5, equal_nan=False):
            message = (
                f"apply_penalties, row {i} ({_describe(row)}), logits "
                f"{[round(x, 4) for x in logits[i].tolist()]}: expected "
                f"{[round(x, 4) for x in expected[i].tolist()]}, got "
                f"{[round(x, 4) for x in got[i].tolist()]}"
            )
            raise AssertionError(lead_with_nonfinite(got, message))


def check_repetition_matches_transformers(impl: ModuleType) -> None:
    """Repetition penalty 1.5 over prompt and output tokens equals transformers' processor."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [1.0, 1.0, -1.0, 4.0, 0.0, -3.0]])
    rows = [
        _row([0, 1, 1], [3], repetition_penalty=1.5),
        _row([2], [5, 3, 3], repetition_penalty=1.5),
    ]
    processor = RepetitionPenaltyLogitsProcessor(penalty=1.5)
    seen = [torch.tensor([[*row.prompt_token_ids, *row.output_token_ids]]) for row in rows]
    expected = torch.cat([processor(ids, logits[i : i + 1].clone()) for i, ids in enumerate(seen)])
    _assert_rows(impl.apply_penalties, logits, rows, expected)


def check_frequency_and_presence_count_outputs(impl: ModuleType) -> None:
    """Frequency 0.5 and presence 1 subtract 0.5 x count + 1 from each output token only."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    rows = [_row([0, 1], [1, 4, 4, 4], frequency_penalty=0.5, presence_penalty=1.0)]
    expected = torch.tensor([[1.0, 2.0 - 1.5, 3.0, 4.0, 5.0 - 2.5]])  # 1 once, 4 three times
    _assert_rows(impl.apply_penalties, logits, rows, expected)


def check_rows_without_penalties_are_untouched(impl: ModuleType) -> None:
    """Only a row that asks for penalties changes; a -inf logit stays -inf; input kept."""
    logits = torch.tensor([[1.0, NEG_INF, 2.0], [1.0, NEG_INF, 2.0]])
    rows = [_row([0, 1], [2, 2]), _row([0, 1], [2, 2], repetition_penalty=2.0)]
    expected = torch.tensor([[1.0, NEG_INF, 2.0], [0.5, NEG_INF, 1.0]])
    before = logits.clone()
    _assert_rows(impl.apply_penalties, logits, rows, expected)
    impl.apply_penalties(logits, rows)
    assert torch.equal(logits, before), (
        f"apply_penalties modified its input: expected {before.tolist()} afterwards, got "
        f"{logits.tolist()}; penalise a copy"
    )


def check_huge_penalty_stays_finite(impl: ModuleType) -> None:
    """A repetition penalty below 1 on a logit near float32's max gives its max, not +inf."""
    big = torch.finfo(torch.float32).max / 2
    logits = torch.tensor([[big, 0.0]])
    rows = [_row([0], [], repetition_penalty=0.01)]
    got = impl.apply_penalties(logits.clone(), rows)
    assert torch.isfinite(got).all(), (
        f"apply_penalties with repetition_penalty 0.01 on logit {big:g}: expected "
        f"{torch.finfo(torch.float32).max:g} (kept finite), got {got[0].tolist()}"
    )


_VOCAB = 8
_TOKENS = st.lists(st.integers(0, _VOCAB - 1), max_size=6)
_ROW = st.builds(
    lambda prompt, output, r, f, p: _row(prompt, output, repetition_penalty=r,
                                         frequency_penalty=f, presence_penalty=p),
    _TOKENS, _TOKENS,
    st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    st.sampled_from([0.0, 0.5, -1.0]),
    st.sampled_from([0.0, 1.0, -0.4]),
)  # fmt: skip


def check_random_batches_match_a_reference(impl: ModuleType) -> None:
    """300 random batches of rows match the penalties written out token by token
    (hypothesis: prompts, outputs and penalties per row; a failure shows the smallest)."""

    def compare(rows: list[SamplingRow], values: list[float]) -> None:
        logits = torch.tensor(values, dtype=torch.float32).view(len(rows), _VOCAB)
        _assert_rows(impl.apply_penalties, logits, rows, _reference(logits, rows))

    compare([_row([1, 2], [2, 3, 3], repetition_penalty=1.3, frequency_penalty=0.5)], [1.0] * 8)

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              verbosity=Verbosity.quiet, report_multiple_bugs=False, print_blob=False)  # fmt: skip
    @given(st.lists(_ROW, min_size=1, max_size=4).flatmap(
        lambda rows: st.tuples(st.just(rows), st.lists(
            st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, NEG_INF]),
            min_size=len(rows) * _VOCAB, max_size=len(rows) * _VOCAB))))  # fmt: skip
    def run(case: tuple[list[SamplingRow], list[float]]) -> None:
        compare(*case)

    run()


PENALTY_CHECKS: list[Callable[[ModuleType], None]] = [
    check_repetition_matches_transformers,
    check_frequency_and_presence_count_outputs,
    check_rows_without_penalties_are_untouched,
    check_huge_penalty_stays_finite,
    check_random_batches_match_a_reference,
]

HINTS: dict[str, tuple[str, str, str]] = {
    "0.8": (
        "Only tokens a row has seen change: repetition scales each seen token's logit once "
        "(divide a positive one, multiply a negative one), frequency and presence subtract "
        "an amount that grows with how often the row produced the token.",
        "Skip the work when no row has penalties; copy the logits; find the seen tokens "
        "(prompt and output) and, separately, the produced ones with their counts; look up "
        "each one's row setting; update those entries only, leaving -inf alone and keeping "
        "the result under float32's max.",
        "In the flat view of the copy, token t of row i is entry i * vocab + t; "
        "`flat_token_ids(...).unique()` lists the seen entries once, and "
        "`.unique(return_counts=True)` on the outputs gives the counts; "
        "`per_row(rows, name, device)[entries // vocab]` is each entry's setting.",
    ),
}
