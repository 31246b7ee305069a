"""`DisaggregatedEngine`: the proxy (rank 0) over P prefill and D decode instances.

It has the interface the server's `AsyncEngine` drives (`add_request`, `abort_request`,
`step`, `has_unfinished_requests`, `get_metrics`), so `minserve serve --disaggregation 1P2D`
streams through it exactly as through a colocated `LLMEngine`. One `step()` is one round
(docs/distributed.md draws it): place requests on the least-loaded instances, command every
live instance (abort, add, hand off KV), and collect each one's report of new tokens, so
the step returns each request's delta (`token_deltas.py`) and the server streams them.

A dead instance is left out of the next rounds, and the requests it held carry on elsewhere
(resumed from the tokens streamed so far); only a request with nowhere to go fails, with
`RequestsFailedError`. The proxy's bookkeeping is `fault_recovery.py`.

Live migration (Llumnix): `migrate(request_id, to_rank)` moves a decoding request to another
decode instance while it decodes (multi-stage pre-copy, `migration.py`); `drain(rank)` moves
every request off one. The proxy's bookkeeping is `migration_control.py`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from minserve.disagg.cluster import (
    ClusterSpec,
    InstanceFailedError,
    proxy_scheduler_config,
    start_cluster,
    stop_cluster,
)
from minserve.disagg.fault_recovery import FaultRecovery, where_again
from minserve.disagg.instance_stats import merge_stats
from minserve.disagg.kv_wire import choose_kv_wire
from minserve.disagg.migration import PRE_COPY, StagePolicy
from minserve.disagg.migration_control import MigrationControl
from minserve.disagg.placement import least_loaded
from minserve.disagg.token_deltas import RemoteRequest
from minserve.disagg.topology import PDTopology
from minserve.disagg.wire import recv_json, send_json
from minserve.distributed.group import free_port
from minserve.engine_args import EngineArgs
from minserve.errors import RequestsFailedError, StructuredOutputError
from minserve.model.default_model import default_model_path
from minserve.model.tokenizer import Tokenizer
from minserve.outputs import RequestOutput
from minserve.request import validate_prompt, validate_resume
from minserve.sampling_params import SamplingParams


class DisaggregatedEngine:
    """Rank 0 of a `<P>P<D>D` cluster: routes, streams, aborts; the instances compute.

    engine_options are `LLM`'s keyword arguments, applied to every instance (each has its
    own KV pool of that size). Call `shutdown()` when done (or use it as a context manager).
    """

    def __init__(
        self,
        model: str | Path | None,
        topology: PDTopology | str,
        transfer_policy: str = "auto",
        startup_timeout_s: float = 300.0,
        step_timeout_s: float = 600.0,
        **engine_options: Any,
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group")
        self.topology = PDTopology.parse(topology) if isinstance(topology, str) else topology
        path = default_model_path() if model is None else Path(model)
        if not path.exists():
            raise FileNotFoundError(f"model path {path} does not exist")
        EngineArgs.from_options(model=path, **engine_options)  # refused here, not in 3 processes
        kv_wire = choose_kv_wire(engine_options.get("device", "auto"), self.topology.world_size - 1)
        self.spec = ClusterSpec(
            str(path), tuple(engine_options.items()), self.topology, free_port(),
            step_timeout_s, transfer_policy, kv_wire,
        )  # fmt: skip
        self.procs, self.control, hellos = start_cluster(self.spec, startup_timeout_s)
        self.tokenizer = (
            Tokenizer.from_pretrained_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)
        )
        self.max_model_len = min(h["max_model_len"] for h in hellos.values())
        self.vocab_size = hellos[self.topology.prefill_ranks[0]]["vocab_size"]
        self.device = None  # the instances' processes run the steps
        self.scheduler_config = proxy_scheduler_config(engine_options, self.topology.num_decode)
        self.alive = set(self.topology.worker_ranks)
        self.requests: dict[str, RemoteRequest] = {}
        self.decisions: dict[str, dict] = {}  # request id -> transfer decision (JSON)
        self.instance_stats: dict[int, dict[str, float]] = {}
        self.counters: Counter[str] = Counter()
        self._adds: dict[int, list[dict]] = defaultdict(list)  # rank -> adds not sent yet
        self._resumes: dict[int, list[dict]] = defaultdict(list)  # rank -> resumes not sent yet
        self._aborts: dict[int, list[str]] = defaultdict(list)
        self._leaving: dict[int, list[str]] = defaultdict(list)  # prefilled, not placed yet
        self.faults = FaultRecovery()
        self.migrations = MigrationControl(self.topology.decode_ranks)
        self.closed = False

    # --- requests in and out (the interface AsyncEngine drives) ---

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams, priority: int = 0, resume_token_ids: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Validate here, then queue for the least-loaded prefill instance's next round.

        resume_token_ids (tokens it generated elsewhere): it goes straight to a decode
        instance, which computes prompt + those tokens and continues after them."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_params(params)
        validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        rank = self._least_loaded(self._live(self.topology.prefill_ranks))
        request = RemoteRequest(request_id, prompt, prompt_token_ids, rank, params, priority)
        if resume_token_ids:
            validate_resume(resume_token_ids, len(prompt_token_ids), params, self.vocab_size,
                            self.max_model_len)  # fmt: skip
            request.token_ids = list(resume_token_ids)
            self._place_again(request)  # as a request whose instance died
        else:
            self._adds[rank].append(request.add_json())
        self.requests[request_id] = request
        self.counters["prompt_tokens"] += len(prompt_token_ids)

    def check_params(self, params: SamplingParams) -> None:
        """What the instances serve: n=1, no logprobs, no structured output (yet)."""
        if params.n != 1 or params.logprobs is not None:
            raise ValueError("disaggregated serving supports n=1 without logprobs for now")
        if params.structured_outputs is not None:
            raise StructuredOutputError(
                "disaggregated serving does not support structured_outputs yet"
            )

    def abort_request(self, request_id: str) -> None:
        """Forget it here; the instance holding it frees its blocks next round."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.counters["num_requests_aborted"] += 1
        rank = request.location
        for pending in (self._adds, self._resumes):
            queued = [a for a in pending[rank] if a["id"] != request_id]
            if len(queued) < len(pending[rank]):
                pending[rank] = queued  # never sent: nothing to free anywhere
                return
        if request_id in self._leaving[rank]:
            self._leaving[rank].remove(request_id)
        if rank in self.alive:
            self._aborts[rank].append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or any(self._aborts.values()) or self.migrations.busy

    # --- one round ---

    def step(self) -> list[RequestOutput]:
        """Command every live instance, collect every report; outputs of requests with news."""
        self.counters["num_steps"] += 1
        lost: dict[str, str] = {}
        self.migrations.start_round(self.requests, self.alive, self._least_loaded)
        sends = self._place_prefilled(lost)
        commands = self._commands(sends)
        for rank, command in commands.items():
            try:
                send_json(command, rank, self.control)
            except (RuntimeError, dist.DistError) as error:
                self._instance_died(rank, error)
        reports = {}
        for rank in commands:
            if rank not in self.alive:
                continue
            try:
                reports[rank] = recv_json(rank)
            except (RuntimeError, dist.DistError) as error:
                self._instance_died(rank, error)
        self._settle_migrations(reports)
        deltas: list[RequestOutput] = []
        for rank, report in reports.items():
            self._apply(rank, report, deltas)
        self._recover(sends, lost)
        outputs = self._outputs(deltas, lost)
        if lost:
            reasons = "; ".join(sorted(set(lost.values())))
            raise RequestsFailedError(reasons, list(lost), outputs, lost)
        return outputs

    def _commands(self, sends: dict[int, list[list]]) -> dict[int, dict]:
        commands = {}
        for rank in self._live(self.topology.prefill_ranks):
            adds, aborts = self._adds.pop(rank, []), self._aborts.pop(rank, [])
            commands[rank] = {"stop": False, "add": adds, "abort": aborts, "send": sends[rank],
                              "resume": self._resumes.pop(rank, [])}  # fmt: skip
        for rank in self._live(self.topology.decode_ranks):
            senders = sorted(p for p, items in sends.items() if any(d == rank for _, d in items))
            commands[rank] = {"stop": False, "abort": self._aborts.pop(rank, []),
                              "resume": self._resumes.pop(rank, []), "receive_from": senders,
                              "migrate": self.migrations.commands(rank)}  # fmt: skip
        return commands

    def _place_prefilled(self, lost: dict[str, str]) -> dict[int, list[list]]:
        """Each prefilled request goes to the least-loaded live decode instance (with none
        left, it is resumed on a prefill instance and decodes there)."""
        sends: dict[int, list[list]] = defaultdict(list)
        decode = self._placeable_decode()
        for rank, request_ids in sorted(self._leaving.items()):
            for request_id in request_ids:
                if request_id not in self.requests:
                    continue  # lost with its instance
                if not decode:
                    self._resume(self.requests[request_id], lost)  # frees its blocks there
                    continue
                target = self._least_loaded(decode)
                self.requests[request_id].location = target
                sends[rank].append([request_id, target])
        self._leaving.clear()
        return sends

    def _apply(self, rank: int, report: dict, deltas: list[RequestOutput]) -> None:
        """One instance's report. Tokens count only from the instance holding the request
        (a destination that committed a migration its source aborted holds a copy)."""
        self.instance_stats[rank] = report["stats"]
        for reported in report["outputs"]:
            request = self.requests.get(reported["id"])
            if request is not None and request.location == rank:
                deltas.append(request.delta(reported))
                self.counters["generation_tokens"] += len(reported["token_ids"])
        self._leaving[rank] += [r for r in report.get("leaving", []) if r in self.requests]
        for decision in report.get("decisions", []):
            self.decisions[decision["request_id"]] = {**decision, "from_rank": rank}
        self.faults.note_report(report)

    def _outputs(self, deltas: list[RequestOutput], lost: dict[str, str]) -> list[RequestOutput]:
        """This round's deltas of the requests not lost; finished ones are forgotten."""
        for request_id in lost:
            self.requests.pop(request_id, None)
        outputs = [d for d in deltas if d.request_id not in lost]
        for delta in outputs:
            if delta.finished:
                del self.requests[delta.request_id]
                self.counters["num_requests_finished"] += 1
        return outputs

    # --- requests whose instance died: resumed elsewhere (`fault_recovery.py`) ---

    def _recover(self, sends: dict[int, list[list]], lost: dict[str, str]) -> None:
        """Requests on a dead instance, or whose hand-off was lost, carry on elsewhere."""
        lost.update(self.faults.refused())
        for request in self.faults.orphans(self.requests, self.alive, sends, lost):
            self._resume(request, lost)

    def _resume(self, request: RemoteRequest, lost: dict[str, str]) -> None:
        """Place a request again whose instance died or lost it; fail it with nowhere to go."""
        old = request.location
        if old in self.alive:
            self._aborts[old].append(request.request_id)  # it may hold part of it: free that
        if self._place_again(request):
            self.counters["num_requests_resumed"] += 1
        else:
            lost[request.request_id] = self.faults.why_lost(old, request.request_id)

    def _place_again(self, request: RemoteRequest) -> bool:
        """Queue it on the least loaded of the instances `where_again` allows; False if no
        instance is left to take it."""
        prefill = self._live(self.topology.prefill_ranks)
        targets, from_start = where_again(request, prefill, self._placeable_decode())
        if not targets:
            return False
        request.location = self._least_loaded(targets)
        queue = self._adds if from_start else self._resumes
        queue[request.location].append(request.add_json() if from_start else request.resume_json())
        return True

    def _instance_died(self, rank: int, error: BaseException) -> None:
        """Leave the rank out from now on; the requests it held are resumed after the round."""
        self.alive.discard(rank)
        kind = "prefill" if self.topology.is_prefill(rank) else "decode"
        self.faults.instance_died(rank, self.procs[rank], kind, error)
        for pending in (self._adds, self._resumes, self._aborts, self._leaving):
            pending.pop(rank, None)
        self.instance_stats.pop(rank, None)

    # --- live migration (the bookkeeping is `migration_control.py`) ---

    def migrate(self, request_id: str, to_rank: int, policy: StagePolicy = PRE_COPY) -> int:
        """Move a decoding request to decode instance `to_rank` while it decodes (live
        migration, Llumnix); returns the rank it leaves. The next rounds carry it out (see
        `migrations.outcomes`); safe to call from a thread other than the one stepping.

        Raises UnknownRequestError, UnknownInstanceError (not a decode rank), or
        MigrationConflictError (not decoding yet, there already, moving already, dead)."""
        return self.migrations.order(self.requests, self.alive, request_id, to_rank, policy)

    def drain(self, rank: int) -> list[str]:
        """Move every request off decode instance `rank` (each round starts a migration for
        whatever it still holds), and place nothing new there until `undrain(rank)`.
        Returns the requests it held. Safe to call from another thread."""
        return self.migrations.drain(self.requests, self.alive, rank)

    def undrain(self, rank: int) -> None:
        """Place requests on decode instance `rank` again."""
        self.migrations.undrain(self.alive, rank)

    def placements(self) -> list[dict[str, Any]]:
        """Where each request in flight lives, and where it is migrating to (or None)."""
        active = dict(self.migrations.active)
        return [
            {"request_id": r, "instance": q.location,
             "migrating_to": active[r].target if r in active else None}
            for r, q in dict(self.requests).items()
        ]  # fmt: skip

    def _settle_migrations(self, reports: dict[int, dict]) -> None:
        moved, drop = self.migrations.settle(reports)
        for request_id, target in moved.items():
            if request_id in self.requests:
                self.requests[request_id].location = target
        for rank, request_id in drop:
            self._aborts[rank].append(request_id)

    # --- placement, metrics, shutdown ---

    def _live(self, ranks: tuple[int, ...]) -> list[int]:
        return [r for r in ranks if r in self.alive]

    def _placeable_decode(self) -> list[int]:
        """Live decode ranks that take new requests: the ones not draining, if any."""
        live = self._live(self.topology.decode_ranks)
        return [r for r in live if r not in self.migrations.draining] or live

    def _least_loaded(self, ranks: list[int]) -> int:
        if not ranks:
            raise InstanceFailedError("no prefill instance is alive; restart the server")
        active = self.migrations.active
        held = Counter(
            active[r].target if r in active else request.location
            for r, request in self.requests.items()
        )  # a migrating request counts where it goes
        free = {r: s["num_free_blocks"] for r, s in self.instance_stats.items()}
        return least_loaded(ranks, held, free)

    def get_metrics(self) -> dict[str, float]:
        """The live instances' stats added up, with the proxy's own request counters."""
        queued = sum(len(adds) for adds in self._adds.values())
        merged = merge_stats(self.instance_stats, self.counters, queued, len(self.alive))
        return {**merged, **self.migrations.stats.as_metrics()}

    def kv_events_info(self) -> None:
        """The instances publish no KV events (their prefix caches are their own)."""
        return None

    def shutdown(self) -> None:
        """Tell every live instance to stop, wait for them, leave the group (idempotent)."""
        if not self.closed:
            self.closed = True
            stop_cluster(self.procs, self.control, self.alive)

    def __enter__(self) -> DisaggregatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
