"""The Triton attention backend: `TorchPagedAttention`'s interface, Triton's kernels.

Built once per step from the step's `AttentionMetadata`: it splits the sequences into
decodes (one query token: `paged_decode`, GQA-grouped, split-K on long contexts) and
prefill/extend chunks (several query tokens: `paged_prefill`), reading the metadata to the
host once. Called per layer: store the step's k/v by slot, then run both kernels.
An 8-bit pool (`kv_cache_dtype`): int8 k/v are quantized by `triton_kv8.py`'s store kernel,
fp8 ones converted in torch and their bytes stored by `paged_store`; decodes run
`triton_kv8.py`'s decode kernel, which widens the bytes as it reads them; prefill and
extend chunks attend over the decoded cache in torch (`paged_torch.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minserve.attention.metadata import AttentionMetadata, PagedKVCache, cache_format
from minserve.attention.paged_plan import AttentionGroup, StepLayout, chunk_groups
from minserve.attention.paged_torch import attend_groups
from minserve.attention.triton_decode import DecodeKernels, paged_decode
from minserve.attention.triton_env import check_kernel_device
from minserve.attention.triton_kv8 import as_bytes, int8_store, kv8_decode
from minserve.attention.triton_prefill import paged_prefill
from minserve.attention.triton_store import paged_store


@dataclass(frozen=True)
class SeqSubset:
    """The metadata of some of a step's sequences (its decodes, or its chunks)."""

    seqs: torch.Tensor  # [S'] int64: which sequences of the step
    query_starts: torch.Tensor  # [S'] int32: row of each one's first query token
    query_lens: torch.Tensor  # [S'] int32
    context_lens: torch.Tensor  # [S'] int32
    block_tables: torch.Tensor  # [S', max_blocks] int32
    max_query_len: int
    max_context_len: int

    @classmethod
    def select(cls, metadata: AttentionMetadata, seqs: list[int]) -> SeqSubset | None:
        """The subset made of sequences `seqs`, or None when there are none (its maxima
        from the host's values: no read of the device)."""
        if not seqs:
            return None
        device = metadata.context_lens.device
        index = torch.tensor(seqs, dtype=torch.int64).to(device, non_blocking=True)
        query_lens, context_lens = metadata.query_lens_list(), metadata.context_lens_list()
        return cls(
            seqs=index,
            query_starts=metadata.query_start_loc[index].contiguous(),
            query_lens=metadata.query_lens[index].contiguous(),
            context_lens=metadata.context_lens[index].contiguous(),
            block_tables=metadata.block_tables[index].contiguous(),
            max_query_len=max(query_lens[i] for i in seqs),
            max_context_len=max(context_lens[i] for i in seqs),
        )


class TritonPagedAttention:
    """`AttentionFn` over a paged KV pool (PagedAttention) with Triton kernels."""

    def __init__(
        self,
        kv: PagedKVCache,
        metadata: AttentionMetadata,
        scale: float | None = None,
        decode_kernels: DecodeKernels | None = None,  # chapter 02 plugs its own in
    ) -> None:
        check_kernel_device(kv.k_cache(0), metadata.block_tables)
        self.kv = kv
        self.decode_kernels = decode_kernels or DecodeKernels()
        self.metadata = metadata
        self.scale = scale
        query_lens = metadata.query_lens_list()
        self.decodes = SeqSubset.select(metadata, [i for i, n in enumerate(query_lens) if n == 1])
        self.chunks = SeqSubset.select(metadata, [i for i, n in enumerate(query_lens) if n > 1])
        # decodes are the step's first rows in the engine's order: then a slice, not a gather
        num_decodes = 0 if self.decodes is None else len(self.decodes.seqs)
        first = query_lens[:num_decodes] == [1] * num_decodes
        self.decode_rows: slice | torch.Tensor = (
            slice(0, num_decodes) if first or self.decodes is None else self.decodes.query_starts
        )
        cache = kv.k_cache(0)
        self.format = cache_format(kv)
        self.groups: list[AttentionGroup] = []  # an 8-bit pool's chunks, run in torch
        if self.format.quantized and self.chunks is not None:
            self.groups = chunk_groups(StepLayout.read(metadata, cache.shape[1]), torch.float32)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.metadata.check_num_tokens(q.shape[0])
        k_cache, v_cache = self.kv.k_cache(layer), self.kv.v_cache(layer)
        if self.format.quantized:
            return self.attend_8bit(q, k, v, k_cache, v_cache)
        paged_store(
            k_cache, v_cache, k, v, self.metadata.slot_mapping, kernel=self.decode_kernels.store
        )
        out = q.new_empty(q.shape)  # [T, Hq, D]
        if self.decodes is not None:
            d = self.decodes
            out[self.decode_rows] = paged_decode(
                q[self.decode_rows], k_cache, v_cache, d.block_tables, d.context_lens,
                d.max_context_len, self.scale, kernel=self.decode_kernels.decode,
                combine_kernel=self.decode_kernels.combine,
            )  # fmt: skip
        if self.chunks is not None:
            c = self.chunks
            paged_prefill(
                q, k_cache, v_cache, c.block_tables, c.query_starts, c.query_lens,
                c.context_lens, c.max_query_len, out, self.scale,
                kernel=self.decode_kernels.prefill,
            )  # fmt: skip
        return out

    def attend_8bit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The step over an 8-bit pool: store encoded bytes, decode in Triton, chunks in torch."""
        fmt = self.format
        if fmt.name == "int8":  # quantized in the store kernel
            int8_store(k_cache, v_cache, k, v, self.metadata.slot_mapping)
        else:  # fp8: converted by torch, its bytes stored
            paged_store(
                as_bytes(k_cache), as_bytes(v_cache), as_bytes(fmt.encode(k)),
                as_bytes(fmt.encode(v)), self.metadata.slot_mapping,
                kernel=self.decode_kernels.store,
            )  # fmt: skip
        out = attend_groups(q, k_cache, v_cache, self.groups, self.scale)  # [T, Hq, D]
        if self.decodes is not None:
            d = self.decodes
            out[self.decode_rows] = kv8_decode(
                q[self.decode_rows], k_cache, v_cache, d.block_tables, d.context_lens, fmt,
                self.scale,
            )  # fmt: skip
        return out
