"""PagedAttention on a CPU with C kernels for the decodes (the default CPU backend).

Per layer: the step's k/v go to their slots in one C call; every decode attends in one C
call that reads its blocks in place through its block table (`kernels/paged_attention.c`);
prefill and extend chunks, few and long, run torch's attention as in `paged_torch.py`,
their reference and fallback. The kernels read an fp32 or a bfloat16 pool (a bfloat16 one
halves the bytes a decode reads; its keys and values are widened as they are read and the
sums kept in fp32), or an 8-bit one (`kv_cache_dtype`: fp8 or int8, halving them again): its
rows are encoded on the way to their slots (int8 by the store kernel, fp8 in torch, both as
`kv_format.py` does), the decode kernel widens them as it reads, a prompt's first chunk
attends over its own rows encoded and decoded again (the values the cache holds), and every
later chunk attends over the decoded cache as the torch reference does. Another dtype, or a
machine where the library cannot be built, runs the plain-torch path for the whole step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minserve.attention.metadata import AttentionMetadata, PagedKVCache, kernel_format
from minserve.attention.paged_plan import StepLayout, chunk_groups, decode_groups
from minserve.attention.paged_torch import attend_groups, is_every_row, paged_store_reference
from minserve.kernels.build import cpu_kernels
from minserve.kernels.decode_layers import DecodeAttention
from minserve.kvcache.kv_format import Int8Format, attention_dtype


class CpuPagedAttention:
    """`AttentionFn` over a paged KV pool: C kernels for store and decode, torch for chunks."""

    def __init__(
        self, kv: PagedKVCache, metadata: AttentionMetadata, scale: float | None = None
    ) -> None:
        self.kv = kv
        self.metadata = metadata
        self.scale = scale
        cache = kv.k_cache(0)
        step = StepLayout.read(metadata, cache.shape[1])
        self.lib = cpu_kernels() if uses_kernels(cache) else None
        self.format = kernel_format(kv, "cpu")
        decodes = step.decodes if self.lib is not None else []
        # a prompt's first chunk attends only to itself: causal attention on the step's own
        # k/v, no gather from the pool, no mask tensor (over an 8-bit cache, on the values
        # the cache holds: the step's own, encoded and decoded again)
        fresh = self.lib is not None
        self.fresh = step.fresh_prefills if fresh else []
        self.dtype = attention_dtype(cache.dtype)
        self.chunks = chunk_groups(step, self.dtype, fresh=not fresh)
        if self.lib is None:  # plain torch for the whole step
            self.chunks = decode_groups(step, self.dtype) + self.chunks
        self.decode_seqs = torch.tensor(decodes, dtype=torch.int64)  # [num_decodes]
        self.decode_rows = torch.tensor([step.starts[i] for i in decodes], dtype=torch.int64)
        self.tables = metadata.block_tables.contiguous()  # [num_seqs, max_blocks] int32
        self.context_lens = metadata.context_lens.contiguous()  # [num_seqs] int32

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.metadata.check_num_tokens(q.shape[0])
        k_cache, v_cache = self.kv.k_cache(layer), self.kv.v_cache(layer)
        if self.lib is None:
            paged_store_reference(k_cache, v_cache, k, v, self.metadata.slot_mapping)
            return attend_groups(q, k_cache, v_cache, self.chunks, self.scale)
        self.store(k_cache, v_cache, k, v)
        if self.fresh and self.format.quantized:  # what the cache holds, in fp32
            k, v = self.format.as_stored(k), self.format.as_stored(v)
        if self.chunks:
            out = attend_groups(q, k_cache, v_cache, self.chunks, self.scale)
        elif len(self.fresh) == 1 and is_every_row(self.fresh[0], q.shape[0]):
            return self.fresh_prefill(q, k, v)  # one prompt alone in the step
        else:
            out = torch.empty_like(q)  # [T, Hq, D]
        for rows in self.fresh:
            out[rows] = self.fresh_prefill(q[rows], k[rows], v[rows])
        if self.decode_seqs.numel() > 0:
            self.decode(out, q, k_cache, v_cache)
        return out

    def kernel_decode(self, dtype: torch.dtype) -> DecodeAttention | None:
        """This step's attention as `decode_layers.c` runs it, for rows of `dtype`: where every
        row is a decode and the C kernels store and read the pool (its dtype `dtype`'s, or
        int8); None otherwise (prefill chunks, an fp8 pool, the torch path)."""
        num_rows = self.metadata.slot_mapping.shape[0]
        if self.lib is None or self.chunks or self.fresh or self.decode_seqs.numel() != num_rows:
            return None
        pool = self.kv.k_cache(0).dtype
        kv_int8 = isinstance(self.format, Int8Format) and dtype in INT8_STORES
        if not kv_int8 and (self.format.quantized or pool is not dtype):
            return None
        return DecodeAttention(
            slots=self.metadata.slot_mapping, tables=self.tables,
            context_lens=self.context_lens, seqs=self.decode_seqs, rows=self.decode_rows,
            block_size=self.kv.k_cache(0).shape[1],
            scale=self.scale,
            kv_int8=kv_int8, caches=lambda layer: (self.kv.k_cache(layer), self.kv.v_cache(layer)),
        )  # fmt: skip

    def fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A prompt's first chunk over itself, in the cache's attention dtype."""
        out = fresh_prefill(q.to(self.dtype), k.to(self.dtype), v.to(self.dtype), self.scale)
        return out.to(q.dtype)

    def store(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v [T, Hkv, D] (rows may be strided, each row contiguous) -> their slots, an
        8-bit cache's rows [T, Hkv, row] encoded on the way: int8 rows in C, fp8 in torch."""
        slots = self.metadata.slot_mapping
        if isinstance(self.format, Int8Format) and k.dtype in INT8_STORES:
            check_rows(k.dtype, k, v)
            getattr(self.lib, INT8_STORES[k.dtype])(
                k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                slots.data_ptr(), slots.numel(), k.stride(0), v.stride(0), *k.shape[1:],
            )  # fmt: skip
            return
        if self.format.quantized:
            k, v = self.format.encode(k), self.format.encode(v)
        check_rows(k_cache.dtype, k, v)
        size = k.element_size()
        self.lib.store_kv(
            k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
            slots.numel(), k.stride(0) * size, v.stride(0) * size, k[0].numel() * size,
        )  # fmt: skip

    def decode(
        self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """Every decode's attention, written into its row of `out` [T, Hq, D]. The kernel
        takes fp32 or bfloat16 queries and outputs (each task widens its few query rows);
        a float16 step's are converted on the way."""
        kernel = getattr(self.lib, DECODE_KERNELS[k_cache.dtype])
        if q.dtype not in (torch.float32, torch.bfloat16):
            q32, out32 = q.float(), torch.empty(q.shape, dtype=torch.float32)  # [T, Hq, D]
            self.run_decode(kernel, out32, q32, k_cache, v_cache)
            out[self.decode_rows] = out32[self.decode_rows].to(out.dtype)
        else:
            check_rows(q.dtype, q, out)
            self.run_decode(kernel, out, q, k_cache, v_cache)

    def run_decode(
        self, kernel: Callable[..., int], out: torch.Tensor, q: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> None:  # fmt: skip
        """One call of the decode kernel: q, out fp32 or bf16 [T, Hq, D]; the pool in its
        dtype."""
        _, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1:3]
        scale = self.scale if self.scale is not None else head_dim**-0.5
        status = kernel(
            out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            self.tables.data_ptr(), self.context_lens.data_ptr(),
            self.decode_seqs.data_ptr(), self.decode_rows.data_ptr(), self.decode_seqs.numel(),
            q.stride(0), out.stride(0), self.tables.stride(0), block_size,
            num_heads, num_kv_heads, head_dim, scale, int(q.dtype == torch.bfloat16),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the paged decode kernel could not allocate its score buffers")


def fresh_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Causal GQA attention of a prompt's first chunk over itself: q [n, Hq, D], k and v
    [n, Hkv, D] -> [n, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q[None].transpose(1, 2),
        k[None].transpose(1, 2),
        v[None].transpose(1, 2),  # [1, H, n, D]
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )  # fmt: skip (4-D, as torch's flash kernel for CPUs wants; 3-D takes the slow math path)
    return out[0].transpose(0, 1)


INT8_STORES = {  # the store kernel that encodes k and v of this dtype into an int8 pool
    torch.float32: "store_kv_int8_f32",
    torch.bfloat16: "store_kv_int8_bf16",
}
DECODE_KERNELS = {  # the pools `paged_attention.c` reads: its decode kernel for each
    torch.float32: "paged_decode_f32",
    torch.bfloat16: "paged_decode_bf16",
    torch.float8_e4m3fn: "paged_decode_e4m3",
    torch.float8_e5m2: "paged_decode_e5m2",
    torch.uint8: "paged_decode_i8",  # int8 values and fp16 scales (`kv_format.py`)
}
CACHE_DTYPES = tuple(DECODE_KERNELS)


def uses_kernels(cache: torch.Tensor) -> bool:
    """The C kernels take an fp32, bfloat16 or 8-bit, contiguous, host-memory pool layer."""
    return cache.device.type == "cpu" and cache.dtype in CACHE_DTYPES and cache.is_contiguous()


def check_rows(dtype: torch.dtype, *tensors: torch.Tensor) -> None:
    """The kernels step over tokens by stride but read each token's heads as one run, in the
    pool's dtype."""
    for t in tensors:
        _, heads, dim = t.shape
        if t.stride(2) != 1 or t.stride(1) != dim or t.dtype != dtype:
            raise ValueError(
                f"the CPU kernels need {dtype} [T, H, D] tensors with contiguous heads, as the "
                f"KV pool; got {t.dtype} of shape {tuple(t.shape)} and strides {t.stride()}"
            )
