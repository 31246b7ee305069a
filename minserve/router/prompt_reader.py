"""The router reads a request as a replica will: the same request models, the same tokenizer.

    /v1/completions       prompt text ─► tokenizer.encode;  token ids as they are
                          (a batch: its first prompt stands for it)
    /v1/chat/completions  messages ─► tokenizer.apply_chat_template ─► tokenizer.encode

The token ids then name the prompt's blocks, per replica root, with the engine's own key
chain (`block_key.block_keys`), so the router can look them up in its exact index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from minserve.kvcache.block_key import BlockKey, block_keys
from minserve.model.default_model import default_model_path
from minserve.model.tokenizer import Tokenizer
from minserve.router.prefix_index import prompt_key
from minserve.router.route_request import RouteRequest
from minserve.server.protocol import ChatCompletionRequest, CompletionRequest

SESSION_HEADER = "x-session-id"


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a .gguf file or a Hugging Face folder (None: the bundled model's)."""
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist; pass the served "
                                "model's .gguf file or Hugging Face folder")  # fmt: skip
    return Tokenizer.from_pretrained_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


class PromptReader:
    """Turns a request body into a `RouteRequest`: key, token ids, session, block keys."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def read(
        self, body: bytes, chat: bool, headers: Mapping[str, str], roots: Mapping[BlockKey, int]
    ) -> RouteRequest:
        """`roots`: each replica root the router follows, with its block size."""
        ids = self.token_ids(body, chat)
        keys = {} if ids is None else {root: tuple(block_keys(root, ids, size))
                                       for root, size in roots.items()}  # fmt: skip
        return RouteRequest(prompt_key(body), None if ids is None else tuple(ids),
                            session_of(body, headers), keys)  # fmt: skip

    def token_ids(self, body: bytes, chat: bool) -> list[int] | None:
        """The prompt's token ids as the replica computes them; None for a body the replica
        will refuse (it answers the client with the reason, not the router)."""
        try:
            if chat:
                request = ChatCompletionRequest.model_validate_json(body)
                messages = [m.as_template_message() for m in request.messages]
                return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
            prompt = CompletionRequest.model_validate_json(body).prompts()[0]
        except (ValidationError, ValueError, TypeError):
            return None
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def session_of(body: bytes, headers: Mapping[str, str]) -> str | None:
    """The session a request belongs to: its x-session-id header, else its "user" field."""
    if header := headers.get(SESSION_HEADER):
        return header
    try:
        user = json.loads(body).get("user")
    except (ValueError, AttributeError):
        return None
    return user if isinstance(user, str) and user else None
