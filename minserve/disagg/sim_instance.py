"""One simulated serving instance: a queue of prefills, a decode batch, and its next step.

Three roles, as in DistServe:
- "colocated": vLLM-style continuous batching with chunked prefill (Sarathi-Serve): each
  step decodes every running sequence and fills the rest of the token budget with
  prompt chunks, so prefills and decodes share (and slow) the same steps;
- "prefill": only prompt chunks; a finished prefill leaves for a decode instance;
- "decode": only decodes of requests whose KV arrived from a prefill instance.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minserve.disagg.workload import SimRequest

ROLES = ("colocated", "prefill", "decode")


@dataclass(eq=False)
class SimState:
    """A request in flight: prompt tokens still to prefill, tokens produced, key times."""

    spec: SimRequest
    prefill_left: int
    num_generated: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def done(self) -> bool:
        return self.num_generated >= self.spec.output_len


@dataclass(frozen=True)
class PlannedStep:
    """What one step runs: prompt chunks (request, tokens) and the sequences it decodes."""

    chunks: tuple[tuple[SimState, int], ...]
    decodes: tuple[SimState, ...]

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass(eq=False)
class SimInstance:
    """An instance's queues; the simulator asks it for a step and tells it when it ends."""

    role: str
    max_num_batched_tokens: int
    max_num_seqs: int
    waiting: deque[SimState] = field(default_factory=deque)  # to prefill, or to admit (decode)
    running: list[SimState] = field(default_factory=list)  # decoding
    busy: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"instance role must be one of {ROLES}, got {self.role!r}")

    @property
    def load(self) -> int:
        """What a router balances: queued prompt tokens (prefill) or sequences (the others)."""
        if self.role == "prefill":
            return sum(s.prefill_left for s in self.waiting)
        return len(self.waiting) + len(self.running)

    def plan(self) -> PlannedStep | None:
        """The next step's batch, or None when there is nothing to run."""
        if self.role == "decode":
            while self.waiting and len(self.running) < self.max_num_seqs:
                self.running.append(self.waiting.popleft())
        decodes = tuple(self.running[: self.max_num_seqs]) if self.role != "prefill" else ()
        chunks = self._chunks(len(decodes)) if self.role != "decode" else ()
        if not chunks and not decodes:
            return None
        return PlannedStep(chunks, decodes)

    def _chunks(self, num_decodes: int) -> tuple[tuple[SimState, int], ...]:
        """Prompt chunks in arrival order under what is left of the token and seat budget."""
        budget = self.max_num_batched_tokens - num_decodes
        seats = self.max_num_seqs - num_decodes
        chunks = []
        for state in self.waiting:
            n = min(state.prefill_left, budget)
            if n <= 0 or seats <= 0:
                break
            chunks.append((state, n))
            budget, seats = budget - n, seats - 1
        return tuple(chunks)

    def finish_step(self, step: PlannedStep, now: float) -> list[SimState]:
        """Apply a finished step at time `now`; return the requests whose prefill completed."""
        prefilled = []
        for state, n in step.chunks:
            state.prefill_left -= n
            if state.prefill_left == 0:
                self.waiting.remove(state)
                self._emit_token(state, now)
                prefilled.append(state)
        for state in step.decodes:
            self._emit_token(state, now)
            if state.done:
                self.running.remove(state)
        if self.role == "colocated":
            self.running += [s for s in prefilled if not s.done]
        return prefilled

    @staticmethod
    def _emit_token(state: SimState, now: float) -> None:
        state.num_generated += 1
        if state.first_token_s is None:
            state.first_token_s = now
        if state.done:
            state.finish_s = now
