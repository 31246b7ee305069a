"""The early-exit proposer (self-speculation, as in LayerSkip / Draft & Verify): the draft is
the target's own first L layers, then its final norm and LM head.

No second model and no second KV cache: the draft's K/V for layers < L are exactly the
target's (same weights, same tokens), so it reads the target's pool. Drafting writes those
layers' K/V at the draft positions; the verifying forward then rewrites them.
"""

from __future__ import annotations

import torch

from minserve.attention.metadata import AttentionMetadata
from minserve.messages import ScheduledChunk
from minserve.model.runner import ModelInputs, ModelRunner, slot_of
from minserve.model.sampler import Sampler
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.distributions import choose_drafts, row_after
from minserve.speculative.draft import Draft


# >>> exercise 6.6: the early-exit draft (self-speculation)
class EarlyExitProposer:
    """Drafts from the target's first `num_draft_layers` layers, k forwards of 1 token.

    Plug yours into the engine with `LLM(speculative_config={"method": "early_exit",
    "num_speculative_tokens": k, "num_draft_layers": L, "proposer_cls": EarlyExitProposer})`.
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        self.runner = runner
        self.sampler = Sampler()  # processes q as the target's sampler processes p
        total = runner.model.config.num_layers
        self.num_layers = config.num_draft_layers or max(1, total // 2)
        if not 1 <= self.num_layers < total:
            raise ValueError(
                f"num_draft_layers must be in [1, {total - 1}] for this {total}-layer model, "
                f"got {self.num_layers}"
            )

    def propose(self, chunks: list[ScheduledChunk], limits: list[int]) -> list[Draft]:
        """Up to `limits[i]` drafts for decode `chunks[i]`, whose block table already has
        slots for them after its token.

        Round j is one batched forward (`_draft_logits`) of every sequence that still wants
        a (j + 1)-th draft. `choose_drafts(self.sampler, logits, rows)` picks each row's
        draft: the argmax for greedy rows, a draw from the early exit's processed q for
        sampling rows, whose row j must see the drafts before it as output (`row_after`).
        A sequence whose row cannot be sampled (its token comes back None: NaN logits)
        stops drafting there; the others go on. Returns `Draft.from_choices(tokens, qs)`
        per sequence, in the order of `chunks`."""
        drafts: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor | None]] = [[] for _ in chunks]
        limits = list(limits)  # lowered for a sequence whose draft row cannot be sampled
        for step in range(max(limits, default=0)):
            active = [i for i, k in enumerate(limits) if k > step]
            if not active:
                break
            logits = self._draft_logits([chunks[i] for i in active], [drafts[i] for i in active])
            step_rows = [row_after(chunks[i].samples[0], drafts[i]) for i in active]
            tokens, qs = choose_drafts(self.sampler, logits, step_rows)
            for i, token, q in zip(active, tokens, qs):
                if token is None:
                    limits[i] = step  # no draft here: this sequence stops drafting
                    continue
                drafts[i].append(token)
                probs[i].append(q)
        return [Draft.from_choices(d, q) for d, q in zip(drafts, probs)]

    def _draft_logits(self, chunks: list[ScheduledChunk], drafts: list[list[int]]) -> torch.Tensor:
        """Each decode's newest token through the first `self.num_layers` layers, then the
        final norm and LM head: logits [B, vocab].

        The newest token of `chunks[i]` is its last draft, or its own token before any: it
        sits at position `start + len(drafts[i])`, attends to every token up to it, and its
        K/V go to that position's pool slot (`slot_of` through the block table). Build
        `AttentionMetadata.build(query_lens=..., context_lens=..., block_tables=...,
        slot_mapping=..., device=...)` and `ModelInputs` (one logits row per sequence), then
        `self.runner.forward(inputs, num_layers=self.num_layers)`."""
        # >>> solution
        last = [c.start + len(d) for c, d in zip(chunks, drafts)]
        tokens = [(d or c.token_ids)[-1] for c, d in zip(chunks, drafts)]
        one_token_each = AttentionMetadata.build(
            query_lens=[1] * len(chunks),
            context_lens=[p + 1 for p in last],
            block_tables=[list(c.block_table) for c in chunks],
            slot_mapping=[
                slot_of(c.block_table, self.runner.kv.block_size, p) for c, p in zip(chunks, last)
            ],
            device=self.runner.device,
        )
        device = self.runner.device
        inputs = ModelInputs(
            input_ids=torch.tensor(tokens, device=device),
            positions=torch.tensor(last, device=device),
            metadata=one_token_each,
            sample_indices=torch.arange(len(chunks), device=device),
        )
        return self.runner.forward(inputs, num_layers=self.num_layers)  # [B, vocab]
        # <<< solution


# <<< exercise
