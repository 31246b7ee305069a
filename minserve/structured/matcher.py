"""One sample's place in its grammar (xgrammar's matcher), as the engine uses it.

`GrammarMatcher` follows `TokenMatcher` (`token_matcher.py`): it wraps xgrammar's matcher
(a pushdown automaton run over the tokens' bytes), which keeps its own history, so
`rollback` is exact for any number of tokens, and finds the string the grammar forces next
(`find_jump_forward_string`), which `forced_tokens` spells in the model's tokens.

Who owns it: the `Sample` it belongs to (`minserve/request.py`), which the scheduler writes.
The matcher's state is a function of the sample's output tokens, so it is advanced where
they are appended (`Sample.append`, the one writer of a sample's tokens) and never drifts
from them: a preempted sequence keeps it, a recomputed prefill does not replay it, a
sibling forked after the prefill starts from its own copy, and a disaggregated decode
instance advances it with the first token it receives. The worker reads it during a step,
to fill the step's masks (`step_masks.py`), and returns it as it found it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import xgrammar as xgr

from minserve.structured.token_matcher import MatcherAfter


class GrammarMatcher:
    """The grammar state of one sample (xgrammar's `GrammarMatcher`). `encode` spells text
    in the model's tokens (no special tokens): for `forced_tokens`."""

    def __init__(self, matcher: xgr.GrammarMatcher, encode: Callable[[str], list[int]]) -> None:
        self._matcher = matcher
        self._encode = encode

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32, on the CPU). Past the
        end (after EOS: a verified position behind an EOS draft) every token: the sample
        has finished, and nothing drawn there is kept."""
        if self._matcher.is_terminated():
            bitmask[row] = -1
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.fork(), self._encode)

    def forced_tokens(self) -> list[int]:
        """The text every continuation starts with (e.g. `"name": "` after `{` in a schema
        whose first key is "name"), in the model's tokens; [] when no text is forced."""
        if self._matcher.is_terminated():
            return []
        text = self._matcher.find_jump_forward_string()
        return self._encode(text) if text else []

    def after(self, token_ids: Sequence[int]) -> MatcherAfter:
        """The state after `token_ids`, read-only (this matcher is unchanged)."""
        return MatcherAfter(self, token_ids)
