"""A sequence as the scheduler sees it: its tokens, its blocks, how much is computed.

A request with n > 1 starts as one sequence that prefills the prompt once; when the
prefill completes, it forks into n sequences that share the prompt's blocks (reference
counts, copy-on-write) and sample their own continuations.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from minserve.kvcache.block_table import BlockTable
from minserve.request import Request, Sample

_SEQ_IDS = itertools.count()  # unique ids, so messages can name sequences by a number


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # never run, or preempted by recompute: needs (re)prefill
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swapping its blocks to host memory
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample's progress through the engine."""

    request: Request
    sample: Sample
    block_table: BlockTable
    priority: int = 0  # lower runs first (vLLM's convention)
    order: int = 0  # admission order, breaks ties between equal arrival times
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    recomputing: bool = False  # preempted to recompute, not yet back in a step
    unforked: list[Sample] = field(default_factory=list)  # siblings that fork after prefill
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))

    @property
    def token_ids(self) -> list[int]:
        return self.sample.prompt_token_ids + self.sample.token_ids

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """token_ids[start:end] without building the whole list (a decode's one token)."""
        prompt, output = self.sample.prompt_token_ids, self.sample.token_ids
        n = len(prompt)
        if start >= n:
            return tuple(output[start - n : end - n])
        return tuple(prompt[start:end]) + tuple(output[: max(0, end - n)])

    def prompt_targets(self, start: int, end: int) -> tuple[int, ...]:
        """The prompt tokens that positions start..end-1 predict, when the request asks for
        prompt logprobs and has no output yet (a recompute after its first token skips them;
        the prompt's last position predicts output, not a prompt token)."""
        prompt = self.sample.prompt_token_ids
        if self.sample.params.prompt_logprobs is None or self.sample.token_ids:
            return ()
        return tuple(prompt[start + 1 : min(end, len(prompt) - 1) + 1])

    @property
    def num_tokens(self) -> int:
        return self.sample.num_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to run through the model before the next sample: 1 for a decode."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens > 0

    @property
    def width(self) -> int:
        """Sequences this entry will become: 1, or n before a request's prefill forks it."""
        return 1 + len(self.unforked)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time
