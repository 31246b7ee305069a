"""The n-gram proposer (prompt lookup decoding): no model, just the sequence's own tokens.

Outputs often copy from their context (code edits, quotes, summaries, loops). If the last
n tokens occurred earlier, guess that what followed them then follows them now.
"""

from __future__ import annotations

from minserve.messages import ScheduledChunk
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.draft import Draft


# >>> exercise 6.3: find the latest earlier match of the last n tokens
def latest_earlier_match(token_ids: list[int], n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that is followed by a token.

    The last n tokens themselves do not count (nothing follows them yet); an earlier
    occurrence may overlap them. None when there is none. [1, 2, 1, 2, 1, 2] with n = 2:
    [1, 2] also starts at 0 and 2; the latest, 2, is followed by a token: return 2.
    """
    # >>> solution
    pattern = token_ids[-n:]
    last = pattern[-1]
    for end in range(len(token_ids) - 2, n - 2, -1):  # `end`: index of the match's last token
        if token_ids[end] == last and token_ids[end - n + 1 : end + 1] == pattern:
            return end - n + 1
    return None
    # <<< solution


# <<< exercise


# >>> exercise 6.4: the n-gram proposer (prompt lookup)
class NgramProposer:
    """Propose the tokens that followed the latest earlier match of the last n tokens.

    Plug yours into the engine with `LLM(speculative_config={"method": "ngram",
    "num_speculative_tokens": k, "proposer_cls": NgramProposer})`.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, chunks: list[ScheduledChunk], limits: list[int]) -> list[Draft]:
        """One guess per decode, each at most its limit long (may be empty). Deterministic,
        whatever the row: q is one-hot at each guess."""
        return [Draft(self.lookup(c.history(), k)) for c, k in zip(chunks, limits, strict=True)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """At most k tokens: those that followed the latest earlier match of the last n
        tokens (`latest_earlier_match`), for n from max_n down to min_n, the first n that
        matches winning: a longer matching context is a better predictor. n never exceeds
        len(token_ids) - 1 (an earlier match needs room). [] when no n matches."""
        # >>> solution
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = latest_earlier_match(token_ids, n)
            if start is not None:
                return token_ids[start + n : start + n + k]
        return []
        # <<< solution


# <<< exercise
