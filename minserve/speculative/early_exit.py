"""The early-exit proposer (self-speculation, as in LayerSkip / Draft & Verify): the draft is
the target's own first L layers, then its final norm and LM head.

No second model and no second KV cache: the draft's K/V for layers < L are exactly the
target's (same weights, same tokens), so it reads the target's pool. Drafting writes those
layers' K/V at the draft positions; the verifying forward then rewrites them.
"""

from __future__ import annotations

import torch

from minserve.attention.metadata import AttentionMetadata
from minserve.model.runner import ModelRunner
from minserve.model.sampler import Sampler, SamplingRow
from minserve.scheduler.sequence import Sequence
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.distributions import choose_drafts, row_after
from minserve.speculative.draft import Draft


class EarlyExitProposer:
    """Drafts from the target's first `num_draft_layers` layers, k forwards of 1 token."""

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

    def propose(
        self, seqs: list[Sequence], limits: list[int], rows: list[SamplingRow]
    ) -> list[Draft]:
        """Draft `limits[i]` tokens for each sequence (its slots are already assigned):
        greedy for greedy rows, drawn from the early exit's processed q for sampling rows."""
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        for step in range(max(limits, default=0)):
            active = [i for i, k in enumerate(limits) if k > step]
            logits = self._draft_logits([seqs[i] for i in active], [drafts[i] for i in active])
            step_rows = [row_after(rows[i], drafts[i]) for i in active]
            tokens, qs = choose_drafts(self.sampler, logits, step_rows)
            for i, token, q in zip(active, tokens, qs):
                drafts[i].append(token)
                probs[i].append(q)
        return [Draft.from_choices(d, q) for d, q in zip(drafts, probs)]

    @torch.inference_mode()
    def _draft_logits(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """Run each sequence's newest token (position N-1+j) through L layers: [B, vocab]."""
        last = [s.num_tokens - 1 + len(d) for s, d in zip(seqs, drafts)]
        tokens = [(d or s.token_ids)[-1] for s, d in zip(seqs, drafts)]
        metadata = AttentionMetadata.build(
            query_lens=[1] * len(seqs),
            context_lens=[p + 1 for p in last],
            block_tables=[s.block_table.blocks for s in seqs],
            slot_mapping=[s.block_table.slot(p) for s, p in zip(seqs, last)],
            device=self.runner.device,
        )
        device = self.runner.device
        hidden = self._first_layers(
            torch.tensor(tokens, device=device), torch.tensor(last, device=device), metadata
        )  # [B, hidden]
        return self.runner.model.compute_logits(hidden)

    def _first_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The decoder cut after `num_layers` layers, then the final norm: [B, hidden]."""
        model = self.runner.model
        attention = self.runner.backend(self.runner.kv, metadata)
        x = model.model.embed_tokens(input_ids)  # [B, hidden]
        rotation = model.rope(positions, x.dtype)
        for i, layer in enumerate(model.model.layers[: self.num_layers]):
            x = layer(x, rotation, attention, i)
        return model.model.norm(x)
