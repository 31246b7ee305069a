"""A streaming request's journal: what the router needs to continue it on another replica.

A request's state is its body and the tokens generated so far (seeded draws are keyed by
position, `minserve/model/seeded_draws.py`, so that is all). The router asks each replica
for the token ids behind every chunk (`return_token_ids`, vLLM's field) and writes down,
chunk by chunk, what it relays:

    body               the client's request, as sent
    token_ids          every generated id relayed so far (the chunks' `token_ids`, joined)
    text               the text relayed so far
    id, created, ...   the stream's identity as the client first saw it

When the replica fails, `resume_body()` is the same request with `resume_token_ids`: "these
tokens are already generated; continue after them". `take` turns each chunk of the new
stream into the one the client expects: the first stream's id, no second role, no token
ids the client did not ask for, and usage counted over both streams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

Chunk = dict[str, Any]  # one streamed chunk's JSON
IDENTITY = ("id", "object", "created", "model")  # a stream's, as its first chunk says


# >>> exercise 11.4: rebuilding a request from its journal
@dataclass
class Journal:
    """One streaming request's record (one prompt, one choice: `n` 1).

    You write `resume_body` (the request to send the next replica) and `take` with
    `_take_choice` (each chunk of a stream written down, then rewritten for the client, so
    that a continued stream reads as the same one). Plug yours into the router with
    `build_router(config, journal_cls=Journal)`.
    """

    body: dict[str, Any]
    wants_token_ids: bool  # the client asked for `return_token_ids` itself
    client_resume_ids: list[int] = field(default_factory=list)  # its own resume_token_ids
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_token_ids: list[int] | None = None
    identity: dict[str, Any] | None = None  # id, object, created, model of the first chunk
    role_sent: bool = False
    finish_reason: str | None = None
    usage_sent: bool = False
    resumes: int = 0  # streams spliced in after the first

    @classmethod
    def of(cls, raw: bytes, chat: bool) -> Journal | None:
        """The journal of a streaming request; None for what cannot be continued as one
        stream (not streaming, several choices or prompts, a body the replica will refuse)."""
        try:
            body = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(body, dict) or body.get("stream") is not True or body.get("n", 1) != 1:
            return None
        if not chat and not is_one_prompt(body.get("prompt")):
            return None
        resumed = body.get("resume_token_ids", [])
        if not is_token_ids(resumed):
            return None
        return cls(body, body.get("return_token_ids") is True, list(resumed))

    @property
    def started(self) -> bool:
        """A chunk has reached the client."""
        return self.identity is not None

    @property
    def finished(self) -> bool:
        """The choice's last chunk (its finish reason) has reached the client."""
        return self.finish_reason is not None

    def upstream_body(self) -> bytes:
        """The request as first sent to a replica: with the token ids of every chunk."""
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def resume_body(self) -> bytes:
        """The request as sent to the next replica: the same body with `return_token_ids`,
        without `echo` once the stream has started (the prompt went out with the first
        chunk), and with `resume_token_ids`: the client's own resume ids, then every token
        relayed (none: no such field)."""
        # >>> solution
        body = {**self.body, "return_token_ids": True}
        if self.started:
            body.pop("echo", None)  # the prompt went out with the first chunk
        resume = self.client_resume_ids + self.token_ids
        if resume:
            body["resume_token_ids"] = resume
        return json.dumps(body).encode()
        # <<< solution

    def resumed(self) -> None:
        """A new stream takes over from here: its chunks continue this one's."""
        self.resumes += 1

    def take(self, chunk: Chunk) -> Chunk | None:
        """Write down one chunk of the current stream; return it as the client sees it
        (None: nothing left to send, a repeated role chunk).

        The first chunk ever fixes the stream's identity (`IDENTITY` keys it has); every
        chunk then carries that identity. `_take_prompt_ids` handles the prompt's ids; each
        choice goes through `_take_choice` (a chunk whose choices all vanish is None).
        Usage: note that it was sent, and once the stream has been resumed replace it with
        `_combined(usage)` (the prompt once, every generated token once)."""
        # >>> solution
        out = dict(chunk)
        if self.identity is None:
            self.identity = {k: chunk[k] for k in IDENTITY if k in chunk}
        for key, value in self.identity.items():
            if key in out:
                out[key] = value
        self._take_prompt_ids(out)
        choices = out.get("choices")
        if choices:
            out["choices"] = [c for c in map(self._take_choice, choices) if c is not None]
            if not out["choices"]:
                return None
        if isinstance(out.get("usage"), dict):
            self.usage_sent = True
            if self.resumes:
                out["usage"] = self._combined(out["usage"])
        return out
        # <<< solution

    def ending(self) -> Chunk | None:
        """The usage chunk a finished stream still owes the client (None: it owes none):
        its replica broke after the last token, before usage and [DONE]."""
        options = self.body.get("stream_options") or {}
        if self.usage_sent or options.get("include_usage") is not True:
            return None
        return {**(self.identity or {}), "choices": [], "usage": self._combined({})}

    def _take_prompt_ids(self, out: Chunk) -> None:
        """The prompt's ids come in a stream's first chunk; the client sees them once."""
        if "prompt_token_ids" not in out:
            return
        first = self.prompt_token_ids is None
        if first:
            self.prompt_token_ids = list(out["prompt_token_ids"])
        if not (first and self.wants_token_ids):
            del out["prompt_token_ids"]

    def _take_choice(self, choice: Chunk) -> Chunk | None:
        """One choice of a chunk: its prompt ids (`_take_prompt_ids`), its `token_ids` added
        to `self.token_ids` (and dropped unless the client asked for them), its finish
        reason kept, its text added to `self.text` (a completion's `text`, a chat delta's
        `content`). A chat delta's `role` goes out once: on a continued stream drop it, and
        drop the whole choice (None) when nothing else is left in it (no content, no ids,
        no logprobs, no finish reason)."""
        # >>> solution
        out = dict(choice)
        self._take_prompt_ids(out)
        ids = out.get("token_ids") or []
        self.token_ids.extend(ids)
        if not self.wants_token_ids:
            out.pop("token_ids", None)
        if out.get("finish_reason") is not None:
            self.finish_reason = out["finish_reason"]
        if not isinstance(out.get("delta"), dict):  # a completion's choice
            self.text += out.get("text") or ""
            return out
        delta = out["delta"] = dict(out["delta"])
        self.text += delta.get("content") or ""
        if "role" not in delta:
            return out
        if not self.role_sent:
            self.role_sent = True
            return out
        del delta["role"]  # a continued chat stream's opening: the client has its role
        empty = not (delta.get("content") or ids or out.get("logprobs"))
        return None if empty and out.get("finish_reason") is None else out
        # <<< solution

    def _combined(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Usage over every stream: the prompt once, each generated token once."""
        if self.prompt_token_ids is not None:
            prompt = len(self.prompt_token_ids)
        else:
            prompt = usage.get("prompt_tokens", 0)
        completion = len(self.token_ids)
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip


# <<< exercise


def is_one_prompt(prompt: object) -> bool:
    """A text or one list of token ids (a batch numbers several choices)."""
    return isinstance(prompt, str) or (bool(prompt) and is_token_ids(prompt))


def is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )
