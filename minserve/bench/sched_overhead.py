"""Scheduler overhead: the share of a decode step spent outside the model and the sampler.

    minserve bench scheduler-overhead --threads 1 [--batch-sizes 8,64,256]

N requests are admitted and prefilled; once every one of them is decoding (steady state),
each step's phases come from the engine's own clock (its `StepRecord`,
minserve/step_timings.py): `schedule()`, building the flat batch and attention metadata,
the forward, the sampler, and the bookkeeping after it (append, stop rules, outputs).
Overhead is schedule + prepare + update over the step's wall time: a serving engine wants
it to be a few percent of the step. Prints a row per number of running requests.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from tqdm.auto import tqdm

from minserve.bench.options import positive_ints, set_threads
from minserve.engine import StepRecord, observe_steps
from minserve.messages import SchedulerOutput
from minserve.sampling_params import SamplingParams
from minserve.step_timings import OVERHEAD_PHASES, PHASES, StepTimings

MAX_STEADY_STEPS = 64  # steps allowed to get every request decoding


@dataclass(frozen=True)
class OverheadResult:
    """Decode steady state at `num_requests` running: mean milliseconds per step by phase."""

    num_requests: int
    num_steps: int
    step_ms: float  # wall time of step(), measured around the call
    phase_ms: dict[str, float]
    overhead_fraction: float  # overhead phases over step wall time, all steps together
    median_step_fraction: float  # the same, step by step, the median

    @property
    def untimed_ms(self) -> float:
        """Step time no phase claimed (the clock's own cost, method calls between laps)."""
        return self.step_ms - sum(self.phase_ms.values())

    @property
    def overhead_us_per_request(self) -> float:
        return 1000 * sum(self.phase_ms[p] for p in OVERHEAD_PHASES) / self.num_requests

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "untimed_ms": self.untimed_ms,
            "overhead_us_per_request": self.overhead_us_per_request,
        }


def is_all_decoding(batch: SchedulerOutput, num_requests: int) -> bool:
    """Did the step run exactly one decode token for each of the requests?"""
    return len(batch.chunks) == num_requests and all(c.is_decode for c in batch.chunks)


def timed_step(engine: Any) -> tuple[float, StepRecord]:
    """One engine step: its wall time and its record (what it ran, its phases)."""
    with observe_steps(engine) as records:
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
    if not records:
        raise RuntimeError("the engine had nothing to run")
    return wall, records[-1]


def add_decoders(engine: Any, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    """Queue `num_requests` random prompts that generate `max_tokens` each (EOS ignored)."""
    rng = random.Random(0)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        ids = [rng.randrange(vocab) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", None, ids, params)


def max_tokens(steps: int, warmup: int) -> int:
    """What each request may generate: enough never to finish while it is measured."""
    return MAX_STEADY_STEPS + warmup + steps


def pool_blocks(num_requests: int, prompt_len: int, steps: int, warmup: int = 2) -> int:
    """KV blocks (of 16) to hold every request at its longest: no preemption."""
    return num_requests * -(-(prompt_len + max_tokens(steps, warmup)) // 16)


def measure(
    engine: Any, num_requests: int, prompt_len: int = 16, steps: int = 16, warmup: int = 2
) -> OverheadResult:
    """Bring `num_requests` to decode steady state on `engine`, then time `steps` steps."""
    if min(num_requests, prompt_len, steps) < 1 or warmup < 0:
        raise ValueError("num_requests, prompt_len and steps must be positive, warmup >= 0")
    add_decoders(engine, num_requests, prompt_len, max_tokens(steps, warmup))
    for _ in range(MAX_STEADY_STEPS):
        _, record = timed_step(engine)
        if is_all_decoding(record.scheduler_output, num_requests):
            break
    else:
        raise RuntimeError(
            f"{num_requests} requests were not all decoding after {MAX_STEADY_STEPS} steps; "
            "raise max_num_seqs, max_num_batched_tokens or the KV pool"
        )
    for _ in range(warmup):
        engine.step()
    walls, timings = [], []
    for i in range(steps):
        wall, record = timed_step(engine)
        walls.append(wall)
        timings.append(record.timings)
        if not is_all_decoding(record.scheduler_output, num_requests):
            raise RuntimeError(f"measured step {i} was not {num_requests} decodes")
    for request_id in [f"r{i}" for i in range(num_requests)]:
        engine.abort_request(request_id)
    return summarize(num_requests, walls, timings)


def summarize(num_requests: int, walls: list[float], timings: list[StepTimings]) -> OverheadResult:
    """Mean phase times per step, and the overhead's share of the step's wall time."""
    total = StepTimings()
    for t in timings:
        total.add(t)
    n = len(walls)
    return OverheadResult(
        num_requests=num_requests,
        num_steps=n,
        step_ms=1000 * sum(walls) / n,
        phase_ms={name: 1000 * getattr(total, name) / n for name in PHASES},
        overhead_fraction=total.overhead / sum(walls),
        median_step_fraction=statistics.median(t.overhead / w for t, w in zip(timings, walls)),
    )


# ---------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="8,64,256", help="running requests, comma-separated")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=16, help="decode steps measured per size")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `scheduler-overhead` subcommand of `minserve bench`."""
    p = kinds.add_parser("scheduler-overhead", help="schedule + bookkeeping share of a step")
    add_arguments(p)
    p.set_defaults(run=run_command)


def measure_sizes(args: argparse.Namespace) -> list[OverheadResult]:
    """One fresh engine per batch size, each brought to steady state and measured."""
    from minserve import LLM  # torch import only when running

    sizes = positive_ints(args.batch_sizes, "--batch-sizes")
    base = LLM(args.model, dtype=args.dtype)
    results = []
    for n in tqdm(sizes, desc="scheduler overhead", unit="batch size"):
        llm = LLM(
            base.loaded,
            num_blocks=pool_blocks(n, args.prompt_len, args.steps),
            max_num_seqs=max(n, 256),
            max_num_batched_tokens=max(2048, n * args.prompt_len),  # every prompt in one step
        )
        results.append(measure(llm.engine, n, args.prompt_len, args.steps))
    return results


def run_command(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    print(table([r.to_dict() for r in measure_sizes(args)]))
    return 0


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table, a row per number of running requests: mean ms per step by phase."""
    rows = [
        "| running requests | step ms | schedule | prepare | update | forward | sample "
        "| untimed | overhead, % of step | median step % | overhead µs / request |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ph = r["phase_ms"]
        cells = [r["num_requests"], f"{r['step_ms']:.1f}"]
        cells += [f"{ph[p]:.2f}" for p in ("schedule", "prepare", "update", "forward", "sample")]
        cells += [f"{r['untimed_ms']:.2f}", f"{100 * r['overhead_fraction']:.2f}%"]
        cells += [f"{100 * r['median_step_fraction']:.2f}%", f"{r['overhead_us_per_request']:.0f}"]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(rows)
