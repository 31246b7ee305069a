"""A KV block's identity (minserve/kvcache/block_key.py): the same key in every process,
chained so a key names its whole prefix, and different whenever anything that makes the
block's bytes differs; the host tier stores blocks under it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from minserve.kvcache.block_key import (
    KEY_BYTES,
    UNSHARED_ROOT,
    KVFingerprint,
    block_keys,
    next_key,
    weights_digest,
)

FINGERPRINT = KVFingerprint(
    weights="ab" * 32, dtype="float32", kv_format="float32", quantization="none",
    compute="cpu:c-kernels", block_size=4, num_layers=30, num_kv_heads=3, head_dim=64,
)  # fmt: skip
TOKENS = list(range(100, 118))  # 4 full blocks of 4 and 2 tokens over


def test_keys_chain_over_full_blocks_only() -> None:
    keys = block_keys(FINGERPRINT.root(), TOKENS, 4)
    assert len(keys) == 4 and all(len(k) == KEY_BYTES for k in keys)
    assert keys[0] == next_key(FINGERPRINT.root(), TOKENS[:4])
    assert keys[2] == next_key(keys[1], TOKENS[8:12])  # the chain: parent, then tokens


def test_a_shared_prefix_shares_exactly_its_blocks_keys() -> None:
    other = TOKENS[:9] + [7] + TOKENS[10:]  # differs in block 2 (tokens 8-11)
    mine, theirs = (block_keys(FINGERPRINT.root(), t, 4) for t in (TOKENS, other))
    assert mine[:2] == theirs[:2] and all(a != b for a, b in zip(mine[2:], theirs[2:]))
    # the same tokens in block 3 after a different block 2: a different key
    assert mine[3] != theirs[3]


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(KVFingerprint)])
def test_every_field_of_the_fingerprint_changes_the_keys(field: str) -> None:
    value = getattr(FINGERPRINT, field)
    changed = (value + "x") if isinstance(value, str) else value + 1
    if field == "tp_rank":  # a rank must stay below the size
        other = dataclasses.replace(FINGERPRINT, tp_size=2, tp_rank=1)
        base = dataclasses.replace(FINGERPRINT, tp_size=2, tp_rank=0)
    else:
        other, base = dataclasses.replace(FINGERPRINT, **{field: changed}), FINGERPRINT
    assert block_keys(other.root(), TOKENS, 4) != block_keys(base.root(), TOKENS, 4)
    assert other.root() != base.root() != UNSHARED_ROOT


def test_another_process_computes_the_same_keys() -> None:
    """Python's hash() is salted per process; the keys are not."""
    code = (
        "from minserve.kvcache.block_key import KVFingerprint, block_keys\n"
        f"f = {FINGERPRINT!r}\n"
        f"print(','.join(k.hex() for k in block_keys(f.root(), {TOKENS!r}, 4)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"},
    )  # fmt: skip
    assert out.stdout.strip() == ",".join(
        k.hex() for k in block_keys(FINGERPRINT.root(), TOKENS, 4)
    )


def test_the_weights_digest_follows_the_bytes_not_the_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\x01" * 1000)
        (folder / "config.json").write_text("{}")  # not a weight file
    assert weights_digest(a) == weights_digest(b) == weights_digest(a / "model.safetensors")
    (b / "model.safetensors").write_bytes(b"\x01" * 999 + b"\x02")
    assert weights_digest(a) != weights_digest(b)
    with pytest.raises(ValueError, match="no weight files"):
        weights_digest(tmp_path)


def test_a_fingerprint_refuses_a_rank_outside_its_size() -> None:
    with pytest.raises(ValueError, match="tp_rank < tp_size"):
        dataclasses.replace(FINGERPRINT, tp_rank=2, tp_size=2)


@pytest.mark.slow
def test_an_engines_fingerprint_names_its_model_and_pool() -> None:
    from minserve import LLM

    llm = LLM(num_blocks=32, block_size=16, enable_prefix_caching=True, kv_offloading_size=0.01)
    engine = llm.engine
    fingerprint = engine.kv_fingerprint(engine.worker.pool)
    assert fingerprint.block_size == 16 and fingerprint.num_layers == 30
    assert fingerprint.weights == weights_digest(llm.loaded.path)
    assert engine.kv.prefix.host.root == fingerprint.root()  # the host tier's keys chain from it
    again = LLM(llm.loaded, num_blocks=32, block_size=8).engine
    assert again.kv_fingerprint(again.worker.pool).root() != fingerprint.root()


def test_the_routers_prefix_hashes_are_the_same_in_another_process() -> None:
    """The router's guess of a replica's cache (router/prefix_index.py) chains the same keys."""
    from minserve.router.prefix_index import chunk_hashes

    code = (
        "from minserve.router.prefix_index import chunk_hashes\n"
        "print(','.join(h.hex() for h in chunk_hashes('The capital of France is', 4)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "7"},
    )  # fmt: skip
    here = chunk_hashes("The capital of France is", 4)
    assert len(here) == 6 and out.stdout.strip() == ",".join(h.hex() for h in here)
    assert chunk_hashes("The capital of Spain", 4)[:3] == here[:3] != chunk_hashes("Tha", 1)
