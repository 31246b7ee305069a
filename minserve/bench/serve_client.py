"""One streamed request to any OpenAI-compatible server, timed as vLLM's benchmark times it.

The clock starts just before the request is sent; each SSE chunk that carries a choice is a
token event, with text or without (a token whose text the server holds back, such as half
a UTF-8 character): the first is TTFT, the gaps between them are ITLs, vLLM's definitions.
Token counts come from the server's `usage` (stream_options.include_usage), which vLLM and
minserve both send.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from minserve.bench.serve_metrics import RequestRecord, request_timings


@dataclass(frozen=True)
class Endpoint:
    """Where to send requests and as which model."""

    base_url: str  # e.g. http://127.0.0.1:8000 (without /v1)
    model: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def completion_body(endpoint: Endpoint, prompt: list[int], output_len: int) -> dict:
    return {**_common(endpoint, output_len), "prompt": prompt}


def chat_body(endpoint: Endpoint, messages: list[dict[str, str]], output_len: int) -> dict:
    return {**_common(endpoint, output_len), "messages": messages}


def _common(endpoint: Endpoint, output_len: int) -> dict:
    return {"model": endpoint.model, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def send(
    client: httpx.AsyncClient, endpoint: Endpoint, body: dict
) -> tuple[RequestRecord, str]:
    """POST one streamed request; return its record and the generated text."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    record, pieces = RequestRecord(), []
    start = record.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", endpoint.base_url + path, json=body,
                                 headers=endpoint.headers) as response:  # fmt: skip
            record.status = response.status_code
            if response.status_code != 200:  # a 503 under overload: it met no SLO
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record, ""
            async for line in response.aiter_lines():
                chunk = _parse(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    record.error = str(chunk["error"])
                    return record, ""
                now = time.perf_counter()
                if chunk.get("choices"):  # a token event (its text may be empty)
                    record.chunk_at.append(now)
                    pieces.append(_text(chunk))
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    record.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
        return record, ""
    record.success = bool(record.chunk_at)
    if not record.success:
        record.error = "the stream ended without a chunk with choices (no first token)"
        return record, ""
    record.ttft, record.itl, record.latency = request_timings(start, record.chunk_at)
    if not record.output_tokens:  # a server without usage: count chunks
        record.output_tokens = len(record.chunk_at)
    return record, "".join(pieces)


def _parse(line: str) -> dict | None:
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    return None if data == "[DONE]" else json.loads(data)


def _text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""
