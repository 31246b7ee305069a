"""Response bodies in OpenAI's shapes: whole responses, streamed chunks, usage, logprobs.

Completions and chat differ only in how one choice is written (`text` or a `message`,
and their logprob formats), so each is a small `ChoiceFormat` and the rest is shared.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from minserve.model.tokenizer import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


TokenLogprobs = dict[int, float]  # token id -> logprob: the token's own and the top ones


@dataclass(frozen=True)
class PromptEcho:
    """A prompt shown before its choice's output (/v1/completions' `echo`): its text (None
    when given as token ids) and, with logprobs, its tokens' (None for the first token)."""

    text: str | None
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None


@dataclass(frozen=True)
class Piece:
    """New output of one choice since the last chunk (or all of it, when not streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt: PromptEcho | None = None  # echo: the choice's first piece starts with its prompt


class ChoiceFormat:
    """How a choice reads in one endpoint; subclasses fill in the endpoint's shape."""

    object: str
    chunk_object: str

    def __init__(self, tokenizer: Tokenizer, top_logprobs: int, token_ids: bool = False) -> None:
        self.tokenizer, self.top_logprobs = tokenizer, top_logprobs
        self.token_ids = token_ids  # return_token_ids: choices list theirs, and the prompt's

    def ids(self, piece: Piece) -> dict:
        """{"token_ids": the ids behind the piece's text} with return_token_ids, else {}."""
        return {"token_ids": list(piece.token_ids)} if self.token_ids else {}

    def prompt_token_ids(self, prompts: list[list[int]]) -> dict:
        """{"prompt_token_ids": ...} with return_token_ids (one prompt's ids; a batch's, one
        list per prompt), else {}."""
        if not self.token_ids:
            return {}
        lists = [list(ids) for ids in prompts]
        return {"prompt_token_ids": lists[0] if len(lists) == 1 else lists}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def choice(self, piece: Piece) -> dict:
        raise NotImplementedError

    def chunk_choice(self, piece: Piece, first: bool) -> dict:
        raise NotImplementedError

    def body(self, response_id: str, model: str, object_: str, **fields) -> dict:
        return {"id": response_id, "object": object_, "created": int(time.time()),
                "model": model, **fields}  # fmt: skip


class CompletionFormat(ChoiceFormat):
    """/v1/completions: `text`, legacy logprobs (tokens, token_logprobs, top_logprobs)."""

    object, chunk_object = "text_completion", "text_completion"

    def choice(self, piece: Piece) -> dict:
        return {"index": piece.index, "text": self.text(piece), "logprobs": self.logprobs(piece),
                "finish_reason": piece.finish_reason, "stop_reason": piece.stop_reason,
                **self.ids(piece)}  # fmt: skip

    def chunk_choice(self, piece: Piece, first: bool) -> dict:
        return {"index": piece.index, "text": self.text(piece), "logprobs": self.logprobs(piece),
                "finish_reason": piece.finish_reason, **self.ids(piece)}  # fmt: skip

    def text(self, piece: Piece) -> str:
        """The piece's text, after its prompt's when it echoes one."""
        if piece.prompt is None:
            return piece.text
        prompt = piece.prompt.text
        if prompt is None:
            prompt = self.tokenizer.decode(piece.prompt.token_ids, skip_special_tokens=False)
        return prompt + piece.text

    def logprobs(self, piece: Piece) -> dict | None:
        """OpenAI's legacy logprobs; an echoed prompt's tokens come first (the first one's
        logprob and top logprobs null: nothing predicts it)."""
        if piece.logprobs is None:
            return None
        token_ids = piece.token_ids
        logprobs: list[TokenLogprobs | None] = list(piece.logprobs)
        if piece.prompt is not None and piece.prompt.logprobs is not None:
            token_ids = piece.prompt.token_ids + token_ids
            logprobs = piece.prompt.logprobs + logprobs
        tokens = [self.token_text(t) for t in token_ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[t] for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [None if lp is None else self._top(lp) for lp in logprobs],
            "text_offset": offsets,
        }

    def _top(self, logprobs: TokenLogprobs) -> dict[str, float]:
        return {self.token_text(t): v for t, v in sorted(logprobs.items(), key=lambda kv: -kv[1])}


class ChatFormat(ChoiceFormat):
    """/v1/chat/completions: an assistant `message` (or `delta`), logprobs per content token."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def choice(self, piece: Piece) -> dict:
        message = {"role": "assistant", "content": piece.text}
        return {"index": piece.index, "message": message, "logprobs": self.logprobs(piece),
                "finish_reason": piece.finish_reason, "stop_reason": piece.stop_reason,
                **self.ids(piece)}  # fmt: skip

    def chunk_choice(self, piece: Piece, first: bool) -> dict:
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        return {"index": piece.index, "delta": delta, "logprobs": self.logprobs(piece),
                "finish_reason": piece.finish_reason, **self.ids(piece)}  # fmt: skip

    def logprobs(self, piece: Piece) -> dict | None:
        if piece.logprobs is None:
            return None
        return {"content": [self._entry(t, lp) for t, lp in zip(piece.token_ids, piece.logprobs)]}

    def _entry(self, token_id: int, logprobs: dict[int, float]) -> dict:
        top = sorted(logprobs.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
        return {**self._token(token_id, logprobs[token_id]),
                "top_logprobs": [self._token(t, v) for t, v in top]}  # fmt: skip

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
