"""The vocabulary split over ranks: a vocab-parallel embedding and LM head (Megatron-LM).

The embedding table and the LM head are the largest matrices of a small model (SmolLM2:
49152 x 576 of its 135M parameters). Each rank keeps a contiguous block of the vocabulary,
padded so every block has the same size:

- Embedding: a rank looks up the token ids that fall in its block and writes zeros for
  the others; an all-reduce then gives every rank every token's row.
- LM head: a rank scores its block of the vocabulary; rank 0, which samples, gathers the
  blocks into the full logits and drops the padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minserve.distributed.comm import Communicator
from minserve.distributed.layers import meta_parameter


# >>> exercise 7.4: the vocabulary-parallel embedding and LM head
def vocab_block(vocab_size: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s token ids: blocks of ceil(vocab / world_size), the last one shorter.

    Every rank but the last holds ceil(vocab / world_size) ids; the last holds what is left,
    which may be nothing at all (vocab 5 over 4 ranks: blocks of 2, rank 3 gets range(5, 5)).
    """
    # >>> solution
    per_rank = math.ceil(vocab_size / world_size)
    return range(min(rank * per_rank, vocab_size), min((rank + 1) * per_rank, vocab_size))
    # <<< solution


class VocabParallelEmbedding(nn.Module):
    """Token id -> hidden vector, with this rank holding only its block of the table."""

    def __init__(
        self, vocab_size: int, hidden_size: int, comm: Communicator, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.rows = vocab_block(vocab_size, comm.rank, comm.world_size)
        self.padded_rows = math.ceil(vocab_size / comm.world_size)
        self.weight = meta_parameter((self.padded_rows, hidden_size), dtype)  # [V_local, hidden]

    def shard(self, weight: torch.Tensor, bias: None = None) -> dict[str, torch.Tensor]:
        """The full table [V, hidden] -> this rank's block, zero-padded to [V_local, hidden].

        V_local is `self.padded_rows` on every rank: rows `self.rows` of the table, then
        zero rows up to that size (the last rank's block can be short, even empty).
        """
        # >>> solution
        block = weight[self.rows.start : self.rows.stop]
        padding = weight.new_zeros(self.padded_rows - len(self.rows), weight.shape[1])
        return {"weight": torch.cat([block, padding])}
        # <<< solution

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden] (one all-reduce).

        Look up the ids in this rank's block (`self.rows`) in the local table; every other
        id gets a zero row, so that the all-reduce adds exactly one real row per token. Ids
        of other blocks must not index outside the local table.
        """
        # >>> solution
        local_ids = input_ids - self.rows.start
        mine = (local_ids >= 0) & (local_ids < len(self.rows))  # [T]
        x = F.embedding(local_ids.clamp(0, self.padded_rows - 1), self.weight)  # [T, hidden]
        x = x * mine[:, None].to(x.dtype)  # rows of other ranks' tokens become zeros
        return self.comm.all_reduce(x)
        # <<< solution


class ParallelLMHead(nn.Module):
    """hidden -> logits over this rank's vocabulary block; rank 0 gathers the whole row."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.comm = embedding.comm
        self.vocab_size = embedding.vocab_size
        self.rows = embedding.rows
        self.padded_rows = embedding.padded_rows
        if tied:  # SmolLM2: the LM head is the embedding table, block for block
            self.weight = embedding.weight
        else:
            self.weight = meta_parameter(tuple(embedding.weight.shape), embedding.weight.dtype)

    shard = VocabParallelEmbedding.shard

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] on rank 0; [N, 0] elsewhere (they never sample).

        Score this rank's (padded) block, then `self.comm.gather(local)`: rank 0 receives
        every block side by side, [N, world_size * V_local], other ranks None. Rank 0 drops
        the padding columns, which sit past `self.vocab_size`.
        """
        # >>> solution
        local = F.linear(hidden, self.weight)  # [N, V_local]
        logits = self.comm.gather(local)  # rank 0: [N, world_size * V_local]
        return local[:, :0] if logits is None else logits[:, : self.vocab_size]
        # <<< solution


# <<< exercise
