"""What a live migration costs a stream: the longest gap between its tokens, pre-copy against
stop-and-copy (Llumnix).

For one context length, one request decodes on a decode instance of a
`DisaggregatedEngine` and moves twice: to the other decode instance by multi-stage
pre-copy, then back by stop-and-copy (one final stage: every block sent while the request
waits). The client sees tokens when the proxy's step returns them, so the gaps between the
request's deltas there are the gaps it sees. Reported per migration: the longest gap from
the order until a token comes from the destination, the final stage's pause measured at the
source, the blocks moved; and, as the yardstick, the median gap while nothing migrates (one
decode step and the round's messages).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minserve.disagg.migration import PRE_COPY, STOP_AND_COPY, StagePolicy
from minserve.disagg.proxy_engine import DisaggregatedEngine
from minserve.sampling_params import SamplingParams

REQUEST_ID = "migrating"


@dataclass(frozen=True)
class MigrationGap:
    """One migration of the request: what the client saw and what it moved."""

    max_gap_s: float  # the longest gap between tokens from the order to the destination's first
    pause_s: float  # the final stage, measured at the source
    blocks_precopied: int
    blocks_final: int


@dataclass(frozen=True)
class MigrationGapRow:
    """One context length: the median gap with no migration, then both kinds of migration."""

    context_len: int
    median_step_s: float
    pre_copy: MigrationGap
    stop_and_copy: MigrationGap
    token_ids: tuple[int, ...] = ()  # every token the client received, in order


@dataclass
class _Stream:
    """The request's token arrival times at the proxy, and the migration windows."""

    times: list[float]
    windows: list[tuple[float, float]]


def synthetic_prompt(context_len: int, vocab_size: int) -> list[int]:
    """`context_len` token ids spread over the vocabulary (no special tokens below 100)."""
    return [(97 * i + 31) % (vocab_size - 100) + 100 for i in range(context_len)]


def measure_migration_gaps(
    cluster: DisaggregatedEngine,
    context_len: int,
    settle_tokens: int = 8,
    max_tokens: int = 128,
    pre_copy: StagePolicy = PRE_COPY,
) -> MigrationGapRow:
    """Decode one request of `context_len` prompt tokens, migrate it twice (pre-copy, then
    stop-and-copy back), `settle_tokens` tokens apart; the gaps its client saw.

    The cluster needs two decode instances with room for the context on each, and nothing
    else in flight."""
    if len(cluster.topology.decode_ranks) < 2:
        label = cluster.topology.label
        raise ValueError(f"migration needs two decode instances; the cluster is {label}")
    prompt = synthetic_prompt(context_len, cluster.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    cluster.add_request(REQUEST_ID, None, prompt, params)
    stream = _Stream([], [])
    gaps = [_migrate(cluster, stream, settle_tokens, p) for p in (pre_copy, STOP_AND_COPY)]
    received = tuple(cluster.requests[REQUEST_ID].token_ids)
    cluster.abort_request(REQUEST_ID)
    while cluster.has_unfinished_requests():
        cluster.step()
    return MigrationGapRow(context_len, _median_outside(stream), *gaps, received)


def _migrate(
    cluster: DisaggregatedEngine, stream: _Stream, settle_tokens: int, policy: StagePolicy
) -> MigrationGap:
    """Decode `settle_tokens` more tokens on a decode rank, then migrate to the other one."""
    decode = cluster.topology.decode_ranks
    settled = len(stream.times) + settle_tokens
    _step_until(cluster, stream, lambda: len(stream.times) >= settled and _where(cluster) in decode)
    stats = cluster.migrations.stats
    before = stats.blocks_precopied, stats.blocks_final, stats.committed
    source = _where(cluster)
    cluster.migrate(REQUEST_ID, decode[1] if source == decode[0] else decode[0], policy)
    start, first = time.perf_counter(), len(stream.times)
    _step_until(cluster, stream, lambda: stats.committed > before[2])
    committed_at = len(stream.times)
    _step_until(cluster, stream, lambda: len(stream.times) > committed_at)  # from the destination
    stream.windows.append((start, stream.times[-1]))
    times = [start, *stream.times[first:]]
    return MigrationGap(
        max(b - a for a, b in zip(times, times[1:])), stats.pause_s_last,
        stats.blocks_precopied - before[0], stats.blocks_final - before[1],
    )  # fmt: skip


def _where(cluster: DisaggregatedEngine) -> int | None:
    request = cluster.requests.get(REQUEST_ID)
    return None if request is None else request.location


def _step_until(cluster: DisaggregatedEngine, stream: _Stream, done: Callable[[], bool]) -> None:
    while not done():
        if REQUEST_ID not in cluster.requests:
            raise RuntimeError(
                f"the request finished before its migrations did; raise max_tokens "
                f"({len(stream.times)} tokens came)"
            )
        for output in cluster.step():
            if output.request_id == REQUEST_ID:
                stream.times.append(time.perf_counter())


def _median_outside(stream: _Stream) -> float:
    """The median gap between consecutive tokens when no migration was under way."""
    pairs = zip(stream.times, stream.times[1:])
    gaps = [b - a for a, b in pairs if not any(s <= b and a <= e for s, e in stream.windows)]
    return statistics.median(gaps)


def run_migration_bench(
    model: str | Path | None, context_lens: tuple[int, ...], **engine_options: Any
) -> list[MigrationGapRow]:
    """A 1P2D cluster of `model` (None: the bundled one); one row per context length."""
    with DisaggregatedEngine(model, "1P2D", "transfer", **engine_options) as cluster:
        return [measure_migration_gaps(cluster, n) for n in context_lens]
