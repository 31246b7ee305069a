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
    """Split a step into attention groups (masks in `dtype`, the cache's). Reads the
    metadata to the host once per step."""
    if metadata.block_tables.shape[1] * block_size < metadata.max_context_len:
        raise ValueError(
            f"block tables have {metadata.block_tables.shape[1]} blocks of {block_size} "
            f"tokens, too few for a context of {metadata.max_context_len} tokens"
        )
    starts = metadata.query_start_loc.tolist()
    contexts = metadata.context_lens.tolist()
    tables = metadata.block_tables.long()  # [num_seqs, max_blocks]
    device = tables.device

    def blocks_for(context: int) -> int:
        return -(-context // block_size)  # ceil

    seqs = range(metadata.num_seqs)
    decodes = [i for i in seqs if starts[i + 1] - starts[i] == 1]
    groups = []
    for bucket in length_buckets(decodes, [blocks_for(c) for c in contexts]):
        longest = blocks_for(contexts[bucket[0]])
        bucket = sorted(bucket)  # batch order: consecutive rows read as a slice, no copy
        groups.append(
            make_group(
                rows=rows_of([starts[i] for i in bucket], device),
                block_index=block_index(tables[torch.tensor(bucket, device=device)], longest),
                positions=torch.tensor([[contexts[i] - 1] for i in bucket], device=device),
                block_size=block_size,
                dtype=dtype,
            )
        )
    for i in seqs:
        start, end, context = starts[i], starts[i + 1], contexts[i]
        if end - start > 1:
            groups.append(
                make_group(
                    rows=slice(start, end),
                    block_index=block_index(tables[i : i + 1], blocks_for(context)),
                    positions=torch.arange(context - (end - start), context, device=device)[None],
                    block_size=block_size,
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
