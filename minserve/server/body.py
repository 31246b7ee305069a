"""A request's JSON body, read within bounds before anything parses it.

    Content-Type    application/json, or 415 (the OpenAI API answers the same)
    size            at most max_request_bytes, or 413, counted as the body streams in
    nesting         at most MAX_JSON_DEPTH arrays and objects deep, or 400: a JSON parser
                    recurses once per level, and '[' * 50000 would exhaust Python's stack
    text            valid UTF-8 and valid JSON, or 400

Each bound is checked before the next step can cost more than the body's own size.
"""

from __future__ import annotations

import json
import re

import numpy as np
from fastapi import Request

from minserve.server.errors import APIError

# The API's bodies nest 5 deep (the body, messages, a message, its content parts, a part);
# 32 leaves room for any client and is far below where a parser's recursion is a risk.
MAX_JSON_DEPTH = 32

_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)  # a JSON string, escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def require_json(request: Request) -> None:
    """Refuse (415) a body that is not declared as JSON: a form or plain text is a mistake."""
    declared = request.headers.get("content-type", "")
    media_type = declared.split(";")[0].strip().lower()
    if media_type != "application/json":
        got = f"Content-Type {declared!r}" if declared else "no Content-Type"
        raise APIError(
            415, f"request has {got}; send the body as JSON with Content-Type: application/json",
            code="unsupported_media_type",
        )  # fmt: skip


def nesting_depth(body: bytes) -> int:
    """How deep arrays and objects nest: the most brackets open at once, strings skipped."""
    brackets = np.frombuffer(_STRING.sub(b"", body).translate(None, _NOT_BRACKETS), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0))


async def read_json_body(request: Request, max_bytes: int) -> bytes:
    """The raw body once it is known to be bounded, UTF-8 and JSON (413 or 400 if not)."""
    body = await _read_bounded(request, max_bytes)
    depth = nesting_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise APIError(
            400, f"request body nests arrays and objects {depth} levels deep; "
            f"this server accepts at most {MAX_JSON_DEPTH}", code="json_too_deep",
        )  # fmt: skip
    try:
        json.loads(body.decode("utf-8"))  # reject before pydantic: clearer messages
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}", code="invalid_utf8") from e
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        reason = str(e).split(";")[0]
        raise APIError(400, f"request body has a number too long: {reason}",
                       code="invalid_json") from e  # fmt: skip
    return body


async def _read_bounded(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(len(body), max_bytes)
    return bytes(body)


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(
        413, f"request body has {size} bytes; this server accepts at most {max_bytes}",
        code="request_too_large",
    )  # fmt: skip
