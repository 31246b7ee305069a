"""Prefill/decode disaggregation on two processes: this one prefills, a spawned one decodes.

`PrefillDecodePair(model)` is DistServe's split at its smallest: the calling process is
the prefill instance and the proxy; rank 1 (`pd_worker.py`) is the decode instance. Each
round, overlapping the two phases:

    rank 0 (prefill + proxy)                   rank 1 (decode)
    hand off last round's prefills (KVTransfer) -> admit, ack, receive KV
    one prefill step (first tokens)            one decode step
    receive finished requests  <-------------  send finished requests (the tokens after
                                               the first), added to the first token here

A request whose first token already ends it never leaves rank 0. Per request, the
transfer-versus-recompute rule (`transfer_rule.py`) picks whether its KV moves or the
decode side prefills the prompt again. If the decode process dies, `generate` raises
`DecodeWorkerError` within the step timeout and rank 0's blocks are freed.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minserve.disagg.engine_hooks import detach_prefilled
from minserve.disagg.hand_off import Admit, Receive, Send, admit, receive_prefilled, send_prefilled
from minserve.disagg.kv_transfer import KVAck, KVOffer, TorchKVTransfer
from minserve.disagg.kv_wire import choose_kv_wire
from minserve.disagg.pd_worker import DECODE_RANK, PairSpec, decode_main, join_pair
from minserve.disagg.transfer_rule import TransferDecision, TransferRule, measure_link
from minserve.disagg.wire import recv_json, send_json
from minserve.distributed.group import free_port
from minserve.engine import observe_steps
from minserve.llm import LLM
from minserve.outputs import CompletionOutput, OutputAccumulator, RequestOutput
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
        admit: Admit = admit,
        send: Send = send_prefilled,
        receive: Receive = receive_prefilled,
        **engine_options: Any,
    ) -> None:
        """The hand-off's pieces are arguments (chapter 08's exercises plug in here): `send`
        runs here, `receive` and `admit` in the decode process, so those two must be
        module-level functions (they cross to it by name)."""
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
            target=decode_main, args=(spec, status, admit, receive), daemon=True
        )
        self.proc.start()
        self._wait_ready(status, startup_timeout_s)
        join_pair(0, spec)
        link = measure_link(DECODE_RANK, sender=True, device=kv_device)
        self.rule = TransferRule(*link, policy=transfer_policy)
        self.transfer = TorchKVTransfer(DECODE_RANK, device=kv_device)
        self.decisions: dict[str, TransferDecision] = {}
        self.send = send
        self.acks: dict[str, KVAck] = {}  # the decode side's answer to each offer
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
        request_ids = [f"pd-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(request_ids, prompts):
            engine.add_request(request_id, *self.llm._tokenize(prompt), params)
        whole = OutputAccumulator()
        try:
            leaving: list[Sequence] = []
            while not all(_finished(whole, request_id) for request_id in request_ids):
                leaving = self.run_round(leaving, whole)
        except (RuntimeError, dist.DistError) as error:
            for request_id in request_ids:
                engine.abort_request(request_id)  # frees what rank 0 still holds
            lost = sum(not _finished(whole, request_id) for request_id in request_ids)
            raise self._failed(error, lost) from error
        return [whole.outputs[request_id] for request_id in request_ids]

    def run_round(self, leaving: list[Sequence], whole: OutputAccumulator) -> list[Sequence]:
        """One round: hand off last round's prefills, one prefill step (first tokens), then
        the decode side's finished requests; every output is added to `whole`. Returns the
        sequences to hand off next round."""
        self._hand_off(leaving)
        leaving = self._prefill_step(whole)
        for result in recv_json(DECODE_RANK):
            whole.add(_decoded(whole.outputs[result["id"]], result))
        return leaving

    def _hand_off(self, leaving: list[Sequence]) -> None:
        """Offer, get acks, send accepted KV, then free rank 0's copies (`hand_off.py`)."""
        send_json({"stop": False}, DECODE_RANK)
        engine = self.llm.engine
        offers = [self._offer(seq, engine.worker.pool.block_nbytes) for seq in leaving]
        for ack in self.send(engine, self.transfer, leaving, offers):
            self.acks[ack.request_id] = ack

    def _offer(self, seq: Sequence, block_nbytes: int) -> KVOffer:
        request = seq.request
        kv_bytes = len(seq.block_table.blocks) * block_nbytes
        decision = self.rule.decide(request.request_id, len(request.prompt_token_ids), kv_bytes)
        self.decisions[request.request_id] = decision
        return KVOffer.of(seq, decision.transfer)

    def _prefill_step(self, whole: OutputAccumulator) -> list[Sequence]:
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
            whole.add(output)
            if not output.finished:
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


def _finished(whole: OutputAccumulator, request_id: str) -> bool:
    output = whole.outputs.get(request_id)
    return output is not None and output.finished


def _decoded(first: RequestOutput, result: dict[str, Any]) -> RequestOutput:
    """A decode instance's JSON result (the tokens after the first) as the delta that
    completes `first`, the request's output from the prefill step."""
    assert first.metrics is not None
    first.metrics.finished_time = time.monotonic()
    completion = CompletionOutput(
        0, result["text"], result["token_ids"], result["finish_reason"], result["stop_reason"]
    )
    return RequestOutput(
        first.request_id, first.prompt, first.prompt_token_ids, [completion], finished=True,
        metrics=first.metrics,
    )  # fmt: skip
