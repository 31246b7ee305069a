"""PagedAttention on a CPU with C kernels (the default CPU backend).

Per layer: the step's k/v go to their slots in one C call; then every query row of the step
attends in one C call that reads its sequence's blocks in place through the block table
(`kernels/paged_attention.c`; vLLM's CPU backend does the same in C++). A decode is one
row; a prompt's chunk is as many rows, each attending to the keys up to its own position
(its context is its position + 1), so prefills, extends and decodes share one kernel and
one pass over the pool. Reading a prompt's keys once per row costs more bytes than a tiled
attention, but a short prompt's keys sit in cache: over 64 prompts of 32-256 tokens the
kernel took 0.46 of the time of torch's flash attention on the prompts' own k/v in bfloat16
(0.7 of it in fp32). Past a megabyte or so of keys the tiles win, so a long prompt's first
chunk (`FLASH_FROM` rows) still runs torch's flash kernel on its own k/v.

The kernels read an fp32 or a bfloat16 pool (a bfloat16 one halves the bytes a decode reads;
its keys and values are widened as they are read and the sums kept in fp32), or an 8-bit one
(`kv_cache_dtype`: fp8 or int8, halving them again): its rows are encoded on the way to their
slots (int8 by the store kernel, fp8 in torch, both as `kv_format.py` does) and widened as
they are read, so every row, a prompt's included, attends over the values the cache holds
(a long first chunk's k/v are encoded and decoded again for torch's kernel).
Another dtype, or a machine where the library cannot be built, runs the plain-torch path
(`paged_torch.py`, the reference these kernels are tested on) for the whole step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minserve.attention.metadata import AttentionMetadata, PagedKVCache, cache_format
from minserve.attention.paged_plan import AttentionGroup, check_tables, plan_step
from minserve.attention.paged_torch import attend_groups, paged_store_reference
from minserve.kernels.build import cpu_kernels
from minserve.kernels.decode_layers import DecodeAttention
from minserve.kvcache.kv_format import Int8Format, attention_dtype


class CpuPagedAttention:
    """`AttentionFn` over a paged KV pool: C kernels store the step's k/v and attend every row."""

    def __init__(
        self, kv: PagedKVCache, metadata: AttentionMetadata, scale: float | None = None
    ) -> None:
        self.kv = kv
        self.metadata = metadata
        self.scale = scale
        cache = kv.k_cache(0)
        check_tables(metadata, cache.shape[1])
        self.lib = cpu_kernels() if uses_kernels(cache) else None
        self.format = cache_format(kv)
        self.dtype = attention_dtype(cache.dtype)
        self.groups: list[AttentionGroup] = []  # the torch path's plan (no C library)
        if self.lib is None:
            self.groups = plan_step(metadata, cache.shape[1], self.dtype)
        # a long prompt's first chunk: torch's flash kernel on its own k/v (see FLASH_FROM)
        lens, starts = metadata.query_lens.long(), metadata.query_start_loc.long()
        first_chunk = metadata.context_lens.long() == lens  # [num_seqs]: nothing cached before
        flash = first_chunk & (lens >= FLASH_FROM.get(self.dtype, min(FLASH_FROM.values())))
        first = metadata.query_starts_list()
        self.flash = [slice(first[i], first[i + 1]) for i in flash.nonzero().flatten().tolist()]
        # every other row is one query of the kernel: its sequence's block table and its own
        # context, its position + 1 (a decode's is the sequence's)
        seqs = torch.repeat_interleave(lens)  # [T] int64
        rows = torch.arange(seqs.numel(), dtype=torch.int64)  # [T]
        contexts = metadata.context_lens.long()[seqs] - lens[seqs] + rows - starts[seqs] + 1
        by_kernel = ~flash[seqs]  # [T]
        self.seqs, self.rows = seqs[by_kernel].contiguous(), rows[by_kernel].contiguous()
        self.context_lens = contexts[by_kernel].to(torch.int32).contiguous()
        self.tables = metadata.block_tables.contiguous()  # [num_seqs, max_blocks] int32
        self.all_decodes = bool((lens == 1).all())

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.metadata.check_num_tokens(q.shape[0])
        k_cache, v_cache = self.kv.k_cache(layer), self.kv.v_cache(layer)
        if self.lib is None:
            paged_store_reference(k_cache, v_cache, k, v, self.metadata.slot_mapping)
            return attend_groups(q, k_cache, v_cache, self.groups, self.scale)
        self.store(k_cache, v_cache, k, v)
        out = torch.empty_like(q)  # [T, Hq, D]
        if self.rows.numel() > 0:
            self.decode(out, q, k_cache, v_cache)
        if self.flash and self.format.quantized:  # the values an 8-bit cache holds, in fp32
            k, v = self.format.as_stored(k), self.format.as_stored(v)
        for rows in self.flash:
            out[rows] = self.fresh_prefill(q[rows], k[rows], v[rows])
        return out

    def kernel_decode(self, dtype: torch.dtype) -> DecodeAttention | None:
        """This step's attention as `decode_layers.c` runs it, for rows of `dtype`: where every
        row is a decode and the C kernels store and read the pool (its dtype `dtype`'s, or
        int8); None otherwise (prefill chunks, an fp8 pool, the torch path)."""
        if self.lib is None or not self.all_decodes:
            return None
        pool = self.kv.k_cache(0).dtype
        kv_int8 = isinstance(self.format, Int8Format) and dtype in INT8_STORES
        if not kv_int8 and (self.format.quantized or pool is not dtype):
            return None
        return DecodeAttention(
            slots=self.metadata.slot_mapping, tables=self.tables,
            context_lens=self.context_lens, seqs=self.seqs, rows=self.rows,
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
        """The kernel's rows' attention (every row but a long first chunk's), written into
        their rows of `out` [T, Hq, D] (k/v stored first). The kernel takes fp32 or bfloat16
        queries and outputs (each task widens its few query rows); a float16 step's are
        converted on the way."""
        kernel = getattr(self.lib, DECODE_KERNELS[k_cache.dtype])
        if q.dtype not in (torch.float32, torch.bfloat16):
            q32, out32 = q.float(), torch.empty(q.shape, dtype=torch.float32)  # [T, Hq, D]
            self.run_decode(kernel, out32, q32, k_cache, v_cache)
            out[self.rows] = out32[self.rows].to(out.dtype)
        else:
            check_rows(q.dtype, q, out)
            self.run_decode(kernel, out, q, k_cache, v_cache)

    def run_decode(
        self, kernel: Callable[..., int], out: torch.Tensor, q: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> None:  # fmt: skip
        """One call of the kernel over every row: q, out fp32 or bf16 [T, Hq, D]; the pool in
        its dtype."""
        _, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1:3]
        scale = self.scale if self.scale is not None else head_dim**-0.5
        status = kernel(
            out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            self.tables.data_ptr(), self.context_lens.data_ptr(),
            self.seqs.data_ptr(), self.rows.data_ptr(), self.rows.numel(),
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
    rows = [t[None].transpose(1, 2) for t in (q, k, v)]  # [1, H, n, D]: 4-D, the flash kernel
    out = F.scaled_dot_product_attention(*rows, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# a prompt's first chunk of at least this many rows (by the attention dtype) runs torch's
# flash kernel on its own k/v: the paged kernel reads a prompt's keys once per row, which
# past a megabyte or so of keys costs more than flash's tiles (`benchmarks/prefill_attention.md`,
# SmolLM2's heads: bf16 1.16x flash's speed at 1024 rows, 0.93x at 2048; fp32 1.03x at 512,
# 0.9x at 1024)
FLASH_FROM = {torch.bfloat16: 2048, torch.float32: 1024}

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
