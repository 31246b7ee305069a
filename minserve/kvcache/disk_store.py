"""The disk tier's store: KV blocks as files named by their key, in one directory.

One file per block (vLLM's KV offloading to a file system, SGLang HiCache's storage tier):
`<dir>/<key[0]:02x>/<key hex>.kvb`, holding a short header and the block's raw bytes.

- **Atomic.** A block is written to a temporary name in the same directory, then renamed
  (`os.replace`), so a reader sees the whole block or none of it, even with several
  instances writing into one directory; temporary files a crash left are removed at start.
- **No unpickling.** The header is one line of JSON (the dtype's name and the shape),
  checked against a short list of dtypes; the bytes go straight into a tensor
  (`torch.frombuffer`). A file that does not parse is a miss, and is removed.
- **Bounded.** At most `capacity_bytes` of blocks; the least recently used files go first.
  A read touches the file's modification time, so the order survives a restart (the store
  rebuilds its index from the directory). Several instances may share a directory (a store
  shared on one machine); each bounds what it knows of, and a file another one removed is
  simply a miss.
- **Off the critical path.** `put` hands the block to a writer thread and returns; `flush`
  waits for the writes queued so far. A block queued and not yet written is already
  `in` the store, and `get` returns it from memory.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from minserve.kvcache.block_key import KEY_BYTES, BlockKey

MAGIC = b"minserve-kv-block v1\n"
SUFFIX = ".kvb"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
              torch.float8_e4m3fn, torch.float8_e5m2)  # the KV pool's storage dtypes
}  # fmt: skip
_TEMP = ".tmp-"


class CorruptBlockError(ValueError):
    """A block file that is not one: bad magic, header, dtype or size."""


@dataclass
class DiskStats:
    """What the disk tier did, in blocks and bytes."""

    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evicted: int = 0
    corrupt: int = 0


class DiskBlockStore:
    """KV blocks on disk under their keys: atomic writes, raw reads, LRU-bounded."""

    def __init__(self, directory: str | Path, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"a disk tier needs at least 1 byte, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the index: the writer thread and readers share it
        self._index: OrderedDict[BlockKey, int] = OrderedDict()  # key -> bytes, LRU first
        self._nbytes = 0
        self._queued: dict[BlockKey, torch.Tensor] = {}  # put, not yet on disk
        self._evicted: list[BlockKey] = []  # removed for room since `take_evicted`
        self._rebuild_index()
        self._queue: queue.Queue[tuple[BlockKey, torch.Tensor] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
        self._writer.start()

    # --- the index ---

    def _rebuild_index(self) -> None:
        """Scan the directory: blocks oldest first by modification time; stray temporary
        files (a writer that died mid-write) removed."""
        self.directory.mkdir(parents=True, exist_ok=True)
        found = []
        for path in self.directory.glob(f"*/*{SUFFIX}"):
            key = _key_of(path)
            if key is not None:
                stat = path.stat()
                found.append((stat.st_mtime_ns, key, stat.st_size))
        for stray in self.directory.glob(f"*/{_TEMP}*"):
            stray.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._nbytes += size
        self._evict_over_capacity()

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this store knows of (headers included)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[BlockKey]:
        """The keys this store knows of (on disk, or queued), least recently used first."""
        with self._lock:
            return [*self._index, *(k for k in self._queued if k not in self._index)]

    def __contains__(self, key: BlockKey) -> bool:
        """Whether the block is on disk now (another instance may have written it)."""
        return key in self._index or key in self._queued or self.path(key).exists()

    def path(self, key: BlockKey) -> Path:
        """Where the block keyed `key` lives: a folder per first byte, the key in hex."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"a block key has {KEY_BYTES} bytes, got {len(key)}")
        return self.directory / f"{key[0]:02x}" / f"{key.hex()}{SUFFIX}"

    # --- writing ---

    def put(self, key: BlockKey, block: torch.Tensor) -> None:
        """Write `block` under `key` in the background (a copy is taken now, on the host)."""
        copy = block.detach().to("cpu", copy=True).contiguous()
        with self._lock:
            self._queued[key] = copy
        self._queue.put((key, copy))

    def flush(self) -> None:
        """Wait until every block queued so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer."""
        self.flush()
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: BlockKey, block: torch.Tensor) -> None:
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        temp = final.parent / f"{_TEMP}{uuid.uuid4().hex}"
        data = encode(block)
        with open(temp, "wb") as f:
            f.write(data)
        os.replace(temp, final)  # atomic: readers see all of it or none
        with self._lock:
            self._queued.pop(key, None)
            self._nbytes -= self._index.pop(key, 0)
            self._index[key] = len(data)
            self._nbytes += len(data)
            self.stats.bytes_written += len(data)
            self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        while self._nbytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._nbytes -= size
            self.path(key).unlink(missing_ok=True)
            self.stats.evicted += 1
            self._evicted.append(key)

    def take_evicted(self) -> list[BlockKey]:
        """The keys removed to stay within capacity since the last call."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    # --- reading ---

    def get(self, key: BlockKey) -> torch.Tensor | None:
        """The block keyed `key`, read from disk; None on a miss. A file that is not a
        valid block counts as a miss and is removed."""
        with self._lock:
            queued = self._queued.get(key)
        if queued is not None:
            self.stats.hits += 1
            return queued.clone()
        path = self.path(key)
        try:
            with open(path, "rb") as f:  # read straight into the block's own buffer
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except FileNotFoundError:
            self._forget(key)
            self.stats.misses += 1
            return None
        try:
            block = decode(data)
        except CorruptBlockError:
            path.unlink(missing_ok=True)
            self._forget(key)
            self.stats.corrupt += 1
            self.stats.misses += 1
            return None
        os.utime(path)  # most recently used, across restarts too
        with self._lock:
            self._nbytes -= self._index.pop(key, 0)
            self._index[key] = len(data)
            self._nbytes += len(data)
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return block

    def drop_page_cache(self, key: BlockKey) -> None:
        """Ask the kernel to forget its cached pages of the block's file, so the next read
        comes from the disk itself (what a benchmark of the disk tier must measure)."""
        path = self.path(key)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            self._nbytes -= self._index.pop(key, 0)


def encode(block: torch.Tensor) -> bytes:
    """The file's bytes: magic, one JSON line (dtype, shape), then the raw tensor bytes."""
    name = str(block.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"a block of dtype {name} cannot be stored; one of {sorted(_DTYPES)}")
    header = json.dumps({"dtype": name, "shape": list(block.shape)}).encode() + b"\n"
    raw = block.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return MAGIC + header + raw


def decode(data: bytes | bytearray) -> torch.Tensor:
    """A block from its file's bytes, checked: no code runs, no pickle is read. A bytearray
    becomes the tensor's storage (no copy)."""
    if not data.startswith(MAGIC):
        raise CorruptBlockError("not a minserve KV block (bad magic)")
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC) : end])
        dtype, shape = _DTYPES[header["dtype"]], [int(n) for n in header["shape"]]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptBlockError(f"a bad block header: {error}") from None
    size = len(data) - (end + 1)
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if end < 0 or size != expected:
        raise CorruptBlockError(f"a block of {size} bytes where {expected} are expected")
    if not size:
        return torch.empty(shape, dtype=dtype)
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, offset=end + 1, count=size)
    return raw.view(dtype).reshape(shape)


def _key_of(path: Path) -> BlockKey | None:
    """The key a block file's name holds; None for other files."""
    try:
        key = bytes.fromhex(path.name.removesuffix(SUFFIX))
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None
