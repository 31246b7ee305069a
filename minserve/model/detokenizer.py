"""Text out of a token stream, one token at a time: vLLM-style incremental detokenization.

Decoding each new token on its own goes wrong twice over. A byte-level token can hold part of a
UTF-8 character (an emoji is often two to four tokens), and some decoders change a token's text
depending on what comes before it (sentencepiece drops the space of the first token it decodes).
So each step decodes a short window of recent tokens twice, without and with the new token, and
emits only the difference. A window whose text ends in U+FFFD is waiting for the rest of a
character: emit nothing yet, and keep the token in the window. A token that adds no text (a
skipped special token, a padding id past the tokenizer's vocabulary) emits nothing.

    tokens:  ... | prefix_offset ... read_offset | new tokens
                   (already emitted, for context)   (not yet emitted)
"""

from __future__ import annotations

from collections.abc import Sequence

from minserve.model.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text deltas that never split a character.

    Invariant: `"".join(deltas) + flush()` equals `tokenizer.decode(output_ids)` when the
    tokenizer's decode is a plain concatenation (byte-level BPE) and the prompt ends on a
    character boundary.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.prefix_offset = max(len(self.token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(self.token_ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is open)."""
        self.token_ids.append(token_id)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """At the end: release held-back bytes (they decode as U+FFFD, as `decode` shows them)."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token
        if hold_incomplete and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._text += delta
        return delta

    def _decode(self, start: int, stop: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:stop], self.skip_special_tokens)
