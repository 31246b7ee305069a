"""A KV block's identity: one content address, the same in every process and after a restart.

A full block's keys and values are a function of every token up to its end and of
everything that turns tokens into bytes: the weights, the dtype the model runs in, the KV
cache's format, the block size, the layer and head geometry, and which heads a tensor-
parallel rank holds. So a block's key chains them (vLLM's block hashes, SGLang HiCache's
page keys):

    root     = H("minserve-kv-v1" | the fingerprint's fields)
    key(b_0) = H(root     | tokens of block 0)
    key(b_i) = H(key(b_i-1) | tokens of block i)

One key stands for the whole prefix up to its block's end, so two prompts share block i's
key exactly when they share their first (i + 1) * block_size tokens and the fingerprint. H
is BLAKE2b with a 16-byte digest over little-endian int64 token ids: deterministic across
processes and machines (Python's `hash()` is salted per process). The prefix cache's host
tier stores blocks under these keys; the disk tier, KV events and the router use them too.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

BlockKey = bytes  # 16 bytes: a block's content address
KEY_BYTES = 16
_VERSION = b"minserve-kv-v1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_READ_CHUNK = 1 << 22


@dataclass(frozen=True)
class KVFingerprint:
    """Everything besides the tokens that makes a block's bytes what they are."""

    weights: str  # hex digest of the weight files' contents (`weights_digest`)
    dtype: str  # the dtype the model computes in: "float32", "bfloat16", ...
    kv_format: str  # how the pool stores K and V: "float32", "int8", ...
    quantization: str  # the weights' in-memory format after load: "none", "q8_0", ...
    compute: str  # the kernels that compute K and V ("cpu:c", "cuda:torch"): their rounding
    block_size: int
    num_layers: int
    num_kv_heads: int  # the model's, before any split
    head_dim: int
    tp_rank: int = 0  # a tensor-parallel rank holds its share of the heads
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.block_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"a fingerprint needs block_size >= 1 and 0 <= tp_rank < tp_size, got "
                f"block_size={self.block_size}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"
            )

    def root(self) -> BlockKey:
        """The key every chain starts from: a digest of the fields, in a fixed order."""
        fields = "\x1f".join(f"{name}={value}" for name, value in sorted(asdict(self).items()))
        return _digest(_VERSION, fields.encode())


def _digest(*parts: bytes) -> BlockKey:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


# The root of a KV cache that shares its blocks with no other process (a KV cache manager
# built without a fingerprint, as in tests): keys still chain, but name no model.
UNSHARED_ROOT: BlockKey = _digest(_VERSION, b"unshared")


# >>> exercise 11.1: the chained block key
def next_key(parent: BlockKey, tokens: Sequence[int]) -> BlockKey:
    """The key of the block holding `tokens`, after the block (or root) keyed `parent`:
    BLAKE2b with a `KEY_BYTES`-byte digest over the parent's bytes, then each token id as
    8 bytes, little-endian, signed. A parent that is not `KEY_BYTES` long is a ValueError
    that says so."""
    # >>> solution
    if len(parent) != KEY_BYTES:
        raise ValueError(f"a parent key has {KEY_BYTES} bytes, got {len(parent)}")
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()
    # <<< solution


def block_keys(root: BlockKey, token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """The keys of the full blocks of `token_ids`, in order: block i's key chains from
    block i-1's (block 0's from `root`), so it names the whole prefix up to its end. A
    partial last block has no key yet."""
    # >>> solution
    keys, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = next_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
    # <<< solution


# <<< exercise


def weights_digest(path: Path) -> str:
    """A digest of the weights at `path` (a file, or a checkpoint folder's weight files):
    their names and contents, so two copies of one checkpoint agree and any changed byte
    does not. Computed once per process for a file that has not changed."""
    files = [path] if path.is_file() else sorted(_weight_files(path))
    if not files:
        raise ValueError(f"no weight files ({', '.join(_WEIGHT_SUFFIXES)}) under {path}")
    stamps = tuple((str(f.resolve()), *_stamp(f)) for f in files)
    return _digest_files(stamps)


def _weight_files(folder: Path) -> Iterable[Path]:
    return (f for f in folder.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file())


def _stamp(path: Path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


@cache
def _digest_files(stamps: tuple[tuple[str, int, int], ...]) -> str:
    """sha256 over (name, contents) of each file; `stamps` (path, size, mtime) key the cache."""
    h = hashlib.sha256()
    for name, _, _ in stamps:
        h.update(Path(name).name.encode() + b"\x00")
        with open(name, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                h.update(chunk)
    return h.hexdigest()
