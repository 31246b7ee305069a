"""Chapter 01's checks of the paged KV pool (exercise 1.3); `checks_ch01` lists them after
the block table's.

The oracles are arithmetic and torch: a block's bytes counted value by value (layers x
K,V x tokens x KV heads x bytes of one stored row), the whole blocks a budget holds, and a
clone of the pool tensor on which each block move is replayed with plain indexing. The pools
are tiny (2 layers, 2 KV heads, head_dim 8, blocks of 4 tokens), filled with distinct
values so that a misplaced copy shows.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from minserve.config import DEFAULT_KV_CACHE_BYTES, CacheConfig
from minserve.kvcache.kv_format import KV_FORMATS, KVFormat
from minserve.model_config import ModelConfig

BLOCK_SIZE = 4
INT8 = KV_FORMATS["int8"]  # a row is head_dim int8 values, then a 2-byte fp16 scale


def _model(num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=num_kv_heads * 2 * head_dim,
        intermediate_size=64, num_layers=num_layers, num_heads=num_kv_heads * 2,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip


TINY = _model()  # one block of 4 tokens in fp32: 2 x 2 x 4 x 2 x 8 x 4 = 1024 bytes
SMOLLM2 = _model(num_layers=30, num_kv_heads=3, head_dim=64)


def _shape(model: ModelConfig) -> str:
    return f"{model.num_layers} layers, {model.num_kv_heads} KV heads, head_dim {model.head_dim}"


def _name(dtype: torch.dtype | KVFormat) -> str:
    return dtype.name if isinstance(dtype, KVFormat) else str(dtype).removeprefix("torch.")


def _row_bytes(model: ModelConfig, dtype: torch.dtype | KVFormat) -> int:
    """Bytes one token's row holds for one KV head: head_dim values (int8: + the scale)."""
    if dtype is INT8:
        return model.head_dim + 2
    storage = dtype.storage_dtype if isinstance(dtype, KVFormat) else dtype  # fp8: 1 byte
    return model.head_dim * storage.itemsize


def _block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype | KVFormat) -> int:
    return model.num_layers * 2 * block_size * model.num_kv_heads * _row_bytes(model, dtype)


def _pool(impl: ModuleType, num_blocks: int = 6, dtype: torch.dtype = torch.float32) -> Any:
    """A pool whose every value is distinct (so any misplaced copy shows)."""
    pool = impl.PagedKVPool(TINY, num_blocks, BLOCK_SIZE, dtype, "cpu")
    pool.kv.copy_(torch.arange(pool.kv.numel(), dtype=torch.float32).view_as(pool.kv))
    return pool


def _differences(got: torch.Tensor, expected: torch.Tensor) -> str:
    """Which (layer, K or V, block) slices of a pool tensor differ, for a message."""
    wrong = (got != expected).flatten(3).any(-1).nonzero().tolist()  # [n, (layer, kv, block)]
    where = [f"layer {layer} {'KV'[kv]} block {block}" for layer, kv, block in wrong]
    return ", ".join(where[:6]) + (f" and {len(where) - 6} more" if len(where) > 6 else "")


def _assert_pool(pool: Any, expected: torch.Tensor, what: str) -> None:
    assert torch.equal(pool.kv, expected), (
        f"{what}: the pool differs from the expected one at {_differences(pool.kv, expected)}"
    )


def check_bytes_per_block_counts_every_layer_k_and_v(impl: ModuleType) -> None:
    """bytes_per_block: layers x K,V x block_size x KV heads x bytes per row, in every format."""
    cases = [
        (SMOLLM2, 16, torch.float32),  # 737,280: the notebook's figure
        (SMOLLM2, 16, torch.bfloat16),
        (TINY, BLOCK_SIZE, torch.float32),
        (_model(num_layers=3, num_kv_heads=1, head_dim=6), 5, torch.float16),
        (TINY, BLOCK_SIZE, KV_FORMATS["fp8_e4m3"]),
        (TINY, BLOCK_SIZE, INT8),
    ]
    for model, block_size, dtype in cases:
        got = impl.PagedKVPool.bytes_per_block(model, block_size, dtype)
        expected = _block_bytes(model, block_size, dtype)
        assert got == expected, (
            f"bytes_per_block({_shape(model)}, block_size={block_size}, {_name(dtype)}): "
            f"expected {expected:,} = {model.num_layers} layers x 2 (K, V) x {block_size} tokens"
            f" x {model.num_kv_heads} KV heads x {_row_bytes(model, dtype)} bytes per row, got "
            f"{got:,}" + (" (an int8 row is head_dim bytes plus a 2-byte scale: the format's "
                          "bytes_per_token_head)" if dtype is INT8 else "")
        )  # fmt: skip


def check_num_blocks_for_rounds_the_budget_down(impl: ModuleType) -> None:
    """num_blocks_for: num_blocks as given, else the whole blocks a budget (1 GiB if none) holds."""
    per_block = _block_bytes(TINY, BLOCK_SIZE, torch.float32)  # 1024
    fp32 = torch.float32
    cases = [  # (num_blocks, kv_cache_memory_bytes, dtype, expected)
        (7, None, fp32, 7),
        (None, 10_000, fp32, 9),
        (None, 3 * per_block, fp32, 3),
        (None, per_block, fp32, 1),
        (None, None, fp32, DEFAULT_KV_CACHE_BYTES // per_block),
        (None, 10_000, INT8, 31),  # int8 blocks of 320 bytes
    ]
    for num_blocks, budget, dtype, expected in cases:
        config = CacheConfig(BLOCK_SIZE, num_blocks=num_blocks, kv_cache_memory_bytes=budget)
        got = impl.PagedKVPool.num_blocks_for(config, TINY, dtype)
        given = (
            f"num_blocks={config.num_blocks}"
            if config.num_blocks is not None
            else f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
        )
        assert got == expected, (
            f"num_blocks_for(CacheConfig({given}, block_size={BLOCK_SIZE}), {_shape(TINY)}, "
            f"{_name(dtype)}; one block is {_block_bytes(TINY, BLOCK_SIZE, dtype)} bytes): "
            f"expected {expected:,}, got {got!r} (a given count is used as is; a budget holds "
            f"only whole blocks; no budget means DEFAULT_KV_CACHE_BYTES = {DEFAULT_KV_CACHE_BYTES})"
        )


def check_a_budget_below_one_block_raises(impl: ModuleType) -> None:
    """A budget smaller than one block raises ValueError (a pool of 0 blocks serves nothing)."""
    config = CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=1000)
    try:
        got = impl.PagedKVPool.num_blocks_for(config, TINY, torch.float32)
    except ValueError as error:
        assert "holds no block" in str(error), (
            f"kv_cache_memory_bytes=1000 with 1024-byte blocks: the ValueError should be "
            f"holds_no_block(...)'s, saying what one block needs; got {str(error)!r}"
        )
        return
    raise AssertionError(
        f"num_blocks_for with kv_cache_memory_bytes=1000 and blocks of 1024 bytes: expected "
        f"ValueError (the budget holds no block), got {got!r}"
    )


def check_the_pool_is_one_zeroed_tensor(impl: ModuleType) -> None:
    """The pool is one zeroed tensor [layers, 2, num_blocks, block_size, Hkv, row], as stored.

    Its dtype is the format's storage dtype; its nbytes are num_blocks x bytes_per_block."""
    for dtype, row, storage in ((torch.float32, 8, torch.float32), (INT8, 10, torch.uint8)):
        pool = impl.PagedKVPool(TINY, 5, BLOCK_SIZE, dtype, "cpu")
        got = (tuple(pool.kv.shape), pool.kv.dtype, pool.kv.device.type)
        expected = ((2, 2, 5, BLOCK_SIZE, 2, row), storage, "cpu")
        assert got == expected, (
            f"PagedKVPool({_shape(TINY)}, num_blocks=5, block_size={BLOCK_SIZE}, "
            f"{_name(dtype)}, 'cpu'): expected kv (shape, dtype, device) = {expected} "
            f"([layers, K/V, num_blocks, block_size, Hkv, row]; the row from the format's "
            f"row_size, the dtype its storage_dtype), got {got}"
        )
        assert not pool.kv.any(), (
            f"a new {_name(dtype)} pool must be all zeros (unused slots must never hold NaNs a "
            "masked kernel could touch): use torch.zeros"
        )
        total = 5 * _block_bytes(TINY, BLOCK_SIZE, dtype)
        assert pool.nbytes == total, (
            f"a {_name(dtype)} pool of 5 blocks: expected nbytes == 5 x bytes_per_block == "
            f"{total}, got {pool.nbytes}"
        )


def check_layer_views_write_into_the_pool(impl: ModuleType) -> None:
    """k_cache(layer) and v_cache(layer) are views [num_blocks, block_size, Hkv, D] of kv."""
    pool = impl.PagedKVPool(TINY, 5, BLOCK_SIZE, torch.float32, "cpu")
    shapes = [(tuple(pool.k_cache(i).shape), tuple(pool.v_cache(i).shape)) for i in range(2)]
    expected_shape = (5, BLOCK_SIZE, 2, 8)
    assert shapes == [(expected_shape, expected_shape)] * 2, (
        f"k_cache(i), v_cache(i) for layers 0 and 1 of a 5-block pool: expected shapes "
        f"{expected_shape} each, got {shapes}"
    )
    expected = pool.kv.clone()
    pool.k_cache(1)[3, 2] = 1.0  # layer 1's keys, block 3, token 2: the model's store
    pool.v_cache(0)[0] = 2.0
    expected[1, 0, 3, 2] = 1.0
    expected[0, 1, 0] = 2.0
    _assert_pool(
        pool, expected, "after writing k_cache(1)[3, 2] = 1 and v_cache(0)[0] = 2 (each "
        "layer's (K, V) must be views kv[i, 0] and kv[i, 1], made once in _layers)",
    )  # fmt: skip


def check_copy_blocks_copies_every_layer_k_and_v(impl: ModuleType) -> None:
    """copy_blocks([(src, dst), ...]) copies whole blocks, every layer, K and V; [] does nothing."""
    pool = _pool(impl)
    expected = pool.kv.clone()
    pool.copy_blocks([])
    _assert_pool(pool, expected, "copy_blocks([]) (nothing to copy)")
    pool.copy_blocks([(1, 4), (2, 5)])
    expected[:, :, [4, 5]] = expected[:, :, [1, 2]]
    _assert_pool(pool, expected, "copy_blocks([(1, 4), (2, 5)]) on a pool of 6 blocks")
    pool = _pool(impl)
    expected = pool.kv.clone()
    pool.copy_blocks([(0, 1), (1, 2)])
    expected[:, :, [1, 2]] = expected[:, :, [0, 1]]
    _assert_pool(
        pool, expected, "copy_blocks([(0, 1), (1, 2)]): block 2 must get block 1's KV as it "
        "was before the call (every src read before any dst is written: one indexing "
        "operation, not a loop over the pairs)",
    )  # fmt: skip


def check_gather_and_write_move_whole_blocks(impl: ModuleType) -> None:
    """gather_blocks copies blocks out, in order; write_blocks stores data cast to the pool's dtype.

    Nothing else in the pool changes."""
    pool = _pool(impl)
    before = pool.kv.clone()
    got = pool.gather_blocks([3, 0])
    expected = before[:, :, [3, 0]]
    assert tuple(got.shape) == tuple(expected.shape) and torch.equal(got, expected), (
        f"gather_blocks([3, 0]): expected kv[:, :, [3, 0]], shape {tuple(expected.shape)}; got "
        f"shape {tuple(got.shape)}" + ("" if got.shape != expected.shape else ", other values")
    )
    got.zero_()
    _assert_pool(pool, before, "after zeroing what gather_blocks returned (it must be a copy)")
    data = torch.full((2, 2, 2, BLOCK_SIZE, 2, 8), 0.5, dtype=torch.float64)  # from the host
    pool.write_blocks([5, 1], data)
    before[:, :, [5, 1]] = 0.5
    _assert_pool(pool, before, "write_blocks([5, 1], float64 data of 0.5), a float32 pool")


def check_block_ids_outside_the_pool_raise(impl: ModuleType) -> None:
    """Block ids outside 0..num_blocks-1 (-1 included) raise ValueError; the pool is unchanged."""
    pool = _pool(impl)
    before = pool.kv.clone()
    data = torch.zeros((2, 2, 1, BLOCK_SIZE, 2, 8))
    moves = {
        "copy_blocks([(0, 6)])": lambda: pool.copy_blocks([(0, 6)]),
        "copy_blocks([(-1, 2)])": lambda: pool.copy_blocks([(-1, 2)]),
        "gather_blocks([-1])": lambda: pool.gather_blocks([-1]),
        "write_blocks([9], ...)": lambda: pool.write_blocks([9], data),
    }
    for what, move in moves.items():
        try:
            move()
        except ValueError:
            _assert_pool(pool, before, f"after the rejected {what}")
            continue
        except IndexError as error:
            raise AssertionError(
                f"{what} on a pool of 6 blocks (ids 0..5): expected ValueError naming the bad "
                f"id, got torch's IndexError ({error}); check the ids in _index first"
            ) from None
        raise AssertionError(
            f"{what} on a pool of 6 blocks (ids 0..5): expected ValueError naming the bad id, "
            "got no error (torch reads -1 as the last block; check ids in _index first)"
        )


POOL_CHECKS = [
    check_bytes_per_block_counts_every_layer_k_and_v,
    check_num_blocks_for_rounds_the_budget_down,
    check_a_budget_below_one_block_raises,
    check_the_pool_is_one_zeroed_tensor,
    check_layer_views_write_into_the_pool,
    check_copy_blocks_copies_every_layer_k_and_v,
    check_gather_and_write_move_whole_blocks,
    check_block_ids_outside_the_pool_raise,
]
