"""The asynchronous engine: one thread drives the engine's `step()`, asyncio handlers wait.

The engine is single-threaded by design, so only the loop thread touches it. Handlers talk
to it through a thread-safe inbox (add, abort), and it answers through each request's own
asyncio queue (`loop.call_soon_threadsafe`). Between steps it drains the inbox, so a
request that arrives mid-generation joins the very next batch: continuous batching, served.

    handler --submit--> inbox --> [engine thread: add / abort, step(), fan out] --> queues
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from minserve.device import use_device
from minserve.engine_client import EngineClient
from minserve.errors import RequestsFailedError, ResumeTokensError, StepFailedError
from minserve.outputs import RequestOutput
from minserve.sampling_params import SamplingParams
from minserve.server.admission import Admission, AdmissionConfig, RequestRefusedError, Work
from minserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """More requests are queued than the server accepts (answered with 503)."""


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (shut down, or it crashed)."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests it ran were aborted (answered with 500)."""


@dataclass(frozen=True)
class _Sink:
    """Where one HTTP request's outputs go: an asyncio queue on the handler's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    sink: _Sink
    arrival: float
    resume_token_ids: list[int] | None = None
    accepted: Future = field(default_factory=Future)


@dataclass(frozen=True)
class _Abort:
    request_id: str


_STOP = object()


class RequestStream:
    """The outputs of one HTTP request's engine requests (one per prompt), as they come."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], sink: _Sink) -> None:
        self._engine, self._sink = engine, sink
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._unfinished = set(request_ids)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) each time a request gets new tokens."""
        while self._unfinished:
            item = await self._sink.queue.get()
            if isinstance(item, BaseException):
                self.abort()  # the failed requests are gone; cancel their siblings too
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield self._index[item.request_id], item

    def abort(self) -> None:
        """Cancel what is still running (the client left); frees its blocks in the engine."""
        for request_id in self._unfinished:
            self._engine.abort(request_id)
        self._unfinished.clear()


class AsyncEngine:
    """Runs an engine (an `EngineClient`: `LLMEngine`, or the disaggregated proxy) in a
    background thread and streams outputs to asyncio handlers.

    max_queued: requests accepted beyond the engine's seats (max_num_seqs) before new ones
    are refused with EngineOverloadedError: a bounded waiting queue. device: the engine's
    device; the loop makes it the current one in its own thread first (CUDA's current
    device is per thread, and a new thread starts on GPU 0). admission: the targets past
    which a request is refused at arrival (RequestRefusedError, `admission.py`); by default
    the engine's `target_ttft_ms` and `target_tpot_ms`.
    """

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        max_queued: int = 256,
        device: torch.device | None = None,
        admission: AdmissionConfig | None = None,
    ) -> None:
        self.engine, self.metrics = engine, metrics
        self.device = device
        self.capacity = engine.scheduler_config.max_num_seqs + max_queued
        targets = admission or AdmissionConfig.from_config(engine.scheduler_config)
        self.admission = Admission(targets) if targets is not None else None
        self.stats: dict[str, float] = engine.get_metrics()  # a snapshot, replaced each loop
        metrics.set_engine_stats(self.stats)  # the pool's size is known before the loop runs
        metrics.count_in_flight(lambda: self.num_in_flight)
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._in_flight = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="minserve-engine", daemon=True)
        self._running = threading.Event()  # the loop runs, in that thread or in `run()`
        self.crash: BaseException | None = None  # what ended the loop, if it crashed

    # --- the handler side (asyncio thread) ---

    def start(self) -> AsyncEngine:
        """Run the engine loop in a background thread (notebooks, tests)."""
        if not self._running.is_set():
            self._running.set()
            self._thread.start()
        return self

    def run(self) -> None:
        """Run the engine loop in the calling thread until `shutdown()` or Ctrl-C; raise
        EngineStoppedError if it crashed (`minserve serve` then exits non-zero).

        `minserve serve` runs it in the main thread: OpenMP answers fastest there (the same
        decode step took about 1.5x as long from a second thread on a 2-core CPU, since
        that thread's OpenMP workers sleep between parallel regions)."""
        self._running.set()
        self._loop()
        if self.crash is not None:
            raise EngineStoppedError(f"the engine loop crashed: {self.crash!r}") from self.crash

    def shutdown(self) -> None:
        if self._running.is_set():
            self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join()

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: the token ids a request may name."""
        return self.engine.vocab_size

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished or aborted."""
        return self._in_flight

    @property
    def is_running(self) -> bool:
        return self._running.is_set()

    async def submit(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        priority: int = 0,
        resume_token_ids: list[int] | None = None,
    ) -> RequestStream:
        """Queue one engine request per (text, token ids); raise at once if any is refused.
        `resume_token_ids`: a single prompt's request continues after these tokens."""
        if not self.is_running:
            raise EngineStoppedError("the engine loop is not running")
        if resume_token_ids and len(prompts) != 1:
            raise ResumeTokensError(
                f"resume_token_ids continues one prompt; the request has {len(prompts)}"
            )
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        prefix = f"req-{next(self._ids)}"
        adds = [
            _Add(
                f"{prefix}-{i}",
                text,
                ids,
                params,
                priority,
                sink,
                time.monotonic(),
                resume_token_ids,
            )  # fmt: skip
            for i, (text, ids) in enumerate(prompts)
        ]
        self._reserve(adds)
        if params.structured_outputs is not None:  # compile the grammar here, not in a step
            try:
                await asyncio.to_thread(self.engine.check_params, params)
            except BaseException:
                for add in adds:
                    self._release(add.request_id)
                raise
        for add in adds:
            self._inbox.put(add)
        stream = RequestStream(self, [a.request_id for a in adds], sink)
        try:
            results = await asyncio.gather(
                *(asyncio.wrap_future(a.accepted) for a in adds), return_exceptions=True
            )
        except BaseException:  # cancelled while waiting (the client left): drop them
            stream.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            stream.abort()
            raise errors[0]
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def _reserve(self, adds: list[_Add]) -> None:
        """Count the requests in flight, or refuse them all: past the capacity, or past a
        target (admission)."""
        with self._lock:
            if self._in_flight + len(adds) > self.capacity:
                self.metrics.refused.labels(reason="capacity").inc()
                raise EngineOverloadedError(
                    f"server is overloaded: {self._in_flight} requests in flight, at most "
                    f"{self.capacity} (max_num_seqs + max_queued); retry later"
                )
            if self.admission is not None:
                try:
                    self.admission.admit({a.request_id: _work(a) for a in adds}, self.stats)
                except RequestRefusedError as refused:
                    self.metrics.refused.labels(reason=refused.reason).inc()
                    raise
            self._in_flight += len(adds)

    def _release(self, request_id: str) -> None:
        with self._lock:
            self._in_flight -= 1
        if self.admission is not None:
            self.admission.release(request_id)

    # --- the engine thread ---

    def _loop(self) -> None:
        try:
            if self.device is not None:
                use_device(self.device)  # kernels launch on this thread's current GPU
            self._serve_forever()
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM in `run()`
            self._refuse_all(EngineStoppedError("the server is shutting down"))
            raise
        except BaseException as error:  # a bug outside step(): no handler may wait forever
            self.crash = error
            self._running.clear()  # /health answers 503 from here on
            logger.exception("the engine loop crashed")
            self._refuse_all(EngineStoppedError(f"the engine loop crashed: {error!r}"))
        finally:
            self._running.clear()

    def _refuse_all(self, stopped: EngineStoppedError) -> None:
        """Fail the requests in flight, and refuse those no one has accepted yet."""
        self._fail_all(stopped)
        for command in self._commands(wait=False):
            if isinstance(command, _Add):
                self._release(command.request_id)
                command.accepted.set_exception(stopped)

    def _serve_forever(self) -> None:
        """Apply what the handlers sent, step, repeat. The metrics snapshot is retaken after
        every change (commands applied, a step run), so a scrape during a long step sees
        the requests it runs (as waiting, if the step admits them) rather than the state
        before they arrived."""
        self._publish_stats()
        while True:
            commands = self._commands(wait=not self.engine.has_unfinished_requests())
            for command in commands:
                if command is _STOP:
                    self._fail_all(EngineStoppedError("the server is shutting down"))
                    return
                self._apply(command)
            if commands:
                self._publish_stats()
            if self.engine.has_unfinished_requests():
                self._step()
                self._publish_stats()

    def _publish_stats(self) -> None:
        self.stats = self.engine.get_metrics()
        self.metrics.set_engine_stats(self.stats)

    def _commands(self, wait: bool) -> list:
        commands = [self._inbox.get()] if wait else []
        while not self._inbox.empty():
            commands.append(self._inbox.get_nowait())
        return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if self._sinks.pop(command.request_id, None) is not None:
                self.engine.abort_request(command.request_id)
                self.metrics.forget(command.request_id)
                self._release(command.request_id)
            return
        try:
            self.engine.add_request(
                command.request_id, command.prompt, command.prompt_token_ids,
                command.params, command.priority, command.resume_token_ids,
            )  # fmt: skip
        except Exception as error:  # bad prompt: the handler answers 400
            self._release(command.request_id)
            command.accepted.set_exception(error)
            return
        self._sinks[command.request_id] = command.sink
        self.metrics.arrived(command.request_id, command.arrival)
        command.accepted.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RequestsFailedError as lost:  # only these requests failed; stream the others
            self._fail_alone(lost)
            outputs = lost.outputs
        except Exception as error:  # keep serving: fail the step's requests, not the server
            logger.exception("an engine step failed; aborting the requests it ran")
            failed = error if isinstance(error, StepFailedError) else StepFailedError(None, error)
            self._fail_step(failed)
            return
        now = time.monotonic()
        for output in outputs:
            self.metrics.observe(output, now)
            if self.admission is not None:
                self.admission.prefilled(output.request_id)
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
                self._release(output.request_id)
            sink.put(output)

    def _fail_alone(self, lost: RequestsFailedError) -> None:
        """Requests that failed alone (the engine aborted them): each gets its own reason."""
        failed = [rid for rid in lost.request_ids if rid in self._sinks]
        self.metrics.request_failures.inc(len(failed))
        for request_id in failed:
            reason = f"{lost.reasons[request_id]}; request aborted"
            self._fail([request_id], RequestsFailedError(reason, [request_id], []))

    def _fail_step(self, error: StepFailedError) -> None:
        """Fail the requests the step scheduled; all of them if it failed before a batch."""
        in_step = None if error.request_ids is None else set(error.request_ids)
        failed = [rid for rid in self._sinks if in_step is None or rid in in_step]
        self.metrics.step_failed(failed)
        sinks = self._abort(failed)
        self._publish_stats()  # before anyone hears: a client told of it sees the aborts
        self._send(sinks, EngineStepError(f"{error}; request aborted"))

    def _fail_all(self, error: BaseException) -> None:
        self._fail(list(self._sinks), error)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        """Abort these requests (their blocks go back to the pool) and send each the error."""
        self._send(self._abort(request_ids), error)

    def _abort(self, request_ids: list[str]) -> list[_Sink]:
        """Abort these requests in the engine; their sinks, not yet told.

        Aborting touches no token (nothing is decoded again), so it cannot fail on the
        tokens that failed the request."""
        sinks = []
        for request_id in request_ids:
            sink = self._sinks.pop(request_id, None)
            if sink is None:  # finished or failed already
                continue
            self.engine.abort_request(request_id)
            self.metrics.forget(request_id)
            self._release(request_id)
            sinks.append(sink)
        return sinks

    @staticmethod
    def _send(sinks: list[_Sink], error: BaseException) -> None:
        for sink in sinks:
            sink.put(error)


def _work(add: _Add) -> Work:
    """What a request adds to the server's work: n sequences, each decoding over its prompt
    and up to max_tokens, and a prompt to prefill once (a resumed one's, with the resume
    tokens, which max_tokens counts)."""
    prompt, params = len(add.prompt_token_ids), add.params
    resumed = len(add.resume_token_ids or ())
    context = params.n * (prompt + max(params.max_tokens or 0, resumed))
    return Work(params.n, context, prompt + resumed)
