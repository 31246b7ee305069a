"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next tokens.

The draft keeps its own paged KV (its own pool, allocator and one block table per
sequence) across steps. Each step it catches up on the tokens it has not seen (the
target's accepted tokens; at first the whole prompt, as one prefill chunk), then decodes
k - 1 more tokens: greedily for greedy requests, while sampling requests draw from the
draft's processed distribution q (kept for rejection sampling). Draft K/V of rejected
guesses is dropped by keeping only the longest prefix of what it computed that matches
the sequence's real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.model.loader import LoadedModel, load_model
from minserve.model.runner import ModelRunner
from minserve.model.sampler import Sampler, SamplingRow
from minserve.scheduler.scheduler import ScheduledSeq
from minserve.scheduler.sequence import SeqStatus, Sequence
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.distributions import choose_drafts, row_after
from minserve.speculative.draft import Draft
from minserve.speculative.kv_rollback import truncate


@dataclass(eq=False)
class DraftSeq:
    """A sequence as the draft model's runner sees it (duck-types `Sequence`)."""

    block_table: BlockTable
    token_ids: list[int] = field(default_factory=list)  # real tokens, then guesses
    num_computed_tokens: int = 0  # tokens whose draft K/V are in the draft pool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    """Guesses from a second model that shares the target's tokenizer."""

    def __init__(self, config: SpeculativeConfig, target: ModelRunner) -> None:
        param = next(target.model.parameters())
        draft = config.model
        loaded = draft if isinstance(draft, LoadedModel) else load_model(draft, param.dtype)
        vocab = target.model.config.vocab_size
        if loaded.config.vocab_size != vocab:
            raise ValueError(
                f"the draft model's vocabulary has {loaded.config.vocab_size} tokens and the "
                f"target's {vocab}; a draft model must share the target's tokenizer"
            )
        pool = PagedKVPool(
            loaded.config, target.kv.num_blocks, target.kv.block_size, param.dtype, param.device
        )
        self.allocator = BlockAllocator(pool.num_blocks)
        self.runner = ModelRunner(loaded.model.to(param.device), pool, target.backend)
        self.states: dict[Sequence, DraftSeq] = {}
        self.sampler = Sampler()  # processes q as the target's sampler processes p

    def propose(
        self, seqs: list[Sequence], limits: list[int], rows: list[SamplingRow]
    ) -> list[Draft]:
        """Up to `limits[i]` guesses for `seqs[i]` (fewer when the draft pool is full):
        greedy for greedy rows, drawn from the draft's processed q for sampling rows."""
        self.release_finished()
        states = [self._sync(seq) for seq in seqs]
        probs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        for step in range(max(limits, default=0)):
            active = [i for i, k in enumerate(limits) if k > step and self._grow(states[i])]
            if not active:
                break
            logits = self.runner.run([self._scheduled(states[i]) for i in active])
            drafted = [states[i].token_ids[seqs[i].num_tokens :] for i in active]
            step_rows = [row_after(rows[i], d) for i, d in zip(active, drafted)]
            tokens, qs = choose_drafts(self.sampler, logits, step_rows)
            for i, token, q in zip(active, tokens, qs):
                states[i].num_computed_tokens = states[i].num_tokens
                states[i].token_ids.append(token)
                probs[i].append(q)
        return [
            Draft.from_choices(state.token_ids[seq.num_tokens :], q)
            for seq, state, q in zip(seqs, states, probs)
        ]

    def release_finished(self) -> None:
        """Free the draft blocks of sequences that finished or were aborted."""
        for seq in [s for s in self.states if s.status is SeqStatus.FINISHED]:
            self.states.pop(seq).block_table.free(self.allocator)

    def _sync(self, seq: Sequence) -> DraftSeq:
        """Keep the draft K/V of the longest computed prefix that matches the real tokens,
        short of the newest one: the first draft needs the logits after it."""
        state = self.states.setdefault(seq, DraftSeq(BlockTable(self.runner.kv.block_size)))
        real = seq.token_ids
        computed = state.token_ids[: min(state.num_computed_tokens, len(real) - 1)]
        valid = _common_prefix(computed, real)
        truncate(state.block_table, self.allocator, valid)
        state.num_computed_tokens, state.token_ids = valid, list(real)
        return state

    def _grow(self, state: DraftSeq) -> bool:
        """Slots for the tokens this draft step computes; False when the pool is full."""
        needed = state.num_tokens - state.block_table.num_tokens
        if state.block_table.blocks_needed(needed) > self.allocator.num_free:
            return False
        state.block_table.append(self.allocator, needed)
        return True

    @staticmethod
    def _scheduled(state: DraftSeq) -> ScheduledSeq:
        return ScheduledSeq(state, state.num_tokens - state.num_computed_tokens)  # type: ignore[arg-type]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
