"""From cumulative engine outputs to what a client has not seen yet.

The engine reports each request's whole output so far; a stream sends only the new part.
`DeltaTracker` remembers, per choice, how much text and how many tokens were sent.
Every step that produced tokens sends a piece, as vLLM does: text held back by the
detokenizer (half a UTF-8 character, a possible stop string) makes a piece with the new
token ids and logprobs but empty text; the text follows with a later piece. So a client
sees each token when it was sampled (TTFT and ITL as vLLM's `bench serve` measures them).
"""

from __future__ import annotations

from dataclasses import dataclass

from minserve.outputs import CompletionOutput, RequestOutput
from minserve.server.responses import Piece


@dataclass
class Sent:
    """What one choice's stream has sent so far."""

    chars: int = 0  # of the choice's text
    tokens: int = 0  # of its token ids (and logprobs)
    finished: bool = False  # its finish_reason went out: nothing more to send
    started: bool = False  # its first piece went out (chat: that one carries the role)


class DeltaTracker:
    """New pieces of every choice; choice index = prompt index * n + sample index."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._sent: dict[int, Sent] = {}
        self.latest: dict[int, RequestOutput] = {}  # prompt index -> its newest output

    def update(self, prompt_index: int, output: RequestOutput) -> list[tuple[Piece, bool]]:
        """(piece, is the choice's first piece) for every choice with something new."""
        self.latest[prompt_index] = output
        pieces = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            sent = self._sent.setdefault(index, Sent())
            piece = new_piece(index, completion, sent)
            if piece is not None:
                pieces.append((piece, not sent.started))
                sent.started = True
        return pieces

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for out in self.latest.values() for c in out.outputs)

    def prompt_tokens(self) -> int:
        return sum(len(out.prompt_token_ids) for out in self.latest.values())


# >>> exercise 9.2: from cumulative outputs to streamed pieces
def new_piece(index: int, completion: CompletionOutput, sent: Sent) -> Piece | None:
    """The part of `completion` (the choice's whole output so far) not sent yet, as the
    Piece for choice `index`; None when there is nothing new or the choice has finished.

    A piece carries the new text, the new token ids and their logprobs (None if the
    request asked for none), and the finish and stop reasons. There is a piece whenever
    there are new tokens, even when their text is empty (the detokenizer holds back half a
    UTF-8 character), and when the choice has just finished (the piece carries the finish
    reason). Update `sent` as you go: chars, tokens, and finished once the finish reason
    is out (`started` is the caller's).
    """
    # >>> solution
    if sent.finished:
        return None
    text = completion.text[sent.chars :]
    finishing = completion.finish_reason is not None
    if not text and len(completion.token_ids) == sent.tokens and not finishing:
        return None  # nothing new (another choice of the same prompt moved)
    logprobs = completion.logprobs
    piece = Piece(
        index=index,
        text=text,
        token_ids=completion.token_ids[sent.tokens :],
        logprobs=None if logprobs is None else logprobs[sent.tokens :],
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )
    sent.chars, sent.tokens = len(completion.text), len(completion.token_ids)
    sent.finished = finishing
    return piece
    # <<< solution


# <<< exercise


def whole_pieces(outputs: dict[int, RequestOutput], n: int) -> list[Piece]:
    """Every choice complete, in index order (a non-streaming response)."""
    return [
        Piece(p * n + c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
        for p in sorted(outputs)
        for c in outputs[p].outputs
    ]
