"""One step's batch as plain integer tensors, broadcast by rank 0 to the other ranks.

Rank 0 schedules; every rank runs the same forward. So each step rank 0 sends what its
model runner prepared (token ids, positions, slot mapping, block tables, ...) and the
block copies its scheduler made (copy-on-write), as two int64 broadcasts: a fixed-size
header with the sizes, then one flat payload. Only tensors cross: nothing is unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from minserve.attention.metadata import AttentionMetadata
from minserve.model.runner import ModelInputs

STOP, STEP = 0, 1
HEADER_LEN = 8  # kind, T, num_seqs, max_blocks, num_sampling, num_copies, max_q, max_ctx


@dataclass(frozen=True)
class StepMessage:
    """A step for the workers: the flat batch and the block copies to make first."""

    inputs: ModelInputs
    copies: list[tuple[int, int]]  # (src, dst) blocks, copied in every layer before the step


def _header(msg: StepMessage) -> torch.Tensor:
    md = msg.inputs.metadata
    sizes = [STEP, md.num_tokens, md.num_seqs, md.block_tables.shape[1]]
    sizes += [msg.inputs.sample_indices.numel(), len(msg.copies)]
    return torch.tensor(sizes + [md.max_query_len, md.max_context_len], dtype=torch.int64)


def pack(msg: StepMessage) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [8], payload [n]) int64 CPU tensors."""
    md, inputs = msg.inputs.metadata, msg.inputs
    parts = [
        inputs.input_ids,  # [T]
        inputs.positions,  # [T]
        md.slot_mapping,  # [T]
        md.query_start_loc,  # [num_seqs + 1]
        md.context_lens,  # [num_seqs]
        md.block_tables.flatten(),  # [num_seqs * max_blocks]
        inputs.sample_indices,  # [num_sampling]
        torch.tensor(msg.copies, dtype=torch.int64).flatten(),  # [2 * num_copies]
    ]
    payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
    return _header(msg), payload


def unpack(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> StepMessage:
    """The inverse of `pack`, with tensors on `device` in the dtypes the runner uses."""
    _, t, s, b, n, c, max_q, max_ctx = header.tolist()
    sizes = [t, t, t, s + 1, s, s * b, n, 2 * c]
    ids, pos, slots, starts, ctx, tables, sample, copies = payload.split(sizes)
    metadata = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=starts.to(device, torch.int32),
        context_lens=ctx.to(device, torch.int32),
        block_tables=tables.view(s, b).to(device, torch.int32),
        max_query_len=max_q,
        max_context_len=max_ctx,
    )
    inputs = ModelInputs(ids.to(device), pos.to(device), metadata, sample.to(device))
    return StepMessage(inputs, [tuple(pair) for pair in copies.view(c, 2).tolist()])


def send(msg: StepMessage | None, group: dist.ProcessGroup | None) -> None:
    """Rank 0: broadcast a step (None: tell the workers to stop)."""
    if msg is None:
        dist.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64), group=group, group_src=0)
        return
    header, payload = pack(msg)
    dist.broadcast(header, group=group, group_src=0)
    dist.broadcast(payload, group=group, group_src=0)


def receive(group: dist.ProcessGroup | None, device: torch.device) -> StepMessage | None:
    """The other ranks: wait for the next step from rank 0 (None: stop)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, group=group, group_src=0)
    if header[0] == STOP:
        return None
    t, s, b, n, c = header[1:6].tolist()
    payload = torch.empty(3 * t + (s + 1) + s + s * b + n + 2 * c, dtype=torch.int64)
    dist.broadcast(payload, group=group, group_src=0)
    return unpack(header, payload, device)
