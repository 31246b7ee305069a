# Your workspace for chapter 11 (The state plane): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 11` from the repository root.
# Generated from minserve/kvcache/block_key.py, minserve/kvcache/load_plan.py, minserve/router/exact_index.py, minserve/router/journal.py, minserve/disagg/stage_planner.py by `python -m minserve.course.generate`.
# stub fingerprint: a73a507c5d0b (lets the generator tell your edits from a stale stub)
"""Chapter 11, The state plane: KV blocks with an identity, tiers, and a router
that knows where they are.

11.1 names a block by its content: a chained BLAKE2b key over the previous
block's key and the block's tokens, the same in every process; plug it in with
`LLM(enable_prefix_caching=True, kv_disk_path=..., plugins=CoursePlugins(
block_keys=block_keys))`: the disk tier's files and the KV events then carry your
keys. 11.2 decides how many of a prompt's leading blocks to load from lower tiers
and how many to recompute, every cut point priced; plug it into the disk tier with
`CoursePlugins(load_plan=plan_load)`. 11.3 keeps the router's index of every
replica's blocks from numbered event batches that may arrive with gaps; plug it
into the router with `build_router(config, KVAware(KVBlocks(n,
index_cls=ExactIndex)))`. 11.4 keeps a stream's journal and rebuilds the request
from it when its replica dies, splicing the next replica's stream into the
client's; plug it in with `build_router(config, journal_cls=Journal)`. 11.5 plans
live migration's pre-copy stages; a disaggregated engine's decode instances use
yours with `cluster.migrate(request_id, rank,
StagePolicy(planner="exercises.ch11_state_plane:next_stage"))`.
"""

from __future__ import annotations  # Journal's methods name their class

import hashlib  # noqa: F401  (your code will want it)
import json  # noqa: F401
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minserve.kvcache.block_key import KEY_BYTES, BlockKey  # noqa: F401
from minserve.kvcache.kv_events import MEDIA, EventBatch, apply_event  # noqa: F401
from minserve.kvcache.load_plan import DEVICE, LoadPlan, TierSpeed, check_plan
from minserve.disagg.stage_planner import FINAL
from minserve.router.exact_index import ReplicaBlocks
from minserve.router.journal import (  # noqa: F401  (your code will want them)
    IDENTITY,
    Chunk,
    is_one_prompt,
    is_token_ids,
)


# Exercise 11.1: the chained block key
def next_key(parent: BlockKey, tokens: Sequence[int]) -> BlockKey:
    """The key of the block holding `tokens`, after the block (or root) keyed `parent`:
    BLAKE2b with a `KEY_BYTES`-byte digest over the parent's bytes, then each token id as
    8 bytes, little-endian, signed. A parent that is not `KEY_BYTES` long is a ValueError
    that says so."""
    raise NotImplementedError("Exercise 11.1: the chained block key")


def block_keys(root: BlockKey, token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """The keys of the full blocks of `token_ids`, in order: block i's key chains from
    block i-1's (block 0's from `root`), so it names the whole prefix up to its end. A
    partial last block has no key yet."""
    raise NotImplementedError("Exercise 11.1: the chained block key")


# Exercise 11.2: the k-tier load-or-recompute rule
def plan_load(
    num_blocks: int,
    holders: Sequence[str],
    block_nbytes: int,
    block_size: int,
    prefill_tokens_per_s: float,
    speeds: Sequence[TierSpeed],
) -> LoadPlan:
    """The fastest way to get a prompt's `num_blocks` blocks into the pool: load a prefix of
    them, recompute the rest.

    `holders[i]` names the fastest tier holding block i (`len(holders) <= num_blocks`: the
    list stops at the first block no tier holds); `speeds` gives each tier's `TierSpeed`
    ("device" is `DEVICE` unless given: free). Loading the first k blocks costs, for each
    tier among `holders[:k]`, its latency once plus `block_nbytes / bytes_per_s` per block;
    recomputing the other `num_blocks - k` costs `block_size / prefill_tokens_per_s` each.
    Try every k from 0 to `len(holders)` (a tier's latency lets the cost rise, then fall
    again as k grows: stopping at the first block that does not pay misses a longer prefix
    that does),
    keep the cheapest; on a tie, load more (the prefill's compute is what other requests
    share). Returns `LoadPlan(k, predicted seconds)`.
    """
    by_name = {speed.name: speed for speed in (DEVICE, *speeds)}
    check_plan(num_blocks, holders, block_nbytes, block_size, prefill_tokens_per_s, by_name)
    raise NotImplementedError("Exercise 11.2: the k-tier load-or-recompute rule")


# Exercise 11.3: an index kept from an event stream with gaps
class ExactIndex:
    """Per replica, per medium: the block keys it holds, exactly as its events said.

    `self.replicas[name]` is a `ReplicaBlocks`: `held[medium]` (a set of keys per medium of
    `MEDIA`), `next_seq` (the batch number expected next) and `behind` (the first number
    missed, until a replay fills the gap). `apply_event(held, event)` applies one event.
    Plug yours into the router with `build_router(config, KVAware(KVBlocks(n,
    index_cls=ExactIndex)))`.
    """

    def __init__(self, replicas: Sequence[str]) -> None:
        self.replicas = {name: ReplicaBlocks() for name in replicas}

    def apply(self, batch: EventBatch) -> bool:
        """Apply one batch in order; False (and the replica marked behind) on a gap. A batch
        already applied (a replay overlapping what arrived) is skipped (True). A gap keeps the
        *first* number missed in `behind`, however many batches arrive past it; a batch in
        order applies its events, moves `next_seq` on and clears `behind`."""
        raise NotImplementedError("Exercise 11.3: an index kept from an event stream with gaps")

    def replay(self, instance: str, batches: Iterable[EventBatch]) -> None:
        """Catch up a replica with the batches since its gap (`EventLog.since`)."""
        for batch in batches:
            self.apply(batch)

    def resync(self, snapshot: EventBatch) -> None:
        """Start a replica over from its snapshot (its log lost the batches it missed): drop
        what the index held for it, then take the snapshot as the next batch in order."""
        raise NotImplementedError("Exercise 11.3: an index kept from an event stream with gaps")

    def reset(self, instance: str) -> None:
        """Start a replica over with nothing held, expecting batch 0 (it restarted, or the
        router begins to follow it)."""
        self.replicas[instance] = ReplicaBlocks()

    def forget(self, instance: str) -> None:
        """Stop indexing a replica (it publishes no events any more)."""
        self.replicas.pop(instance, None)

    def match(self, keys: Sequence[BlockKey]) -> dict[str, dict[str, int]]:
        """For each replica and medium, how many leading blocks of a prompt's `keys` it holds
        there (a prefix counts only while every block before it is held in that medium or
        a faster one: device, then host, then disk)."""
        return {name: self.match_one(name, keys) for name in self.replicas}

    def match_one(self, instance: str, keys: Sequence[BlockKey]) -> dict[str, int]:
        """For one replica, per medium of `MEDIA` (fastest first), how many leading `keys`
        it holds in that medium or a faster one: {"device": 2, "host": 3, "disk": 5} means
        blocks 0-1 are on the device, block 2 is on the host (or the device), blocks 3-4
        somewhere. A block held nowhere ends the prefix in every medium."""
        raise NotImplementedError("Exercise 11.3: an index kept from an event stream with gaps")

    def blocks(self, instance: str, medium: str) -> set[BlockKey]:
        """A copy of what the index holds for one replica and medium."""
        return set(self.replicas[instance].held[medium])


# Exercise 11.4: rebuilding a request from its journal
@dataclass
class Journal:
    """One streaming request's record (one prompt, one choice: `n` 1).

    You write `resume_body` (the request to send the next replica) and `take` with
    `_take_choice` (each chunk of a stream written down, then rewritten for the client, so
    that a continued stream reads as the same one). Plug yours into the router with
    `build_router(config, journal_cls=Journal)`.
    """

    body: dict[str, Any]
    wants_token_ids: bool  # the client asked for `return_token_ids` itself
    client_resume_ids: list[int] = field(default_factory=list)  # its own resume_token_ids
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_token_ids: list[int] | None = None
    identity: dict[str, Any] | None = None  # id, object, created, model of the first chunk
    role_sent: bool = False
    finish_reason: str | None = None
    usage_sent: bool = False
    resumes: int = 0  # streams spliced in after the first

    @classmethod
    def of(cls, raw: bytes, chat: bool) -> Journal | None:
        """The journal of a streaming request; None for what cannot be continued as one
        stream (not streaming, several choices or prompts, a body the replica will refuse)."""
        try:
            body = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(body, dict) or body.get("stream") is not True or body.get("n", 1) != 1:
            return None
        if not chat and not is_one_prompt(body.get("prompt")):
            return None
        resumed = body.get("resume_token_ids", [])
        if not is_token_ids(resumed):
            return None
        return cls(body, body.get("return_token_ids") is True, list(resumed))

    @property
    def started(self) -> bool:
        """A chunk has reached the client."""
        return self.identity is not None

    @property
    def finished(self) -> bool:
        """The choice's last chunk (its finish reason) has reached the client."""
        return self.finish_reason is not None

    def upstream_body(self) -> bytes:
        """The request as first sent to a replica: with the token ids of every chunk."""
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def resume_body(self) -> bytes:
        """The request as sent to the next replica: the same body with `return_token_ids`,
        without `echo` once the stream has started (the prompt went out with the first
        chunk), and with `resume_token_ids`: the client's own resume ids, then every token
        relayed (none: no such field)."""
        raise NotImplementedError("Exercise 11.4: rebuilding a request from its journal")

    def resumed(self) -> None:
        """A new stream takes over from here: its chunks continue this one's."""
        self.resumes += 1

    def take(self, chunk: Chunk) -> Chunk | None:
        """Write down one chunk of the current stream; return it as the client sees it
        (None: nothing left to send, a repeated role chunk).

        The first chunk ever fixes the stream's identity (`IDENTITY` keys it has); every
        chunk then carries that identity. `_take_prompt_ids` handles the prompt's ids; each
        choice goes through `_take_choice` (a chunk whose choices all vanish is None).
        Usage: note that it was sent, and once the stream has been resumed replace it with
        `_combined(usage)` (the prompt once, every generated token once)."""
        raise NotImplementedError("Exercise 11.4: rebuilding a request from its journal")

    def ending(self) -> Chunk | None:
        """The usage chunk a finished stream still owes the client (None: it owes none):
        its replica broke after the last token, before usage and [DONE]."""
        options = self.body.get("stream_options") or {}
        if self.usage_sent or options.get("include_usage") is not True:
            return None
        return {**(self.identity or {}), "choices": [], "usage": self._combined({})}

    def _take_prompt_ids(self, out: Chunk) -> None:
        """The prompt's ids come in a stream's first chunk; the client sees them once."""
        if "prompt_token_ids" not in out:
            return
        first = self.prompt_token_ids is None
        if first:
            self.prompt_token_ids = list(out["prompt_token_ids"])
        if not (first and self.wants_token_ids):
            del out["prompt_token_ids"]

    def _take_choice(self, choice: Chunk) -> Chunk | None:
        """One choice of a chunk: its prompt ids (`_take_prompt_ids`), its `token_ids` added
        to `self.token_ids` (and dropped unless the client asked for them), its finish
        reason kept, its text added to `self.text` (a completion's `text`, a chat delta's
        `content`). A chat delta's `role` goes out once: on a continued stream drop it, and
        drop the whole choice (None) when nothing else is left in it (no content, no ids,
        no logprobs, no finish reason)."""
        raise NotImplementedError("Exercise 11.4: rebuilding a request from its journal")

    def _combined(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Usage over every stream: the prompt once, each generated token once."""
        if self.prompt_token_ids is not None:
            prompt = len(self.prompt_token_ids)
        else:
            prompt = usage.get("prompt_tokens", 0)
        completion = len(self.token_ids)
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip


# Exercise 11.5: the pre-copy stage planner
def next_stage(
    filled_blocks: int,
    sent_blocks: int,
    block_bytes: int,
    bandwidth_bytes_s: float,
    latency_s: float,
    step_s: float,
    tokens_per_block: int,
    stages_done: int,
    max_stages: int,
) -> range | str:
    """The next stage of a pre-copy: the block indices to copy now, or FINAL.

    filled_blocks: the request's full blocks on the source now (its computed tokens //
    tokens_per_block); sent_blocks: the first blocks the earlier stages copied; block_bytes:
    one block's KV, every layer; bandwidth_bytes_s and latency_s: the link to the
    destination; step_s: the source's measured decode step; stages_done: pre-copy stages so
    far; max_stages: how many the migration may take (0: stop-and-copy).

    Left to send are `dirty = filled_blocks - sent_blocks` full blocks; the final stage also
    carries the partly filled last block. Decide in this order:

    1. The pause going final now would cost is `latency_s + (dirty + 1) * block_bytes /
       bandwidth_bytes_s`. If it is at most one decode step (`step_s`), return FINAL.
    2. If `stages_done >= max_stages`, return FINAL (stop chasing the source).
    3. A pre-copy stage runs beside one of the source's decode steps and lasts
       `stage_s(n) = max(step_s, latency_s + n * block_bytes / bandwidth_bytes_s)` for n
       blocks; meanwhile the source fills `new(n) = stage_s(n) / step_s / tokens_per_block`
       blocks. Send as many as one step hides, `n = min(dirty, max(1, fits))` with `fits`
       the whole blocks that `step_s - latency_s` carries, so the stream never waits on the
       copy; if that makes no progress (`new(n) >= n`), send all `dirty` at once instead;
       if even that makes none (`new(dirty) >= dirty`), another stage would not shrink what
       is left: return FINAL.
    4. Otherwise copy those n blocks: return `range(sent_blocks, sent_blocks + n)`.
    """
    if step_s <= 0 or bandwidth_bytes_s <= 0 or tokens_per_block < 1:
        raise ValueError(
            f"step_s and bandwidth_bytes_s must be positive and tokens_per_block at least 1; "
            f"got {step_s}, {bandwidth_bytes_s}, {tokens_per_block}"
        )
    if sent_blocks > filled_blocks:
        raise ValueError(f"{sent_blocks} blocks sent but only {filled_blocks} filled")
    raise NotImplementedError("Exercise 11.5: the pre-copy stage planner")
