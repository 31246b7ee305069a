"""Serving metrics with vLLM's `bench serve` definitions, from per-request timestamps.

TTFT     first chunk with a choice - request sent (its text may be empty: a held-back token)
ITL      gaps between consecutive chunks with a choice (one list over all requests)
TPOT     (E2E - TTFT) / (output tokens - 1), for requests with more than one token
E2E      last chunk - request sent
request throughput = completed / duration;  output throughput = output tokens / duration
goodput  = requests meeting every SLO (`ttft:ms`, `tpot:ms`, `e2el:ms`) / duration;
           a one-token request counts TPOT as 0, as vLLM does; a failed request (a 503 the
           server answered under overload among them: `refused`) meets none
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds, from time.perf_counter)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    success: bool = False
    error: str = ""
    status: int = 0  # the HTTP status (0: no response); a 503 is a request the server refused

    turn: int = 0  # which turn of its session (0: the first)
    sent_at: float = 0.0  # when the request went out
    chunk_at: list[float] = field(default_factory=list)  # when each chunk with a choice came

    @property
    def tpot(self) -> float:
        """Decode time per token after the first; 0 with one token or fewer (vLLM)."""
        return time_per_output_token(self.ttft, self.latency, self.output_tokens)


# >>> exercise 9.1: TTFT, ITL and TPOT from timestamps
def request_timings(sent_at: float, chunk_at: Sequence[float]) -> tuple[float, list[float], float]:
    """(TTFT, ITL gaps, E2E latency) of a request sent at `sent_at` whose chunks with a
    choice arrived at `chunk_at` (ascending, at least one; seconds from one clock).

    TTFT runs from sending to the first chunk, each ITL gap between two consecutive
    chunks, E2E from sending to the last chunk.
    """
    # >>> solution
    if not chunk_at:
        raise ValueError("a request without a chunk has no timings (it never got a token)")
    gaps = [later - earlier for earlier, later in zip(chunk_at, chunk_at[1:])]
    return chunk_at[0] - sent_at, gaps, chunk_at[-1] - sent_at
    # <<< solution


def time_per_output_token(ttft: float, latency: float, output_tokens: int) -> float:
    """TPOT: the decode time after the first token, per token after the first.

    A request with one output token (or none) has no decode: its TPOT is 0, as in vLLM.
    """
    # >>> solution
    if output_tokens <= 1:
        return 0.0
    return (latency - ttft) / (output_tokens - 1)
    # <<< solution


# <<< exercise


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:1000", "tpot:100"] -> {"ttft": 1.0, "tpot": 0.1} (seconds); names checked."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(SLO_METRICS)}; "
                             f"got {item!r}")  # fmt: skip
        try:
            ms = float(value)
        except ValueError as e:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of ms") from e
        if ms <= 0:
            raise ValueError(f"--goodput {name}: the SLO must be positive, got {ms} ms")
        slos[name] = ms / 1000
    return slos


# >>> exercise 9.2: goodput at an SLO
def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO it is held to: {"ttft" | "tpot" | "e2el": seconds}.

    A value equal to its limit meets it; the request's E2E latency is `record.latency`.
    """
    # >>> solution
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    return all(values[name] <= limit for name, limit in slos.items())
    # <<< solution


def request_goodput(
    records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float]
) -> float:
    """Goodput (DistServe): completed requests that met every SLO, per second of the run.

    A failed request (`record.success` False) never counts, whatever its timings.
    """
    # >>> solution
    return sum(r.success and meets_slos(r, slos) for r in records) / duration_s
    # <<< solution


# <<< exercise


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and the asked percentiles, in milliseconds (0 when empty, as vLLM)."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000 if len(values_s) else np.zeros(1)
    stats = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    stats.update({f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})
    return stats


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float],
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict:  # fmt: skip
    """Everything `bench serve` reports, from the records of one run."""
    done = [r for r in records if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "refused": sum(r.status == 503 for r in records),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "request_goodput": request_goodput(records, duration_s, slos) if slos else None,
        "slos_ms": {name: s * 1000 for name, s in slos.items()},
        "ttft_ms": distribution([r.ttft for r in done], percentiles),
        "tpot_ms": distribution([r.tpot for r in done if r.output_tokens > 1], percentiles),
        "itl_ms": distribution([gap for r in done for gap in r.itl], percentiles),
        "e2el_ms": distribution([r.latency for r in done], percentiles),
    }
