"""Prefill/decode disaggregation on two processes: this one prefills, a spawned one decodes.

`PrefillDecodePair(model)` is DistServe's split at its smallest: the calling process is
the prefill instance and the proxy; rank 1 (`pd_worker.py`) is the decode instance. Each
round, overlapping the two phases:

    rank 0 (prefill + proxy)                   rank 1 (decode)
    hand off last round's prefills (KVTransfer) -> admit, ack, receive KV
    one prefill step                           one decode step
    receive finished requests  <-------------  send finished requests

A request whose first token already ends it never leaves rank 0. Per request, the
transfer-versus-recompute rule (`transfer_rule.py`) picks whether its KV moves or the
decode side prefills the prompt again. If the decode process dies, `generate` raises
`DecodeWorkerError` within the step timeout and rank 0's blocks are freed.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minserve.disagg.engine_hooks import detach_prefilled
from minserve.disagg.kv_transfer import KVOffer, TorchKVTransfer
from minserve.disagg.kv_wire import choose_kv_wire
from minserve.disagg.pd_worker import DECODE_RANK, PairSpec, decode_main, join_pair
from minserve.disagg.transfer_rule import TransferDecision, TransferRule, measure_link
from minserve.disagg.wire import recv_json, send_json
from minserve.distributed.group import free_port
from minserve.engine import observe_steps
from minserve.llm import LLM
from minserve.outputs import CompletionOutput, RequestOutput
from minserve.request import Request
from minserve.sampling_params import SamplingParams
from minserve.scheduler.sequence import Sequence


class DecodeWorkerError(RuntimeError):
    """The decode instance died or failed; the requests it held are lost."""


class PrefillDecodePair:
    """One prefill instance (this process) and one decode instance (a spawned process)."""

    def __init__(
        self,
        model: str | Path,
        transfer_policy: str = "auto",
        startup_timeout_s: float = 120.0,
        step_timeout_s: float = 60.0,
        **engine_options: Any,
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group")
        kv_wire = choose_kv_wire(engine_options.get("device", "auto"), num_instances=2)
        spec = PairSpec(
            str(model), tuple(engine_options.items()), free_port(), step_timeout_s, kv_wire
        )
        kv_device = spec.kv_device(0)
        if kv_device.type == "cuda":
            torch.cuda.set_device(kv_device)
        self.llm = LLM(model, **engine_options)
        status = mp.get_context("spawn").Queue()
        self.proc = mp.get_context("spawn").Process(
            target=decode_main, args=(spec, status), daemon=True
        )
        self.proc.start()
        self._wait_ready(status, startup_timeout_s)
        join_pair(0, spec)
        link = measure_link(DECODE_RANK, sender=True, device=kv_device)
        self.rule = TransferRule(*link, policy=transfer_policy)
        self.transfer = TorchKVTransfer(DECODE_RANK, device=kv_device)
        self.decisions: dict[str, TransferDecision] = {}
        self.closed = False
        self._ids = itertools.count()

    def _wait_ready(self, status: Any, timeout: float) -> None:
        try:
            message = status.get(timeout=timeout)
        except queue.Empty:
            message = f"no word within {timeout:.0f} s"
        if message != "ready":
            self.closed = True
            self.proc.terminate()
            raise DecodeWorkerError(f"the decode instance failed to start:\n{message}")

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams
    ) -> list[RequestOutput]:
        """Like `LLM.generate`: outputs in prompt order, prefilled here and decoded there."""
        if self.closed:
            raise DecodeWorkerError("the pair was shut down (or its decode instance died)")
        if params.n != 1 or params.logprobs is not None:
            raise ValueError("disaggregated serving supports n=1 without logprobs for now")
        engine = self.llm.engine
        assert engine is not None
        requests = []
        for prompt in prompts:
            text, ids = self.llm._tokenize(prompt)
            requests.append(engine.add_request(f"pd-{next(self._ids)}", text, ids, params))
        done: dict[str, RequestOutput] = {}
        try:
            self._serve(requests, done)
        except (RuntimeError, dist.DistError) as error:
            for request in requests:
                engine.abort_request(request.request_id)  # frees what rank 0 still holds
            raise self._failed(error, len(requests) - len(done)) from error
        return [done[r.request_id] for r in requests]

    def _serve(self, requests: list[Request], done: dict[str, RequestOutput]) -> None:
        by_id = {r.request_id: r for r in requests}
        leaving: list[Sequence] = []
        while len(done) < len(requests):
            leaving, results = self.run_round(leaving, done)
            for result in results:
                done[result["request_id"]] = _output(by_id[result["request_id"]], result)

    def run_round(
        self, leaving: list[Sequence], done: dict[str, RequestOutput]
    ) -> tuple[list[Sequence], list[dict[str, Any]]]:
        """One round: hand off last round's prefills, one prefill step (requests done with
        their first token go to `done`), then the decode side's finished results (JSON).
        Returns the sequences to hand off next round, and those results."""
        self._hand_off(leaving)
        leaving = self._prefill_step(done)
        return leaving, recv_json(DECODE_RANK)

    def _hand_off(self, leaving: list[Sequence]) -> None:
        """Offer, get acks, send accepted KV, then free rank 0's copies."""
        send_json({"stop": False}, DECODE_RANK)
        worker = self.llm.engine.worker
        offers = [self._offer(seq, worker.pool.block_nbytes) for seq in leaving]
        accepted = self.transfer.offer(offers)
        for seq, ok in zip(leaving, accepted):
            if ok:
                self.transfer.send_blocks(worker.read_blocks(seq.block_table.blocks))
        for seq in leaving:
            self.llm.engine.scheduler.free_detached(seq)

    def _offer(self, seq: Sequence, block_nbytes: int) -> KVOffer:
        request = seq.request
        kv_bytes = len(seq.block_table.blocks) * block_nbytes
        decision = self.rule.decide(request.request_id, len(request.prompt_token_ids), kv_bytes)
        self.decisions[request.request_id] = decision
        return KVOffer.of(seq, decision.transfer)

    def _prefill_step(self, done: dict[str, RequestOutput]) -> list[Sequence]:
        """One step of the prefill engine; requests that got their first token leave it."""
        engine = self.llm.engine
        if not engine.has_unfinished_requests():
            return []
        with observe_steps(engine) as records:
            outputs = engine.step()
        for record in records:
            batch, forward = record.scheduler_output, record.timings.forward
            self.rule.observe_prefill(batch.num_batched_tokens, forward)
        leaving = []
        for output in outputs:
            if output.finished:
                done[output.request_id] = output
            else:
                leaving.append(detach_prefilled(engine, output.request_id))
        return leaving

    def _failed(self, error: BaseException, num_lost: int) -> DecodeWorkerError:
        self.proc.join(2)
        code = self.proc.exitcode
        self._close_after_failure()
        return DecodeWorkerError(
            f"the decode instance (pid {self.proc.pid}, exit code {code}) failed: {error}; "
            f"{num_lost} requests of this call were lost"
        )

    def _close_after_failure(self) -> None:
        self.closed = True
        if self.proc.is_alive():
            self.proc.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()

    def shutdown(self) -> None:
        """Stop the decode process and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        send_json({"stop": True}, DECODE_RANK)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
        dist.destroy_process_group()

    def __enter__(self) -> PrefillDecodePair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _output(request: Request, result: dict[str, Any]) -> RequestOutput:
    """A decode instance's JSON result as the `RequestOutput` LLM.generate would return."""
    request.record_token_time()
    completion = CompletionOutput(
        0, result["text"], result["token_ids"], result["finish_reason"], result["stop_reason"]
    )
    return RequestOutput(
        request.request_id, request.prompt, list(request.prompt_token_ids), [completion],
        finished=True, metrics=request.metrics,
    )  # fmt: skip
