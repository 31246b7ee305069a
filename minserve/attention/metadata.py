"""What a paged-attention backend needs to know about one step (PagedAttention's page tables).

The KV cache is a pool of fixed-size blocks. A sequence's tokens live in the blocks its
*block table* lists, in order: token `p` of a sequence sits in block `table[p // block_size]`
at offset `p % block_size`, which is pool *slot* `block * block_size + offset`. Per step the
engine hands the backend one `AttentionMetadata`; per layer the backend reads the pool through
`PagedKVCache`.

Order convention: sequences appear in the flat batch in the order given, each one's query
tokens contiguous. The engine puts decodes (query length 1) first, then prefill and extend
chunks, but a backend must be correct for any order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from minserve.kvcache.kv_format import KVFormat, stored_format


class PagedKVCache(Protocol):
    """Anything holding per-layer paged K/V, e.g. the engine's `PagedKVPool`."""

    def k_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] keys of one layer (a view)."""
        ...

    def v_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] values of one layer (a view)."""
        ...


def cache_format(kv: PagedKVCache) -> KVFormat:
    """The format of kv's rows: the one the pool holds (the engine's `PagedKVPool`, a
    `kv_codec`'s arithmetic included), else the one its dtype names."""
    held = getattr(kv, "format", None)
    return held if isinstance(held, KVFormat) else stored_format(kv.k_cache(0).dtype)


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens go in the paged KV pool and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] int64: pool slot (block * block_size + offset) per token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths (vLLM's name)
    context_lens: torch.Tensor  # [num_seqs] int32: tokens cached after this step, new included
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_context_len: int
    # the same values as the host's ints, kept from `build` so that no backend reads the
    # device back for them (a GPU would wait on the stream); empty where built otherwise
    host_query_starts: tuple[int, ...] = ()
    host_context_lens: tuple[int, ...] = ()

    def query_starts_list(self) -> list[int]:
        """query_start_loc as host ints: kept from the build, else read from the tensor."""
        return list(self.host_query_starts) or self.query_start_loc.tolist()

    def context_lens_list(self) -> list[int]:
        """context_lens as host ints: kept from the build, else read from the tensor."""
        return list(self.host_context_lens) or self.context_lens.tolist()

    def query_lens_list(self) -> list[int]:
        starts = self.query_starts_list()
        return [b - a for a, b in zip(starts, starts[1:])]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def check_num_tokens(self, num_tokens: int) -> None:
        """A backend called on a batch the metadata was not built from fails here, plainly."""
        if num_tokens != self.num_tokens:
            raise ValueError(
                f"step has {num_tokens} tokens but the attention metadata maps "
                f"{self.num_tokens}; build the metadata from the same batch"
            )

    @property
    def query_lens(self) -> torch.Tensor:
        """[num_seqs] int32: new tokens of each sequence in this step."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def num_decodes(self) -> int:
        """Sequences with exactly one query token, wherever they sit in the batch."""
        return int((self.query_lens == 1).sum())

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
        to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> AttentionMetadata:
        """Pack per-sequence Python lists into device tensors, after checking they agree.
        `to_device` moves each host tensor (a runner's staged copy); else built on `device`."""
        _check_lists(query_lens, context_lens, block_tables, slot_mapping)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        move = to_device or partial(torch.Tensor.to, device=device)
        return cls(
            slot_mapping=move(torch.tensor(slot_mapping, dtype=torch.int64)),  # [T]
            query_start_loc=move(torch.tensor(starts, dtype=torch.int32)),
            context_lens=move(torch.tensor(context_lens, dtype=torch.int32)),
            block_tables=move(
                torch.tensor(padded, dtype=torch.int32).view(len(padded), max_blocks)
            ),  # [num_seqs, max_blocks]
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            host_query_starts=tuple(starts),
            host_context_lens=tuple(context_lens),
        )


def _check_lists(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
) -> None:
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(
            f"got {len(query_lens)} query lengths, {len(context_lens)} context lengths and "
            f"{len(block_tables)} block tables; need one of each per sequence"
        )
    if sum(query_lens) != len(slot_mapping):
        raise ValueError(
            f"query lengths add up to {sum(query_lens)} tokens but slot_mapping has "
            f"{len(slot_mapping)} slots; need one slot per new token"
        )
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        if not 1 <= n <= ctx:
            raise ValueError(
                f"sequence {i} has query length {n} and context length {ctx}; need "
                "1 <= query length <= context length (the context includes the new tokens)"
            )
