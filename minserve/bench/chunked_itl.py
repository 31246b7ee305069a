"""Chunked prefill (Sarathi-Serve) measured: what long prompts do to the running streams.

A few requests decode steadily (the streams) while long prompts keep arriving. Without
chunking, a long prompt's whole prefill runs in one step, and every stream waits that step
for its next token: a stall. With chunked prefill, the prompt is cut to fit a token budget
(`max_num_batched_tokens`) and shares many short steps with the decodes.

Both configurations run the same requests through `LLMEngine.step()` (a `StepTrace`); a
long prompt arrives every `arrival_every` steps, that is, after the same number of stream
tokens whatever the configuration, so every run does exactly the same work and greedy
outputs can be compared token for token. Inter-token latency (ITL, vLLM's `bench serve`
definition) is the time between consecutive tokens of a stream, pooled over the streams;
throughput is tokens over engine time (the sum of step durations).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from minserve.sampling_params import SamplingParams
from minserve.viz.step_trace import Arrival, StepTrace, fastest_runs, trace_engine

PERCENTILES = (50, 90, 99)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # how steps are timed
STREAM, LONG = "stream", "long"


@dataclass(frozen=True)
class ItlWorkload:
    """Streams that decode steadily, and long prompts that arrive while they do."""

    num_streams: int = 12
    stream_prompt_len: int = 64
    stream_output_len: int = 96
    num_long: int = 3
    long_prompt_len: int = 2048
    long_output_len: int = 16
    first_arrival: int = 8  # the step before which the first long prompt arrives
    arrival_every: int = 30  # steps between long prompts
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        last = self.long_arrival_steps[-1]
        if last >= self.stream_output_len:
            raise ValueError(
                f"the last long prompt arrives at step {last}, after the streams' "
                f"{self.stream_output_len} tokens; raise stream_output_len or arrive sooner"
            )

    @property
    def stream_ids(self) -> list[str]:
        return [f"{STREAM}{i}" for i in range(self.num_streams)]

    def arrivals(self, vocab_size: int) -> list[Arrival]:
        """The requests, seeded: random token ids, EOS ignored, greedy."""
        rng = random.Random(self.seed)

        def request(request_id: str, prompt_len: int, output_len: int, step: int) -> Arrival:
            ids = tuple(rng.randrange(vocab_size) for _ in range(prompt_len))
            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            return Arrival(request_id, ids, params, step)

        streams = [
            request(r, self.stream_prompt_len, self.stream_output_len, 0) for r in self.stream_ids
        ]
        longs = [
            request(f"{LONG}{j}", self.long_prompt_len, self.long_output_len, step)
            for j, step in enumerate(self.long_arrival_steps)
        ]
        return streams + longs

    @property
    def long_arrival_steps(self) -> list[int]:
        return [self.first_arrival + j * self.arrival_every for j in range(self.num_long)]

    def kv_blocks(self, block_size: int = 16) -> int:
        """KV blocks for every request at its longest, all at once: no preemption."""
        stream = -(-(self.stream_prompt_len + self.stream_output_len) // block_size)
        long = -(-(self.long_prompt_len + self.long_output_len) // block_size)
        return self.num_streams * stream + self.num_long * long

    def min_unchunked_budget(self) -> int:
        """Without chunking, one step must hold a whole long prompt plus every decode."""
        return self.long_prompt_len + self.num_streams + self.num_long


@dataclass(frozen=True)
class ItlConfig:
    """One engine configuration to compare: chunked prefill or not, and the token budget."""

    enable_chunked_prefill: bool
    max_num_batched_tokens: int

    @property
    def name(self) -> str:
        mode = "chunked" if self.enable_chunked_prefill else "unchunked"
        return f"{mode}-{self.max_num_batched_tokens}"


@dataclass(frozen=True)
class ItlResult:
    """One configuration's run: the streams' ITL, throughput, and how the steps looked."""

    name: str
    enable_chunked_prefill: bool
    max_num_batched_tokens: int
    itl_ms: dict[str, float]  # p50, p90, p99, max, mean over every gap of every stream
    num_itl_samples: int
    output_tokens: int
    total_tokens: int  # prompt tokens + output tokens
    seconds: float  # engine time: the sum of step durations
    num_steps: int
    max_step_tokens: int  # the largest step: at most the budget
    mixed_steps: int  # steps running a prefill chunk and decodes together
    num_preemptions: int
    long_ttft_s: float  # mean time to first token of the long prompts
    example_stream: dict[str, list[float]]  # one stream's token times (s) and ITLs (ms)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return self.total_tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
            "total_tokens_per_s": round(self.total_tokens_per_s, 2),
        }


def itl_summary(gaps_s: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 / max / mean of inter-token gaps, in ms (numpy's linear percentiles)."""
    if not gaps_s:
        raise ValueError("no inter-token gaps: the streams need at least two tokens each")
    ms = np.asarray(gaps_s) * 1000
    stats = {f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}
    return {**stats, "max": float(ms.max()), "mean": float(ms.mean())}


def stream_gaps(trace: StepTrace, stream_ids: Sequence[str]) -> list[float]:
    """Every inter-token gap (seconds) of every stream, pooled."""
    return [gap for r in stream_ids for gap in trace.inter_token_latencies(r)]


def summarize(config: ItlConfig, trace: StepTrace, workload: ItlWorkload) -> ItlResult:
    """The numbers of one configuration's trace."""
    gaps = stream_gaps(trace, workload.stream_ids)
    longs = [r for r in trace.request_ids if r.startswith(LONG)]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in trace.outputs.values())
    example = workload.stream_ids[0]
    return ItlResult(
        name=config.name,
        enable_chunked_prefill=config.enable_chunked_prefill,
        max_num_batched_tokens=config.max_num_batched_tokens,
        itl_ms=itl_summary(gaps),
        num_itl_samples=len(gaps),
        output_tokens=trace.num_generated,
        total_tokens=prompt_tokens + trace.num_generated,
        seconds=trace.wall_time,
        num_steps=len(trace.steps),
        max_step_tokens=max(step.num_tokens for step in trace.steps),
        mixed_steps=sum(_is_mixed(step.scheduled) for step in trace.steps),
        num_preemptions=trace.num_preemptions,
        long_ttft_s=float(np.mean([trace.time_to_first_token(r) for r in longs])),
        example_stream={
            "token_times_s": trace.token_times(example),
            "itl_ms": [1000 * g for g in trace.inter_token_latencies(example)],
        },
    )


def _is_mixed(scheduled: Sequence[Any]) -> bool:
    return any(w.is_decode for w in scheduled) and any(not w.is_decode for w in scheduled)


def run_configs(
    make_engine: Callable[[ItlConfig], Any],
    configs: Sequence[ItlConfig],
    workload: ItlWorkload,
    vocab_size: int,
    repeats: int = 1,
    on_run: Callable[[str], None] | None = None,
    clock: str = "wall",
) -> tuple[list[ItlResult], dict[str, list[list[int]]]]:
    """Run every configuration (`repeats` times, taking turns, fastest step kept); the results
    and each configuration's greedy tokens, request by request.

    clock "wall" times steps as a user sees them; "cpu" counts only this process's CPU time,
    which other jobs on a shared machine disturb far less (the same thing with one thread on
    an idle machine).
    """
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; choose one of {', '.join(CLOCKS)}")
    arrivals = workload.arrivals(vocab_size)

    def run(config: ItlConfig) -> Callable[[], StepTrace]:
        def once() -> StepTrace:
            trace = trace_engine(make_engine(config), arrivals, CLOCKS[clock])
            if on_run is not None:
                on_run(config.name)
            return trace

        return once

    traces = fastest_runs({c.name: run(c) for c in configs}, repeats)
    results = [summarize(c, traces[c.name], workload) for c in configs]
    tokens = {
        name: [ids for r in trace.request_ids for ids in trace.token_ids(r)]
        for name, trace in traces.items()
    }
    return results, tokens


def comparison(results: Sequence[ItlResult]) -> dict[str, dict[str, float]]:
    """Each chunked run against the unchunked one: how much lower its p99 ITL (x), and its
    throughput as a fraction of the unchunked throughput."""
    base = next(r for r in results if not r.enable_chunked_prefill)
    return {
        r.name: {
            "p99_itl_reduction": base.itl_ms["p99"] / r.itl_ms["p99"],
            "max_itl_reduction": base.itl_ms["max"] / r.itl_ms["max"],
            "throughput_ratio": r.total_tokens_per_s / base.total_tokens_per_s,
            "long_ttft_ratio": r.long_ttft_s / base.long_ttft_s,
        }
        for r in results
        if r.enable_chunked_prefill
    }
