"""The plan of a paged-attention step in plain torch: which sequences attend together.

Decodes (one query token each) run together in padded, masked batches, bucketed by context
length so that little work goes into padding; each prefill or extend chunk runs alone. The
plan is made once per step, from the metadata read to the host, and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minserve.attention.metadata import AttentionMetadata

BUCKET_FILL = 0.75  # a decode shares a padded batch if it fills 3/4 of its longest context


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one computation: all the decodes, or a single prefill chunk."""

    rows: torch.Tensor | slice  # their query tokens' rows in the flat batch
    block_index: torch.Tensor  # [B * num_blocks] int32: the blocks of their longest context
    positions: torch.Tensor  # [B, n] int64: each query token's position in its sequence
    mask: torch.Tensor  # [B, n, S] added to the scores: 0 where key j <= query position, -inf after


def make_group(
    rows: torch.Tensor | slice,
    block_index: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
) -> AttentionGroup:
    """A group and its causal mask, built once per step and shared by every layer.

    The mask is additive, in the scores' dtype: given a boolean one, torch's attention
    would convert it on every call, in every layer."""
    num_keys = block_index.numel() // positions.shape[0] * block_size  # S, padding included
    key_pos = torch.arange(num_keys, device=positions.device)
    hidden = key_pos > positions[:, :, None]  # [B, n, S]
    mask = torch.zeros(hidden.shape, dtype=dtype, device=positions.device)
    return AttentionGroup(rows, block_index, positions, mask.masked_fill_(hidden, float("-inf")))


def plan_step(
    metadata: AttentionMetadata, block_size: int, dtype: torch.dtype = torch.float32
) -> list[AttentionGroup]:
    """Split a step into attention groups (masks in `dtype`, the cache's): the decodes'
    buckets, then each prefill or extend chunk. Reads the metadata to the host once."""
    step = StepLayout.read(metadata, block_size)
    return decode_groups(step, dtype) + chunk_groups(step, dtype)


@dataclass(frozen=True)
class StepLayout:
    """The metadata a plan reads, on the host: where each sequence's queries sit."""

    starts: list[int]  # query_start_loc
    contexts: list[int]  # context_lens
    tables: torch.Tensor  # [num_seqs, max_blocks] int64
    block_size: int

    @classmethod
    def read(cls, metadata: AttentionMetadata, block_size: int) -> StepLayout:
        check_tables(metadata, block_size)
        return cls(
            metadata.query_starts_list(),
            metadata.context_lens_list(),
            metadata.block_tables.long(),
            block_size,
        )

    def query_len(self, seq: int) -> int:
        return self.starts[seq + 1] - self.starts[seq]

    def blocks_for(self, seq: int) -> int:
        return -(-self.contexts[seq] // self.block_size)  # ceil

    @property
    def decodes(self) -> list[int]:
        """The sequences with one query token."""
        return [i for i in range(len(self.contexts)) if self.query_len(i) == 1]


def check_tables(metadata: AttentionMetadata, block_size: int) -> None:
    """The block tables are wide enough for the longest context of the step."""
    if metadata.block_tables.shape[1] * block_size < metadata.max_context_len:
        raise ValueError(
            f"block tables have {metadata.block_tables.shape[1]} blocks of {block_size} "
            f"tokens, too few for a context of {metadata.max_context_len} tokens"
        )


def decode_groups(step: StepLayout, dtype: torch.dtype) -> list[AttentionGroup]:
    """The decodes in padded batches of similar context lengths (`length_buckets`)."""
    device = step.tables.device
    groups = []
    num_blocks = [step.blocks_for(i) for i in range(len(step.contexts))]
    for bucket in length_buckets(step.decodes, num_blocks):
        longest = num_blocks[bucket[0]]
        bucket = sorted(bucket)  # batch order: consecutive rows read as a slice, no copy
        groups.append(
            make_group(
                rows=rows_of([step.starts[i] for i in bucket], device),
                block_index=block_index(step.tables[torch.tensor(bucket, device=device)], longest),
                positions=torch.tensor([[step.contexts[i] - 1] for i in bucket], device=device),
                block_size=step.block_size,
                dtype=dtype,
            )
        )
    return groups


def chunk_groups(step: StepLayout, dtype: torch.dtype) -> list[AttentionGroup]:
    """One group per prefill or extend chunk (more than one query token)."""
    device = step.tables.device
    groups = []
    for i, (start, context) in enumerate(zip(step.starts, step.contexts)):
        n = step.query_len(i)
        if n > 1:
            groups.append(
                make_group(
                    rows=slice(start, start + n),
                    block_index=block_index(step.tables[i : i + 1], step.blocks_for(i)),
                    positions=torch.arange(context - n, context, device=device)[None],
                    block_size=step.block_size,
                    dtype=dtype,
                )
            )
    return groups


def rows_of(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    """The flat-batch rows of a group: a slice when they are consecutive, else an index."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def length_buckets(
    seqs: list[int], num_blocks: list[int], fill: float = BUCKET_FILL
) -> list[list[int]]:
    """Cut `seqs`, longest first, into buckets padded to their first (longest) member.

    A sequence joins the current bucket while it needs at least `fill` of the bucket's
    blocks, so padding stays under 1 - `fill` per sequence; fewer, fuller buckets trade a
    little padding for fewer kernel launches. `num_blocks` is indexed by sequence.
    """
    buckets: list[list[int]] = []
    for i in sorted(seqs, key=lambda i: -num_blocks[i]):
        if buckets and num_blocks[i] >= fill * num_blocks[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def block_index(tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first `num_blocks` of each table, flattened into a fresh contiguous int32 tensor
    (index_select on a strided or int64 view of the tables is several times slower)."""
    return tables[:, :num_blocks].flatten().to(torch.int32).clone()
