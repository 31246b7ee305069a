"""From engine deltas to numbered choices: the pieces a stream sends, and the usage counts.

Each engine step gives one delta per request that got tokens (a `RequestOutput` holding
this step's text, token ids and logprobs, `minserve/output_processor.py`). A stream sends
each delta's completions as they are, one piece per choice, numbered across the prompts of
the HTTP request: choice index = prompt index * n + sample index. A token whose text is
held back (half a UTF-8 character, a possible stop string) still makes a piece, with its
token id and empty text, so a client sees every token when it was sampled (TTFT and ITL as
vLLM's `bench serve` measures them); the text follows with a later piece. So with
`return_token_ids` a piece lists the ids of the tokens sampled in its step, whatever text it
shows, and a choice's ids over its pieces are all its generated tokens, in order.

With /v1/completions' `echo`, each choice's first piece carries its prompt (and, with
logprobs, the prompt's: they come with the request's first delta). With max_tokens 0 the
engine still runs one token (as vLLM does); `without_output` leaves it out of every delta.
"""

from __future__ import annotations

import dataclasses

from minserve.outputs import CompletionOutput, RequestOutput
from minserve.server.responses import Piece, PromptEcho


def piece_of(index: int, completion: CompletionOutput, prompt: PromptEcho | None = None) -> Piece:
    """One choice's completion (a delta, or a whole output) as the piece for choice `index`."""
    c = completion
    return Piece(index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, prompt)


def prompt_echo(output: RequestOutput) -> PromptEcho:
    """The request's prompt to echo, with its logprobs as {token id: logprob} per token."""
    logprobs = None
    if output.prompt_logprobs is not None:
        logprobs = [
            None if entry is None else {t: lp.logprob for t, lp in entry.items()}
            for entry in output.prompt_logprobs
        ]
    return PromptEcho(output.prompt, list(output.prompt_token_ids), logprobs)


def without_output(delta: RequestOutput) -> RequestOutput:
    """The delta with its completions emptied (echo with max_tokens 0: the prompt alone)."""
    empty = [
        dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])
        for c in delta.outputs
    ]
    return dataclasses.replace(delta, outputs=empty)


class ChoiceStream:
    """Numbers the deltas of one HTTP request's prompts, and counts the tokens for `usage`;
    with `echo`, a choice's first piece starts with its prompt. `resumed`: the stream
    continues one that sent the choice's first piece already (`resume_token_ids`), so no
    piece is a first one (chat's role, the echo and `prompt_token_ids` are not sent again)."""

    def __init__(self, n: int, echo: bool = False, resumed: bool = False) -> None:
        self.n = n
        self.echo = echo
        self.resumed = resumed
        self._started: set[int] = set()  # choices whose first piece went out (chat: the role)
        self._prompt_tokens: dict[int, int] = {}  # prompt index -> its length
        self.completion_tokens = 0

    def pieces(self, prompt_index: int, delta: RequestOutput) -> list[tuple[Piece, bool]]:
        """(piece, is the choice's first piece) for every completion of the delta."""
        self._prompt_tokens[prompt_index] = len(delta.prompt_token_ids)
        pieces = []
        for completion in delta.outputs:
            index = prompt_index * self.n + completion.index
            self.completion_tokens += len(completion.token_ids)
            first = index not in self._started and not self.resumed
            prompt = prompt_echo(delta) if self.echo and first else None
            pieces.append((piece_of(index, completion, prompt), first))
            self._started.add(index)
        return pieces

    @property
    def prompt_tokens(self) -> int:
        return sum(self._prompt_tokens.values())


def whole_pieces(outputs: dict[int, RequestOutput], n: int, echo: bool = False) -> list[Piece]:
    """Every choice complete, in index order (a non-streaming response); `outputs` maps each
    prompt index to its whole output (`OutputAccumulator`); `echo`: each after its prompt."""
    return [
        piece_of(p * n + c.index, c, prompt_echo(outputs[p]) if echo else None)
        for p in sorted(outputs)
        for c in outputs[p].outputs
    ]


def token_counts(outputs: dict[int, RequestOutput]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of whole outputs, for `usage`."""
    prompt = sum(len(out.prompt_token_ids) for out in outputs.values())
    completion = sum(len(c.token_ids) for out in outputs.values() for c in out.outputs)
    return prompt, completion
