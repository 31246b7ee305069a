"""The router's own failure: a replica broke after it accepted the request."""

from __future__ import annotations

from minserve.server.errors import APIError


class GatewayError(APIError):
    """502: the chosen replica broke after it accepted the request, and the request could
    not be sent again (no resend left, or no replica to send it to)."""

    def __init__(self, message: str) -> None:
        super().__init__(502, message, code="bad_gateway")

    def body(self) -> dict:
        body = super().body()
        body["error"]["type"] = "server_error"
        return body
