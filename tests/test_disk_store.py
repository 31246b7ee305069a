"""The disk tier's store (minserve/kvcache/disk_store.py): blocks come back bit for bit,
files appear whole or not at all, nothing is unpickled, the size stays bounded with the
least recently used blocks going first, and a restart or a second instance on the same
directory finds what was written."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch

from minserve.kvcache.block_key import UNSHARED_ROOT, block_keys
from minserve.kvcache.disk_store import MAGIC, CorruptBlockError, DiskBlockStore, decode, encode

KEYS = block_keys(UNSHARED_ROOT, list(range(64)), 4)  # 16 distinct block keys


def _block(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A block as the pool reads it: [layers, 2, 1, block_size, Hkv, D]."""
    values = torch.randn(2, 2, 1, 4, 3, 8, generator=torch.Generator().manual_seed(seed))
    return (values * 50).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_a_block_comes_back_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    store = DiskBlockStore(tmp_path, 1 << 20)
    block = _block(0, dtype)
    store.put(KEYS[0], block)
    store.flush()
    got = store.get(KEYS[0])
    assert got is not None and got.dtype == dtype and got.shape == block.shape
    assert torch.equal(got.view(torch.uint8), block.view(torch.uint8))
    assert store.get(KEYS[1]) is None
    assert (store.stats.hits, store.stats.misses) == (1, 1)
    store.close()


def test_the_file_is_named_by_its_key_and_holds_no_pickle(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, 1 << 20)
    store.put(KEYS[2], _block(2))
    store.close()
    path = store.path(KEYS[2])
    assert path.name == KEYS[2].hex() + ".kvb" and path.parent.name == f"{KEYS[2][0]:02x}"
    data = path.read_bytes()
    assert data.startswith(MAGIC) and b"pickle" not in data[:200]
    path.write_bytes(pickle.dumps(_block(2)))  # a pickle where a block should be
    again = DiskBlockStore(tmp_path, 1 << 20)
    assert again.get(KEYS[2]) is None and again.stats.corrupt == 1 and not path.exists()
    again.close()


@pytest.mark.parametrize(
    "data",
    [
        MAGIC + b'{"dtype": "float32", "shape": [2, 2]}\n' + b"\x00" * 15,  # one byte short
        MAGIC + b'{"dtype": "object", "shape": [1]}\n' + b"\x00" * 8,  # not a KV dtype
        MAGIC + b"not json\n",
        b"\x80\x04" + b"\x00" * 40,  # no magic
    ],
    ids=["truncated", "bad dtype", "bad header", "no magic"],
)
def test_decode_refuses_what_is_not_a_block(data: bytes) -> None:
    with pytest.raises(CorruptBlockError):
        decode(data)
    assert torch.equal(decode(encode(_block(5))), _block(5))


def test_writes_are_atomic_and_leftovers_of_a_crash_are_removed(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, 1 << 20)
    store.put(KEYS[3], _block(3))
    store.close()
    folder = store.path(KEYS[3]).parent
    stray = folder / ".tmp-deadbeef"  # a writer that died before its rename
    stray.write_bytes(encode(_block(4))[:50])
    restarted = DiskBlockStore(tmp_path, 1 << 20)
    assert not stray.exists() and len(restarted) == 1
    assert torch.equal(restarted.get(KEYS[3]), _block(3))  # after a restart, same directory
    restarted.close()


def test_the_least_recently_used_blocks_go_first_and_a_restart_keeps_the_order(
    tmp_path: Path,
) -> None:
    size = len(encode(_block(0)))
    store = DiskBlockStore(tmp_path, 3 * size)  # room for three blocks
    for i in range(3):
        store.put(KEYS[i], _block(i))
        store.flush()
        time.sleep(0.01)  # distinct modification times
    assert store.get(KEYS[0]) is not None  # 0 is now the most recent: 1 is the oldest
    time.sleep(0.01)
    store.put(KEYS[3], _block(3))
    store.flush()
    assert KEYS[1] not in store and all(k in store for k in (KEYS[0], KEYS[2], KEYS[3]))
    assert store.nbytes == 3 * size and store.stats.evicted == 1
    store.close()
    smaller = DiskBlockStore(tmp_path, 2 * size)  # a restart with less room drops the oldest
    assert KEYS[2] not in smaller and KEYS[0] in smaller and KEYS[3] in smaller
    smaller.close()


def test_two_instances_share_a_directory(tmp_path: Path) -> None:
    writer, reader = DiskBlockStore(tmp_path, 1 << 20), DiskBlockStore(tmp_path, 1 << 20)
    writer.put(KEYS[5], _block(5))
    writer.flush()
    assert KEYS[5] in reader and torch.equal(reader.get(KEYS[5]), _block(5))
    os.remove(writer.path(KEYS[5]))  # the other instance evicted it
    assert reader.get(KEYS[5]) is None
    writer.close()
    reader.close()


def test_a_read_after_the_page_cache_was_dropped_is_the_same_block(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, 1 << 20)
    store.put(KEYS[6], _block(6))
    store.flush()
    store.drop_page_cache(KEYS[6])
    assert torch.equal(store.get(KEYS[6]), _block(6))
    store.close()
