"""`LLM`: the offline API, shaped like vLLM's (`generate`, `chat`, `SamplingParams`)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from minserve.attention.triton_decode import DecodeKernels
from minserve.config import CacheConfig, SchedulerConfig
from minserve.distributed.launcher import TensorParallelDriver, start_tensor_parallel
from minserve.engine import LLMEngine
from minserve.errors import RequestsFailedError, StepFailedError
from minserve.execution import ExecutionConfig
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.kv_format import KVCodec, check_kv_codec
from minserve.kvcache.radix_cache import RadixCache
from minserve.kvcache.swap import HostSwapSpace
from minserve.loader import LoadedModel, load_model
from minserve.model.ops import ModelOps
from minserve.model.quant_blocks import QuantCodec
from minserve.model.quantized_linear import use_quant_codec
from minserve.model.sampler import Sampler
from minserve.model.tokenizer import Tokenizer
from minserve.output_processor import OutputProcessor, SampleOutput, check_stop_matcher_cls
from minserve.outputs import OutputAccumulator, RequestOutput
from minserve.reference import ReferenceGenerator
from minserve.request import Request, StopRules, validate_params, validate_prompt
from minserve.sampling_params import SamplingParams
from minserve.scheduler.policy import priority_value
from minserve.scheduler.scheduler import Scheduler
from minserve.speculative.config import SpeculativeConfig
from minserve.stop_strings import StopStringMatcher

# A prompt is text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...}.
Prompt = str | list[int] | dict[str, Any]
Message = dict[str, str]
ENGINES = ("paged", "reference")
logger = logging.getLogger(__name__)


class LLM:
    """Load a model once, then generate for batches of prompts.

    model: a .gguf file or a Hugging Face checkpoint folder; None means the bundled
    SmolLM2-135M-Instruct; an already loaded model (`other_llm.loaded`) is shared, not
    loaded again (leave dtype and device as "auto" then). dtype: "auto" (bf16 on a GPU
    and on a CPU with native bfloat16, else fp32), "float32", "bfloat16" or "float16". The
    other options are vLLM's (see docs/engine.md); engine="reference" runs the
    contiguous-KV reference path instead (the oracle).
    tensor_parallel_size=N splits the model over N processes (docs/distributed.md); call
    `shutdown()` when done; tensor_parallel_layers names the module whose parallel layers
    every rank builds its shard with (chapter 07: "exercises.ch07_parallel_linear").
    speculative_config={"method": "ngram", "num_speculative_tokens": k}
    turns on speculative decoding (docs/speculative.md). scheduling_policy is a name
    ("fcfs", "priority", "lpm") or a class built from the KV cache manager whose instances
    are sort keys (chapter 05: `LLM(scheduling_policy=LongestPrefixMatch)`). decode_kernels
    (with attention_backend="triton") replaces the Triton decode, store and prefill kernels,
    as chapter 02 does with a student's (docs/course.md). How it runs on this machine (device,
    dtype, attention backend, C kernels) is logged once at info level and returned by
    `get_execution_config()` (docs/engine.md, "Which path runs: the execution config").
    model_ops=ModelOps.from_module(module) runs the model on that module's `rms_norm`,
    `apply_rope`, `swiglu` and `attend` (chapter 00; docs/course.md): the first three in
    every layer instead of minserve's own (and its C kernels), `attend` once per sequence
    over its K/V gathered from the paged pool (or over the reference engine's contiguous
    cache). The ops are set on the loaded model, so an LLM sharing it shares them.
    Likewise block_allocator_cls, block_table_cls (chapter 01), scheduler_cls,
    prefix_cache_cls and sample_output_cls swap in a class of the same shape; chunk_rule (a
    sequence's share of a step's token budget, as `minserve.scheduler.budget.prefill_chunk`)
    and preemption_rule (swap or recompute a preempted sequence, as
    `minserve.scheduler.preemption.preemption_mode`) replace chapter 04's two rules;
    swap_space_cls (with swap_space > 0) keeps the account of the host swap space, as
    `minserve.kvcache.swap.HostSwapSpace` does (chapter 04).
    kv_cache_dtype="fp8_e4m3" (or "fp8"), "fp8_e5m2" or "int8" stores the KV cache in 8
    bits: twice the tokens in the same memory, half the bytes a decode reads (vLLM's option;
    docs/engine.md, "8-bit KV cache"); "auto" stores the model's dtype.
    kv_codec=KVCodec.from_module(module) (with kv_cache_dtype="int8") stores and reads that
    cache with the module's `quantize_int8` and `dequantize_int8` (chapter 10); attention
    then runs in torch, the path that calls them ("auto"; the C and Triton int8 kernels
    have minserve's own arithmetic, so naming them is an error).
    quantization="gguf" keeps a GGUF file's Q8_0, Q4_0 and Q4_1 matrices as stored and
    widens them where they are used (vLLM's spelling; docs/engine.md, "Quantized weights");
    quantization="int8" stores every weight matrix as int8 with a scale per output channel.
    quant_codec=QuantCodec.from_module(module) makes those layers widen their blocks with that
    module's dequantize functions and multiply with its `dequantize_matmul` (chapter 10), set
    on the loaded model like model_ops.
    stop_matcher_cls cuts each sample's text at its stop strings, as
    `minserve.stop_strings.StopStringMatcher` (chapter 09: `LLM(stop_matcher_cls=...)`).
    """

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        swap_space: float = 0.0,
        enable_prefix_caching: bool = False,
        kv_offloading_size: float = 0.0,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        scheduling_policy: str | Callable[..., Any] = "fcfs",
        attention_backend: str = "auto",
        sampler: Sampler | None = None,
        block_allocator_cls: type = BlockAllocator,
        block_table_cls: type = BlockTable,
        scheduler_cls: type = Scheduler,
        prefix_cache_cls: type = RadixCache,
        sample_output_cls: type = SampleOutput,
        stop_matcher_cls: type = StopStringMatcher,
        model_ops: ModelOps | None = None,
        chunk_rule: Callable[[int, int, bool], int] | None = None,
        preemption_rule: Callable[[int, int, int], str] | None = None,
        swap_space_cls: type = HostSwapSpace,
        engine: str = "paged",
        tensor_parallel_size: int = 1,
        tensor_parallel_layers: str | None = None,
        speculative_config: dict[str, Any] | None = None,
        decode_kernels: DecodeKernels | None = None,
        quantization: str | None = None,
        quant_codec: QuantCodec | None = None,
        kv_codec: KVCodec | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        speculative = _speculative(speculative_config, engine, tensor_parallel_size)
        if decode_kernels is not None and (engine != "paged" or tensor_parallel_size != 1):
            raise ValueError("decode_kernels runs on the paged engine with one process only")
        if quantization is not None and tensor_parallel_size != 1:
            raise ValueError("quantization runs in one process; leave tensor_parallel_size at 1")
        if kv_cache_dtype != "auto" and (engine != "paged" or tensor_parallel_size != 1):
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} stores the paged engine's KV pool in one "
                "process; use engine='paged' with tensor_parallel_size=1, or kv_cache_dtype='auto'"
            )
        check_kv_codec(kv_cache_dtype, kv_codec)
        if tensor_parallel_layers is not None and tensor_parallel_size == 1:
            raise ValueError("tensor_parallel_layers applies with tensor_parallel_size > 1")
        check_stop_matcher_cls(stop_matcher_cls)
        cache = CacheConfig(
            block_size, num_blocks, kv_cache_memory_bytes, swap_space, enable_prefix_caching,
            kv_offloading_size, gpu_memory_utilization, kv_cache_dtype,
        )  # fmt: skip
        scheduler = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, scheduling_policy
        )
        self.tensor_parallel: TensorParallelDriver | None = None
        tp_parts: dict[str, Any] = {}  # rank 0's step peers (docs/distributed.md)
        if tensor_parallel_size != 1:
            self.tensor_parallel = start_tensor_parallel(
                model, tensor_parallel_size, engine, cache,
                dtype=dtype, device=device, attention_backend=attention_backend,
                parallel_layers=tensor_parallel_layers,
            )  # fmt: skip
            tp_parts = self.tensor_parallel.engine_parts(cache)
            self.loaded: LoadedModel = self.tensor_parallel.loaded
        else:
            self.loaded = _load(model, dtype, device, quantization)
        if model_ops is not None and tensor_parallel_size != 1:
            raise ValueError("model_ops runs in one process; leave tensor_parallel_size at 1")
        self.loaded.model.use_ops(model_ops or self.loaded.platform.ops)
        if use_quant_codec(self.loaded.model, quant_codec) == 0 and quant_codec is not None:
            raise ValueError(
                'quant_codec widens GGUF blocks; load a .gguf model with quantization="gguf"'
            )
        attend = model_ops.attend if model_ops is not None else None
        self.sampler = sampler or Sampler()
        rules = _scheduling_rules(chunk_rule, preemption_rule, engine)
        if swap_space_cls is not HostSwapSpace and engine != "paged":
            raise ValueError(
                f"swap_space_cls plugs into the paged engine; engine={engine!r} has none"
            )
        self.engine: LLMEngine | None = None
        self.reference: ReferenceGenerator | None = None
        if engine == "paged":
            self.engine = LLMEngine(
                self.loaded, cache, scheduler, max_model_len, self.sampler,
                attention_backend, block_allocator_cls, scheduler_cls, prefix_cache_cls,
                **tp_parts, speculative_config=speculative, sample_output_cls=sample_output_cls,
                stop_matcher_cls=stop_matcher_cls,
                decode_kernels=decode_kernels, attend=attend, block_table_cls=block_table_cls,
                scheduling_rules=rules, swap_space_cls=swap_space_cls, kv_codec=kv_codec,
            )  # fmt: skip
            self.max_model_len = self.engine.max_model_len
        else:
            self.max_model_len = _reference_max_len(max_model_len, self.loaded)
            rules = StopRules(self.loaded.eos_token_ids, self.max_model_len)
            self.reference = ReferenceGenerator(
                self.loaded.model, self.sampler, rules, max_num_seqs, attend
            )
        self.execution: ExecutionConfig = (  # how it runs, said once (docs/engine.md)
            self.engine.execution
            if self.engine is not None
            else replace(self.loaded.execution, attention="contiguous")
        )
        if model_ops is not None:  # the layers compute with a student's functions
            self.execution = replace(self.execution, ops="yours")
        logger.info(self.execution.summary())
        self.sample_output_cls = sample_output_cls
        self.stop_matcher_cls = stop_matcher_cls
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the LLM cannot generate afterwards)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1 (the model's embedding rows)."""
        return self.loaded.config.vocab_size

    def get_metrics(self) -> dict[str, float]:
        """Engine counters: steps, preemptions, swaps, KV usage, tokens (paged engine only)."""
        if self.engine is None:
            raise ValueError("metrics come from the paged engine; this LLM runs engine='reference'")
        return self.engine.get_metrics()

    def get_execution_config(self) -> ExecutionConfig:
        """How this LLM runs: device, dtype, attention backend, C kernels... (set at load)."""
        return self.execution

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int | str] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs come back in the order of the prompts.

        priority: one per prompt, an int (lower runs first) or an SLO class name
        ("interactive", "standard", "batch"); used by scheduling_policy="priority".
        A prompt that fails alone (NaN logits, say) does not stop the others: once they
        finish, RequestsFailedError names the failed prompts and holds the others' outputs.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        priorities = [priority_value(p) for p in priority or [0] * len(prompt_list)]
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        tokenized = [self._tokenize(p) for p in prompt_list]  # validate all before queueing any
        vocab_size = self.loaded.config.vocab_size
        for (_, token_ids), sp in zip(tokenized, params):
            validate_prompt(token_ids, vocab_size, self.max_model_len)
            validate_params(sp, vocab_size)
        if self.engine is None and any(sp.prompt_logprobs is not None for sp in params):
            raise ValueError("prompt_logprobs needs the paged engine (engine='paged')")
        request_ids = [str(next(self._ids)) for _ in tokenized]
        failed: dict[str, str] = {}  # request id -> why, filled as requests fail
        deltas = (
            self._run_engine(request_ids, tokenized, params, priorities, failed)
            if self.engine is not None
            else self._run_reference(request_ids, tokenized, params)
        )
        whole = OutputAccumulator()
        with tqdm(total=len(prompt_list), desc="Generating", disable=not use_tqdm) as bar:
            for delta in deltas:
                bar.update(whole.add(delta).finished)
        if failed:
            raise _prompts_failed(request_ids, failed, whole)
        return [whole.outputs[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.loaded.tokenizer
        prompts = [
            tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(
        self,
        request_ids: list[str],
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        priorities: list[int],
        failed: dict[str, str],
    ) -> Iterator[RequestOutput]:
        """Every step's deltas until all requests finish; those that fail alone go in
        `failed` (the engine has aborted them)."""
        engine = self.engine
        assert engine is not None
        for request_id, (text, ids), sp, prio in zip(request_ids, prompts, params, priorities):
            engine.add_request(request_id, text, ids, sp, prio)
        try:
            while engine.has_unfinished_requests():
                try:
                    yield from engine.step()
                except RequestsFailedError as lost:
                    failed.update(lost.reasons)
                    yield from lost.outputs
                except StepFailedError as error:  # offline, the step's own error says it best
                    raise error.__cause__ from None
        finally:  # after a failed step, nothing of this call stays queued
            for request_id in request_ids:
                engine.abort_request(request_id)

    def _run_reference(
        self,
        request_ids: list[str],
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
    ) -> Iterator[RequestOutput]:
        """The reference path's deltas, through an output processor of its own."""
        assert self.reference is not None
        outputs = OutputProcessor(
            self.loaded.tokenizer, self.sample_output_cls, self.stop_matcher_cls
        )
        requests = []
        for request_id, (text, ids), sp in zip(request_ids, prompts, params):
            request = Request.create(request_id, ids, sp)
            outputs.add_request(request_id, text, ids, sp, request.arrival_time)
            requests.append(request)
        return self.reference.run(requests, outputs)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.loaded.tokenizer.encode(prompt)
        return None, list(prompt)


def _prompts_failed(
    request_ids: list[str], failed: dict[str, str], whole: OutputAccumulator
) -> RequestsFailedError:
    """The prompts that failed (by position) and why; the others' outputs, in order."""
    position = {request_id: i for i, request_id in enumerate(request_ids)}
    message = "; ".join(f"prompt {position[rid]} failed: {why}" for rid, why in failed.items())
    others = [whole.outputs[rid] for rid in request_ids if rid not in failed]
    return RequestsFailedError(
        f"{message} (the other prompts' outputs are in .outputs)", list(failed), others, failed
    )


def _load(
    model: str | Path | LoadedModel | None,
    dtype: str | torch.dtype,
    device: str,
    quantization: str | None = None,
) -> LoadedModel:
    """Load `model`, or reuse it when it is loaded already (several engines, one set of weights)."""
    if not isinstance(model, LoadedModel):
        return load_model(model, dtype=dtype, device=device, quantization=quantization)
    if dtype != "auto" or device != "auto" or quantization is not None:
        param = next(model.model.parameters())
        raise ValueError(
            "dtype, device and quantization apply when loading, and this model is loaded "
            f"already ({param.dtype} on {param.device}); leave them as 'auto' and None"
        )
    return model


def _speculative(
    options: dict[str, Any] | None, engine: str, tensor_parallel_size: int
) -> SpeculativeConfig | None:
    """vLLM's speculative_config dict, validated (the paged engine on one process only)."""
    if options is None:
        return None
    if engine != "paged" or tensor_parallel_size != 1:
        raise ValueError(
            "speculative_config needs engine='paged' and tensor_parallel_size=1 "
            f"(got engine={engine!r}, tensor_parallel_size={tensor_parallel_size})"
        )
    return SpeculativeConfig.from_dict(options)


def _reference_max_len(requested: int | None, loaded: LoadedModel) -> int:
    limit = loaded.config.max_position_embeddings
    if requested is not None and not 0 < requested <= limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {requested}")
    return requested or limit


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(
            f"got {len(params)} SamplingParams for {count} prompts; give one or one per prompt"
        )
    return params


def _scheduling_rules(
    chunk_rule: Callable[..., int] | None, preemption_rule: Callable[..., str] | None, engine: str
) -> dict[str, Callable[..., Any]]:
    """The scheduler's decision functions that were given (the others stay minserve's)."""
    given = {"chunk_rule": chunk_rule, "preemption_rule": preemption_rule}
    rules = {name: rule for name, rule in given.items() if rule is not None}
    if rules and engine != "paged":
        raise ValueError(
            f"scheduling rules ({', '.join(rules)}) plug into the paged engine's scheduler; "
            f"engine={engine!r} has none"
        )
    return rules
