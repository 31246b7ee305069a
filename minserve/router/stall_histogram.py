"""How long a resumed stream's client waited: from its replica's failure to the next chunk.

The stall is the price of continuing a stream elsewhere: the new replica must prefill the
prompt and the tokens generated so far (less what its prefix cache holds) before the next
token. A Prometheus histogram, kept by the router and rendered at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client.core import HistogramMetricFamily

STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds


class StallHistogram:
    """Counts of stalls per bucket (upper bounds in seconds), their sum and the longest."""

    def __init__(self, buckets: tuple[float, ...] = STALL_BUCKETS) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram buckets must increase, got {buckets}")
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket (+Inf)
        self.sum = 0.0
        self.longest = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.longest = max(self.longest, seconds)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """The histogram as Prometheus reads it: cumulative counts per upper bound."""
        bounds = [*(f"{b:g}" for b in self.buckets), "+Inf"]
        cumulative = [sum(self.counts[: i + 1]) for i in range(len(self.counts))]
        return HistogramMetricFamily(name, documentation, list(zip(bounds, cumulative)),
                                     sum_value=self.sum)  # fmt: skip
