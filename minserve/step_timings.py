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
PHASES = ("schedule", "propose", "prepare", "forward", "sample", "update")


@dataclass
class StepTimings:
    """Seconds spent in each phase of `LLMEngine.step()` (one step, or a sum of steps)."""

    schedule: float = 0.0  # scheduler.schedule(): who runs, how many tokens, blocks
    propose: float = 0.0  # speculative decoding: the proposer's drafts (model work, not overhead)
    prepare: float = 0.0  # flat input ids, positions, slot mapping, block tables as tensors
    forward: float = 0.0  # the decoder and the logits of the sampling rows
    sample: float = 0.0  # the sampler
    update: float = 0.0  # append tokens, stop rules, fork, free finished, build outputs
    # structured output, not phases: the mask thread's time (beside prepare and forward)
    # and the part of it the sampler waited for (inside sample)
    masks_filled: float = 0.0
    masks_waited: float = 0.0

    @property
    def total(self) -> float:
        """The step's wall time: its phases (the mask thread runs beside them)."""
        return sum(getattr(self, name) for name in PHASES)

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
