"""The model runner: turns a scheduled batch into flat tensors and paged-attention metadata.

For each scheduled sequence it lays out the tokens it computes this step (a decode's one
token, or a prefill chunk), their positions and pool slots (through the block table),
runs the decoder once over the whole flat batch, and returns logits only for sequences
whose every token is now computed: those sample next (a speculating decode gets one row per
position it verifies: its token and each draft).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minserve.attention.metadata import AttentionMetadata, PagedKVCache
from minserve.model.llama import AttentionFn, CausalLM
from minserve.scheduler.scheduler import ScheduledSeq


@dataclass(frozen=True)
class ModelInputs:
    """One step's flat batch."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_indices: (
        torch.Tensor
    )  # [num_sampling]: flat index of each sampling sequence's last token


class ModelRunner:
    """Runs the decoder over a scheduled batch with a paged-attention backend."""

    def __init__(self, model: CausalLM, kv: PagedKVCache, backend: type) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = next(model.parameters()).device

    def prepare(self, scheduled: list[ScheduledSeq]) -> ModelInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_indices: list[int] = []
        for s in scheduled:
            seq, end = s.seq, s.start + s.num_new_tokens
            input_ids += seq.token_ids[s.start : end]
            positions += range(s.start, end)
            slots += [seq.block_table.slot(p) for p in range(s.start, end)]
            if s.draft_token_ids:  # speculative decoding: logits at every draft too
                _add_drafts(s, input_ids, positions, slots, sample_indices)
            elif end == seq.num_tokens:
                sample_indices.append(len(input_ids) - 1)
        metadata = AttentionMetadata.build(
            query_lens=[s.num_query_tokens for s in scheduled],
            context_lens=[s.start + s.num_query_tokens for s in scheduled],
            block_tables=[s.seq.block_table.blocks for s in scheduled],
            slot_mapping=slots,
            device=self.device,
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, device=self.device),
            positions=torch.tensor(positions, device=self.device),
            metadata=metadata,
            sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=self.device),
        )

    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Forward the batch; logits [num_sampling, vocab] in the order of `scheduled`."""
        return self.forward(self.prepare(scheduled))

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The decoder over prepared inputs; logits [num_sampling, vocab]."""
        return self.model.compute_logits(self.sampled_hidden(inputs))

    @torch.inference_mode()
    def forward_greedy(self, inputs: ModelInputs) -> torch.Tensor:
        """The decoder, then each sampling row's greedy token [num_sampling] (no logits)."""
        return self.model.greedy_tokens(self.sampled_hidden(inputs))

    def sampled_hidden(self, inputs: ModelInputs) -> torch.Tensor:
        """The decoder's final hidden states at the sampling rows [num_sampling, hidden]."""
        attention: AttentionFn = self.backend(self.kv, inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, attention)  # [T, hidden]
        return hidden[inputs.sample_indices]


def _add_drafts(
    s: ScheduledSeq,
    input_ids: list[int],
    positions: list[int],
    slots: list[int],
    sample_indices: list[int],
) -> None:
    """Append a decode's drafts after its token; sample its token's row and every draft's."""
    first = s.start + s.num_new_tokens
    drafted = range(first, first + len(s.draft_token_ids))
    input_ids += s.draft_token_ids
    positions += drafted
    slots += [s.seq.block_table.slot(p) for p in drafted]
    sample_indices += range(len(input_ids) - 1 - len(s.draft_token_ids), len(input_ids))
