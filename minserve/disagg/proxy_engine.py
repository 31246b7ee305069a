"""`DisaggregatedEngine`: the proxy (rank 0) over P prefill and D decode instances.

It has the interface the server's `AsyncEngine` drives (`add_request`, `abort_request`,
`step`, `has_unfinished_requests`, `get_metrics`), so `minserve serve --disaggregation 1P2D`
streams through it exactly as through a colocated `LLMEngine`. One `step()` is one round
(docs/distributed.md draws it): place requests on the least-loaded instances, command every
live instance (abort, add, hand off KV), and collect each one's report of new tokens, so
the step returns each request's delta (`token_deltas.py`) and the server streams them.

A dead instance (its socket closes, or a report takes longer than the step timeout) costs
only the requests it held: `step()` raises `RequestsFailedError` naming them, with the
step's other outputs, and the next rounds leave that rank out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict
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
from minserve.disagg.instance_stats import merge_stats
from minserve.disagg.kv_wire import choose_kv_wire
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
from minserve.request import validate_prompt
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
        self._aborts: dict[int, list[str]] = defaultdict(list)
        self._leaving: dict[int, list[str]] = defaultdict(list)  # prefilled, not placed yet
        self._admitted: set[str] = set()  # ids decode ranks took in this round
        self.closed = False

    # --- requests in and out (the interface AsyncEngine drives) ---

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams, priority: int = 0, resume_token_ids: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Validate here, then queue for the least-loaded prefill instance's next round."""
        if resume_token_ids:
            raise ValueError("resume_token_ids: disaggregated serving does not continue requests")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_params(params)
        validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        rank = self._least_loaded(self._live(self.topology.prefill_ranks))
        self.requests[request_id] = RemoteRequest(request_id, prompt, prompt_token_ids, rank)
        params_json = asdict(params)
        self._adds[rank].append({"id": request_id, "prompt_token_ids": prompt_token_ids,
                                 "params": params_json, "priority": priority})  # fmt: skip
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
        queued = [a for a in self._adds[rank] if a["id"] != request_id]
        if len(queued) < len(self._adds[rank]):
            self._adds[rank] = queued  # never sent: nothing to free anywhere
            return
        if request_id in self._leaving[rank]:
            self._leaving[rank].remove(request_id)
        if rank in self.alive:
            self._aborts[rank].append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or any(self._aborts.values())

    # --- one round ---

    def step(self) -> list[RequestOutput]:
        """Command every live instance, collect every report; outputs of requests with news."""
        self.counters["num_steps"] += 1
        lost: dict[str, str] = {}
        sends = self._place_prefilled(lost)
        commands = self._commands(sends)
        for rank, command in commands.items():
            try:
                send_json(command, rank, self.control)
            except (RuntimeError, dist.DistError) as error:
                self._instance_died(rank, error, lost)
        deltas: list[RequestOutput] = []
        for rank in commands:
            if rank not in self.alive:
                continue
            try:
                report = recv_json(rank)
            except (RuntimeError, dist.DistError) as error:
                self._instance_died(rank, error, lost)
                continue
            self._apply(rank, report, deltas, lost)
        self._lost_in_transit(sends, lost)
        outputs = self._outputs(deltas, lost)
        if lost:
            reasons = "; ".join(sorted(set(lost.values())))
            raise RequestsFailedError(reasons, list(lost), outputs, lost)
        return outputs

    def _commands(self, sends: dict[int, list[list]]) -> dict[int, dict]:
        commands = {}
        for rank in self._live(self.topology.prefill_ranks):
            adds, aborts = self._adds.pop(rank, []), self._aborts.pop(rank, [])
            commands[rank] = {"stop": False, "add": adds, "abort": aborts, "send": sends[rank]}
        for rank in self._live(self.topology.decode_ranks):
            senders = sorted(p for p, items in sends.items() if any(d == rank for _, d in items))
            commands[rank] = {"stop": False, "abort": self._aborts.pop(rank, []),
                              "receive_from": senders}  # fmt: skip
        return commands

    def _place_prefilled(self, lost: dict[str, str]) -> dict[int, list[list]]:
        """Each prefilled request goes to the least-loaded live decode instance."""
        sends: dict[int, list[list]] = defaultdict(list)
        decode = self._live(self.topology.decode_ranks)
        for rank, request_ids in sorted(self._leaving.items()):
            for request_id in request_ids:
                if request_id not in self.requests:
                    continue  # lost with its instance
                if not decode:
                    lost[request_id] = "no decode instance is alive"
                    self._aborts[rank].append(request_id)  # the prefill rank frees its blocks
                    continue
                target = self._least_loaded(decode)
                self.requests[request_id].location = target
                sends[rank].append([request_id, target])
        self._leaving.clear()
        return sends

    def _apply(
        self, rank: int, report: dict, deltas: list[RequestOutput], lost: dict[str, str]
    ) -> None:
        self.instance_stats[rank] = report["stats"]
        for reported in report["outputs"]:
            request = self.requests.get(reported["id"])
            if request is not None:
                deltas.append(request.delta(reported))
                self.counters["generation_tokens"] += len(reported["token_ids"])
        self._leaving[rank] += [r for r in report.get("leaving", []) if r in self.requests]
        self._admitted.update(request_id for request_id, _ in report.get("admitted", []))
        for decision in report.get("decisions", []):
            self.decisions[decision["request_id"]] = {**decision, "from_rank": rank}
        for request_id in report["lost"]:
            lost[request_id] = f"the KV hand-off of {request_id} failed (an instance died)"

    def _lost_in_transit(self, sends: dict[int, list[list]], lost: dict[str, str]) -> None:
        """A prefill rank that died mid-round: what it was handing off and no decode rank got."""
        for rank, items in sends.items():
            if rank not in self.alive:
                for request_id, _ in items:
                    if request_id not in self._admitted:
                        lost.setdefault(request_id, f"prefill rank {rank} died handing it off")
        self._admitted.clear()

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

    def _instance_died(self, rank: int, error: BaseException, lost: dict[str, str]) -> None:
        """Leave the rank out from now on; the requests it held are lost."""
        self.alive.discard(rank)
        proc = self.procs[rank]
        proc.join(2.0)  # a dead process's exit may lag its closed socket
        if proc.is_alive():
            proc.terminate()  # stuck past the step timeout: it cannot rejoin the rounds
        kind = "prefill" if self.topology.is_prefill(rank) else "decode"
        reason = (
            f"the {kind} instance (rank {rank}, pid {proc.pid}, exit code {proc.exitcode}) "
            f"failed: {error}"
        )
        for request_id, request in self.requests.items():
            if request.location == rank:
                lost[request_id] = reason
        self._adds.pop(rank, None)
        self._aborts.pop(rank, None)
        self._leaving.pop(rank, None)
        self.instance_stats.pop(rank, None)

    # --- placement, metrics, shutdown ---

    def _live(self, ranks: tuple[int, ...]) -> list[int]:
        return [r for r in ranks if r in self.alive]

    def _least_loaded(self, ranks: list[int]) -> int:
        if not ranks:
            raise InstanceFailedError("no prefill instance is alive; restart the server")
        held = Counter(r.location for r in self.requests.values())
        free = {r: s["num_free_blocks"] for r, s in self.instance_stats.items()}
        return least_loaded(ranks, held, free)

    def get_metrics(self) -> dict[str, float]:
        """The live instances' stats added up, with the proxy's own request counters."""
        queued = sum(len(adds) for adds in self._adds.values())
        return merge_stats(self.instance_stats, self.counters, queued, len(self.alive))

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
