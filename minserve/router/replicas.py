"""The router's view of its replicas: address, requests in flight, health, counts.

A replica that refuses a connection is marked down for `cooldown_s` and skipped; after
that it is tried again (a successful `/health` probe brings it back at once).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minserve.router.stall_histogram import StallHistogram

PREFIX = "minserve_router:"


@dataclass
class Replica:
    """One `minserve serve` (or any OpenAI-compatible server) behind the router."""

    url: str  # e.g. http://127.0.0.1:8001, without /v1
    in_flight: int = 0
    down_until: float = 0.0  # time.monotonic() before which the replica is skipped
    last_error: str = ""
    routed: Counter[str] = field(default_factory=Counter)  # requests sent, by reason
    matched_units: int = 0  # prompt units the router expected this replica to hold
    expected_blocks: Counter[str] = field(default_factory=Counter)  # kv_aware, by medium
    errors: int = 0  # connections refused or broken
    resumes: int = 0  # streams continued here after their replica failed mid-stream
    resumed_tokens: int = 0  # generated tokens those streams carried over
    broken_streams: int = 0  # streams that failed here and could not be continued

    def is_up(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.down_until

    def mark_down(self, error: Exception, cooldown_s: float) -> None:
        self.errors += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self.down_until = time.monotonic() + cooldown_s

    def mark_up(self) -> None:
        self.down_until = 0.0


def parse_replica_url(url: str) -> str:
    """`http(s)://host:port` without a trailing slash or /v1; anything else is refused."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


class _RouterCollector(Collector):
    """Per-replica counts and gauges, read from the replicas at scrape time; the stalls of
    resumed streams."""

    def __init__(
        self, replicas: list[Replica], catchups: Sequence[Counter[str]], stalls: StallHistogram
    ) -> None:
        self.replicas, self.catchups, self.stalls = replicas, catchups, stalls

    def collect(self) -> Iterator[Metric]:
        routed = CounterMetricFamily(
            PREFIX + "requests_routed", "Requests sent to a replica, by the policy's reason",
            labels=["replica", "reason"],
        )  # fmt: skip
        matched = CounterMetricFamily(
            PREFIX + "prefix_matched_units", "Prompt units (chars or tokens) the router "
            "expected the chosen replica to hold", labels=["replica"],
        )  # fmt: skip
        blocks = CounterMetricFamily(
            PREFIX + "expected_block_hits", "KV blocks of routed prompts the chosen replica "
            "said it holds (kv_aware), by medium", labels=["replica", "medium"],
        )  # fmt: skip
        catchups = CounterMetricFamily(
            PREFIX + "kv_feed_catchups", "Times the KV event feed caught up with a replica: "
            "replay (missed batches), resync (a snapshot), reset (it restarted)",
            labels=["replica", "kind"],
        )  # fmt: skip
        errors = CounterMetricFamily(
            PREFIX + "replica_errors", "Connections to a replica that failed", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "requests_in_flight", "Requests in flight to a replica", labels=["replica"]
        )
        up = GaugeMetricFamily(PREFIX + "replica_up", "1 if the replica is routed to, 0 if "
                               "skipped after an error", labels=["replica"])  # fmt: skip
        resumes = CounterMetricFamily(
            PREFIX + "stream_resumes", "Streams continued on this replica after their replica "
            "failed mid-stream", labels=["replica"],
        )  # fmt: skip
        carried = CounterMetricFamily(
            PREFIX + "resumed_tokens", "Generated tokens carried over to this replica by "
            "resumed streams (its resume_token_ids)", labels=["replica"],
        )  # fmt: skip
        broken = CounterMetricFamily(
            PREFIX + "streams_broken", "Streams that failed on this replica and ended with an "
            "error event (no replica, or no resume, left)", labels=["replica"],
        )  # fmt: skip
        now = time.monotonic()
        for r, caught_up in zip(self.replicas, self.catchups, strict=True):
            for reason, count in sorted(r.routed.items()):
                routed.add_metric([r.url, reason], count)
            matched.add_metric([r.url], r.matched_units)
            for medium, count in sorted(r.expected_blocks.items()):
                blocks.add_metric([r.url, medium], count)
            for kind, count in sorted(caught_up.items()):
                catchups.add_metric([r.url, kind], count)
            errors.add_metric([r.url], r.errors)
            in_flight.add_metric([r.url], r.in_flight)
            up.add_metric([r.url], float(r.is_up(now)))
            resumes.add_metric([r.url], r.resumes)
            carried.add_metric([r.url], r.resumed_tokens)
            broken.add_metric([r.url], r.broken_streams)
        stalls = self.stalls.family(
            PREFIX + "resume_stall_seconds",
            "Seconds from a replica's failure mid-stream to the stream's next chunk from another",
        )
        yield from (routed, matched, blocks, catchups, errors, in_flight, up, resumes, carried,
                    broken, stalls)  # fmt: skip


def render_metrics(
    replicas: list[Replica], catchups: Sequence[Counter[str]] | None = None,
    stalls: StallHistogram | None = None,
) -> bytes:  # fmt: skip
    """Prometheus text for these replicas (a fresh registry: no process-wide state);
    `catchups`: per replica, the KV event feed's catch-ups by kind; `stalls`: resumed
    streams' waits."""
    registry = CollectorRegistry()
    catchups = catchups or [Counter() for _ in replicas]
    registry.register(_RouterCollector(replicas, catchups, stalls or StallHistogram()))
    return generate_latest(registry)
