"""The model runner: turns a step's chunks into flat tensors and paged-attention metadata.

For each scheduled chunk it lays out the tokens it computes this step (a decode's one
token, or a prefill chunk), their positions and pool slots (through the block table),
runs the decoder once over the whole flat batch, and returns logits only for chunks that
sample next (a speculating decode gets one row per position it verifies: its token and
each draft). A chunk that asks for prompt logprobs adds one row per prompt position it
scores, after all the sampling rows; other chunks add none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from minserve.attention.metadata import AttentionMetadata, PagedKVCache
from minserve.messages import ScheduledChunk
from minserve.model.llama import AttentionFn, CausalLM


@dataclass(frozen=True)
class ModelInputs:
    """One step's flat batch."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    # [num_sampling + num_prompt_rows]: flat index of each logits row's token, the sampling
    # rows first, then the prompt positions scored for prompt logprobs
    sample_indices: torch.Tensor


def slot_of(block_table: Sequence[int], block_size: int, position: int) -> int:
    """The pool slot of token `position`: its block's first slot plus its offset."""
    block, offset = divmod(position, block_size)
    return block_table[block] * block_size + offset


class ModelRunner:
    """Runs the decoder over a step's chunks with a paged-attention backend."""

    def __init__(self, model: CausalLM, kv: PagedKVCache, backend: type) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = next(model.parameters()).device

    def prepare(
        self,
        chunks: Sequence[ScheduledChunk],
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> ModelInputs:
        """Flat input ids, positions, slots and metadata; `drafts` (seq id -> draft tokens)
        run after their decode's token, each with a logits row of its own."""
        drafts = drafts or {}
        self.begin_step()
        block_size = self.kv.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_indices: list[int] = []
        prompt_rows: list[int] = []
        query_lens: list[int] = []
        for c in chunks:
            prompt_rows += range(len(input_ids), len(input_ids) + len(c.prompt_targets))
            own = drafts.get(c.seq_id, ())
            tokens = [*c.token_ids, *own]
            span = range(c.start, c.start + len(tokens))
            input_ids += tokens
            positions += span
            slots += [slot_of(c.block_table, block_size, p) for p in span]
            query_lens.append(len(tokens))
            if own:  # speculative decoding: logits at its token and at every draft
                sample_indices += range(len(input_ids) - 1 - len(own), len(input_ids))
            elif c.samples:
                sample_indices.append(len(input_ids) - 1)
        metadata = AttentionMetadata.build(
            query_lens=query_lens,
            context_lens=[c.start + q for c, q in zip(chunks, query_lens)],
            block_tables=[list(c.block_table) for c in chunks],
            slot_mapping=slots,
            to_device=self.to_device,
        )
        return ModelInputs(
            input_ids=self.to_device(torch.tensor(input_ids)),
            positions=self.to_device(torch.tensor(positions)),
            metadata=metadata,
            sample_indices=self.to_device(
                torch.tensor(sample_indices + prompt_rows, dtype=torch.long)
            ),
        )

    def begin_step(self) -> None:
        """A new step's inputs are about to be built (a platform's runner resets buffers)."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One of the step's host tensors on the model's device."""
        return host.to(self.device)

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Forward the chunks; logits [num_rows, vocab]: sampling rows in the order of
        `chunks`, then prompt-logprob rows."""
        return self.forward(self.prepare(chunks))

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, num_layers: int | None = None) -> torch.Tensor:
        """The decoder over prepared inputs; logits [num_rows, vocab]. `num_layers`
        stops after the first layers (early-exit drafting)."""
        return self.model.compute_logits(self.sampled_hidden(inputs, num_layers))

    @torch.inference_mode()
    def forward_greedy(self, inputs: ModelInputs) -> torch.Tensor:
        """The decoder, then each sampling row's greedy token [num_sampling] (no logits)."""
        return self.greedy_tokens(self.sampled_hidden(inputs))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> the argmax of each row's fp32 logits [N]."""
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def sampled_hidden(self, inputs: ModelInputs, num_layers: int | None = None) -> torch.Tensor:
        """The decoder's final hidden states at the logits rows [num_rows, hidden]."""
        attention: AttentionFn = self.backend(self.kv, inputs.metadata)
        hidden = self.decoder(inputs, attention, num_layers)
        return hidden[inputs.sample_indices]  # [num_rows, hidden]

    def decoder(
        self, inputs: ModelInputs, attention: AttentionFn, num_layers: int | None
    ) -> torch.Tensor:
        """The model over the flat batch -> hidden states [T, hidden]. A platform's runner
        may run the same layers another way (the CPU's C decode loop)."""
        return self.model(inputs.input_ids, inputs.positions, attention, num_layers)
