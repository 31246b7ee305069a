"""Where a replica publishes its KV events: what its `GET /v1/kv_events` says.

    GET /v1/kv_events -> 200 {"instance": "replica-a", "root": "<32 hex>", "block_size": 16,
                              "host": "127.0.0.1", "port": 5561, "replay_port": 5562}
                         404 when the replica publishes no KV events

`instance` names the replica's event batches (`EventBatch.instance`); `root` and
`block_size` say how to chain a prompt's block keys for it (`block_key.block_keys`); `port`
is its PUB socket and `replay_port` the socket that answers replays. A replica that restarts
answers with a new publisher: new ports, a log numbered from 0 again.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from minserve.kvcache.block_key import KEY_BYTES, BlockKey

KV_EVENTS_PATH = "/v1/kv_events"


@dataclass(frozen=True)
class KVEventSource:
    """One replica's KV event publisher, and the key chain its blocks are named by."""

    instance: str
    root: BlockKey
    block_size: int
    host: str
    port: int
    replay_port: int

    @classmethod
    def from_json(cls, raw: object) -> KVEventSource:
        """The source a `/v1/kv_events` answer describes; a ValueError names what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError(f"{KV_EVENTS_PATH} answered {type(raw).__name__}, not an object")
        try:
            source = cls(str(raw["instance"]), bytes.fromhex(raw["root"]), int(raw["block_size"]),
                         str(raw["host"]), int(raw["port"]), int(raw["replay_port"]))  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{KV_EVENTS_PATH} answered an unusable body: {error!r}") from None
        if len(source.root) != KEY_BYTES or source.block_size < 1:
            raise ValueError(
                f"{KV_EVENTS_PATH} needs a root of {KEY_BYTES} bytes and block_size >= 1, got "
                f"{len(source.root)} bytes and {source.block_size}"
            )
        return source


def fetch_source(http: httpx.Client, url: str) -> KVEventSource | None:
    """Ask the replica at `url` where it publishes; None when it publishes no KV events (404).
    A replica that is down raises httpx's error; another status raises `httpx.HTTPStatusError`."""
    response = http.get(url + KV_EVENTS_PATH)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return KVEventSource.from_json(response.json())
