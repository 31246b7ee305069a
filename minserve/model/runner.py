"""The model runner: turns a step's chunks into flat tensors and paged-attention metadata.

For each scheduled chunk it lays out the tokens it computes this step (a decode's one
token, or a prefill chunk), their positions and pool slots (through the block table),
runs the decoder once over the whole flat batch, and returns logits only for chunks that
sample next (a speculating decode gets one row per position it verifies: its token and
each draft). A chunk that asks for prompt logprobs adds one row per prompt position it
scores, after all the sampling rows; other chunks add none.

Chapter 03's exercise 3.4 is the marked region below, `flat_batch`: the step's chunks laid
end to end. A student's version plugs into the engine's runner with
`LLM(plugins=CoursePlugins(flat_batch=...))` (`ModelRunner.use_flat_batch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from minserve.attention.metadata import AttentionMetadata, PagedKVCache
from minserve.messages import ScheduledChunk
from minserve.model.llama import AttentionFn, CausalLM

ToDevice = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelInputs:
    """One step's flat batch."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    # [num_sampling + num_prompt_rows]: flat index of each logits row's token, the sampling
    # rows first, then the prompt positions scored for prompt logprobs
    sample_indices: torch.Tensor


# chunks, drafts (seq id -> draft tokens), block size, to_device -> the step's inputs
FlatBatchFn = Callable[
    [Iterable[ScheduledChunk], Mapping[int, Iterable[int]], int, ToDevice], ModelInputs
]


def slot_of(block_table: Sequence[int], block_size: int, position: int) -> int:
    """The pool slot of token `position`: its block's first slot plus its offset."""
    block, offset = divmod(position, block_size)
    return block_table[block] * block_size + offset


# >>> exercise 3.4: one step's flat batch (token ids, positions, slots, logits rows)
def flat_batch(
    chunks: Iterable[ScheduledChunk],
    drafts: Mapping[int, Iterable[int]],
    block_size: int,
    to_device: ToDevice,
) -> ModelInputs:
    """Lay a step's chunks end to end, so that decodes and prefill chunks of any lengths
    run as one forward over one flat batch of tokens (Orca's selective batching; vLLM's
    flattened input): no padding, and each sequence's attention told apart by metadata.

    Chunk `c` computes `c.token_ids` at positions `c.start`, `c.start + 1`, ..., then its
    drafts (`drafts.get(c.seq_id, ())`, speculative decoding) at the positions after them.
    Each of these tokens is written to the KV pool at its slot (`slot_of` through
    `c.block_table`). Per chunk, `AttentionMetadata.build` takes its query length (the
    tokens it computes), its context length (the tokens cached once the step ran, these
    included), its block table (a list) and the slot mapping; pass it `to_device`.
    Logits rows (`sample_indices`, flat token indices): a chunk with drafts gets one at
    its token and one at each draft, another chunk that samples (`c.samples`) one at its
    last token; after all of those, in batch order, each chunk's prompt-logprob rows: its
    first `len(c.prompt_targets)` tokens. `input_ids`, `positions` and `sample_indices`
    are int64 tensors; every tensor goes through `to_device`.
    """
    # >>> solution
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    block_tables: list[list[int]] = []
    sample_indices: list[int] = []
    prompt_rows: list[int] = []  # after every sampling row
    for c in chunks:
        first = len(input_ids)  # the chunk's first flat index
        own = list(drafts.get(c.seq_id, ()))
        tokens = [*c.token_ids, *own]
        span = range(c.start, c.start + len(tokens))
        input_ids += tokens
        positions += span
        slots += [slot_of(c.block_table, block_size, p) for p in span]
        query_lens.append(len(tokens))
        context_lens.append(c.start + len(tokens))  # the cached prefix and these tokens
        block_tables.append(list(c.block_table))
        last = len(input_ids) - 1
        if own:  # speculative decoding: logits at its token and at every draft
            sample_indices += range(last - len(own), last + 1)
        elif c.samples:
            sample_indices.append(last)
        prompt_rows += range(first, first + len(c.prompt_targets))
    return ModelInputs(
        input_ids=to_device(torch.tensor(input_ids, dtype=torch.long)),  # [T]
        positions=to_device(torch.tensor(positions, dtype=torch.long)),  # [T]
        metadata=AttentionMetadata.build(
            query_lens, context_lens, block_tables, slots, to_device=to_device
        ),
        sample_indices=to_device(torch.tensor(sample_indices + prompt_rows, dtype=torch.long)),
    )
    # <<< solution


# <<< exercise


class ModelRunner:
    """Runs the decoder over a step's chunks with a paged-attention backend."""

    def __init__(self, model: CausalLM, kv: PagedKVCache, backend: type) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = next(model.parameters()).device
        self.flat_batch: FlatBatchFn = flat_batch  # how a step's chunks become one batch

    def prepare(
        self,
        chunks: Sequence[ScheduledChunk],
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> ModelInputs:
        """Flat input ids, positions, slots and metadata; `drafts` (seq id -> draft tokens)
        run after their decode's token, each with a logits row of its own."""
        self.begin_step()
        return self.flat_batch(chunks, drafts or {}, self.kv.block_size, self.to_device)

    def use_flat_batch(self, layout: FlatBatchFn) -> None:
        """Lay out every step's batch with `layout` (chapter 03's exercise 3.4)."""
        self.flat_batch = layout

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
