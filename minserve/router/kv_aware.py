"""`kv_aware` routing: the replica that can start the request's first token soonest, judged
from what each replica says it caches (its KV events), not from what the router guessed.

For each replica that is up, an estimate in seconds (llm-d's and Dynamo's KV-aware scoring):

    prefill   (prompt tokens - tokens in blocks it holds) / prefill_tokens_per_s
  + loads     blocks held only on host x host_block_load_s + only on disk x disk_block_load_s
  + queue     requests in flight x decode_s_per_request

and the lowest wins (ties: replicas take turns). A replica that publishes no KV events is
judged by the approximate prefix index (the prompts the router sent it, as on the device).
A session goes back to the replica of its last turn while its time to live runs, unless
that replica's estimate is worse than the best by more than `session_margin_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from minserve.kvcache.kv_events import MEDIA
from minserve.router.kv_blocks import KVBlocks
from minserve.router.policy import Decision, _Turns
from minserve.router.prefix_index import PrefixIndex
from minserve.router.route_request import RouteRequest
from minserve.router.sessions import SessionTable


def _setting(default: float, text: str) -> float:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class KVAwareConfig:
    """The cost model's speeds and the session rule. The defaults fit the bundled
    SmolLM2-135M in float32 on a 2-core CPU (block size 16: a block's K and V are 0.7 MB)."""

    prefill_tokens_per_s: float = _setting(500.0, "prompt tokens a replica computes per second")
    host_block_load_s: float = _setting(0.0005, "seconds to copy one KV block from host memory "
                                        "into a replica's device pool")  # fmt: skip
    disk_block_load_s: float = _setting(0.005, "seconds to read one KV block from a replica's "
                                        "disk tier into its device pool")  # fmt: skip
    decode_s_per_request: float = _setting(0.1, "seconds each request in flight on a replica "
                                           "adds before a new request's first token")  # fmt: skip
    session_ttl_s: float = _setting(300.0, "seconds a session stays on its replica after its "
                                    "last request")  # fmt: skip
    session_margin_s: float = _setting(0.5, "seconds a session's replica may be slower than the "
                                       "best before the session moves")  # fmt: skip

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        negative = [f.name for f in fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"kv_aware settings must be >= 0: {', '.join(negative)}")


@dataclass(frozen=True)
class Estimate:
    """One replica's expected time to first token, and the cache behind it."""

    seconds: float
    cached_tokens: int  # prompt tokens it holds (exact, or guessed where it has no events)
    blocks: dict[str, int]  # blocks found, per medium: "device", then host only, disk only


class KVAware:
    """Lowest estimated time to first token, from the replicas' KV events; sticky sessions."""

    name = "kv_aware"

    def __init__(
        self, blocks: KVBlocks, config: KVAwareConfig = KVAwareConfig(),
        guesses: PrefixIndex | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """`guesses`: the prefix index for replicas without events (over token ids)."""
        self.blocks, self.config = blocks, config
        self.guesses = PrefixIndex(blocks.num_replicas) if guesses is None else guesses
        self.sessions = SessionTable(config.session_ttl_s, clock)
        self._turns = _Turns()

    def estimate(self, request: RouteRequest, replica: int, load: int, guessed: int) -> Estimate:
        """`replica`'s estimate with `load` requests in flight; `guessed`: the tokens the
        prefix index believes it holds (used only when it publishes no events)."""
        c = self.config
        prompt = len(request.token_ids or ())
        held = self.blocks.match(replica, request.block_keys)
        if held is None:
            cached, blocks, loads_s = min(guessed, prompt), {}, 0.0
        else:
            device, host, disk = (held.blocks[m] for m in MEDIA)
            cached = min(disk * held.block_size, prompt)
            blocks = {"device": device, "host": host - device, "disk": disk - host}
            loads_s = blocks["host"] * c.host_block_load_s + blocks["disk"] * c.disk_block_load_s
        seconds = (prompt - cached) / c.prefill_tokens_per_s + loads_s
        return Estimate(seconds + load * c.decode_s_per_request, cached, blocks)

    def choose_request(
        self, request: RouteRequest, loads: Sequence[int], candidates: Sequence[int]
    ) -> Decision:
        """The candidate with the lowest estimate, reason "kv" ("least_loaded" when it holds
        nothing of the prompt); the session's replica instead, reason "session", while it is
        within `session_margin_s` of that."""
        guessed = self._guesses(request)
        estimates = {r: self.estimate(request, r, loads[r], guessed[r]) for r in candidates}
        best = min(self._turns.order(candidates), key=lambda r: estimates[r].seconds)
        home = self.sessions.replica(request.session)
        if home in estimates:
            if estimates[home].seconds <= estimates[best].seconds + self.config.session_margin_s:
                return _decision(home, "session", estimates[home])
        return _decision(best, "kv" if estimates[best].cached_tokens else "least_loaded",
                         estimates[best])  # fmt: skip

    def record_request(self, request: RouteRequest, replica: int) -> None:
        self.sessions.touch(request.session, replica)
        if request.token_ids:
            self.guesses.insert(request.token_ids, replica)

    def _guesses(self, request: RouteRequest) -> list[int]:
        if not request.token_ids:
            return [0] * self.blocks.num_replicas
        return self.guesses.match(request.token_ids)


def _decision(replica: int, reason: str, estimate: Estimate) -> Decision:
    return Decision(replica, reason, estimate.cached_tokens, estimate.blocks)
