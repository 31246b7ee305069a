"""What the engine asks of a grammar matcher: one sample's place in its grammar.

Every matcher (xgrammar's, in `matcher.py`, or chapter 12's `ChoiceMatcher`) follows
`TokenMatcher`:

    fill_bitmask(bitmask, row)  the tokens allowed next, as bits, into row `row` of an int32
                                [rows, ceil(vocab / 32)] tensor; reads the state only
    accept(token_id)            move on by one token (False, state unchanged: forbidden)
    rollback(num_tokens)        undo the last `num_tokens` accepted (speculative decoding
                                walks drafts forward to fill their masks, then steps back)
    is_terminated               complete, and its stop token (EOS) accepted
    fork()                      an independent copy (a request's n samples)
    forced_tokens()             the tokens of the text the grammar forces next, [] if
                                there is no single continuation (jump-forward's drafts)

`after(matcher, token_ids)` is the state a position after some drafts sees, without
touching the matcher: what the sampler reads for that position when nothing filled its
mask ahead (`step_masks.py` does, for the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class TokenMatcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def accept(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    @property
    def is_terminated(self) -> bool: ...

    def fork(self) -> TokenMatcher: ...

    def forced_tokens(self) -> list[int]: ...


def valid_prefix(matcher: TokenMatcher, token_ids: Sequence[int]) -> int:
    """How many of `token_ids`, from the first, the grammar allows in a row (the matcher is
    left as it was): drafts past the first forbidden one can never be accepted."""
    accepted = 0
    for token_id in token_ids:
        if matcher.is_terminated or not matcher.accept(token_id):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return accepted


class MatcherAfter:
    """A matcher's state after some tokens, as a constraint the sampler can read: a fork
    that accepted them (the matcher itself is left as it was)."""

    def __init__(self, matcher: TokenMatcher, token_ids: Sequence[int]) -> None:
        self._state = matcher.fork()
        for token_id in token_ids:
            if not self._state.accept(token_id):
                raise ValueError(f"token {token_id} breaks the grammar: no state after it")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._state.fill_bitmask(bitmask, row)

    def after(self, token_ids: Sequence[int]) -> MatcherAfter:
        return MatcherAfter(self._state, token_ids)
