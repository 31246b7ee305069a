"""Prefix-caching workloads and runs: shared system prompts, and multi-turn chats.

- Shared prefix (vLLM's prefix_repetition, SGLang's generated-shared-prefix): P system
  prompts of L tokens, each followed by Q questions of q tokens, in shuffled order.
  Ideally every request but each prompt's first reuses its L tokens.
- Multi-turn chat: C conversations of T turns; turn t's prompt is the whole conversation
  so far (earlier prompts and answers) plus a new user message. Ideally each turn reuses
  the previous turn's prompt and answer.

Each run drives the engine with `trace_engine` and returns a `PrefixRun`: hit rate
(cached prompt tokens / prompt tokens), time to first token, throughput, and the time
spent in the radix tree as a fraction of the step time.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

from minserve.engine import LLMEngine
from minserve.sampling_params import SamplingParams
from minserve.viz.step_trace import Arrival, StepTrace, trace_engine

EngineFactory = Callable[..., LLMEngine]  # options (enable_prefix_caching, ...) -> engine


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """P system prompts x Q questions; random token ids, fixed seed, shuffled arrivals."""

    num_prefixes: int = 4
    prefix_len: int = 512
    questions_per_prefix: int = 8
    question_len: int = 32
    output_len: int = 8
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        prefixes = [_tokens(rng, self.prefix_len, vocab_size) for _ in range(self.num_prefixes)]
        prompts = [
            prefix + _tokens(rng, self.question_len, vocab_size)
            for prefix in prefixes
            for _ in range(self.questions_per_prefix)
        ]
        rng.shuffle(prompts)
        return prompts

    @property
    def ideal_hit_rate(self) -> float:
        """Every request but the first of each prefix reuses the whole prefix."""
        hits = self.num_prefixes * (self.questions_per_prefix - 1) * self.prefix_len
        total = self.num_prefixes * self.questions_per_prefix
        return hits / (total * (self.prefix_len + self.question_len))

    def arrivals(self, vocab_size: int, tag: str = "q") -> list[Arrival]:
        params = _greedy(self.output_len)
        return [
            Arrival(f"{tag}{i}", tuple(p), params) for i, p in enumerate(self.prompts(vocab_size))
        ]


@dataclass(frozen=True)
class MultiTurnWorkload:
    """C conversations of T turns; each turn adds a user message and a generated answer."""

    conversations: int = 4
    turns: int = 4
    user_len: int = 64
    output_len: int = 16
    seed: int = 1


@dataclass
class PrefixRun:
    """What one run measured (times are engine time: the steps' wall times)."""

    name: str
    prompt_tokens: int
    cached_tokens: int
    ideal_cached_tokens: int
    output_tokens: int
    seconds: float
    ttft_s: list[float]
    upkeep_s: float
    evicted_blocks: int
    host_bytes_out: int = 0  # host tier: pool -> host
    host_bytes_in: int = 0  # host tier: host -> pool

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_cached_tokens / self.prompt_tokens

    @property
    def ttft_p50_s(self) -> float:
        return median(self.ttft_s)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def upkeep_fraction(self) -> float:
        return self.upkeep_s / self.seconds

    def to_dict(self) -> dict[str, Any]:
        derived = ("hit_rate", "ideal_hit_rate", "ttft_p50_s", "output_tokens_per_s")
        return {
            **{k: v for k, v in asdict(self).items() if k != "ttft_s"},
            **{k: round(getattr(self, k), 6) for k in (*derived, "upkeep_fraction")},
        }


def run_shared_prefix(
    name: str, make_engine: EngineFactory, workload: SharedPrefixWorkload, **options: Any
) -> PrefixRun:
    """All requests at once (offline), on a fresh engine built with `options`."""
    engine = make_engine(**options)
    arrivals = workload.arrivals(engine.loaded.config.vocab_size)
    trace = trace_engine(engine, arrivals)
    ideal = round(workload.ideal_hit_rate * sum(len(a.prompt_token_ids) for a in arrivals))
    return _summarize(name, engine, [trace], ideal)


def probe_ttft(
    make_engine: EngineFactory, workload: SharedPrefixWorkload, **options: Any
) -> list[float]:
    """TTFT of one request at a time, after each prefix was seen once: the latency of a hit
    (cache on) or of a full prefill (cache off), with no queueing in the way."""
    engine = make_engine(**options)
    first_of: dict[tuple[int, ...], Arrival] = {}  # prefix -> its first request
    second_of: dict[tuple[int, ...], Arrival] = {}  # ... and its second: the probe
    for arrival in workload.arrivals(engine.loaded.config.vocab_size):
        prefix = arrival.prompt_token_ids[: workload.prefix_len]
        (second_of if prefix in first_of else first_of).setdefault(prefix, arrival)
    trace_engine(engine, list(first_of.values()))  # each prefix seen once
    return [trace_engine(engine, [a]).time_to_first_token(a.request_id) for a in second_of.values()]


def run_multi_turn(
    name: str, make_engine: EngineFactory, workload: MultiTurnWorkload, **options: Any
) -> PrefixRun:
    """Turn by turn: each turn's requests (one per conversation) arrive together."""
    engine = make_engine(**options)
    rng = random.Random(workload.seed)
    vocab = engine.loaded.config.vocab_size
    history: list[list[int]] = [[] for _ in range(workload.conversations)]
    traces, ideal = [], 0
    for turn in range(workload.turns):
        prompts = [h + _tokens(rng, workload.user_len, vocab) for h in history]
        ideal += sum(len(h) for h in history)  # all that was seen before could be reused
        arrivals = [
            Arrival(f"c{c}t{turn}", tuple(p), _greedy(workload.output_len))
            for c, p in enumerate(prompts)
        ]
        traces.append(trace_engine(engine, arrivals))
        history = [p + traces[-1].token_ids(a.request_id)[0] for p, a in zip(prompts, arrivals)]
    return _summarize(name, engine, traces, ideal)


def _summarize(name: str, engine: LLMEngine, traces: list[StepTrace], ideal: int) -> PrefixRun:
    outputs = [o for t in traces for o in t.outputs.values()]
    metrics = engine.get_metrics()
    return PrefixRun(
        name=name,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        cached_tokens=sum(o.num_cached_tokens for o in outputs),
        ideal_cached_tokens=ideal,
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        seconds=sum(t.wall_time for t in traces),
        ttft_s=[t.time_to_first_token(r) for t in traces for r in t.outputs],
        upkeep_s=metrics["prefix_cache_upkeep_seconds"],
        evicted_blocks=metrics["prefix_cache_evicted_blocks"],
        host_bytes_out=metrics["host_tier_bytes_out"],
        host_bytes_in=metrics["host_tier_bytes_in"],
    )


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(count)]  # ids 0-2: special tokens


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
