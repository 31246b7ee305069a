"""The engine: one `step()` is four calls passing messages one way, and one message back
(vLLM v1, nano-vllm).

    sched_out = scheduler.schedule()                      # who runs, how many tokens each,
                                                          # block tables, block copies, the
                                                          # sequences finished meanwhile
    run_out   = worker.execute(sched_out)                 # drops those sequences' state;
                                                          # block copies, decoder, sampler
    update    = scheduler.update_from_output(sched_out, run_out)
                                                          # aborts the worker's failures;
                                                          # computed tokens, forks, appended
                                                          # tokens, token stop rules, frees
    processed = output_processor.process(update)          # text, stop strings, logprobs
    scheduler.apply_stops(processed.stops)                # the one message back

`LLM` drives it to completion and adds the deltas up; the server streams them as they come.
The scheduler owns every piece of scheduling state, the worker owns the device (and what it
keeps per sequence, dropped when a step names the sequence finished), the output processor
owns what the caller sees. What the output processor finds in the text is the one message
that goes back (`OutputStops`): a stop string finishes its sample, text that failed aborts
its request.

Failures come in two sizes. One request's (its logits row is NaN, its tokens cannot be
decoded) aborts that request, the step goes on for the others, and `step()` raises
`RequestsFailedError` with their deltas. Anything else the step raises is the step's own:
`StepFailedError`, naming the requests it was running.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from minserve.attention.backends import choose_attention
from minserve.config import CacheConfig, SchedulerConfig, resolve_max_model_len
from minserve.engine_args import EngineArgs
from minserve.engine_metrics import EngineCounters, engine_metrics
from minserve.errors import RequestsFailedError, StepFailedError
from minserve.kvcache.block_events import BlockEventTracker
from minserve.kvcache.block_key import KVFingerprint, block_keys, weights_digest
from minserve.kvcache.disk_store import DiskBlockStore
from minserve.kvcache.disk_tier import DiskTier
from minserve.kvcache.host_tier import TierCosts, host_tier_for
from minserve.kvcache.kv_event_socket import kv_event_publisher
from minserve.kvcache.kv_events import BlockStored
from minserve.kvcache.kv_format import kv_format as resolve_kv_format
from minserve.kvcache.load_plan import measure_disk_speed, measure_host_speed, plan_load
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.loader import LoadedModel
from minserve.messages import ModelRunnerOutput, NewTokens, SchedulerOutput
from minserve.model.tokenizer import Tokenizer
from minserve.output_processor import OutputProcessor, ProcessedStep
from minserve.outputs import RequestOutput
from minserve.plugins import NO_PLUGINS, CoursePlugins
from minserve.request import (
    Request,
    StopRules,
    validate_params,
    validate_prompt,
    validate_resume,
)
from minserve.sampling_params import SamplingParams
from minserve.scheduler.draft_planner import DraftPlanner
from minserve.scheduler.sequence import Sequence
from minserve.scheduler.step_time import scheduler_class
from minserve.step_timings import PhaseClock, StepTimings
from minserve.worker.memory import GIB, measure_kv_cache_budget
from minserve.worker.pool_size import PoolPeers, PoolRequest
from minserve.worker.warmup import warm_up
from minserve.worker.worker import StepPeers, Worker

if TYPE_CHECKING:
    from minserve.structured.compiler import GrammarCompiler
    from minserve.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One step's messages, its deltas and where its time went (traces, calibration)."""

    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput
    outputs: list[RequestOutput]
    timings: StepTimings


StepObserver = Callable[[StepRecord], None]


class Stoppable(Protocol):
    """What runs beside an engine and stops with it (a tensor-parallel group's driver)."""

    def shutdown(self) -> None: ...


@contextmanager
def observe_steps(engine: LLMEngine) -> Iterator[list[StepRecord]]:
    """Collect the record of every step the engine runs inside the block."""
    records: list[StepRecord] = []
    engine.observers.append(records.append)
    try:
        yield records
    finally:
        engine.observers.remove(records.append)


def _size_for_device(
    cache_config: CacheConfig,
    loaded: LoadedModel,
    scheduler_config: SchedulerConfig,
    peers: StepPeers | None = None,
) -> tuple[CacheConfig, bool]:
    """On a GPU with no pool size given, the pool takes what `gpu_memory_utilization` leaves
    after the weights and the largest step's activations (measured). True if sized so.
    Tensor parallel: every rank measures its own shard, together (their layers
    all-reduce), and the pool is the smallest any rank affords (`pool_size.py`)."""
    device = next(loaded.model.parameters()).device
    given = cache_config.num_blocks is not None or cache_config.kv_cache_memory_bytes is not None
    measure = device.type == "cuda" and not given
    if isinstance(peers, PoolPeers):
        request = PoolRequest.for_engine(cache_config, loaded.model, scheduler_config, measure)
        num_blocks = peers.agree_pool_blocks(request, loaded.model)
        return replace(cache_config, num_blocks=num_blocks, kv_cache_memory_bytes=None), measure
    if not measure:
        return cache_config, False
    budget = measure_kv_cache_budget(
        loaded.model, cache_config.gpu_memory_utilization,
        scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs,
    )  # fmt: skip
    return replace(cache_config, kv_cache_memory_bytes=budget), True


def _resumed(request: Request) -> NewTokens:
    """A resumed request's journal tokens as its one sample's first new tokens, with the
    finish the token stop rules gave them (for the output processor to prime with)."""
    sample = request.samples[0]
    tokens = tuple(sample.token_ids)
    return NewTokens(
        request.request_id, sample.index, tokens, (None,) * len(tokens),
        sample.finish_reason, sample.stop_reason,
    )  # fmt: skip


def caps_below(caps: dict[str, int], limit: int) -> bool:
    return any(cap < limit for cap in caps.values())


class LLMEngine:
    """Continuous batching over a paged KV cache (vLLM's design, small)."""

    def __init__(
        self,
        loaded: LoadedModel,
        args: EngineArgs,
        plugins: CoursePlugins = NO_PLUGINS,
        peers: StepPeers | None = None,  # tensor parallel: the other ranks' workers
        tensor_parallel: Stoppable | None = None,  # the driver of the other ranks
    ) -> None:
        """Build order: the pool's size (measured on a GPU, agreed between ranks), the
        attention backend, the pool, the worker on the platform's runner, then the KV cache
        manager (its host tier prices copies with the worker's measured costs), the
        scheduler and the output processor. `build_engine` loads the model and calls this."""
        if args.engine != "paged":
            raise ValueError(f"LLMEngine is the paged engine; got engine={args.engine!r}")
        plugins.check(args)
        self.loaded, self.args, self.plugins = loaded, args, plugins
        self.scheduler_config = scheduler_config = args.scheduler
        self.tensor_parallel = tensor_parallel
        param = next(loaded.model.parameters())
        self.device: torch.device | None = param.device
        self.vocab_size: int = loaded.config.vocab_size
        cache_config, sized_by_memory = _size_for_device(
            args.cache, loaded, scheduler_config, peers
        )
        execution = loaded.execution.with_kv_cache(cache_config.kv_cache_dtype)
        attention = choose_attention(
            args.attention_backend, execution.device, execution.c_kernels,
            execution.kv_cache_dtype, plugins.kv_codec is not None, plugins.decode_kernels,
            plugins.attend,
        )  # fmt: skip
        ops = "yours" if plugins.model_ops is not None else execution.ops
        self.execution = replace(execution, attention=attention.name, ops=ops)
        backend = attention.backend
        kv_format = resolve_kv_format(self.execution.kv_cache_dtype, param.dtype, plugins.kv_codec)
        pool_cls = plugins.kv_pool_cls  # minserve's PagedKVPool, or chapter 01's
        num_blocks = pool_cls.num_blocks_for(cache_config, loaded.config, kv_format)
        pool = pool_cls(loaded.config, num_blocks, cache_config.block_size, kv_format, param.device)
        logger.info(
            "KV pool: %d blocks of %d tokens = %d tokens, %.2f GiB, stored as %s",
            num_blocks, pool.block_size, num_blocks * pool.block_size, pool.nbytes / GIB,
            kv_format.name,
        )  # fmt: skip
        runner = loaded.platform.runner(loaded.model, pool, backend)
        if plugins.flat_batch is not None:  # chapter 03's layout of a step's batch
            runner.use_flat_batch(plugins.flat_batch)
        disk_store = (
            DiskBlockStore(cache_config.kv_disk_path, int(cache_config.kv_disk_size * GIB))
            if cache_config.kv_disk_path is not None
            else None
        )
        self.worker = Worker(runner, plugins.sampler, args.speculative, peers, disk_store)
        if self.execution.attention == "triton" and pool.device.type == "cuda":
            seconds = warm_up(self.worker, scheduler_config.max_num_batched_tokens)
            logger.info("warm-up: the Triton kernels' step shapes ran once in %.1f s", seconds)
        self.kv = self._kv_manager(cache_config, plugins, pool)
        caps = {"the KV pool's size in tokens": num_blocks * pool.block_size}
        if not scheduler_config.enable_chunked_prefill:  # a whole sequence runs in one step
            caps["max_num_batched_tokens"] = scheduler_config.max_num_batched_tokens
        model_limit = loaded.config.max_position_embeddings
        max_model_len = args.max_model_len
        if sized_by_memory and max_model_len is None and caps_below(caps, model_limit):
            raise ValueError(
                f"the model's max_model_len ({model_limit}) does not fit the KV cache "
                f"({num_blocks * pool.block_size} tokens in {pool.nbytes / GIB:.2f} GiB); "
                "give a smaller max_model_len, or raise gpu_memory_utilization"
            )
        self.max_model_len = resolve_max_model_len(max_model_len, model_limit, caps)
        if self.max_model_len < model_limit and max_model_len is None:
            logger.info(
                "max_model_len %d: capped by %s (the model allows %d)",
                self.max_model_len, min(caps, key=caps.__getitem__), model_limit,
            )  # fmt: skip
        self.rules = StopRules(loaded.eos_token_ids, self.max_model_len)
        drafts = DraftPlanner(args.speculative) if args.speculative is not None else None
        scheduler_cls = scheduler_class(scheduler_config, plugins.scheduler_cls)  # overload
        self.scheduler = scheduler_cls(  # scheduling_rules: chapter 04's chunk_rule, ...
            scheduler_config, self.kv, self.rules, drafts, **plugins.scheduling_rules
        )
        self.output_processor = OutputProcessor(
            loaded.tokenizer, plugins.sample_output_cls, plugins.stop_matcher_cls
        )
        self.kv_events = kv_event_publisher(args.kv_events)
        if self.kv_events is not None and self.worker.disk_store is not None:
            on_disk = self.worker.disk_store.keys()  # written before this engine started
            if on_disk:
                self.kv_events.publish((BlockStored(tuple(on_disk), None, "disk"),))
        self.counters = EngineCounters()
        self.timings = StepTimings()  # every step's, summed
        self.observers: list[StepObserver] = []  # called with each step's record
        self._grammars: GrammarCompiler | None = None  # structured output, on first use
        self._grammars_lock = threading.Lock()
        self._choice_vocabulary = None  # a structured.choice_dfa.Vocabulary, on first use

    def _kv_manager(
        self, cache_config: CacheConfig, plugins: CoursePlugins, pool: PagedKVPool
    ) -> KVCacheManager:
        """The scheduler's side of the KV cache: blocks, prefix cache, swap and host tier."""
        allocator = plugins.block_allocator_cls(pool.num_blocks)
        swap = (
            plugins.swap_space_cls.from_config(cache_config, pool.block_nbytes)
            if cache_config.swap_space > 0
            else None
        )
        prefix_cache = host_tier = events = disk = None
        if cache_config.enable_prefix_caching:
            prefix_cache = plugins.prefix_cache_cls(pool.block_size, allocator)
            lower_tiers = cache_config.kv_offloading_size > 0 or self.worker.disk_store is not None
            costs = self.worker.measure_tier_costs() if lower_tiers else None
            root = self.kv_fingerprint(pool).root()  # block keys chain from it
            if costs is not None and cache_config.kv_offloading_size > 0:
                host_tier = host_tier_for(
                    cache_config, pool.block_size, pool.block_nbytes, costs, root,
                    plugins.host_tier_cls,  # minserve's HostPrefixTier, or chapter 05's
                )  # fmt: skip
            if self.args.kv_events is not None or self.worker.disk_store is not None:
                keys_fn = plugins.block_keys or block_keys  # minserve's, or chapter 11's
                events = BlockEventTracker(root, pool.block_size, keys_fn)  # keys cached blocks
            if costs is not None and self.worker.disk_store is not None:
                disk = self._disk_tier(self.worker.disk_store, pool, costs)
        return KVCacheManager(
            allocator, pool.block_size, swap, prefix_cache, host_tier, plugins.block_table_cls,
            events, disk,
        )  # fmt: skip

    def _disk_tier(self, store: DiskBlockStore, pool: PagedKVPool, costs: TierCosts) -> DiskTier:
        """The disk tier, its speed measured on its own directory (cold reads, then the copy
        up into the pool)."""
        disk = measure_disk_speed(store.directory, pool.read_blocks([0]))
        speed = disk.then(measure_host_speed(pool))
        logger.info(
            "disk tier at %s: %.2f GB/s, %.2f ms a request (prefill %.0f tokens/s)",
            store.directory, speed.bytes_per_s / 1e9, speed.latency_s * 1e3,
            costs.prefill_tokens_per_s,
        )  # fmt: skip
        rule = self.plugins.load_plan or plan_load  # minserve's, or chapter 11's
        return DiskTier(store, pool.block_size, pool.block_nbytes, speed,
                        costs.prefill_tokens_per_s, rule)  # fmt: skip

    def kv_fingerprint(self, pool: PagedKVPool) -> KVFingerprint:
        """What makes this engine's KV blocks the bytes they are (`kvcache/block_key.py`)."""
        config, execution = self.loaded.config, self.execution
        return KVFingerprint(
            weights=weights_digest(self.loaded.path),
            dtype=str(execution.dtype).removeprefix("torch."),
            kv_format=pool.format.name,
            quantization=execution.quantization,
            compute=f"{execution.device.type}:{execution.ops}",
            block_size=pool.block_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            tp_size=self.args.tensor_parallel_size,
        )

    # --- requests in and out ---

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        resume_token_ids: list[int] | None = None,
    ) -> None:
        """Validate and queue a request; its n samples prefill once, then fork.

        resume_token_ids: the tokens this request already generated elsewhere (an instance
        that died mid-stream); it continues after them exactly as if it had generated them
        here. They are its one sample's first output tokens (n must be 1): max_tokens,
        min_tokens, the penalties, the stop rules, the grammar and the seeded draws count
        them, the prefill computes them with the prompt, and the outputs hold only what
        follows them. A list that finishes the request already gives, at the next step, a
        final output with no new text."""
        if self.output_processor.holds(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab_size = self.loaded.config.vocab_size
        validate_prompt(prompt_token_ids, vocab_size, self.max_model_len)
        validate_params(params, vocab_size)
        resume = list(resume_token_ids or ())
        if resume:
            validate_resume(resume, len(prompt_token_ids), params, vocab_size, self.max_model_len)
        matcher = self._grammar_matcher(params)
        request = Request.create(request_id, prompt_token_ids, params, constraint=matcher)
        request.samples[0].replay(resume, self.rules)
        runs = self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, params, request.arrival_time,
            _resumed(request) if resume else None,
        )  # fmt: skip
        if runs:
            self.scheduler.add(self._first_sequence(request, priority))
        self.counters.num_prompt_tokens += len(prompt_token_ids)

    def check_params(self, params: SamplingParams) -> None:
        """What `add_request` checks of `params` and may take time over, from any thread: a
        structured output's grammar is compiled into the cache (the server calls this before
        it queues the request, so the engine thread finds it compiled). ValueError if bad."""
        validate_params(params, self.loaded.config.vocab_size)
        self._grammar_matcher(params)  # compiles (or finds) the grammar; the matcher is dropped

    def _grammar_matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """Structured output: a matcher at the start of the request's compiled grammar."""
        if params.structured_outputs is None:
            return None
        choice = params.structured_outputs.choice
        choice_matcher_cls = self.plugins.choice_matcher_cls  # chapter 12's, not xgrammar's
        if choice is not None and choice_matcher_cls is not None:
            if self._choice_vocabulary is None:
                from minserve.structured.choice_dfa import Vocabulary

                grammars = self.grammars()
                self._choice_vocabulary = Vocabulary.from_tokenizer_info(
                    grammars.info, grammars.encode
                )
            return choice_matcher_cls.build(choice, self._choice_vocabulary)
        return self.grammars().matcher(params.structured_outputs)

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler (minserve/structured/), built on first use: only
        engines that get a structured request load xgrammar and index the vocabulary."""
        with self._grammars_lock:
            if self._grammars is None:
                from minserve.structured.compiler import GrammarCompiler, tokenizer_info
                from minserve.structured.crash_probe import CrashProbe
                from minserve.structured.grammar_ends import can_end

                info = tokenizer_info(
                    self.loaded.tokenizer, self.vocab_size, self.loaded.eos_token_ids
                )
                tokenizer = self.loaded.tokenizer
                self._grammars = GrammarCompiler(
                    info,
                    lambda text: tokenizer.encode(text, add_special_tokens=False),
                    can_end=self.plugins.grammar_can_end or can_end,  # chapter 12's or minserve's
                    probe=CrashProbe(),
                )
            return self._grammars

    def _first_sequence(self, request: Request, priority: int) -> Sequence:
        first, *siblings = request.samples
        order = self.counters.num_prompt_requests
        self.counters.num_prompt_requests += 1
        return Sequence(
            request=request,
            sample=first,
            block_table=self.kv.new_table(),
            priority=priority,
            order=order,
            unforked=siblings,
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is (waiting, mid-prefill, decoding, swapped out).

        Its blocks go back to the pool (or its host copy is dropped) at once.
        """
        if not self.output_processor.holds(request_id):
            return
        self.output_processor.forget(request_id)
        self.scheduler.abort_request(request_id)  # the next step tells the worker
        self.counters.num_requests_aborted += 1

    def forget_request(self, request_id: str) -> None:
        """Drop a request the scheduler no longer holds (detached: another instance goes on
        with it)."""
        self.output_processor.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    # --- the step ---

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return a delta for every request that got new tokens (its
        completions hold this step's text and tokens only).

        Raises RequestsFailedError (with the others' deltas) when some requests failed
        alone and were aborted; StepFailedError when the step itself failed."""
        clock = PhaseClock()
        try:
            sched_out = self.scheduler.schedule()
        except Exception as error:
            raise StepFailedError(None, error) from error
        clock.lap("schedule")
        try:
            outputs, failed = self._run(sched_out, clock)
        except Exception as error:
            raise StepFailedError(sched_out.request_ids, error) from error
        finally:
            self._publish_kv_events()
        outputs = self._finished_at_once() + outputs
        if failed:
            raise RequestsFailedError.from_reasons(failed, outputs)
        return outputs

    def _finished_at_once(self) -> list[RequestOutput]:
        """Final outputs of requests that their resume tokens finished at `add_request`."""
        ready = self.output_processor.take_ready()
        self.counters.num_requests_finished += len(ready)
        return ready

    def _run(
        self, sched_out: SchedulerOutput, clock: PhaseClock
    ) -> tuple[list[RequestOutput], dict[str, str]]:
        """The step's deltas, and the requests that failed alone (request id -> why)."""
        if sched_out.is_empty:
            self.worker.execute(sched_out)  # block operations, finished sequences' state
            self._check_progress()
            return [], {}
        run_out = self.worker.execute(sched_out)
        clock.skip()  # the worker timed its own phases
        self._record_step(sched_out)
        update = self.scheduler.update_from_output(sched_out, run_out)
        self.kv.step_ran()  # the blocks this step computed may be written through
        processed = self.output_processor.process(update)
        self.scheduler.apply_stops(processed.stops)
        failed = update.failed | processed.stops.failed
        self._count(processed, failed)
        clock.lap("update")
        if run_out.timings is not None:
            clock.timings.add(run_out.timings)
            disk = self.kv.prefix.disk if self.kv.prefix is not None else None
            if disk is not None:  # its rule prices recomputing at the speed measured here
                disk.observe_step(sched_out.num_batched_tokens, run_out.timings.forward)
        self._observe(StepRecord(sched_out, run_out, processed.outputs, clock.timings))
        return processed.outputs, failed

    def _publish_kv_events(self) -> None:
        """The step's changes to what the tiers hold, as one numbered batch (if any)."""
        tracker = self.kv.prefix.events if self.kv.prefix is not None else None
        if self.kv_events is not None and tracker is not None:
            events = tracker.take()
            if events:
                self.kv_events.publish(events)

    def kv_events_info(self) -> dict[str, object] | None:
        """Where a router subscribes to this engine's KV events (None: not published)."""
        if self.kv_events is None or self.kv.prefix is None or self.kv.prefix.events is None:
            return None
        publisher = self.kv_events
        return {
            "instance": publisher.log.instance, "root": self.kv.prefix.events.root.hex(),
            "block_size": self.kv.block_size, "host": publisher.host, "port": publisher.port,
            "replay_port": publisher.replay_port,
        }  # fmt: skip

    def _count(self, processed: ProcessedStep, failed: dict[str, str]) -> None:
        """Requests finished this step, and those aborted because they failed alone."""
        self.counters.num_requests_finished += sum(out.finished for out in processed.outputs)
        self.counters.num_requests_aborted += len(failed)

    def _record_step(self, sched_out: SchedulerOutput) -> None:
        self.counters.num_steps += 1
        self.counters.num_batched_tokens += sched_out.num_batched_tokens
        self.counters.kv_usage_peak = max(self.counters.kv_usage_peak, self.kv.usage)

    def _observe(self, record: StepRecord) -> None:
        self.timings.add(record.timings)
        for observer in self.observers:
            observer(record)

    def _check_progress(self) -> None:
        """An empty batch with work left would loop forever: say why instead."""
        if self.scheduler.has_unfinished:
            raise RuntimeError(
                f"the scheduler made no progress with {len(self.scheduler.waiting)} waiting, "
                f"{len(self.scheduler.running)} running and {len(self.scheduler.swapped)} "
                f"swapped sequences and {self.kv.allocator.num_free} free blocks"
            )

    def get_tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    def shutdown(self) -> None:
        """Stop what runs beside this engine (the worker's mask thread, a tensor-parallel
        group's other ranks); the engine cannot step afterwards."""
        self.worker.masks.shutdown()
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.worker.disk_store is not None:
            if not self.scheduler.has_unfinished:  # the last step's writes, not yet carried out
                self.worker.execute(self.scheduler.schedule())
            self.worker.disk_store.close()  # the writes queued so far reach the disk

    def get_metrics(self) -> dict[str, float]:
        """Engine counters and gauges (vLLM's names where it has them)."""
        return engine_metrics(self.counters, self.scheduler, self.kv, self.timings)
