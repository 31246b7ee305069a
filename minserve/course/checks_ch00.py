"""Checks for chapter 00, run against any module that defines the decoder's pieces
(`rms_norm`, `apply_rope`, `swiglu`, `attend`), the sampler's filters (`apply_top_k`,
`apply_top_p`, `apply_min_p`), its penalties (`apply_penalties`, checked in
`checks_ch00_penalties.py`) and RoPE's frequencies (`rope_inverse_frequencies`, in
`checks_ch00_rope.py`): the solutions, or a student's exercise file.

The model's pieces are compared with torch references (and transformers' own RoPE) on
random tensors, then assembled into a tiny random Llama whose logits must match
transformers'. The filters get a few rows of hand-made logits whose answer can be worked
out on paper. Every assertion shows expected against got.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch

from minserve.course.checks_ch00_model import HINTS as MODEL_HINTS
from minserve.course.checks_ch00_model import MODEL_CHECKS
from minserve.course.checks_ch00_penalties import HINTS as PENALTY_HINTS
from minserve.course.checks_ch00_penalties import PENALTY_CHECKS
from minserve.course.checks_ch00_rope import HINTS as ROPE_HINTS
from minserve.course.checks_ch00_rope import ROPE_CHECKS

NEG_INF = float("-inf")


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)  # [rows, vocab]


def _log_probs(probs: list[float]) -> list[float]:
    """Logits whose softmax is `probs` (which sum to 1)."""
    return [math.log(p) for p in probs]


def _kept(row: torch.Tensor) -> list[int]:
    return [j for j, value in enumerate(row.tolist()) if value != NEG_INF]


def _assert_filters(
    name: str,
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    setting: torch.Tensor,
    expected_kept: list[list[int]],
) -> None:
    """Run `fn(logits, setting)` and compare, row by row, which tokens survive."""
    got = fn(logits.clone(), setting)
    assert isinstance(got, torch.Tensor) and got.shape == logits.shape, (
        f"{name} must return a tensor shaped like logits {tuple(logits.shape)}, "
        f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))}"
    )
    for i, (row_in, row_out) in enumerate(zip(logits, got, strict=True)):
        knob = f"{name.removeprefix('apply_')}={setting[i].item():g}"
        where = f"{name}, row {i} ({knob}), logits {row_in.tolist()}"
        for j, (before, after) in enumerate(zip(row_in.tolist(), row_out.tolist(), strict=True)):
            assert after == NEG_INF or after == before, (
                f"{where}: token {j} went from {before} to {after}; removed tokens must "
                "become exactly float('-inf') and kept tokens must keep their logit"
            )
        assert _kept(row_out) == expected_kept[i], (
            f"{where}: expected to keep tokens {expected_kept[i]}, got {_kept(row_out)}"
        )


def _assert_input_untouched(
    name: str,
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    setting: torch.Tensor,
) -> None:
    before = logits.clone()
    fn(logits, setting)
    assert torch.equal(logits, before), (
        f"{name} modified its input: expected {before.tolist()} afterwards, got "
        f"{logits.tolist()}; build a new tensor (masked_fill, not masked_fill_)"
    )


# Probabilities 0.15, 0.5, 0.1, 0.25, deliberately out of order.
_PROBS = [0.15, 0.5, 0.1, 0.25]


def check_top_k_keeps_k_largest(impl: ModuleType) -> None:
    """k = 2 keeps the two largest logits of a row, wherever they sit."""
    logits = _logits([[1.0, 4.0, 3.0, 2.0, 0.0]])
    _assert_filters("apply_top_k", impl.apply_top_k, logits, torch.tensor([2]), [[1, 2]])


def check_top_k_keeps_ties_at_kth_value(impl: ModuleType) -> None:
    """Three tokens tie for the largest logit; with k = 2 all three stay (ties are kept)."""
    logits = _logits([[3.0, 1.0, 3.0, 2.0, 3.0]])
    _assert_filters("apply_top_k", impl.apply_top_k, logits, torch.tensor([2]), [[0, 2, 4]])


def check_top_k_larger_than_vocab_keeps_all(impl: ModuleType) -> None:
    """k = 10 over a vocabulary of 4 keeps every token."""
    logits = _logits([[0.5, -1.0, 2.0, 0.0]])
    _assert_filters("apply_top_k", impl.apply_top_k, logits, torch.tensor([10]), [[0, 1, 2, 3]])


def check_top_k_per_row_settings(impl: ModuleType) -> None:
    """Each row uses its own k; k = 0 and k = -1 leave a row untouched."""
    logits = _logits([[0.1, 0.9, 0.5, 0.3]] * 4)
    top_k = torch.tensor([1, 0, 3, -1])
    expected = [[1], [0, 1, 2, 3], [1, 2, 3], [0, 1, 2, 3]]
    _assert_filters("apply_top_k", impl.apply_top_k, logits, top_k, expected)


def check_top_k_leaves_input_unchanged(impl: ModuleType) -> None:
    """apply_top_k returns a new tensor and does not write into the logits it was given."""
    logits = _logits([[1.0, 4.0, 3.0, 2.0]])
    _assert_input_untouched("apply_top_k", impl.apply_top_k, logits, torch.tensor([1]))


def check_top_p_keeps_smallest_nucleus(impl: ModuleType) -> None:
    """p = 0.6 needs 0.5 + 0.25; p = 0.8 needs 0.5 + 0.25 + 0.15."""
    logits = _logits([_log_probs(_PROBS)] * 2)
    top_p = torch.tensor([0.6, 0.8])
    _assert_filters("apply_top_p", impl.apply_top_p, logits, top_p, [[1, 3], [0, 1, 3]])


def check_top_p_tiny_keeps_one(impl: ModuleType) -> None:
    """A tiny p keeps exactly the most probable token, even of a nearly flat distribution."""
    logits = _logits([_log_probs(_PROBS), _log_probs([0.25, 0.24, 0.26, 0.25])])
    top_p = torch.tensor([1e-6, 1e-6])
    _assert_filters("apply_top_p", impl.apply_top_p, logits, top_p, [[1], [2]])


def check_top_p_keeps_ties_at_boundary(impl: ModuleType) -> None:
    """p = 0.5 over 0.4, 0.2, 0.2, 0.1, 0.1: one 0.2 reaches 0.5, and its tie stays too."""
    logits = _logits([_log_probs([0.1, 0.2, 0.4, 0.1, 0.2])])
    _assert_filters("apply_top_p", impl.apply_top_p, logits, torch.tensor([0.5]), [[1, 2, 4]])


def check_top_p_per_row_settings(impl: ModuleType) -> None:
    """Each row uses its own p; p = 1 leaves a row untouched, even a token of logit -1e4."""
    logits = _logits([_log_probs(_PROBS), _log_probs(_PROBS), [0.0, 1.0, -1e4, 2.0]])
    top_p = torch.tensor([1.0, 0.6, 1.0])
    expected = [[0, 1, 2, 3], [1, 3], [0, 1, 2, 3]]
    _assert_filters("apply_top_p", impl.apply_top_p, logits, top_p, expected)


def check_top_p_after_top_k(impl: ModuleType) -> None:
    """Tokens already at -inf count as probability 0: the nucleus of 0.6, 0.3, 0.1 at p = 0.85."""
    logits = _logits([[NEG_INF, math.log(0.6), NEG_INF, math.log(0.3), math.log(0.1)]])
    _assert_filters("apply_top_p", impl.apply_top_p, logits, torch.tensor([0.85]), [[1, 3]])


def check_top_p_leaves_input_unchanged(impl: ModuleType) -> None:
    """apply_top_p returns a new tensor and does not write into the logits it was given."""
    logits = _logits([_log_probs(_PROBS)])
    _assert_input_untouched("apply_top_p", impl.apply_top_p, logits, torch.tensor([0.6]))


def check_min_p_keeps_tokens_near_max(impl: ModuleType) -> None:
    """Max prob 0.5: min_p = 0.25 keeps probs >= 0.125, min_p = 0.4 keeps probs >= 0.2."""
    logits = _logits([_log_probs(_PROBS)] * 2)
    min_p = torch.tensor([0.25, 0.4])
    _assert_filters("apply_min_p", impl.apply_min_p, logits, min_p, [[0, 1, 3], [1, 3]])


def check_min_p_one_keeps_only_the_max(impl: ModuleType) -> None:
    """min_p = 1 keeps the most probable token and anything tied with it."""
    logits = _logits([[2.0, 5.0, 5.0, 1.0]])
    _assert_filters("apply_min_p", impl.apply_min_p, logits, torch.tensor([1.0]), [[1, 2]])


def check_min_p_per_row_settings(impl: ModuleType) -> None:
    """Each row uses its own min_p; 0 leaves a row untouched, even a token of logit -1e4."""
    logits = _logits([_log_probs(_PROBS), [0.0, 1.0, -1e4, 2.0], _log_probs(_PROBS)])
    min_p = torch.tensor([0.4, 0.0, 0.0])
    expected = [[1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    _assert_filters("apply_min_p", impl.apply_min_p, logits, min_p, expected)


def check_min_p_leaves_input_unchanged(impl: ModuleType) -> None:
    """apply_min_p returns a new tensor and does not write into the logits it was given."""
    logits = _logits([_log_probs(_PROBS)])
    _assert_input_untouched("apply_min_p", impl.apply_min_p, logits, torch.tensor([0.4]))


FILTER_CHECKS: list[Callable[[ModuleType], None]] = [
    check_top_k_keeps_k_largest,
    check_top_k_keeps_ties_at_kth_value,
    check_top_k_larger_than_vocab_keeps_all,
    check_top_k_per_row_settings,
    check_top_k_leaves_input_unchanged,
    check_top_p_keeps_smallest_nucleus,
    check_top_p_tiny_keeps_one,
    check_top_p_keeps_ties_at_boundary,
    check_top_p_per_row_settings,
    check_top_p_after_top_k,
    check_top_p_leaves_input_unchanged,
    check_min_p_keeps_tokens_near_max,
    check_min_p_one_keeps_only_the_max,
    check_min_p_per_row_settings,
    check_min_p_leaves_input_unchanged,
]
CHECKS = MODEL_CHECKS + FILTER_CHECKS + PENALTY_CHECKS + ROPE_CHECKS

HINTS: dict[str, tuple[str, str, str]] = {
    **MODEL_HINTS,
    **PENALTY_HINTS,
    **ROPE_HINTS,
    "0.5": (
        "Top-k keeps a row's k largest logits; everything below the k-th largest becomes -inf.",
        "Find each row's k-th largest value (a threshold), then mask the logits below it; "
        "rows with k <= 0 keep everything, and k may exceed the vocabulary.",
        "k = top_k.clamp(1, vocab); kth = logits.sort(descending=True).values.gather(1, "
        "(k - 1)[:, None]); mask = logits < kth, and no mask where top_k <= 0.",
    ),
    "0.6": (
        "Top-p keeps the smallest set of most probable tokens whose probabilities add up to p.",
        "Sort each row's probabilities in descending order, take the running sum, find the "
        "first position where it reaches p; that token's probability is the row's threshold.",
        "probs = logits.softmax(-1); sorted = probs.sort(descending=True).values; "
        "cut = (sorted.cumsum(-1) < p[:, None]).sum(-1); keep probs >= sorted[row, cut].",
    ),
    "0.7": (
        "Min-p keeps tokens whose probability is at least min_p times the row's largest.",
        "Softmax each row, take its max, scale by that row's min_p: one threshold per row.",
        "probs = logits.softmax(-1); floor = min_p[:, None] * probs.max(-1, keepdim=True)"
        ".values; return logits.masked_fill(probs < floor, -inf).",
    ),
}
