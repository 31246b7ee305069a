"""The worker: everything that touches the device, behind one call per step.

    run_out = worker.execute(sched_out)

1. drop what it keeps for the sequences the step names finished (a draft model's KV), then
   carry out the step's block operations (copy-on-write, swaps, host-tier copies), in order;
2. speculative decoding: propose drafts in the slots the scheduler reserved;
   structured output: cut drafts where the grammar forbids one, and start filling the
   step's grammar masks in a thread of their own (`minserve/structured/step_masks.py`);
3. lay the chunks out as one flat batch and run the decoder over it (`ModelRunner`);
4. sample: every row plain greedy -> the argmax straight from the head (no logits kept);
   otherwise the sampler over the logits rows; speculating -> verify the drafts. A row the
   sampler cannot draw from fails its request alone (`ModelRunnerOutput.failed`);
5. prompt logprobs, from the rows of the prompt positions chunks asked to score.

It decides nothing about scheduling and keeps no scheduling state: what it returns
(`ModelRunnerOutput`) goes back to `Scheduler.update_from_output`. With tensor parallelism
rank 0's worker hands each step to the other ranks first (`peers`), and every rank carries
out the same block operations on its own pool and host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from minserve.kvcache.block_ops import apply_block_ops
from minserve.kvcache.disk_store import DiskBlockStore
from minserve.kvcache.host_store import HostBlockStore
from minserve.kvcache.host_tier import TierCosts
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.messages import (
    BlockOp,
    ModelRunnerOutput,
    PromptLogprobs,
    SampledTokens,
    ScheduledChunk,
    SchedulerOutput,
)
from minserve.model.llama import CausalLM
from minserve.model.prompt_logprobs import score_prompt_chunks
from minserve.model.runner import ModelInputs, ModelRunner
from minserve.model.sampler import Sampler, SamplingRow, is_plain_greedy
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.decoder import Proposal, SpeculativeDecoder
from minserve.step_timings import PhaseClock
from minserve.structured.step_masks import MaskFiller

Sampled = dict[int, tuple[SampledTokens, ...]]
Failed = dict[str, str]  # request id -> why its sampling failed


class StepPeers(Protocol):
    """Other processes that run every step's forward with this worker (tensor parallel)."""

    def send(self, inputs: ModelInputs | None, block_ops: tuple[BlockOp, ...]) -> None: ...

    def failure(self, error: Exception) -> Exception: ...


class Worker:
    """Owns the model, the paged KV pool and its host copies, the attention backend, the
    sampler and the speculative proposer; runs one step per `execute`."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler | None = None,
        speculative_config: SpeculativeConfig | None = None,
        peers: StepPeers | None = None,
        disk_store: DiskBlockStore | None = None,  # the disk tier's files (its writer)
    ) -> None:
        self.runner = runner  # the platform's: the model over the paged pool
        self.pool: PagedKVPool = runner.kv
        self.sampler = sampler or Sampler()
        self.swap_store = HostBlockStore()  # preempted sequences' blocks, by sequence id
        self.tier_store = HostBlockStore()  # the prefix cache's host tier, by slot
        self.disk_store = disk_store
        self.speculator = (
            SpeculativeDecoder(speculative_config, self.runner) if speculative_config else None
        )
        self.peers = peers
        self.masks = MaskFiller(runner.model.config.vocab_size)  # structured output

    @property
    def model(self) -> CausalLM:
        return self.runner.model

    def measure_tier_costs(self) -> TierCosts:
        """Copy bandwidth and prefill speed on this device (the host tier's rule)."""
        num_params = sum(p.numel() for p in self.model.parameters())
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        return TierCosts.measure(self.pool, num_params, dtype)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: what finished sequences kept dropped, block operations, drafts,
        the forward, the samples."""
        clock = PhaseClock()
        self.release(scheduler_output.finished_seq_ids)
        apply_block_ops(
            scheduler_output.block_ops, self.pool, self.swap_store, self.tier_store, self.disk_store
        )
        clock.lap("prepare")
        chunks = scheduler_output.chunks
        proposal = None
        if self.speculator is not None and chunks:
            proposal = self.speculator.propose(chunks)
        clock.lap("propose")
        if not chunks:
            if self.peers is not None and scheduler_output.block_ops:
                self.peers.send(None, scheduler_output.block_ops)
            return ModelRunnerOutput(timings=clock.timings)
        chunks, masks = self.masks.start(chunks, proposal.drafts if proposal else {})
        if proposal is not None and masks is not None:
            proposal.drop_unused_probs()
        inputs = self.runner.prepare(chunks, proposal.drafts if proposal else None)
        clock.lap("prepare")
        if self.peers is not None:
            self.peers.send(inputs, scheduler_output.block_ops)
        try:
            sampled, failed, prompt_logprobs = self._forward_and_sample(
                chunks, inputs, proposal, clock
            )
        except RuntimeError as error:  # with peers: a collective inside the forward
            if self.peers is None:
                raise
            raise self.peers.failure(error) from error
        finally:
            if masks is not None:  # the matchers are the samples' again
                masks.finish()
        if masks is not None:
            clock.timings.masks_filled += masks.filled_s
            clock.timings.masks_waited += masks.waited_s
        return ModelRunnerOutput(
            sampled=sampled,
            failed=failed,
            num_drafts={k: len(v) for k, v in proposal.drafts.items()} if proposal else {},
            num_draft_rounds=proposal.num_rounds if proposal else 0,
            timings=clock.timings,
            prompt_logprobs=prompt_logprobs,
        )

    def _forward_and_sample(
        self,
        step_chunks: Sequence[ScheduledChunk],
        inputs: ModelInputs,
        proposal: Proposal | None,
        clock: PhaseClock,
    ) -> tuple[Sampled, Failed, dict[str, PromptLogprobs]]:
        chunks = [c for c in step_chunks if c.samples]  # one logits row each
        rows = [row for c in chunks for row in c.samples]
        scored = [c for c in step_chunks if c.prompt_targets]
        if proposal is None and not scored and all(is_plain_greedy(row) for row in rows):
            greedy_ids = self.runner.forward_greedy(inputs).tolist()  # [num_sampling]
            clock.lap("forward")
            tokens = [[(t,)] * len(c.samples) for c, t in zip(chunks, greedy_ids)]
            sampled = _per_chunk(chunks, tokens, [[(None,)] * len(c.samples) for c in chunks])
            clock.lap("sample")
            return sampled, {}, {}
        logits = self.runner.forward(inputs)  # [num_sampling + num_prompt_rows, vocab]
        clock.lap("forward")
        num_prompt_rows = sum(len(c.prompt_targets) for c in scored)
        prompt_logprobs = score_prompt_chunks(scored, logits[len(logits) - num_prompt_rows :])
        logits = logits[: len(logits) - num_prompt_rows]  # [num_sampling, vocab]
        if not rows:  # prompt chunks only, scoring their positions
            sampled, failed = {}, {}
        elif proposal is not None:
            assert self.speculator is not None
            sampled, failed = self.speculator.verify(chunks, proposal, logits, self.sampler)
        else:
            sampled, failed = self._sample(chunks, rows, logits)
        clock.lap("sample")
        return sampled, failed, prompt_logprobs

    def _sample(
        self, chunks: Sequence, rows: list[SamplingRow], logits: torch.Tensor
    ) -> tuple[Sampled, Failed]:
        """One token per sampling row; a chunk's rows (n samples) share its logits row. A
        chunk with a row the sampler could not draw from fails its request."""
        logits_rows = [i for i, c in enumerate(chunks) for _ in c.samples]
        result = self.sampler(logits[logits_rows], rows)
        kept, tokens, logprobs, failed, first = [], [], [], {}, 0
        for c in chunks:
            span = range(first, first + len(c.samples))
            first = span.stop
            reasons = [result.failed[i] for i in span if i in result.failed]
            if reasons:
                failed[c.request_id] = f"the sampler could not draw a token: {reasons[0]}"
                continue
            kept.append(c)
            tokens.append([(result.token_ids[i],) for i in span])
            logprobs.append([(result.logprobs[i],) for i in span])
        return _per_chunk(kept, tokens, logprobs), failed

    def release(self, seq_ids: Sequence[int]) -> None:
        """Drop what is kept per sequence for these finished ones (a draft model's KV);
        `execute` does it for those its step names finished."""
        if self.speculator is not None and seq_ids:
            self.speculator.release(seq_ids)

    def follow(self, inputs: ModelInputs | None, block_ops: tuple[BlockOp, ...]) -> None:
        """Tensor parallel ranks 1..N-1: carry out the step rank 0 sent, on our heads."""
        apply_block_ops(block_ops, self.pool, self.swap_store, self.tier_store)
        if inputs is not None:
            self.runner.forward(inputs)  # our share; rank 0 samples

    # --- KV transfer (prefill/decode disaggregation) ---

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """These blocks' KV, every layer, on the pool's device (to send)."""
        return self.pool.gather_blocks(blocks)

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Received KV into these blocks."""
        self.pool.write_blocks(blocks, data)


def _per_chunk(chunks: Sequence, tokens: list[list], logprobs: list[list]) -> Sampled:
    """{seq id: (SampledTokens per sample row)} from per-chunk lists of tuples."""
    return {
        c.seq_id: tuple(SampledTokens(t, lp) for t, lp in zip(ts, lps))
        for c, ts, lps in zip(chunks, tokens, logprobs)
    }
