"""One sample's place in its grammar: which tokens may come next, moved on by each token.

A `GrammarMatcher` wraps xgrammar's matcher (a pushdown automaton run over the tokens'
bytes) with the four things the engine asks of it:

- `fill_bitmask(bitmask, row)`: the tokens allowed next, one bit each, into row `row` of an
  int32 [rows, ceil(vocab / 32)] tensor (bit j of word w is token 32 w + j). It reads the
  state and changes nothing, so the sampler may call it for any step;
- `accept(token_id)`: move on by a token the sample kept (False: the grammar forbids it);
- `is_terminated`: the grammar is complete and its stop token (EOS) was accepted;
- `fork()`: an independent copy of the state (a request's n samples each walk their own).

Who owns it: the `Sample` it belongs to (`minserve/request.py`), which the scheduler writes.
The matcher's state is a function of the sample's output tokens, so it is advanced where
they are appended (`Sample.append`, the one writer of a sample's tokens) and never drifts
from them: a preempted sequence keeps it, a recomputed prefill does not replay it, a
sibling forked after the prefill starts from its own copy, and a disaggregated decode
instance advances it with the first token it receives. The worker only reads it, through
the sampling row, to fill the step's bitmask.
"""

from __future__ import annotations

import torch
import xgrammar as xgr


class GrammarMatcher:
    """The grammar state of one sample (xgrammar's `GrammarMatcher`)."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32, on the CPU)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.fork())
