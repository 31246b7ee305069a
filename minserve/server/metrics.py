"""Prometheus metrics for `GET /metrics`, with vLLM's names under the `minserve:` prefix.

Latencies are histograms observed by the engine thread as tokens come out:

    TTFT  first token time - arrival (the HTTP request reached the server)
    ITL   gap between two consecutive outputs of one request (one engine step apart)
    TPOT  (finish - first token) / (output tokens - 1): the decode speed a user sees
    E2E   finish - arrival

Engine gauges and counters (running, waiting, KV usage, preemptions, tokens, and with
speculative decoding on, drafts and accepted tokens; with a step-time or TTFT target, the
steps capped, the prefill rate and the step cost model) are read from the engine's latest
`get_metrics()` snapshot when Prometheus scrapes; the engine thread retakes it after every
change. When no request is in flight, free + evictable blocks = total blocks: a block
counted in neither is held by a request that should be gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minserve.outputs import RequestOutput

PREFIX = "minserve:"
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# engine stat -> (metric, help); gauges are read as they are, counters are totals
GAUGES = {
    "num_requests_running": ("num_requests_running", "Requests in the running batch"),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting to be scheduled"),
    "num_requests_swapped": ("num_requests_swapped", "Requests swapped out to host memory"),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)"),
    "num_free_blocks": ("kv_cache_free_blocks", "KV-cache blocks free"),
    "num_blocks": ("kv_cache_total_blocks", "KV-cache blocks in the pool"),
    "prefix_cache_evictable_blocks": ("kv_cache_evictable_blocks",
                                      "KV-cache blocks held only by the prefix cache (evictable)"),
}  # fmt: skip
COUNTERS = {
    "num_preemptions": ("num_preemptions", "Sequences preempted (recompute or swap)"),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens received"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "num_requests_finished": ("request_success", "Requests finished"),
    "num_requests_aborted": ("request_aborted", "Requests aborted (client left, or failed)"),
    "num_steps": ("engine_steps", "Engine steps run"),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "prefix_cache_preempted_queries": ("prefix_cache_preempted_queries", "Tokens looked up in "
                                       "the prefix cache by requests back from a preemption"),
    "prefix_cache_preempted_hits": ("prefix_cache_preempted_hits", "Tokens found in the prefix "
                                    "cache by requests back from a preemption"),
    "num_steps_capped": ("engine_steps_capped", "Steps that ran fewer prompt tokens than were "
                         "waiting, to keep the step-time target"),
    # the KV tiers beneath the device: hits (blocks brought back), bytes, time
    "prefix_cache_promoted_blocks": ("host_tier_hit_blocks", "Cached blocks copied back from "
                                     "the host tier"),
    "host_tier_bytes_in": ("host_tier_bytes_in", "Bytes copied back from the host tier"),
    "host_tier_bytes_out": ("host_tier_bytes_out", "Bytes demoted to the host tier"),
    "disk_tier_blocks_loaded": ("disk_tier_hit_blocks", "Cached blocks read back from the disk "
                                "tier"),
    "disk_tier_bytes_in": ("disk_tier_bytes_in", "Bytes read back from the disk tier"),
    "disk_tier_bytes_out": ("disk_tier_bytes_out", "Bytes written through to the disk tier"),
    "disk_tier_load_seconds": ("disk_tier_load_seconds", "Seconds spent reading blocks from the "
                               "disk tier for requests"),
}  # fmt: skip
# with a step-time or TTFT target (exported only then): what the engine measured
STEP_TIME_GAUGES = {
    "prefill_tokens_per_second": ("prefill_tokens_per_second",
                                  "Prompt tokens computed per second while prompts waited"),
    "step_cost_fixed_seconds": ("step_cost_fixed_seconds", "Step cost model: seconds per step"),
    "step_cost_prefill_seconds": ("step_cost_prefill_seconds",
                                  "Step cost model: extra seconds of a step with a prompt chunk"),
    "step_cost_per_token_seconds": ("step_cost_per_token_seconds",
                                    "Step cost model: seconds per token run"),
    "step_cost_per_context_token_seconds": ("step_cost_per_context_token_seconds",
                                            "Step cost model: seconds per context token"),
}  # fmt: skip
# speculative decoding (exported only when it is on): acceptance = accepted / draft tokens
SPEC_GAUGES = {
    "spec_decode_acceptance_rate": ("spec_decode_acceptance_rate",
                                    "Draft tokens accepted / draft tokens verified (0-1)"),
    "spec_decode_mean_acceptance_length": ("spec_decode_mean_acceptance_length",
                                           "Tokens gained per verification: 1 + accepted drafts"),
}  # fmt: skip
SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Sequence-steps that verified drafts"),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified"),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",
                                        "Draft tokens accepted"),
}  # fmt: skip


@dataclass
class _Timing:
    arrival: float
    first: float | None = None
    last: float | None = None
    tokens: dict[int, int] = field(default_factory=dict)  # sample index -> tokens so far


class _EngineCollector(Collector):
    """Engine gauges and counters from the latest snapshot, at scrape time."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        speculating = "spec_decode_num_draft_tokens" in self.stats
        timing = "step_cost_fitted" in self.stats  # a step-time or TTFT target is set
        gauges = {**GAUGES, **(SPEC_GAUGES if speculating else {}),
                  **(STEP_TIME_GAUGES if timing else {})}  # fmt: skip
        counters = {**COUNTERS, **(SPEC_COUNTERS if speculating else {})}
        for key, (name, text) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, text, value=self.stats.get(key, 0))
        for key, (name, text) in counters.items():
            yield CounterMetricFamily(PREFIX + name, text, value=self.stats.get(key, 0))


class ServerMetrics:
    """One server's metrics in its own registry (two servers in a process do not mix)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = self._histogram("inter_token_latency_seconds", "Time between two outputs")
        self.tpot = self._histogram("time_per_output_token_seconds", "Decode time per token")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to last token")
        self.step_failures = Counter(PREFIX + "engine_step_failures", "Engine steps that raised",
                                     registry=self.registry)  # fmt: skip
        self.request_failures = Counter(PREFIX + "request_failure", "Requests failed by a step",
                                        registry=self.registry)  # fmt: skip
        self.in_flight = Gauge(PREFIX + "num_requests_in_flight", "Requests the HTTP layer holds "
                               "(accepted, not finished or aborted); past max_num_seqs + "
                               "max_queued, new ones get 503", registry=self.registry)  # fmt: skip
        self.refused = Counter(PREFIX + "request_refused", "Requests refused at arrival (503), by "
                               "reason: capacity (past max_num_seqs + max_queued), ttft or "
                               "tpot (admission's targets)", ["reason"],
                               registry=self.registry)  # fmt: skip
        for reason in ("capacity", "ttft", "tpot"):
            self.refused.labels(reason=reason)  # exported from the start, at 0
        self._timings: dict[str, _Timing] = {}

    def count_in_flight(self, read: Callable[[], int]) -> None:
        """Read the requests in flight when scraped (they are counted outside the engine)."""
        self.in_flight.set_function(read)

    def _histogram(self, name: str, text: str) -> Histogram:
        return Histogram(PREFIX + name, text, buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        """The Prometheus text exposition format."""
        return generate_latest(self.registry)

    def set_engine_stats(self, stats: dict[str, float]) -> None:
        self._engine.stats = stats

    def arrived(self, request_id: str, arrival: float) -> None:
        self._timings[request_id] = _Timing(arrival)

    def forget(self, request_id: str) -> None:
        self._timings.pop(request_id, None)

    def step_failed(self, failed_request_ids: list[str]) -> None:
        """A step raised; these requests were answered with a 500 and dropped."""
        self.step_failures.inc()
        self.request_failures.inc(len(failed_request_ids))
        for request_id in failed_request_ids:
            self.forget(request_id)

    def observe(self, output: RequestOutput, now: float) -> None:
        """A request got new tokens at `now` (time.monotonic); `output` is the step's delta."""
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        if timing.first is None:
            timing.first = now
            self.ttft.observe(now - timing.arrival)
        else:
            self.itl.observe(now - timing.last)
        timing.last = now
        for c in output.outputs:
            timing.tokens[c.index] = timing.tokens.get(c.index, 0) + len(c.token_ids)
        if output.finished:
            del self._timings[output.request_id]
            self.e2e.observe(now - timing.arrival)
            longest = max(timing.tokens.values())
            if longest > 1:
                self.tpot.observe((now - timing.first) / (longest - 1))
