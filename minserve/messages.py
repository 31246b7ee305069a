"""The messages of one engine step: scheduler -> worker -> scheduler -> output processor
-> scheduler (vLLM v1's shape).

    sched_out = scheduler.schedule()                              # SchedulerOutput
    run_out   = worker.execute(sched_out)                         # ModelRunnerOutput
    update    = scheduler.update_from_output(sched_out, run_out)  # SchedulerUpdate
    processed = output_processor.process(update)                  # deltas, and OutputStops
    scheduler.apply_stops(processed.stops)                        # the one message back

All are plain data: ids, token ids, positions, block ids. The scheduler decides and does
the bookkeeping (which blocks a sequence owns, which sequences finished); the worker owns
the device: the KV pool, the block copies the scheduler asked for, the model, the sampler,
and what it keeps per sequence (dropped when a step names the sequence finished). Nothing
in a message points back into the scheduler's state, so a message can cross a process
boundary (tensor parallel ranks receive the same step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minserve.model.sampler import SamplingRow
    from minserve.step_timings import StepTimings


# --- block operations: what the worker does to its KV memory before the forward ---


@dataclass(frozen=True)
class CopyBlocks:
    """Copy-on-write: block src's KV into block dst, every layer (after a fork)."""

    src: int
    dst: int


@dataclass(frozen=True)
class SwapOut:
    """A preempted sequence's blocks go to host memory under `key` (its sequence id)."""

    key: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SwapIn:
    """Host copy `key` comes back into these (fresh) blocks; the host copy is released."""

    key: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class DropSwapped:
    """An aborted sequence's host copy is released without coming back."""

    key: int


@dataclass(frozen=True)
class Demote:
    """Prefix-cache host tier: an evicted cached block's KV is kept in host slot `slot`."""

    block: int
    slot: int


@dataclass(frozen=True)
class Promote:
    """Prefix-cache host tier: host slot `slot` is copied back into block `block`."""

    slot: int
    block: int


@dataclass(frozen=True, eq=False)
class DiskWrite:
    """Disk tier: a computed cached block's KV is written through under its content key
    (the worker hands it to the store's writer thread)."""

    block: int
    key: bytes


@dataclass(frozen=True, eq=False)
class DiskLoad:
    """Disk tier: KV read from disk (by the scheduler, which checked it) goes into `block`.
    [layers, 2, 1, block_size, kv_heads, head_dim], the pool's storage dtype."""

    block: int
    data: torch.Tensor


BlockOp = CopyBlocks | SwapOut | SwapIn | DropSwapped | Demote | Promote | DiskWrite | DiskLoad


# --- scheduler -> worker ---


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's work this step: a decode's one token, or a chunk of its prompt.

    `samples` are the rows to sample from the logits after its last token: empty while a
    prompt is still being prefilled, one row for a decode, n rows at the end of the prefill
    of a request with n samples (the sequence, then the siblings it forks into). A row
    refers to its sequence's output tokens and random generator as they are (read-only for
    the worker): only the process that samples (rank 0 under tensor parallelism) uses them.
    """

    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]  # the tokens this step computes
    start: int  # position of token_ids[0]
    block_table: tuple[int, ...]  # the sequence's blocks: slots for these tokens (and drafts)
    samples: tuple[SamplingRow, ...] = ()
    num_draft_slots: int = 0  # speculative decoding: slots reserved for drafts after it
    num_prompt_tokens: int = 0
    # prompt_logprobs: the top-k asked for, and the prompt tokens its positions predict
    # (token_ids[i] predicts prompt_targets[i]; the prompt's last position predicts output,
    # so it is not among them). Empty for every other chunk: no extra logits.
    prompt_logprobs: int = 0
    prompt_targets: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token after the prompt (not the last piece of a prompt or a recompute)."""
        return self.num_new_tokens == 1 and self.start >= self.num_prompt_tokens

    def history(self) -> list[int]:
        """Every token of the sequence so far (a sampling chunk only): prompt, then output."""
        row = self.samples[0]
        return [*row.prompt_token_ids, *row.output_token_ids]


@dataclass(frozen=True)
class SchedulerOutput:
    """This step's batch (decodes first), in the order the worker lays it out.

    `block_ops` run first and in order (they were decided in that order: a block a swap-out
    reads may be handed to another sequence later in the same step).
    """

    chunks: tuple[ScheduledChunk, ...] = ()
    block_ops: tuple[BlockOp, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()  # what made room for this batch
    # sequences finished or aborted since the last step: the worker drops what it keeps for
    # them (a draft model's KV) before it runs this one (vLLM v1's `finished_req_ids`)
    finished_seq_ids: tuple[int, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def request_ids(self) -> list[str]:
        return list(dict.fromkeys(c.request_id for c in self.chunks))


# --- worker -> scheduler ---


@dataclass(frozen=True)
class SampledTokens:
    """What one sampling row produced: one token, or (speculating) accepted drafts and the
    target's own token after them; with their logprobs (None where none were asked for)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float] | None, ...]


@dataclass(frozen=True)
class PromptLogprobs:
    """A chunk's prompt logprobs: for the prompt tokens at positions `first`, `first` + 1, ...
    each one's logprob given the tokens before it, its rank (1: the most likely) and the
    top-k token ids with their logprobs (most likely first)."""

    first: int  # position of token_ids[0] in the prompt (>= 1)
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """The worker's answer: per sampling chunk, one `SampledTokens` per row of its `samples`.

    A chunk whose sampling failed (NaN logits, say) has no entry in `sampled`; its request
    is in `failed` with the reason, and the scheduler's update aborts it before it moves
    the others on.
    """

    sampled: dict[int, tuple[SampledTokens, ...]] = field(default_factory=dict)  # by seq id
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed
    num_drafts: dict[int, int] = field(default_factory=dict)  # seq id -> drafts verified
    num_draft_rounds: int = 0  # sequential draft positions this step (the longest draft)
    timings: StepTimings | None = None  # the worker's phases: propose, prepare, forward, sample
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # by request id


# --- scheduler -> output processor ---


@dataclass(frozen=True)
class NewTokens:
    """The tokens one sample (`index` of a request's n) gained this step.

    finish_reason is the scheduler's: "stop" when the last token is EOS or a stop token id
    (`stop_reason`: that id, None for EOS), "length" at max_tokens or the model's length
    limit, None while it goes on. Stop strings are the output processor's to find.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float] | None, ...]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0  # the request's prompt tokens found in the prefix cache


@dataclass(frozen=True)
class SchedulerUpdate:
    """What `Scheduler.update_from_output` did with a step, for the output processor: each
    sample's new tokens (batch order), the sequences it finished (the next step's
    `SchedulerOutput` names them to the worker), the requests it aborted because the worker
    failed them alone (request id -> why), and the prompt logprobs the worker scored."""

    new_tokens: tuple[NewTokens, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # by request id


# --- output processor -> scheduler ---


@dataclass(frozen=True)
class OutputStops:
    """What the output processor found in the text, the one message that goes back: the
    samples a stop string ended (the scheduler finishes them, "stop") and the requests whose
    tokens could not be turned into output (the scheduler aborts them: they fail alone)."""

    stopped: tuple[tuple[str, int], ...] = ()  # (request id, sample index)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why
