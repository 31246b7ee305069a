"""Where a step's time goes: the scheduler and the engine's bookkeeping versus the model.

`LLMEngine.step()` and the worker lap a `PhaseClock` after each phase; the engine sums the
steps' `StepTimings` (`get_metrics()`). Scheduler overhead is everything that is
neither the model forward, nor the speculative proposer (a draft model's forwards), nor
sampling: a serving engine wants it to be a few percent of a step (`minserve bench
scheduler-overhead`).

On a GPU, kernels run asynchronously: `forward` then measures launching them and `sample`
includes waiting for them; their sum, and the CPU-side overhead phases, stay right.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

OVERHEAD_PHASES = ("schedule", "prepare", "update")


@dataclass
class StepTimings:
    """Seconds spent in each phase of `LLMEngine.step()` (one step, or a sum of steps)."""

    schedule: float = 0.0  # scheduler.schedule(): who runs, how many tokens, blocks
    propose: float = 0.0  # speculative decoding: the proposer's drafts (model work, not overhead)
    prepare: float = 0.0  # flat input ids, positions, slot mapping, block tables as tensors
    forward: float = 0.0  # the decoder and the logits of the sampling rows
    sample: float = 0.0  # the sampler
    update: float = 0.0  # append tokens, stop rules, fork, free finished, build outputs

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def overhead(self) -> float:
        """Seconds outside the model and the sampler: scheduling and bookkeeping."""
        return sum(getattr(self, name) for name in OVERHEAD_PHASES)

    def add(self, other: StepTimings) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class PhaseClock:
    """Charges the time since the previous lap to a phase: `clock.lap("schedule")`."""

    def __init__(self) -> None:
        self.timings = StepTimings()
        self._last = time.perf_counter()

    def skip(self) -> None:
        """Start the next phase now, charging the time since the last lap to none."""
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        setattr(self.timings, phase, getattr(self.timings, phase) + now - self._last)
        self._last = now
