"""Live migration between decode instances: both sides of one stage (Llumnix).

A request moves while it decodes, one stage a round (the proxy lists the migrations each
round, in one global order of (source, destination, request), so no two ranks wait on each
other in a cycle):

    source (decodes the request)                   destination
    header: pre-copy [a, b), final, or gone  ──►   reserve blocks for them (or refuse)
                                             ◄──   ack: ok, or why not
    pre-copy: blocks a..b-1 travel while the       received while its own step runs,
      source runs its decode step                    then written into the reserved blocks
    final: the request is not stepped here;  ──►   written; the request continues here from
      the blocks left, its generated tokens          its tokens (`adopt_migrated`) and
                                             ◄──     decodes in this round's step: commit
    release the request: its blocks are freed

`stage_planner.next_stage` picks pre-copy or final. Any failure aborts: a refusal (no
room), a link that breaks or a peer that dies. The destination then frees what it reserved
and the source, never stopped but for the final exchange, keeps decoding. A migration the
proxy no longer lists (a peer died after its stage) is forgotten the same way.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

import torch
import torch.distributed as dist

from minserve.disagg.engine_hooks import adopt_migrated, release_migrated
from minserve.disagg.kv_transfer import TorchKVTransfer
from minserve.disagg.stage_planner import FINAL, next_stage
from minserve.engine import LLMEngine
from minserve.kvcache.block_table import BlockTable
from minserve.sampling_params import SamplingParams
from minserve.scheduler.sequence import SeqStatus, Sequence

LINK_ERRORS = (RuntimeError, dist.DistError)  # a closed socket, or the step timeout


@dataclass(frozen=True)
class StagePolicy:
    """How many pre-copy stages a migration takes: at least `min_stages`, then the planner's
    choice, at most `max_stages` (0: stop-and-copy, one final stage). `planner`: which
    planner decides, as "module:function" (a function shaped like `next_stage`, chapter 11's
    say; the decode instances import it by that name); "" is minserve's.

    `step_share`: the share of a decode step a stage may take. The planner sizes stages to
    what one step hides, which holds where the copy runs beside the step (a GPU's copy
    engine). Where the copy shares the cores that decode (a CPU), a stage adds its time to
    the step the client waits on: given half a step, every gap stays near 1.5 steps."""

    min_stages: int = 0
    max_stages: int = 32  # stages send what one decode step hides: long contexts take several
    planner: str = ""
    step_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.min_stages <= self.max_stages:
            raise ValueError(
                f"need 0 <= min_stages <= max_stages, got {self.min_stages}, {self.max_stages}"
            )
        if not 0 < self.step_share <= 1:
            raise ValueError(f"step_share must be in (0, 1], got {self.step_share}")


PRE_COPY = StagePolicy()
STOP_AND_COPY = StagePolicy(0, 0)


@cache
def planner(name: str) -> Callable[..., range | str]:
    """The stage planner named "module:function" ("": minserve's `next_stage`)."""
    if not name:
        return next_stage
    module, _, function = name.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"no stage planner {name!r}: {error}") from error


@dataclass(frozen=True)
class MigrationOrder:
    """One migration in a round's command: which request, from where, to where, how."""

    request_id: str
    source: int
    target: int
    policy: StagePolicy = PRE_COPY

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MigrationOrder:
        return cls(**{**d, "policy": StagePolicy(**d["policy"])})


@dataclass
class _Outgoing:
    """Source side, between rounds: the blocks sent so far (a prefix of the block table)."""

    sent: list[int] = field(default_factory=list)
    stages: int = 0


@dataclass
class _InFlight:
    """Pre-copy blocks travelling during the step (`kv`, kept alive until they arrive);
    on the destination, `blocks` receive them."""

    request_id: str
    peer: int
    work: dist.Work
    kv: torch.Tensor
    blocks: list[int] = field(default_factory=list)


class Migrations:
    """A decode instance's migrations, out and in: each listed one advances a stage a round.

    `run_stages` before the instance's step, `finish` after it: the round's outcomes, one
    per migration, `{"id", "outcome": "stage" | "committed" | "aborted", "blocks",
    "pause_s", "reason"}` (pause_s: the final stage's seconds, on the source).
    """

    def __init__(
        self,
        engine: LLMEngine,
        rank: int,
        links: dict[int, tuple[float, float]],
        transfers: dict[int, TorchKVTransfer],
        kv_device: torch.device,
    ) -> None:
        self.engine, self.rank, self.links = engine, rank, links
        self.transfers, self.kv_device = transfers, kv_device
        self.step_s: float | None = None  # the instance's decode step, measured
        self.outgoing: dict[str, _Outgoing] = {}
        self.incoming: dict[str, BlockTable] = {}  # blocks reserved for each request coming in
        self.in_flight: list[_InFlight] = []
        self.outcomes: dict[str, dict[str, Any]] = {}

    def transfer(self, peer: int) -> TorchKVTransfer:
        return self.transfers.setdefault(peer, TorchKVTransfer(peer, device=self.kv_device))

    # --- the round ---

    def run_stages(self, orders: list[MigrationOrder]) -> None:
        """This round's stage of every migration listed, in the command's (global) order."""
        listed = {order.request_id for order in orders}
        for request_id in [r for r in self.incoming if r not in listed]:
            self.engine.kv.free(self.incoming.pop(request_id))  # its source died, or gave up
        self.outgoing = {r: o for r, o in self.outgoing.items() if r in listed}
        for order in orders:
            if order.source == self.rank:
                self._send_stage(order)
            else:
                self._receive_stage(order)

    def finish(self) -> list[dict[str, Any]]:
        """After the step: wait for the pre-copy blocks in flight, write those received."""
        for flight in self.in_flight:
            try:
                flight.work.wait()
            except LINK_ERRORS as error:
                self._abort(flight.request_id, f"the link to rank {flight.peer} failed: {error}")
                continue
            if flight.blocks and flight.request_id in self.incoming:
                self.engine.worker.write_blocks(flight.blocks, flight.kv)
        self.in_flight = []
        outcomes, self.outcomes = list(self.outcomes.values()), {}
        return outcomes

    def _outcome(self, request_id: str, outcome: str, blocks: int = 0, **extra: Any) -> None:
        self.outcomes[request_id] = {"id": request_id, "outcome": outcome, "blocks": blocks,
                                     "pause_s": 0.0, "reason": "", **extra}  # fmt: skip

    def _abort(self, request_id: str, reason: str) -> None:
        """Give up: the source keeps the request; the destination frees what it reserved."""
        self.outgoing.pop(request_id, None)
        table = self.incoming.pop(request_id, None)
        if table is not None:
            self.engine.kv.free(table)
        self._outcome(request_id, "aborted", reason=reason)

    # --- the source ---

    def _send_stage(self, order: MigrationOrder) -> None:
        request_id, transfer = order.request_id, self.transfer(order.target)
        seqs = self.engine.scheduler.sequences_of(request_id)
        try:
            if not seqs:
                transfer.send_message({"kind": "gone"})
                self._abort(request_id, "the request finished or was aborted before it moved")
                return
            out = self.outgoing.setdefault(request_id, _Outgoing())
            plan = self._plan(seqs[0], out, order)
            if plan == FINAL:
                self._send_final(seqs[0], out, transfer, order.target)
            else:
                self._send_precopy(seqs[0], out, plan, transfer)
        except LINK_ERRORS as error:  # the destination died, or the link broke
            self._abort(request_id, f"the link to rank {order.target} failed: {error}")

    def _plan(self, seq: Sequence, out: _Outgoing, order: MigrationOrder) -> range | str:
        """The stage planner's choice; before `min_stages` are done, a pre-copy of every
        block not sent yet."""
        if seq.status is not SeqStatus.RUNNING:
            return FINAL  # preempted here: no KV to copy; the destination recomputes
        blocks, block_size = seq.block_table.blocks, self.engine.kv.block_size
        if blocks[: len(out.sent)] != out.sent:
            out.sent = []  # preempted or swapped since the last stage: start over
        filled = seq.num_computed_tokens // block_size
        if out.stages < order.policy.min_stages:
            return range(len(out.sent), filled)
        latency_s, bandwidth = self.links[order.target]
        step_s = (self.step_s or 1e-3) * order.policy.step_share  # unmeasured: a millisecond
        return planner(order.policy.planner)(
            filled, len(out.sent), self.engine.worker.pool.block_nbytes, bandwidth, latency_s,
            step_s, block_size, out.stages, order.policy.max_stages,
        )  # fmt: skip

    def _send_precopy(
        self, seq: Sequence, out: _Outgoing, stage: range, transfer: TorchKVTransfer
    ) -> None:
        """Blocks `stage` go while this instance decodes (the request included)."""
        request_id = seq.request_id
        transfer.send_message({"kind": "stage", "start": stage.start, "stop": stage.stop})
        ack = transfer.receive_message()
        if not ack["ok"]:
            self._abort(request_id, ack["reason"])
            return
        blocks = seq.block_table.blocks[stage.start : stage.stop]
        if blocks:
            kv, work = transfer.start_send_blocks(self.engine.worker.read_blocks(blocks))
            self.in_flight.append(_InFlight(request_id, transfer.peer, work, kv))
        out.sent += blocks
        out.stages += 1
        self._outcome(request_id, "stage", len(blocks))

    def _send_final(
        self, seq: Sequence, out: _Outgoing, transfer: TorchKVTransfer, target: int
    ) -> None:
        """Pause: the blocks not sent yet and the request's state; release it on commit."""
        start_s = time.perf_counter()
        running = seq.status is SeqStatus.RUNNING
        num_computed = seq.num_computed_tokens if running else 0
        first = len(out.sent) if running else 0
        stop = math.ceil(num_computed / self.engine.kv.block_size)
        sample = seq.sample
        transfer.send_message({
            "kind": "final", "start": first, "stop": stop, "num_computed": num_computed,
            "prompt_token_ids": sample.prompt_token_ids, "token_ids": sample.token_ids,
            "params": asdict(sample.params),
        })  # fmt: skip
        ack = transfer.receive_message()
        if not ack["ok"]:
            self._abort(seq.request_id, ack["reason"])
            return
        if stop > first:
            transfer.send_blocks(self.engine.worker.read_blocks(seq.block_table.blocks[first:stop]))
        commit = transfer.receive_message()
        if not commit["ok"]:
            self._abort(seq.request_id, commit["reason"])
            return
        release_migrated(self.engine, seq.request_id)
        del self.outgoing[seq.request_id]
        pause_s = time.perf_counter() - start_s
        self._observe_link(target, stop - first, pause_s)
        self._outcome(seq.request_id, "committed", stop - first, pause_s=pause_s)

    def _observe_link(self, peer: int, blocks: int, seconds: float) -> None:
        """What a final stage really took, blocks read from the pool, sent, written and
        acknowledged, becomes the link's bandwidth for the planner (the measure taken at
        start times the socket alone, and promises more than a stage gets)."""
        if blocks >= 2:
            latency_s, _ = self.links[peer]
            per_block_s = max(seconds - latency_s, 1e-9) / blocks
            self.links[peer] = (latency_s, self.engine.worker.pool.block_nbytes / per_block_s)

    # --- the destination ---

    def _receive_stage(self, order: MigrationOrder) -> None:
        request_id, transfer = order.request_id, self.transfer(order.source)
        table = self.incoming.setdefault(request_id, self.engine.kv.new_table())
        committed = False
        try:
            header = transfer.receive_message()
            if header["kind"] == "gone":
                self._abort(request_id, "the request finished or was aborted before it moved")
                return
            block_size = self.engine.kv.block_size
            final = header["kind"] == "final"
            tokens = header["num_computed"] if final else header["stop"] * block_size
            refused = self._reserve(table, tokens)
            transfer.send_message({"ok": not refused, "reason": refused})
            if refused:
                self._abort(request_id, refused)
                return
            if not final:
                self._receive_precopy(request_id, table, header, transfer)
                return
            committed = self._receive_final(request_id, table, header, transfer)
        except LINK_ERRORS as error:  # the source died, or the link broke
            if not committed:
                self._abort(request_id, f"the link to rank {order.source} failed: {error}")

    def _reserve(self, table: BlockTable, num_tokens: int) -> str:
        """Grow (or cut) `table` to slots for `num_tokens` tokens; why not, or ""."""
        kv = self.engine.kv
        if num_tokens <= table.num_tokens:
            kv.truncate(table, num_tokens)
            return ""
        if not kv.can_append(table, num_tokens - table.num_tokens):
            return (
                f"no room on rank {self.rank} for {num_tokens} migrated tokens: "
                f"{kv.allocator.num_free} free blocks of {kv.block_size} tokens"
            )
        kv.append(table, num_tokens - table.num_tokens)
        return ""

    def _receive_precopy(
        self, request_id: str, table: BlockTable, header: dict, transfer: TorchKVTransfer
    ) -> None:
        blocks = table.blocks[header["start"] : header["stop"]]
        if blocks:
            kv, work = transfer.start_receive_blocks(self._shape(len(blocks)), self._dtype)
            self.in_flight.append(_InFlight(request_id, transfer.peer, work, kv, blocks))
        self._outcome(request_id, "stage", len(blocks))

    def _receive_final(
        self, request_id: str, table: BlockTable, header: dict, transfer: TorchKVTransfer
    ) -> bool:
        """The last blocks and the request's state; it continues here. True once committed."""
        blocks = table.blocks[header["start"] : header["stop"]]
        if blocks:
            kv = transfer.receive_blocks(self._shape(len(blocks)), self._dtype)
            self.engine.worker.write_blocks(blocks, kv)
        del self.incoming[request_id]
        params = SamplingParams(**header["params"])
        try:
            adopt_migrated(
                self.engine, request_id, header["prompt_token_ids"], params,
                header["token_ids"], table, header["num_computed"],
            )  # fmt: skip
        except (ValueError, MemoryError) as error:
            self.engine.kv.free(table)
            self.engine.abort_request(request_id)
            transfer.send_message({"ok": False, "reason": f"rank {self.rank} refused: {error}"})
            self._outcome(request_id, "aborted", reason=str(error))
            return False
        self._outcome(request_id, "committed", len(blocks))
        transfer.send_message({"ok": True, "reason": ""})
        return True

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        layers, kv, _, *tail = self.engine.worker.pool.kv.shape  # [L, 2, blocks, bs, Hkv, D]
        return (layers, kv, num_blocks, *tail)

    @property
    def _dtype(self) -> torch.dtype:
        return self.engine.worker.pool.dtype
