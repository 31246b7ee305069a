"""Checks for chapter 11 (the state plane), run against any module that defines
`next_key`, `block_keys`, `plan_load` and `ExactIndex`: minserve's own, the solutions, or a
student's exercise file.

Oracles: the block keys are recomputed here with `hashlib` from their definition, and in a
second Python process (whose `hash()` is salted differently); the load plan against a
brute-force minimum over every cut point and a case worked out on paper (a disk with 5 ms
of latency, 1 ms a block to load, 2 ms a block to recompute); the index against the
publisher's own state (`EventLog.held`, what its batches add up to) after a random stream
of events with batches dropped on the way.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from minserve.course.randomized import randomized
from minserve.kvcache.kv_events import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventLog,
    KVEvent,
)
from minserve.kvcache.load_plan import TierSpeed

ROOT = hashlib.blake2b(b"a chapter 11 root", digest_size=16).digest()
QUIET = randomized(150, shrink=False)  # the first failing run, at once


def _key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The definition: BLAKE2b-128 over the parent, then each token as 8 bytes LE signed."""
    data = parent + b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)
    return hashlib.blake2b(data, digest_size=16).digest()


# --- 11.1 the chained block key ---


def check_a_key_digests_its_parent_and_tokens(impl: ModuleType) -> None:
    """next_key: BLAKE2b-128 of the parent's 16 bytes, then each token as 8 bytes LE"""
    for tokens in ([1, 2, 3, 4], [0], [], [2**40, -1, 7]):
        got, want = impl.next_key(ROOT, tokens), _key(ROOT, tokens)
        assert isinstance(got, bytes) and len(got) == 16, (
            f"a key is 16 bytes; next_key(ROOT, {tokens}) returned {got!r}"
        )
        assert got == want, (
            f"next_key(ROOT, {tokens}) = {got.hex()}, expected {want.hex()} (BLAKE2b with "
            "digest_size=16 over the parent's bytes, then each token id as 8 bytes, "
            "little-endian, signed)"
        )


def check_a_parent_of_the_wrong_length_is_refused(impl: ModuleType) -> None:
    """next_key refuses a parent that is not 16 bytes (ValueError that says so)"""
    for parent in (b"", ROOT[:8], ROOT + b"x"):
        try:
            impl.next_key(parent, [1, 2])
        except ValueError as error:
            assert "16" in str(error) and str(len(parent)) in str(error), (
                f"the ValueError should name 16 bytes and the {len(parent)} given: {error}"
            )
        else:
            raise AssertionError(f"next_key accepted a parent of {len(parent)} bytes")


def check_block_keys_chain_and_skip_a_partial_block(impl: ModuleType) -> None:
    """block_keys: one key per full block, each from the one before; a partial block none"""
    tokens = list(range(100, 111))  # 11 tokens, blocks of 4: two full blocks
    got = impl.block_keys(ROOT, tokens, 4)
    first = _key(ROOT, tokens[:4])
    want = [first, _key(first, tokens[4:8])]
    assert got == want, (
        f"block_keys(ROOT, 11 tokens, 4) should give 2 keys, block 1's chained from block "
        f"0's; got {len(got)}: {[k.hex()[:8] for k in got]}, expected "
        f"{[k.hex()[:8] for k in want]}"
    )
    assert impl.block_keys(ROOT, tokens[:3], 4) == [], "3 tokens fill no block of 4: no key"


def check_prompts_share_exactly_their_common_blocks(impl: ModuleType) -> None:
    """Two prompts share block i's key exactly when they share their first (i+1)*bs tokens"""

    @QUIET
    @given(st.lists(st.integers(0, 5), min_size=0, max_size=30),
           st.lists(st.integers(0, 5), min_size=0, max_size=30),
           st.lists(st.integers(0, 5), min_size=0, max_size=30), st.integers(1, 5))  # fmt: skip
    def run(common: list[int], a: list[int], b: list[int], size: int) -> None:
        x, y = common + a, common + b
        kx, ky = impl.block_keys(ROOT, x, size), impl.block_keys(ROOT, y, size)
        shared = 0
        while shared < min(len(x), len(y)) and x[shared] == y[shared]:
            shared += 1
        same = sum(1 for i in range(min(len(kx), len(ky))) if kx[i] == ky[i])
        assert same == min(shared // size, len(kx), len(ky)), (
            f"prompts {x} and {y} share {shared} leading tokens: with blocks of {size} they "
            f"share {shared // size} keys, not {same}"
        )

    run()


_OTHER_PROCESS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("student", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["student"] = module
spec.loader.exec_module(module)
print(",".join(k.hex() for k in module.block_keys(bytes.fromhex(sys.argv[2]), range(40), 8)))
"""


def check_keys_are_the_same_in_another_process(impl: ModuleType) -> None:
    """The same tokens get the same keys in a second process (no salted hash())"""
    here = [k.hex() for k in impl.block_keys(ROOT, range(40), 8)]
    path = inspect.getsourcefile(impl.block_keys)
    if path is None:
        raise AssertionError("this check loads your block_keys again in another process: a file")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, path, ROOT.hex()],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, f"loading the module in another process failed:\n{run.stderr}"
    there = run.stdout.strip().split(",")
    assert there == here, (
        "another process computed different keys for the same 40 tokens: keys must not "
        "depend on the process (Python's hash() of str and bytes is salted per process)"
    )


# --- 11.2 the k-tier load-or-recompute rule ---

DISK = TierSpeed("disk", 0.005, 1e6)  # 5 ms latency; a 1000-byte block loads in 1 ms
HOST = TierSpeed("host", 0.0, 1e6)
BLOCK_BYTES, BLOCK_SIZE, PREFILL = 1000, 4, 2000.0  # recompute: 4 / 2000 = 2 ms a block


def _plan(impl: ModuleType, num_blocks: int, holders: list[str]) -> Any:
    return impl.plan_load(num_blocks, holders, BLOCK_BYTES, BLOCK_SIZE, PREFILL, [HOST, DISK])


def _brute_force(num_blocks: int, holders: list[str], speeds: dict[str, TierSpeed],
                 block_bytes: int, recompute_s: float) -> float:  # fmt: skip
    """The cheapest cut, each tier's latency once per tier used before the cut."""
    best = math.inf
    for k in range(len(holders) + 1):
        used = holders[:k]
        load = sum(speeds[t].latency_s for t in set(used))
        load += sum(block_bytes / speeds[t].bytes_per_s for t in used)
        best = min(best, load + (num_blocks - k) * recompute_s)
    return best


def check_one_disk_block_is_recomputed_and_eight_are_loaded(impl: ModuleType) -> None:
    """A tier's latency is paid once: 1 disk block 6 ms vs 2 ms; 8 disk blocks 13 ms vs 16 ms"""
    one = _plan(impl, 1, ["disk"])
    assert one.num_load == 0 and math.isclose(one.seconds, 0.002), (
        f"one disk block: loading costs 5 ms + 1 ms, recomputing 2 ms: load 0, 0.002 s; "
        f"got num_load={one.num_load}, seconds={one.seconds}"
    )
    eight = _plan(impl, 8, ["disk"] * 8)
    assert eight.num_load == 8 and math.isclose(eight.seconds, 0.013), (
        f"eight disk blocks: loading costs 5 ms + 8 x 1 ms = 13 ms, recomputing 16 ms: load "
        f"8, 0.013 s; got num_load={eight.num_load}, seconds={eight.seconds} (a rule that "
        "stops at the first block that does not pay alone never sees the eight)"
    )


def check_device_blocks_are_free_and_a_tie_loads(impl: ModuleType) -> None:
    """Device blocks cost nothing; host blocks 1 ms vs 2 ms; equal costs load more"""
    plan = _plan(impl, 6, ["device", "device", "host"])
    want = 0.001 + 3 * 0.002  # two free, one from the host, three recomputed
    assert plan.num_load == 3 and math.isclose(plan.seconds, want), (
        f"2 device blocks (free) + 1 host block (1 ms) + 3 recomputed (6 ms): load 3, "
        f"{want} s; got num_load={plan.num_load}, seconds={plan.seconds}"
    )
    tie = impl.plan_load(2, ["host", "host"], 2000, BLOCK_SIZE, PREFILL, [HOST])
    assert tie.num_load == 2, (
        f"each host block costs 2 ms to load and 2 ms to recompute: a tie loads (the prefill "
        f"is what other requests share); got num_load={tie.num_load}"
    )


def check_the_plan_is_the_cheapest_cut(impl: ModuleType) -> None:
    """Random tiers and speeds: the plan's time equals a brute-force minimum over every cut"""
    tiers = st.sampled_from(["device", "host", "disk", "remote"])

    @QUIET
    @given(st.lists(tiers, max_size=12), st.integers(0, 6),
           st.floats(0, 0.02), st.floats(1e4, 1e7), st.floats(0, 0.02), st.floats(1e4, 1e7),
           st.floats(100, 1e5))  # fmt: skip
    def run(holders: list[str], extra: int, disk_lat: float, disk_bw: float,
            remote_lat: float, remote_bw: float, prefill: float) -> None:  # fmt: skip
        speeds = [HOST, TierSpeed("disk", disk_lat, disk_bw),
                  TierSpeed("remote", remote_lat, remote_bw)]  # fmt: skip
        num_blocks = len(holders) + extra
        got = impl.plan_load(num_blocks, holders, BLOCK_BYTES, BLOCK_SIZE, prefill, speeds)
        by_name = {s.name: s for s in speeds} | {"device": TierSpeed("device", 0, math.inf)}
        want = _brute_force(num_blocks, holders, by_name, BLOCK_BYTES, BLOCK_SIZE / prefill)
        assert 0 <= got.num_load <= len(holders), (
            f"num_load {got.num_load} is not a cut of {len(holders)} held blocks"
        )
        assert math.isclose(got.seconds, want, rel_tol=1e-9, abs_tol=1e-12), (
            f"holders {holders}, {num_blocks} blocks: the cheapest cut takes {want} s, the "
            f"plan says {got.seconds} s (load {got.num_load})"
        )
        used = holders[: got.num_load]
        cost = sum(by_name[t].latency_s for t in set(used))
        cost += sum(BLOCK_BYTES / by_name[t].bytes_per_s for t in used)
        cost += (num_blocks - got.num_load) * BLOCK_SIZE / prefill
        assert math.isclose(cost, got.seconds, rel_tol=1e-9, abs_tol=1e-12), (
            f"loading {got.num_load} blocks costs {cost} s, but the plan says {got.seconds} s"
        )

    run()


# --- 11.3 an index kept from an event stream with gaps ---

K = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(40)]


def _batch(seq: int, *events: KVEvent, instance: str = "a") -> EventBatch:
    return EventBatch(seq, instance, tuple(events), ts=1.0)


def _held(index: Any, instance: str = "a") -> dict[str, set[bytes]]:
    return {m: set(index.replicas[instance].held[m]) for m in MEDIA}


def check_batches_in_order_apply_their_events(impl: ModuleType) -> None:
    """Stored, removed and cleared events change what a replica holds, medium by medium"""
    index = impl.ExactIndex(["a"])
    assert index.apply(_batch(0, BlockStored((K[0], K[1]), None, "device")))
    assert index.apply(_batch(1, BlockStored((K[2],), None, "host"),
                              BlockRemoved((K[1],), "device")))  # fmt: skip
    got = _held(index)
    want = {"device": {K[0]}, "host": {K[2]}, "disk": set()}
    assert got == want, f"after two batches the index should hold {want}, got {got}"
    assert index.apply(_batch(2, AllBlocksCleared("device")))
    assert _held(index)["device"] == set(), "AllBlocksCleared('device') empties the device"
    assert index.replicas["a"].next_seq == 3, (
        f"after batches 0, 1, 2 the next expected is 3, got {index.replicas['a'].next_seq}"
    )


def check_a_gap_is_remembered_until_a_replay_fills_it(impl: ModuleType) -> None:
    """A skipped number: False, nothing applied, `behind` = the first number missed"""
    index = impl.ExactIndex(["a"])
    batches = [_batch(i, BlockStored((K[i],), None, "device")) for i in range(4)]
    index.apply(batches[0])
    for later in batches[2:]:
        applied = index.apply(later)
        assert applied is False, f"batch {later.seq} after a gap at 1 must not apply"
        assert index.replicas["a"].behind == 1, (
            f"batch 1 is missing: behind should stay 1, got {index.replicas['a'].behind}"
        )
    assert _held(index)["device"] == {K[0]}, "batches past a gap must not change the index"
    index.replay("a", batches[1:])
    replica = index.replicas["a"]
    assert (replica.behind, replica.next_seq) == (None, 4), (
        f"after the replay: behind None, next_seq 4; got {replica.behind}, {replica.next_seq}"
    )
    assert _held(index)["device"] == set(K[:4]), "the replay should apply batches 1 to 3"


def check_a_batch_applied_twice_changes_nothing(impl: ModuleType) -> None:
    """A replay that overlaps what arrived skips the batches already applied"""
    index = impl.ExactIndex(["a"])
    stored = _batch(0, BlockStored((K[5],), None, "disk"))
    removed = _batch(1, BlockRemoved((K[5],), "disk"))
    index.apply(stored)
    index.apply(removed)
    assert index.apply(stored) is True, "a batch already applied is no gap: True"
    assert _held(index)["disk"] == set(), (
        "batch 0 (stored) arrived again after batch 1 removed its block, and put it back: "
        "a batch older than next_seq must be skipped"
    )
    index.replay("a", [stored, removed, _batch(2), _batch(1, BlockStored((K[6],), None, "disk"))])
    assert _held(index)["disk"] == set(), (
        "batch 0 (stored) was applied again after batch 1 removed the block: a batch "
        "older than next_seq must be skipped"
    )


def check_a_snapshot_replaces_what_was_held(impl: ModuleType) -> None:
    """resync: what the replica held is dropped; the snapshot's state and number are taken"""
    index = impl.ExactIndex(["a", "b"])
    index.apply(_batch(0, BlockStored((K[0], K[1]), None, "device")))
    index.apply(_batch(0, BlockStored((K[9],), None, "host"), instance="b"))
    log = EventLog("a")
    log.next_seq = 7
    snapshot = log.snapshot({"device": [K[3]], "disk": [K[4]]})
    index.resync(snapshot)
    got, want = _held(index), {"device": {K[3]}, "host": set(), "disk": {K[4]}}
    assert got == want, f"after the snapshot replica a holds {want}, got {got}"
    assert index.replicas["a"].next_seq == 8, (
        f"the snapshot was batch 7: next is 8, got {index.replicas['a'].next_seq}"
    )
    assert _held(index, "b")["host"] == {K[9]}, "a snapshot of a must not touch replica b"


def check_a_prefix_counts_across_media(impl: ModuleType) -> None:
    """match_one: leading blocks per medium, a slower medium extending the faster ones"""
    index = impl.ExactIndex(["a"])
    stored = (BlockStored((K[0], K[2]), None, "device"), BlockStored((K[1],), None, "host"),
              BlockStored((K[3], K[4]), None, "disk"))  # fmt: skip
    index.apply(_batch(0, *stored))
    got = index.match_one("a", K[:6])
    want = {"device": 1, "host": 3, "disk": 5}
    assert got == want, (
        f"device holds blocks 0 and 2, host 1, disk 3 and 4: the prefix reaches block 0 on "
        f"the device, 0-2 with the host, 0-4 with the disk: {want}; got {got}"
    )


def check_a_random_stream_with_drops_ends_exact(impl: ModuleType) -> None:
    """A publisher's random events, a third of its batches lost: after the replays the index
    equals what the publisher holds"""
    for seed in range(6):
        rng = random.Random(seed)
        log, index = EventLog("a", capacity=1000), impl.ExactIndex(["a"])
        for _ in range(60):
            batch = log.append(_random_events(rng, log))
            if rng.random() < 0.33:
                continue  # lost on the way
            if not index.apply(batch):
                behind = index.replicas["a"].behind
                batches = log.since(behind)
                assert batches is not None, "the log keeps every batch here"
                index.replay("a", batches)
        got = _held(index)
        if index.replicas["a"].behind is not None or index.replicas["a"].next_seq < log.next_seq:
            index.replay("a", log.since(index.replicas["a"].next_seq) or [])
            got = _held(index)
        assert got == log.held, (
            f"seed {seed}: after the stream the index holds {_sizes(got)} keys, the "
            f"publisher {_sizes(log.held)}"
        )


def _random_events(rng: random.Random, log: EventLog) -> tuple[KVEvent, ...]:
    events: list[KVEvent] = []
    for _ in range(rng.randint(1, 3)):
        medium, roll = rng.choice(MEDIA), rng.random()
        if roll < 0.6:
            events.append(BlockStored(tuple(rng.sample(K, 3)), None, medium))
        elif roll < 0.95 and log.held[medium]:
            events.append(BlockRemoved(tuple(rng.sample(sorted(log.held[medium]), 1)), medium))
        else:
            events.append(AllBlocksCleared(medium))
    return tuple(events)


def _sizes(held: dict[str, set[bytes]]) -> dict[str, int]:
    return {m: len(keys) for m, keys in held.items()}


# --- 11.4 rebuilding a request from its journal ---

PROMPT_IDS = [101, 102, 103, 104, 105]


def _completion_stream(ids: list[int], stream_id: str, created: int, prompt: bool,
                       usage: dict | None) -> list[dict]:  # fmt: skip
    """A replica's completion chunks for `ids` (one token a chunk, its text "<id>"), the
    first carrying the prompt's ids, the last the finish, then usage when asked."""
    chunks = []
    for i, token in enumerate(ids):
        choice = {"index": 0, "text": f"<{token}>", "token_ids": [token],
                  "finish_reason": "length" if i == len(ids) - 1 else None}  # fmt: skip
        chunk = {"id": stream_id, "object": "text_completion", "created": created,
                 "model": "m", "choices": [choice]}  # fmt: skip
        if i == 0 and prompt:
            chunk["prompt_token_ids"] = list(PROMPT_IDS)
        chunks.append(chunk)
    if usage is not None:
        chunks.append({"id": stream_id, "object": "text_completion", "created": created,
                       "model": "m", "choices": [], "usage": usage})  # fmt: skip
    return chunks


def _usage(completion: int) -> dict:
    prompt = len(PROMPT_IDS)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _client_view(chunks: list[dict], wants_ids: bool) -> list[dict]:
    """What an uninterrupted stream looks like to a client that did (not) ask for ids."""
    if wants_ids:
        return chunks
    out = []
    for chunk in chunks:
        chunk = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
        chunk["choices"] = [{k: v for k, v in c.items() if k != "token_ids"}
                            for c in chunk["choices"]]  # fmt: skip
        out.append(chunk)
    return out


def _journal(impl: ModuleType, wants_ids: bool = False, **extra: Any) -> Any:
    body = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 8,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    if wants_ids:
        body["return_token_ids"] = True
    journal = impl.Journal.of(json.dumps(body).encode(), chat=False)
    assert journal is not None, "Journal.of gave None for a plain streaming completion"
    return journal


def check_the_resumed_request_carries_the_tokens_relayed(impl: ModuleType) -> None:
    """resume_body: the same request with return_token_ids, no echo, and every token relayed"""
    journal = _journal(impl, echo=True, resume_token_ids=[7, 8])
    first = json.loads(journal.resume_body())
    assert first.get("return_token_ids") is True and first.get("echo") is True, (
        f"before any chunk the body keeps echo and asks for token ids; got {first}"
    )
    assert first.get("resume_token_ids") == [7, 8], (
        f"the client's own resume_token_ids [7, 8] go on; got {first.get('resume_token_ids')}"
    )
    for chunk in _completion_stream([1, 2, 3], "a", 1, True, None)[:2]:
        journal.take(chunk)
    body = json.loads(journal.resume_body())
    assert "echo" not in body, "once the stream has started, echo must go (the prompt went out)"
    assert body.get("resume_token_ids") == [7, 8, 1, 2], (
        f"after relaying tokens 1 and 2 the next replica continues after [7, 8, 1, 2]; got "
        f"{body.get('resume_token_ids')}"
    )
    ignored = ("resume_token_ids", "return_token_ids", "echo")
    rest = {k: v for k, v in body.items() if k not in ignored}
    assert rest == {k: v for k, v in first.items() if k not in ignored}, (
        "the rest of the body is unchanged"
    )
    plain = json.loads(_journal(impl).resume_body())
    assert "resume_token_ids" not in plain, "with nothing relayed, no resume_token_ids at all"


def check_a_continued_stream_reads_as_the_uninterrupted_one(impl: ModuleType) -> None:
    """A stream cut after k chunks and continued by another replica: the client sees, chunk
    for chunk, the uninterrupted stream (its id, one usage counting every token)"""
    ids = [11, 12, 13, 14, 15, 16]
    for wants_ids in (False, True):
        want = _client_view(_completion_stream(ids, "first", 100, True, _usage(6)), wants_ids)
        for k in range(1, len(ids)):
            journal = _journal(impl, wants_ids)
            cut = _completion_stream(ids, "first", 100, True, None)[:k]  # then it broke
            got = [journal.take(c) for c in cut]
            journal.resumed()
            rest = _completion_stream(ids[k:], "second", 200, True, _usage(len(ids) - k))
            got += [journal.take(c) for c in rest]
            got = [c for c in got if c is not None]
            assert got == want, (
                f"cut after {k} of 6 chunks (client asked for token ids: {wants_ids}): the "
                f"client should see the uninterrupted stream.\n  expected: {_short(want)}\n"
                f"  got:      {_short(got)}"
            )
            assert journal.token_ids == ids and journal.text == "".join(f"<{t}>" for t in ids)


def check_a_continued_chat_stream_has_one_role(impl: ModuleType) -> None:
    """Chat: the continuation's role goes, a role-only chunk vanishes, content stays"""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    journal = impl.Journal.of(json.dumps(body).encode(), chat=True)

    def chunk(stream_id: str, delta: dict, ids: list[int]) -> dict:
        return {"id": stream_id, "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": delta, "token_ids": ids,
                             "finish_reason": None}]}  # fmt: skip

    first = journal.take(chunk("a", {"role": "assistant", "content": ""}, []))
    assert first["choices"][0]["delta"].get("role") == "assistant", "the first role goes out"
    journal.take(chunk("a", {"content": "Hel"}, [1]))
    journal.resumed()
    assert journal.take(chunk("b", {"role": "assistant", "content": ""}, [])) is None, (
        "a continued stream's role-only opening chunk must vanish (the client has its role)"
    )
    out = journal.take(chunk("b", {"role": "assistant", "content": "lo"}, [2]))
    assert out is not None and out["id"] == "a", "the continuation carries the first stream's id"
    assert out["choices"][0]["delta"] == {"content": "lo"}, (
        f"a second role must go, the content stay: got {out['choices'][0]['delta']}"
    )
    assert journal.text == "Hello" and journal.token_ids == [1, 2]


def _short(chunks: list[dict]) -> str:
    return " | ".join(json.dumps(c, sort_keys=True)[:90] for c in chunks[:4]) + " ..."


# --- 11.5 the pre-copy stage planner ---

LINK = {"block_bytes": 1000, "bandwidth_bytes_s": 1e6, "latency_s": 5e-4, "step_s": 0.01}


def _stage(impl: ModuleType, filled: int, sent: int, stages: int = 0, cap: int = 4,
           tpb: int = 16, **link: float) -> Any:  # fmt: skip
    return impl.next_stage(filled, sent, **{**LINK, **link}, tokens_per_block=tpb,
                           stages_done=stages, max_stages=cap)  # fmt: skip


def check_a_long_context_is_pre_copied_then_the_rest_goes_final(impl: ModuleType) -> None:
    """1 ms a block, 10 ms a step: 9 blocks a stage (what a step hides), the last goes final"""
    got = _stage(impl, 100, 0)
    assert got == range(0, 9), (
        f"100 full blocks, none sent: going final would pause 0.5 + 101 x 1 = 101.5 ms, more "
        f"than a 10 ms step; one step hides 9.5 ms of copying, 9 blocks, while the source "
        f"fills 0.06: copy range(0, 9); got {got!r}"
    )
    got = _stage(impl, 101, 100, stages=1)
    assert got == impl.FINAL, f"1 block left: a pause of 2.5 ms fits a step: FINAL; got {got!r}"
    got = _stage(impl, 110, 100, stages=1)
    assert got == range(100, 109), (
        f"10 blocks left: going final would pause 11.5 ms > 10 ms, so one more stage of what a "
        f"step hides, range(100, 109); got {got!r}"
    )
    got = _stage(impl, 64, 0, tpb=1, bandwidth_bytes_s=2e5)
    assert got == range(0, 64), (
        f"5 ms a block, a block a step: a 1-block stage (what a step hides) lets the source "
        f"fill one more, no progress; all 64 at once (320.5 ms) let it fill 32: range(0, 64); "
        f"got {got!r}"
    )


def check_the_stage_cap_and_a_pre_copy_that_cannot_catch_up(impl: ModuleType) -> None:
    """At max_stages (0: stop-and-copy) go final; a stage that fills what it sends: final"""
    assert _stage(impl, 100, 0, stages=4, cap=4) == impl.FINAL, "4 stages done of 4: FINAL"
    assert _stage(impl, 100, 0, stages=0, cap=0) == impl.FINAL, "max_stages 0: stop-and-copy"
    got = _stage(impl, 3, 2, tpb=1, bandwidth_bytes_s=1e4)
    assert got == impl.FINAL, (
        f"100 ms a block, a token a block: a 1-block stage fills 10 new blocks, so another "
        f"stage leaves more, not less: FINAL; got {got!r}"
    )


def check_whole_migrations_send_every_block_once_and_pause_briefly(impl: ModuleType) -> None:
    """Random links and contexts, a decoding source: every block sent once, in order, and
    the planner going final only when the pause fits a step or pre-copy cannot catch up"""
    rng = random.Random(5)
    for _ in range(300):
        link = {
            "block_bytes": rng.choice([1000, 50_000]),
            "bandwidth_bytes_s": 10 ** rng.uniform(6, 9),
            "latency_s": 10 ** rng.uniform(-5, -3),
            "step_s": 10 ** rng.uniform(-3, -1.5),
        }
        per_block = link["block_bytes"] / link["bandwidth_bytes_s"]
        tpb, tokens, sent, stages, cap = 16, rng.randrange(16, 4000), 0, 0, 400
        while True:
            filled = tokens // tpb
            plan = _stage(impl, filled, sent, stages, cap, tpb, **link)
            if plan == impl.FINAL:
                break
            assert isinstance(plan, range) and plan.start == sent and sent < plan.stop <= filled, (
                f"{filled} blocks filled, {sent} sent: a stage sends the next blocks not sent "
                f"yet, range({sent}, n) with n <= {filled}; got {plan!r}"
            )
            stage_s = max(link["step_s"], link["latency_s"] + len(plan) * per_block)
            tokens += max(1, int(stage_s / link["step_s"]))
            sent, stages = plan.stop, stages + 1
        dirty = tokens // tpb - sent
        pause = link["latency_s"] + (dirty + 1) * per_block
        if stages < cap and pause > link["step_s"]:  # the planner went final on its own
            stage_s = max(link["step_s"], link["latency_s"] + dirty * per_block)
            assert stage_s / link["step_s"] / tpb >= dirty, (
                f"the planner went final with a {pause * 1e3:.1f} ms pause although sending "
                f"the {dirty} blocks left would have shrunk them"
            )


CHECKS = [
    check_a_key_digests_its_parent_and_tokens,
    check_a_parent_of_the_wrong_length_is_refused,
    check_block_keys_chain_and_skip_a_partial_block,
    check_prompts_share_exactly_their_common_blocks,
    check_keys_are_the_same_in_another_process,
    check_one_disk_block_is_recomputed_and_eight_are_loaded,
    check_device_blocks_are_free_and_a_tie_loads,
    check_the_plan_is_the_cheapest_cut,
    check_batches_in_order_apply_their_events,
    check_a_gap_is_remembered_until_a_replay_fills_it,
    check_a_batch_applied_twice_changes_nothing,
    check_a_snapshot_replaces_what_was_held,
    check_a_prefix_counts_across_media,
    check_a_random_stream_with_drops_ends_exact,
    check_the_resumed_request_carries_the_tokens_relayed,
    check_a_continued_stream_reads_as_the_uninterrupted_one,
    check_a_continued_chat_stream_has_one_role,
    check_a_long_context_is_pre_copied_then_the_rest_goes_final,
    check_the_stage_cap_and_a_pre_copy_that_cannot_catch_up,
    check_whole_migrations_send_every_block_once_and_pause_briefly,
]


HINTS: dict[str, tuple[str, str, str]] = {
    "11.1": (
        "A block's KV depends on every token before it, so its name must too: chain each "
        "block's key from the key before it, the first from the root (the model's "
        "fingerprint). And the name must be the same in every process: no hash().",
        "next_key: check the parent's length, then BLAKE2b with a 16-byte digest over the "
        "parent's bytes followed by each token as 8 bytes. block_keys: walk the tokens in "
        "steps of block_size, stop before a partial block, and feed each key in as the next "
        "block's parent.",
        "hashlib.blake2b(parent, digest_size=KEY_BYTES), then h.update(...) with "
        "int(t).to_bytes(8, 'little', signed=True) for each token joined with b''; in "
        "block_keys, range(0, len(token_ids) - block_size + 1, block_size).",
    ),
    "11.2": (
        "Loading a prefix of the held blocks and recomputing the rest: price every cut "
        "point. A tier's latency is paid once per request that uses it, so a longer run of "
        "blocks from a slow tier can pay where one block does not.",
        "Start with k = 0 (recompute all). Walk the holders in order, keeping the running "
        "load time: add a tier's latency the first time you meet it, and each block's bytes "
        "over its bandwidth; the total for cut k is that plus the remaining blocks times a "
        "block's recompute time. Keep the cheapest, ties to the larger k.",
        "recompute a block: block_size / prefill_tokens_per_s; a set of tiers already paid "
        "for; compare with <= so a tie moves best to the later cut; by_name[name] gives the "
        "TierSpeed (device's bandwidth is infinite, so its blocks add 0).",
    ),
    "11.3": (
        "Events arrive numbered, over a socket that may drop some. Apply a batch only in "
        "order; a gap means the index must wait for a replay, remembering where the gap "
        "began; a batch it has already seen must change nothing.",
        "apply: a seq below next_seq is old (True); above it is a gap (set behind to "
        "next_seq if it is unset, False); equal: apply each event with apply_event, move "
        "next_seq on, clear behind. resync: a fresh ReplicaBlocks expecting the snapshot's "
        "number, then apply it. match_one: grow a reach through MEDIA in order.",
        "match_one keeps one `reach` across the media: for each medium (device, host, disk) "
        "add its set to those seen, advance reach while keys[reach] is in any of them, and "
        "record counts[medium] = reach.",
    ),
    "11.4": (
        "A stream is state the router can keep: the request and the tokens relayed so far. "
        "Sent again with those tokens as resume_token_ids, another replica continues where "
        "the first stopped; the router then makes the second stream look like the first.",
        "resume_body: copy the body, ask for token ids, drop echo once started, add the client's "
        "resume ids then self.token_ids. take: fix the identity on the first chunk, stamp it "
        "on every chunk, handle prompt ids, map _take_choice over the choices (None if none "
        "is left), combine usage after a resume. _take_choice: record ids, text, finish; drop "
        "ids the client did not ask for; let the role through once.",
        "On the first chunk keep, for each key of IDENTITY the chunk has, its value; a "
        "completion's choice has 'text', a chat choice a 'delta' dict with 'content' and "
        "maybe 'role'; after del delta['role'], return None when there is no content, no "
        "ids, no logprobs and no finish_reason.",
    ),
    "11.5": (
        "Full blocks never change again, so they can be copied while the source decodes; "
        "only the last stage pauses the request. Pre-copy again while that shrinks what is "
        "left; go final as soon as the pause would fit one decode step.",
        "dirty = filled - sent. Going final now costs latency + (dirty + 1) blocks over the "
        "bandwidth; FINAL if that fits step_s or the stages are used up. Else try n = the "
        "blocks one step hides (at least 1, at most dirty); if the source fills at least n "
        "while they travel, try all dirty blocks; if even that makes no progress, FINAL.",
        "a stage of n blocks lasts max(step_s, latency_s + n * block_bytes / bandwidth) and "
        "the source fills that / step_s / tokens_per_block blocks meanwhile; the blocks one "
        "step hides: how many whole blocks fit in step_s minus the latency; the stage is "
        "the n block indices starting at sent_blocks.",
    ),
}
