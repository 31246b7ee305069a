"""The paged KV pool: one preallocated tensor holding every layer's keys and values.

PagedAttention's memory: instead of one contiguous [max_len] cache per sequence, the pool
is cut into fixed-size blocks and a sequence's tokens live wherever its block table says.
Attention reads `k_cache(layer)` / `v_cache(layer)` through the block tables; this module
only owns the memory, sizes it, and copies blocks (copy-on-write, swapping).
Values are stored in a `KVFormat` (`kv_format.py`): the model's dtype, fp8 or int8.
The class is chapter 01's exercise 1.3 (the marked region below).
"""

from __future__ import annotations

import torch

from minserve.config import DEFAULT_KV_CACHE_BYTES, CacheConfig
from minserve.kvcache.kv_format import KVFormat, stored_format
from minserve.model_config import ModelConfig


# >>> exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)
class PagedKVPool:
    """The paged KV pool: per layer K and V shaped [num_blocks, block_size, num_kv_heads, row].

    All layers live in one tensor [num_layers, 2 (K, V), num_blocks, block_size, Hkv, row],
    so a block's whole KV (every layer) moves with one indexing operation. `row` is head_dim
    values in the format's storage dtype (int8: head_dim + 2 bytes, see `kv_format.py`).

    You write the pool's size (`bytes_per_block`: what one block costs; `num_blocks_for`:
    how many blocks a byte budget holds), its memory (the tensor `self.kv`, in `__init__`,
    with each layer's K and V views in `self._layers`) and the block moves the engine asks
    of it (`copy_blocks` for copy-on-write, `gather_blocks` and the store of `write_blocks`
    for swapping, through `_index`). Plug it into the engine with
    `LLM(plugins=CoursePlugins(kv_pool_cls=PagedKVPool))`.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | KVFormat,
        device: torch.device | str,
    ) -> None:
        """Allocate the whole pool up front: `self.kv`, zeros of the format's storage dtype
        on `device`, shaped as the class says; then `self._layers[i]`, layer i's (K, V)
        views of it (`kv[i, 0]` and `kv[i, 1]`: views, so the model's writes land in `kv`)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be at least 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.format = as_format(dtype)
        self.dtype = self.format.storage_dtype  # what the pool tensor holds
        self.device = torch.device(device)
        self.block_nbytes = self.bytes_per_block(model_config, block_size, self.format)
        # >>> solution
        row = self.format.row_size(model_config.head_dim)  # head_dim values, as stored
        # zeros, not empty: unused slots must never hold NaNs a masked kernel could touch
        self.kv = torch.zeros(
            (model_config.num_layers, 2, num_blocks, block_size, model_config.num_kv_heads, row),
            dtype=self.dtype,
            device=self.device,
        )  # [num_layers, 2, num_blocks, block_size, Hkv, row]
        # each layer's views made once: attention asks for them every layer of every step
        self._layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(model_config.num_layers)]
        # <<< solution

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys, [num_blocks, block_size, Hkv, D]; a view, writes go to the pool."""
        return self._layers[layer][0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s values, [num_blocks, block_size, Hkv, D]; a view into the pool."""
        return self._layers[layer][1]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every layer, K and V (copy-on-write after a fork).

        One indexing operation for all the (src, dst) pairs, whatever their number (none:
        nothing to do); every src is read before any dst is written.
        """
        # >>> solution
        if not copies:
            return
        src, dst = (self._index(blocks) for blocks in zip(*copies))
        self.kv[:, :, dst] = self.kv[:, :, src]
        # <<< solution

    def gather_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A copy of these blocks' KV in every layer, on the pool's device (for sending).

        Shape [num_layers, 2, len(blocks), block_size, Hkv, row], in the stored format.
        """
        # >>> solution
        return self.kv[:, :, self._index(blocks)]
        # <<< solution

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """`gather_blocks` as a host tensor (for swapping out); pinned on a GPU, so that
        copying it back can overlap other work (`write_blocks`)."""
        data = self.gather_blocks(blocks)
        if self.device.type == "cpu":
            return data  # the gather made a copy already
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        host.copy_(data, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the host reads it next
        return host

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """The inverse of `read_blocks`: put `data` into these blocks (for swapping in),
        moved to the pool's device and dtype (without blocking: from pinned memory the copy
        runs on the stream, ahead of the kernels that read it)."""
        expected = self.kv.shape[:2] + (len(blocks),) + self.kv.shape[3:]
        if data.shape != expected:
            raise ValueError(
                f"data for {len(blocks)} blocks must be shaped {tuple(expected)}, "
                f"got {tuple(data.shape)}"
            )
        if self.format.quantized and data.dtype != self.dtype:
            raise ValueError(
                f"data for a {self.format.name} pool must hold its stored bytes ({self.dtype}), "
                f"got {data.dtype}"
            )
        # >>> solution
        self.kv[:, :, self._index(blocks)] = data.to(self.device, self.dtype, non_blocking=True)
        # <<< solution

    @property
    def nbytes(self) -> int:
        """Bytes the pool occupies (every layer, K and V)."""
        return self.kv.numel() * self.kv.element_size()

    @staticmethod
    def bytes_per_block(
        model_config: ModelConfig, block_size: int, dtype: torch.dtype | KVFormat
    ) -> int:
        """Bytes of one block in every layer: layers x (K, V) x block_size x Hkv x bytes per
        token and head (head_dim x itemsize, or the format's row: `bytes_per_token_head`)."""
        # >>> solution
        per_head = as_format(dtype).bytes_per_token_head(model_config.head_dim)
        return block_size * 2 * model_config.num_layers * model_config.num_kv_heads * per_head
        # <<< solution

    @classmethod
    def num_blocks_for(
        cls, cache_config: CacheConfig, model_config: ModelConfig, dtype: torch.dtype | KVFormat
    ) -> int:
        """`cache_config.num_blocks` if set, else as many whole blocks as the byte budget
        holds: `kv_cache_memory_bytes`, or `DEFAULT_KV_CACHE_BYTES` when that is None. A
        budget too small for one block raises the ValueError `holds_no_block` makes."""
        # >>> solution
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        budget = cache_config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
        per_block = cls.bytes_per_block(model_config, cache_config.block_size, dtype)
        if budget < per_block:
            raise holds_no_block(budget, per_block, cache_config.block_size, model_config, dtype)
        return budget // per_block
        # <<< solution

    def _index(self, blocks: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Block ids as an index tensor (int64) on the pool's device; ids outside the pool
        raise ValueError naming them (before anything is read or written)."""
        # >>> solution
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} are outside the pool (0 .. {self.num_blocks - 1})")
        return torch.tensor(blocks, dtype=torch.long, device=self.device)
        # <<< solution


# <<< exercise


def holds_no_block(
    budget: int, per_block: int, block_size: int, model_config: ModelConfig,
    dtype: torch.dtype | KVFormat,
) -> ValueError:  # fmt: skip
    """The error for a KV budget smaller than one block of `per_block` bytes, with the
    arithmetic behind that figure."""
    m, fmt = model_config, as_format(dtype)
    return ValueError(
        f"kv_cache_memory_bytes={budget} holds no block: one block of {block_size} tokens "
        f"needs {per_block} bytes ({m.num_layers} layers x K,V x {m.num_kv_heads} KV heads x "
        f"{fmt.bytes_per_token_head(m.head_dim)} bytes per token and head: head_dim "
        f"{m.head_dim} in {fmt.name}); raise the budget, lower block_size or store the cache "
        "in 8 bits (kv_cache_dtype)"
    )


def as_format(dtype: torch.dtype | KVFormat) -> KVFormat:
    """A plain dtype is the format that stores values in that dtype."""
    return dtype if isinstance(dtype, KVFormat) else stored_format(dtype)
