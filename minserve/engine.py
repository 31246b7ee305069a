"""The engine: one `step()` = schedule, run the model over the flat batch, sample, append.

    batch  = scheduler.schedule()          # who runs, how many tokens each (chunked prefill)
    logits = runner.run(batch)             # decoder + paged attention over the KV pool
    tokens = sampler(logits, rows)         # one token per sequence that finished its tokens
                                           # (all plain greedy: runner.forward_greedy gives
                                           # the tokens, exact, through the head's bf16 screen)
    append, stop, free                     # Sample.append applies the stop rules

`LLM` drives it to completion; the server (a later chapter) drives it step by step and
streams each step's outputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minserve.attention.backends import get_attention_backend
from minserve.config import CacheConfig, SchedulerConfig, resolve_max_model_len
from minserve.engine_metrics import EngineCounters, engine_metrics
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.host_tier import host_tier_for
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.kvcache.radix_cache import RadixCache
from minserve.kvcache.swap import HostSwapSpace
from minserve.model.loader import LoadedModel
from minserve.model.runner import ModelRunner
from minserve.model.sampler import Sampler, is_plain_greedy
from minserve.outputs import RequestOutput
from minserve.request import Request, StopRules, validate_prompt
from minserve.sampling_params import SamplingParams
from minserve.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from minserve.scheduler.sequence import Sequence
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.decoder import Proposal, SpeculativeDecoder
from minserve.step_timings import PhaseClock, StepTimings


@dataclass
class TrackedRequest:
    """A request in flight and its sequences (one per sample once forked)."""

    request: Request
    seqs: list[Sequence] = field(default_factory=list)


class LLMEngine:
    """Continuous batching over a paged KV cache (vLLM's design, small)."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        max_model_len: int | None = None,
        sampler: Sampler | None = None,
        attention_backend: str = "auto",
        block_allocator_cls: type = BlockAllocator,
        scheduler_cls: type = Scheduler,
        prefix_cache_cls: type = RadixCache,
        pool_cls: type = PagedKVPool,  # tensor parallel: rank 0's pool mirrors its copies
        runner_cls: Callable[..., ModelRunner] = ModelRunner,  # ... its runner broadcasts
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.loaded = loaded
        self.scheduler_config = scheduler_config
        param = next(loaded.model.parameters())
        num_blocks = PagedKVPool.num_blocks_for(cache_config, loaded.config, param.dtype)
        pool = pool_cls(
            loaded.config, num_blocks, cache_config.block_size, param.dtype, param.device
        )
        swap = HostSwapSpace.from_config(cache_config) if cache_config.swap_space > 0 else None
        allocator = block_allocator_cls(num_blocks)
        if prefix_cache_cls is not RadixCache and not cache_config.enable_prefix_caching:
            raise ValueError("prefix_cache_cls is used only with enable_prefix_caching=True")
        prefix_cache = (
            prefix_cache_cls(pool.block_size, allocator)
            if cache_config.enable_prefix_caching
            else None
        )
        host_tier = host_tier_for(cache_config, pool, loaded.model) if prefix_cache else None
        self.kv = KVCacheManager(allocator, pool, swap, prefix_cache, host_tier)
        caps = {"the KV pool's size in tokens": num_blocks * pool.block_size}
        if not scheduler_config.enable_chunked_prefill:  # a whole sequence runs in one step
            caps["max_num_batched_tokens"] = scheduler_config.max_num_batched_tokens
        self.max_model_len = resolve_max_model_len(
            max_model_len, loaded.config.max_position_embeddings, caps
        )
        self.rules = StopRules(loaded.eos_token_ids, self.max_model_len)
        self.scheduler = scheduler_cls(scheduler_config, self.kv)
        self.execution = loaded.execution.with_attention(attention_backend)  # how it runs
        backend = get_attention_backend(self.execution.attention)
        self.runner = runner_cls(loaded.model, pool, backend)
        self.sampler = sampler or Sampler()
        self.speculator = (  # docs/speculative.md
            SpeculativeDecoder(
                speculative_config, self.kv, scheduler_config.max_num_batched_tokens, self.runner
            )
            if speculative_config is not None
            else None
        )
        self.counters = EngineCounters()
        self.requests: dict[str, TrackedRequest] = {}
        self._order = itertools.count()
        self.last_batch = SchedulerOutput()  # what the latest step ran (for step traces)
        self.last_timings = StepTimings()  # where the latest step's time went
        self.timings = StepTimings()  # ... and every step's, summed

    # --- requests in and out ---

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request; its n samples prefill once, then fork."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        validate_prompt(prompt_token_ids, self.loaded.config.vocab_size, self.max_model_len)
        request = Request.create(
            request_id, prompt, prompt_token_ids, params, self.loaded.tokenizer
        )
        first, *siblings = request.samples
        seq = Sequence(
            request=request,
            sample=first,
            block_table=self.kv.new_table(),
            priority=priority,
            order=next(self._order),
            unforked=siblings,
        )
        self.requests[request_id] = TrackedRequest(request, [seq])
        self.scheduler.add(seq)
        self.counters.num_prompt_tokens += len(prompt_token_ids)
        return request

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is (waiting, mid-prefill, decoding, swapped out).

        Its blocks go back to the pool (or its host copy is dropped) at once.
        """
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return
        for seq in tracked.seqs:
            self.scheduler.finish(seq)
        for sample in tracked.request.samples:
            sample.abort()
        self.counters.num_requests_aborted += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the step ---

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of every request that got new tokens."""
        clock = PhaseClock()
        batch = self.last_batch = self.scheduler.schedule()
        clock.lap("schedule")
        if batch.is_empty:
            self._check_progress()
            return []
        proposal = None
        if self.speculator is not None:
            proposal = self.speculator.propose(batch, self.rules)  # drafts, with KV slots
            clock.lap("propose")
        inputs = self.runner.prepare(batch.scheduled)
        clock.lap("prepare")
        logits = greedy_ids = None
        if proposal is None and self._all_plain_greedy(batch):
            greedy_ids = self.runner.forward_greedy(inputs)  # [num_sampling]: no logits needed
        else:
            logits = self.runner.forward(inputs)  # [num_sampling, vocab]
        clock.lap("forward")
        self._record_step(batch)
        sampling = []
        for s in batch.scheduled:
            self._record_cache_hit(s)
            s.seq.num_computed_tokens += s.num_new_tokens
            self._cache_filled_blocks(s.seq)
            if s.seq.num_uncomputed_tokens == 0:
                sampling.append(s.seq)
        outputs = self._sample_and_append(sampling, logits, greedy_ids, clock, batch, proposal)
        self.last_timings = clock.timings
        self.timings.add(clock.timings)
        return outputs

    def _sample_and_append(
        self,
        sampling: list[Sequence],
        logits: torch.Tensor | None,
        greedy_ids: torch.Tensor | None,
        clock: PhaseClock,
        batch: SchedulerOutput,
        proposal: Proposal | None,
    ) -> list[RequestOutput]:
        targets, rows_of_logits = [], []
        for i, seq in enumerate(sampling):
            family = [seq, *self._fork(seq)] if seq.unforked else [seq]
            targets += family
            rows_of_logits += [i] * len(family)
        clock.lap("update")
        if greedy_ids is not None:  # every row plain greedy: the argmax is the sample
            emitted = zip(targets, greedy_ids[rows_of_logits].tolist(), [None] * len(targets))
        elif self.speculator is None or proposal is None:
            rows = [t.sample.sampling_row(self.rules) for t in targets]
            result = self.sampler(logits[rows_of_logits], rows)
            emitted = zip(targets, result.token_ids, result.logprobs)
        else:  # several tokens per sequence: accepted drafts, then the target's own
            verified = self.speculator.verify(
                batch, proposal, targets, logits, self.sampler, self.rules, clock.timings
            )
            emitted = self.speculator.emitted_tokens(verified)
        clock.lap("sample")
        progressed: dict[str, Request] = {}
        for seq, token, logprobs in emitted:
            seq.sample.append(token, logprobs, self.rules)
            seq.request.record_token_time()
            self.counters.num_generation_tokens += 1
            if seq.sample.finished:
                self.scheduler.finish(seq)
            progressed[seq.request.request_id] = seq.request
        for request_id, request in progressed.items():
            if request.finished:
                del self.requests[request_id]
                self.counters.num_requests_finished += 1
        outputs = [r.to_output() for r in progressed.values()]
        clock.lap("update")
        return outputs

    def _all_plain_greedy(self, batch: SchedulerOutput) -> bool:
        """Whether every sequence sampling this step just takes the argmax of its logits."""
        return all(
            is_plain_greedy(s.seq.sample.sampling_row(self.rules))
            for s in batch.scheduled
            if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens
        )

    def _record_cache_hit(self, s: ScheduledSeq) -> None:
        """A request's first chunk starts after its cached prefix: that many tokens were hits."""
        request = s.seq.request
        if request.num_cached_tokens is None:
            request.num_cached_tokens = s.start
            self.counters.num_prefix_cache_queries += len(request.prompt_token_ids)
            self.counters.num_prefix_cache_hits += s.start

    def _cache_filled_blocks(self, seq: Sequence) -> None:
        """Prefix caching: blocks this step filled go into the cache (chunk by chunk)."""
        if self.kv.prefix_cache is not None:
            self.kv.cache_computed(seq.block_table, seq.token_ids, seq.num_computed_tokens)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        siblings = self.scheduler.fork(seq)
        self.requests[seq.request.request_id].seqs.extend(siblings)
        return siblings

    def _record_step(self, batch: SchedulerOutput) -> None:
        self.counters.num_steps += 1
        self.counters.num_batched_tokens += batch.num_batched_tokens
        self.counters.kv_usage_peak = max(self.counters.kv_usage_peak, self.kv.usage)

    def _check_progress(self) -> None:
        """An empty batch with work left would loop forever: say why instead."""
        if self.scheduler.has_unfinished:
            raise RuntimeError(
                f"the scheduler made no progress with {len(self.scheduler.waiting)} waiting, "
                f"{len(self.scheduler.running)} running and {len(self.scheduler.swapped)} "
                f"swapped sequences and {self.kv.allocator.num_free} free blocks"
            )

    def get_metrics(self) -> dict[str, float]:
        """Engine counters and gauges (vLLM's names where it has them)."""
        return engine_metrics(self)
