"""The paged KV pool (sizing, views, copy-on-write copies, swapping blocks) and the host
swap space, on a tiny two-layer model shape; and exercise 1.3's checks of a pool, fed
typical wrong pools."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minserve.config import DEFAULT_KV_CACHE_BYTES, CacheConfig
from minserve.course import checks_ch01_pool as checks
from minserve.kvcache import HostSwapSpace, PagedKVPool, SwapSpaceFullError
from minserve.kvcache.block_ops import apply_block_ops
from minserve.kvcache.host_store import HostBlockStore
from minserve.kvcache.kv_format import KVFormat
from minserve.messages import CopyBlocks, SwapOut
from minserve.model_config import ModelConfig


def _model(num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=32,
        hidden_size=num_kv_heads * 2 * head_dim,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=num_kv_heads * 2,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


MODEL = _model()
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # layers x (K, V) x block_size 4 x Hkv x D x fp32 = 1024


def _pool(num_blocks: int = 6) -> PagedKVPool:
    """A pool whose every value is distinct, so any misplaced copy shows."""
    pool = PagedKVPool(MODEL, num_blocks, 4, torch.float32, torch.device("cpu"))
    pool.kv.copy_(torch.arange(pool.kv.numel(), dtype=torch.float32).view_as(pool.kv))
    return pool


# --- sizing ---------------------------------------------------------------------------


def test_bytes_per_block_counts_every_layer_k_and_v():
    assert PagedKVPool.bytes_per_block(MODEL, 4, torch.float32) == BLOCK_BYTES
    assert PagedKVPool.bytes_per_block(MODEL, 4, torch.bfloat16) == BLOCK_BYTES // 2


def test_bytes_per_block_of_smollm2():
    smollm2 = _model(num_layers=30, num_kv_heads=3, head_dim=64)
    # 30 layers x 2 x 16 tokens x 3 heads x 64 x 2 bytes: 360 KiB per block of 16 tokens
    assert PagedKVPool.bytes_per_block(smollm2, 16, torch.bfloat16) == 368_640


def test_num_blocks_given_as_a_count_is_used_as_is():
    assert PagedKVPool.num_blocks_for(CacheConfig(num_blocks=7), MODEL, torch.float32) == 7


def test_num_blocks_from_a_byte_budget_rounds_down():
    config = CacheConfig(block_size=4, kv_cache_memory_bytes=10_000)
    assert PagedKVPool.num_blocks_for(config, MODEL, torch.float32) == 9  # 10_000 // 1024


def test_num_blocks_without_count_or_budget_uses_the_default_budget():
    config = CacheConfig(block_size=4)
    expected = DEFAULT_KV_CACHE_BYTES // BLOCK_BYTES
    assert PagedKVPool.num_blocks_for(config, MODEL, torch.float32) == expected == 1 << 20


def test_a_budget_below_one_block_is_an_error_with_the_numbers():
    config = CacheConfig(block_size=4, kv_cache_memory_bytes=1000)
    message = "kv_cache_memory_bytes=1000 holds no block: one block of 4 tokens needs 1024 bytes"
    with pytest.raises(ValueError, match=message):
        PagedKVPool.num_blocks_for(config, MODEL, torch.float32)


def test_pool_size_is_blocks_times_bytes_per_block():
    pool = PagedKVPool(MODEL, 5, 4, torch.float32, "cpu")
    assert pool.nbytes == 5 * BLOCK_BYTES == 5 * pool.block_nbytes
    assert (pool.num_blocks, pool.block_size) == (5, 4)
    assert not pool.kv.any()


# --- layer views --------------------------------------------------------------------------


def test_layer_caches_are_views_into_the_pool():
    pool = PagedKVPool(MODEL, 3, 4, torch.float32, "cpu")
    assert pool.k_cache(1).shape == pool.v_cache(1).shape == (3, 4, 2, 8)
    pool.k_cache(1)[2, 3] = 1.0
    pool.v_cache(0)[0, 0] = 2.0
    assert pool.kv.sum() == 16 * 1.0 + 16 * 2.0  # one slot holds Hkv x D = 16 values
    assert (pool.kv[1, 0, 2, 3] == 1).all() and (pool.kv[0, 1, 0, 0] == 2).all()


# --- copying blocks -----------------------------------------------------------------------


def test_copy_blocks_copies_every_layer_k_and_v_and_nothing_else():
    pool = _pool()
    expected = pool.kv.clone()
    expected[:, :, 4] = pool.kv[:, :, 1]
    expected[:, :, 5] = pool.kv[:, :, 2]
    pool.copy_blocks([(1, 4), (2, 5)])
    assert torch.equal(pool.kv, expected)
    for layer in range(MODEL.num_layers):
        assert torch.equal(pool.k_cache(layer)[4], pool.k_cache(layer)[1])
        assert torch.equal(pool.v_cache(layer)[5], pool.v_cache(layer)[2])


def test_copy_blocks_of_nothing_changes_nothing():
    pool = _pool()
    before = pool.kv.clone()
    pool.copy_blocks([])
    assert torch.equal(pool.kv, before)


def test_block_ids_outside_the_pool_are_rejected():
    with pytest.raises(ValueError, match=r"block ids \[6\] are outside the pool \(0 .. 5\)"):
        _pool().copy_blocks([(0, 6)])


def test_read_then_write_blocks_moves_them_through_host_memory():
    pool = _pool()
    expected = pool.kv.clone()
    expected[:, :, [0, 5]] = pool.kv[:, :, [3, 1]]
    data = pool.read_blocks([3, 1])
    assert data.device.type == "cpu" and data.shape == (2, 2, 2, 4, 2, 8)
    pool.write_blocks([0, 5], data)
    assert torch.equal(pool.kv, expected)


def test_write_blocks_checks_the_shape():
    pool = _pool()
    with pytest.raises(ValueError, match=r"data for 3 blocks must be shaped \(2, 2, 3, 4, 2, 8\)"):
        pool.write_blocks([0, 1, 2], pool.read_blocks([0, 1]))


# --- the host swap space --------------------------------------------------------------------


def _swap(capacity_blocks: int) -> HostSwapSpace:
    return HostSwapSpace(capacity_blocks * BLOCK_BYTES, BLOCK_BYTES)


def test_swap_out_then_in_restores_the_blocks_elsewhere():
    pool, swap, store = _pool(), _swap(3), HostBlockStore()
    original = pool.kv[:, :, [1, 2]].clone()
    apply_block_ops([swap.swap_out(7, [1, 2])], pool, store, HostBlockStore())
    assert 7 in swap and swap.num_blocks(7) == 2
    assert (swap.used_bytes, swap.bytes_out, swap.bytes_in) == (2 * BLOCK_BYTES, 2 * BLOCK_BYTES, 0)
    pool.kv.zero_()  # the blocks are reused by other sequences meanwhile
    apply_block_ops([swap.swap_in(7, [4, 0])], pool, store, HostBlockStore())
    assert torch.equal(pool.kv[:, :, [4, 0]], original)
    assert 7 not in swap and 7 not in store
    assert (swap.used_bytes, swap.bytes_out, swap.bytes_in) == (0, 2 * BLOCK_BYTES, 2 * BLOCK_BYTES)


def test_block_ops_run_in_the_order_they_were_decided():
    """A block swapped out and then given to another sequence (a copy writes it) is read
    before it is written."""
    pool, store = _pool(), HostBlockStore()
    pool.kv[:, :, 2] = 2.0
    pool.kv[:, :, 3] = 3.0
    apply_block_ops([SwapOut(7, (2,)), CopyBlocks(3, 2)], pool, store, HostBlockStore())
    assert bool((store.get(7) == 2.0).all()) and bool((pool.kv[:, :, 2] == 3.0).all())


def test_can_swap_out_compares_with_the_remaining_capacity():
    swap = _swap(3)
    swap.swap_out(7, [0])
    assert swap.can_swap_out(2) and not swap.can_swap_out(3)


def test_swapping_out_more_than_the_capacity_raises_and_stores_nothing():
    swap = _swap(3)
    with pytest.raises(SwapSpaceFullError, match="4 blocks needs 4096 bytes, but only 3072 of"):
        swap.swap_out(7, [0, 1, 2, 3])
    assert 7 not in swap and (swap.used_bytes, swap.bytes_out) == (0, 0)


def test_swap_in_into_the_wrong_number_of_blocks_raises_and_keeps_the_copy():
    swap = _swap(3)
    swap.swap_out(7, [1, 2])
    with pytest.raises(ValueError, match="swapped out with 2 blocks, but 1 blocks were given"):
        swap.swap_in(7, [4])
    assert swap.num_blocks(7) == 2 and swap.bytes_in == 0


def test_discard_frees_the_space_without_copying_back():
    pool, swap, store = _pool(), _swap(2), HostBlockStore()
    apply_block_ops([swap.swap_out(7, [1, 2])], pool, store, HostBlockStore())
    apply_block_ops([swap.discard(7)], pool, store, HostBlockStore())
    assert (swap.used_bytes, swap.bytes_in) == (0, 0) and 7 not in swap and 7 not in store
    swap.swap_out(8, [3, 4])  # the space is usable again


def test_unknown_or_repeated_sequences_are_errors():
    swap = _swap(3)
    with pytest.raises(KeyError, match="sequence 9 is not swapped out"):
        swap.swap_in(9, [0])
    swap.swap_out(7, [1])
    with pytest.raises(ValueError, match="sequence 7 is already swapped out"):
        swap.swap_out(7, [2])


def test_swap_space_from_config_is_given_in_gib():
    assert HostSwapSpace.from_config(CacheConfig(swap_space=0.5), 1).capacity_bytes == 1 << 29


def test_read_blocks_is_a_copy_that_write_blocks_puts_back():
    pool = _pool()
    pool.kv.copy_(torch.randn(pool.kv.shape))
    saved = pool.read_blocks([4, 1])  # [layers, 2, 2, bs, Hkv, D]
    expected = pool.kv[:, :, [4, 1]].clone()
    pool.kv.zero_()  # the host copy must not follow the pool
    assert torch.equal(saved, expected) and saved.device.type == "cpu"
    pool.write_blocks([0, 5], saved)
    assert torch.equal(pool.kv[:, :, [0, 5]], expected)
    assert pool.kv[:, :, [1, 2, 3, 4]].abs().sum() == 0


# --- exercise 1.3's checks catch the usual wrong pools --------------------------------------


class _KeysOnly(PagedKVPool):
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.kv[:, 0, dst] = self.kv[:, 0, src]  # forgets the values


class _PairByPair(PagedKVPool):
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.kv[:, :, dst] = self.kv[:, :, src]  # a later src may be an earlier dst


class _NoScaleBytes(PagedKVPool):
    @staticmethod
    def bytes_per_block(model_config, block_size, dtype) -> int:
        itemsize = (dtype.storage_dtype if isinstance(dtype, KVFormat) else dtype).itemsize
        per_head = model_config.head_dim * itemsize  # an int8 row's scale left out
        return block_size * 2 * model_config.num_layers * model_config.num_kv_heads * per_head


class _RoundsUp(PagedKVPool):
    @classmethod
    def num_blocks_for(cls, cache_config, model_config, dtype) -> int:
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        budget = cache_config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
        return -(-budget // cls.bytes_per_block(model_config, cache_config.block_size, dtype))


class _UncheckedIds(PagedKVPool):
    def _index(self, blocks) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)


class _CopiedLayers(PagedKVPool):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._layers = [(k.clone(), v.clone()) for k, v in self._layers]


@pytest.mark.parametrize(
    ("wrong", "check", "message"),
    [
        (_KeysOnly, checks.check_copy_blocks_copies_every_layer_k_and_v,
         r"copy_blocks\(\[\(1, 4\), \(2, 5\)\]\) on a pool of 6 blocks: the pool differs from "
         r"the expected one at layer 0 V block 4"),
        (_PairByPair, checks.check_copy_blocks_copies_every_layer_k_and_v,
         r"block 2 must get block 1's KV as it was before the call .* at layer 0 K block 2"),
        (_NoScaleBytes, checks.check_bytes_per_block_counts_every_layer_k_and_v,
         r"bytes_per_block\(2 layers, 2 KV heads, head_dim 8, block_size=4, int8\): expected "
         r"320 .* got 256 \(an int8 row is head_dim bytes plus a 2-byte scale"),
        (_RoundsUp, checks.check_num_blocks_for_rounds_the_budget_down,
         r"kv_cache_memory_bytes=10000, .* expected 9, got 10"),
        (_RoundsUp, checks.check_a_budget_below_one_block_raises,
         r"expected ValueError \(the budget holds no block\), got 1"),
        (_UncheckedIds, checks.check_block_ids_outside_the_pool_raise,
         r"copy_blocks\(\[\(0, 6\)\]\) .* got torch's IndexError"),
        (_CopiedLayers, checks.check_layer_views_write_into_the_pool,
         r"each layer's \(K, V\) must be views kv\[i, 0\] and kv\[i, 1\]"),
    ],
    ids=lambda x: getattr(x, "__name__", "")[:30],
)  # fmt: skip
def test_the_pool_checks_catch_a_wrong_pool(wrong, check, message):
    with pytest.raises(AssertionError, match=message):
        check(SimpleNamespace(PagedKVPool=wrong))


def test_the_pool_checks_pass_minserve_s_pool():
    for check in checks.POOL_CHECKS:
        check(SimpleNamespace(PagedKVPool=PagedKVPool))
