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
from minserve.loader import LoadedModel, load_model
from minserve.messages import ScheduledChunk
from minserve.model.runner import ModelRunner
from minserve.model.sampler import Sampler, SamplingRow
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.distributions import choose_drafts, row_after
from minserve.speculative.draft import Draft


@dataclass(eq=False)
class DraftSeq:
    """One sequence's state in the draft model: its draft KV and the tokens it has seen."""

    block_table: BlockTable
    token_ids: list[int] = field(default_factory=list)  # real tokens, then guesses
    num_computed_tokens: int = 0  # tokens whose draft K/V are in the draft pool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chunk(self, row: SamplingRow) -> ScheduledChunk:
        """The tokens the draft model has not computed yet, as one chunk to run, sampled
        after its last token with the target's row."""
        start = self.num_computed_tokens
        return ScheduledChunk(
            seq_id=-1,
            request_id="",
            token_ids=tuple(self.token_ids[start:]),
            start=start,
            block_table=tuple(self.block_table.blocks),
            samples=(row,),
        )


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
        model = loaded.model.to(param.device)
        self.runner = loaded.platform.runner(model, pool, target.backend)
        self.states: dict[int, DraftSeq] = {}  # sequence id -> its draft state
        self.sampler = Sampler()  # processes q as the target's sampler processes p

    def propose(self, chunks: list[ScheduledChunk], limits: list[int]) -> list[Draft]:
        """Up to `limits[i]` guesses for decode `chunks[i]` (fewer when the draft pool is
        full, or where the draft model's logits cannot be sampled): greedy for greedy rows, drawn
        from the draft's processed q for sampling rows."""
        states = [self._sync(c) for c in chunks]
        real_lengths = [state.num_tokens for state in states]
        probs: list[list[torch.Tensor | None]] = [[] for _ in chunks]
        limits = list(limits)  # lowered for a sequence whose draft row cannot be sampled
        for step in range(max(limits, default=0)):
            active = [i for i, k in enumerate(limits) if k > step and self._grow(states[i])]
            if not active:
                break
            logits = self.runner.run([states[i].chunk(chunks[i].samples[0]) for i in active])
            drafted = [states[i].token_ids[real_lengths[i] :] for i in active]
            step_rows = [row_after(chunks[i].samples[0], d) for i, d in zip(active, drafted)]
            tokens, qs = choose_drafts(self.sampler, logits, step_rows)
            for i, token, q in zip(active, tokens, qs):
                states[i].num_computed_tokens = states[i].num_tokens
                if token is None:
                    limits[i] = step  # no draft here: this sequence stops drafting
                    continue
                states[i].token_ids.append(token)
                probs[i].append(q)
        return [
            Draft.from_choices(state.token_ids[n:], q)
            for n, state, q in zip(real_lengths, states, probs)
        ]

    def release(self, seq_ids: list[int] | tuple[int, ...]) -> None:
        """Free the draft blocks of sequences that finished or were aborted."""
        for seq_id in seq_ids:
            state = self.states.pop(seq_id, None)
            if state is not None:
                state.block_table.free(self.allocator)

    def _sync(self, chunk: ScheduledChunk) -> DraftSeq:
        """Keep the draft K/V of the longest computed prefix that matches the real tokens,
        short of the newest one: the first draft needs the logits after it."""
        block_size = self.runner.kv.block_size
        state = self.states.setdefault(chunk.seq_id, DraftSeq(BlockTable(block_size)))
        real = chunk.history()
        computed = state.token_ids[: min(state.num_computed_tokens, len(real) - 1)]
        valid = _common_prefix(computed, real)
        if state.block_table.blocks:
            state.block_table.truncate(self.allocator, valid)
        state.num_computed_tokens, state.token_ids = valid, real
        return state

    def _grow(self, state: DraftSeq) -> bool:
        """Slots for the tokens this draft step computes; False when the pool is full."""
        needed = state.num_tokens - state.block_table.num_tokens
        if state.block_table.blocks_needed(needed) > self.allocator.num_free:
            return False
        state.block_table.append(self.allocator, needed)
        return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
