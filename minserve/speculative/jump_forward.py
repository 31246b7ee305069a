"""Jump-forward decoding (SGLang's idea) as a proposer: draft what the grammar forces.

Where a structured output's grammar admits one continuation for several characters (a
JSON schema's `"name": ` after a comma), decoding them one forward each is waste. The
grammar's matcher knows the forced text (`forced_tokens`: the text, in the tokenizer's
spelling); this proposer drafts those tokens, and the target verifies them in one forward
like any draft. Verification keeps the engine exact: greedy output is the text the model
writes under the mask token for token, and where the model would spell the forced text in
other tokens ("na" + "me" instead of "name"), the draft stops being kept there.
Sequences without a grammar get no drafts.
"""

from __future__ import annotations

from minserve.messages import ScheduledChunk
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.draft import Draft


class JumpForwardProposer:
    """Drafts each constrained sequence's forced tokens, at most its limit."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, chunks: list[ScheduledChunk], limits: list[int]) -> list[Draft]:
        drafts = []
        for chunk, limit in zip(chunks, limits, strict=True):
            matcher = chunk.samples[0].constraint  # the sample's own (a TokenMatcher)
            forced = [] if matcher is None else matcher.forced_tokens()  # type: ignore[attr-defined]
            drafts.append(Draft(forced[:limit]))
        return drafts
