"""One step as plain integer tensors, broadcast by rank 0 to the other ranks.

Rank 0 schedules; every rank runs the same forward. So each step rank 0 sends what its
model runner prepared (token ids, positions, slot mapping, block tables, ...) and the
step's block operations (copy-on-write, swaps, host-tier copies), as two int64
broadcasts: a fixed-size header with the sizes, then one flat payload. Only tensors cross:
nothing is unpickled. A step with block operations and no batch (an abort's swap copy
dropped) has no inputs: the ranks carry out the operations and run no forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from minserve.attention.metadata import AttentionMetadata
from minserve.messages import BlockOp, CopyBlocks, Demote, DropSwapped, Promote, SwapIn, SwapOut
from minserve.model.runner import ModelInputs

STOP, STEP, OPS_ONLY = 0, 1, 2
HEADER_LEN = 8  # kind, T, num_seqs, max_blocks, num_sampling, len(ops), max_q, max_ctx

# each block operation as [code, key, n, *blocks]
_OP_CODES: dict[type, int] = {
    CopyBlocks: 0, SwapOut: 1, SwapIn: 2, DropSwapped: 3, Demote: 4, Promote: 5,
}  # fmt: skip


@dataclass(frozen=True)
class StepMessage:
    """A step for the workers: the block operations to carry out first, then the batch."""

    inputs: ModelInputs | None
    block_ops: tuple[BlockOp, ...]


def encode_ops(ops: tuple[BlockOp, ...]) -> list[int]:
    """Block operations as flat integers: [code, key, n, *blocks] each."""
    flat: list[int] = []
    for op in ops:
        if isinstance(op, CopyBlocks):
            key, blocks = op.src, (op.dst,)
        elif isinstance(op, SwapOut | SwapIn):
            key, blocks = op.key, op.blocks
        elif isinstance(op, DropSwapped):
            key, blocks = op.key, ()
        elif isinstance(op, Demote):
            key, blocks = op.slot, (op.block,)
        else:
            key, blocks = op.slot, (op.block,)
        flat += [_OP_CODES[type(op)], key, len(blocks), *blocks]
    return flat


def decode_ops(flat: list[int]) -> tuple[BlockOp, ...]:
    """The inverse of `encode_ops`."""
    ops: list[BlockOp] = []
    i = 0
    while i < len(flat):
        code, key, n = flat[i : i + 3]
        blocks = tuple(flat[i + 3 : i + 3 + n])
        i += 3 + n
        if code == 0:
            ops.append(CopyBlocks(key, blocks[0]))
        elif code in (1, 2):
            ops.append((SwapOut if code == 1 else SwapIn)(key, blocks))
        elif code == 3:
            ops.append(DropSwapped(key))
        elif code == 4:
            ops.append(Demote(blocks[0], key))
        else:
            ops.append(Promote(key, blocks[0]))
    return tuple(ops)


def _header(msg: StepMessage, num_op_ints: int) -> torch.Tensor:
    if msg.inputs is None:
        return torch.tensor([OPS_ONLY, 0, 0, 0, 0, num_op_ints, 0, 0], dtype=torch.int64)
    md = msg.inputs.metadata
    sizes = [STEP, md.num_tokens, md.num_seqs, md.block_tables.shape[1]]
    sizes += [msg.inputs.sample_indices.numel(), num_op_ints]
    return torch.tensor(sizes + [md.max_query_len, md.max_context_len], dtype=torch.int64)


def pack(msg: StepMessage) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [8], payload [n]) int64 CPU tensors."""
    ops = torch.tensor(encode_ops(msg.block_ops), dtype=torch.int64)
    if msg.inputs is None:
        return _header(msg, ops.numel()), ops
    md, inputs = msg.inputs.metadata, msg.inputs
    parts = [
        inputs.input_ids,  # [T]
        inputs.positions,  # [T]
        md.slot_mapping,  # [T]
        md.query_start_loc,  # [num_seqs + 1]
        md.context_lens,  # [num_seqs]
        md.block_tables.flatten(),  # [num_seqs * max_blocks]
        inputs.sample_indices,  # [num_sampling]
        ops,  # [len(ops)]
    ]
    payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
    return _header(msg, ops.numel()), payload


def _payload_len(header: torch.Tensor) -> int:
    t, s, b, n, c = header[1:6].tolist()
    return 3 * t + (s + 1) + s + s * b + n + c


def unpack(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> StepMessage:
    """The inverse of `pack`, with tensors on `device` in the dtypes the runner uses."""
    kind, t, s, b, n, c, max_q, max_ctx = header.tolist()
    if kind == OPS_ONLY:
        return StepMessage(None, decode_ops(payload.tolist()))
    sizes = [t, t, t, s + 1, s, s * b, n, c]
    ids, pos, slots, starts, ctx, tables, sample, ops = payload.split(sizes)
    metadata = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=starts.to(device, torch.int32),
        context_lens=ctx.to(device, torch.int32),
        block_tables=tables.view(s, b).to(device, torch.int32),
        max_query_len=max_q,
        max_context_len=max_ctx,
        host_query_starts=tuple(starts.tolist()),  # the payload is on the host
        host_context_lens=tuple(ctx.tolist()),
    )
    inputs = ModelInputs(ids.to(device), pos.to(device), metadata, sample.to(device))
    return StepMessage(inputs, decode_ops(ops.tolist()))


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
    payload = torch.empty(_payload_len(header), dtype=torch.int64)
    dist.broadcast(payload, group=group, group_src=0)
    return unpack(header, payload, device)
