"""`LLM`: the offline API, shaped like vLLM's (`generate`, `chat`, `SamplingParams`)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from minserve.engine import LLMEngine
from minserve.engine_args import EngineArgs
from minserve.engine_builder import build_engine, load
from minserve.errors import RequestsFailedError, StepFailedError
from minserve.execution import ExecutionConfig
from minserve.loader import LoadedModel
from minserve.model.sampler import Sampler
from minserve.model.tokenizer import Tokenizer
from minserve.output_processor import OutputProcessor
from minserve.outputs import OutputAccumulator, RequestOutput
from minserve.plugins import NO_PLUGINS, CoursePlugins
from minserve.reference import ReferenceGenerator
from minserve.request import (
    Request,
    StopRules,
    validate_params,
    validate_prompt,
    validate_resume,
)
from minserve.sampling_params import SamplingParams
from minserve.scheduler.policy import priority_value

# A prompt is text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...};
# a dict may add "resume_token_ids" (the tokens a request already generated elsewhere).
Prompt = str | list[int] | dict[str, Any]
Message = dict[str, str]
logger = logging.getLogger(__name__)


class LLM:
    """Load a model once, then generate for batches of prompts.

    The options are vLLM's (`EngineArgs`, docs/engine.md): model is a .gguf file or a
    Hugging Face checkpoint folder (None: the bundled SmolLM2-135M-Instruct; an already
    loaded `other_llm.loaded` is shared, not loaded again). dtype "auto" is bf16 on a GPU
    and on a CPU with native bfloat16, else fp32. quantization="gguf" keeps a GGUF file's
    Q8_0, Q4_0 and Q4_1 matrices as stored; "int8" stores every weight matrix as int8 with a
    scale per output channel. kv_cache_dtype="fp8_e4m3" (or "fp8"), "fp8_e5m2" or "int8"
    stores the KV cache in 8 bits. tensor_parallel_size=N splits the model over N processes
    (docs/distributed.md; call `shutdown()` when done). speculative_config={"method":
    "ngram", "num_speculative_tokens": k} turns on speculative decoding
    (docs/speculative.md). engine="reference" runs the contiguous-KV reference path (the
    oracle). The other options (block_size, num_blocks, kv_cache_memory_bytes,
    kv_offloading_size, enable_chunked_prefill, scheduling_policy) go by name to
    `EngineArgs`; an unknown name is refused.

    plugins=CoursePlugins(...) runs the engine on a student's parts: a model's ops, a block
    allocator, a scheduler, chapter 04's rules, chapter 02's kernels, chapter 10's codecs
    (docs/course.md). How it runs on this machine (device, dtype, ops, attention backend) is
    logged once at info level and returned by `get_execution_config()`.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        swap_space: float = 0.0,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = False,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        attention_backend: str = "auto",
        speculative_config: dict[str, Any] | None = None,
        engine: str = "paged",
        plugins: CoursePlugins | None = None,
        **engine_options: Any,
    ) -> None:
        self.args = EngineArgs.from_options(
            model=model, dtype=dtype, device=device, quantization=quantization,
            tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, swap_space=swap_space,
            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            attention_backend=attention_backend, speculative_config=speculative_config,
            engine=engine, **engine_options,
        )  # fmt: skip
        self.plugins = plugins = plugins or NO_PLUGINS
        self.engine: LLMEngine | None = None
        self.reference: ReferenceGenerator | None = None
        if engine == "paged":
            self.engine = build_engine(self.args, plugins)
            self.loaded: LoadedModel = self.engine.loaded
            self.max_model_len = self.engine.max_model_len
            self.execution: ExecutionConfig = self.engine.execution
        else:
            plugins.check(self.args)
            self.loaded = load(self.args)
            plugins.install(self.loaded)
            self.max_model_len = _reference_max_len(max_model_len, self.loaded)
            rules = StopRules(self.loaded.eos_token_ids, self.max_model_len)
            self.reference = ReferenceGenerator(
                self.loaded.model, plugins.sampler or Sampler(), rules, max_num_seqs,
                plugins.attend,
            )  # fmt: skip
            ops = "yours" if plugins.model_ops is not None else self.loaded.execution.ops
            self.execution = replace(self.loaded.execution, attention="contiguous", ops=ops)
            logger.info(self.execution.summary())  # how it runs, said once (docs/engine.md)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the LLM cannot generate afterwards)."""
        if self.engine is not None:
            self.engine.shutdown()

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

        A prompt dict with "resume_token_ids" continues a request that generated those
        tokens elsewhere (`LLMEngine.add_request`): its output holds what follows them only.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        priorities = [priority_value(p) for p in priority or [0] * len(prompt_list)]
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        tokenized = [self._tokenize(p) for p in prompt_list]  # validate all before queueing any
        resumes = [_resume_of(p) for p in prompt_list]
        vocab_size = self.loaded.config.vocab_size
        for (_, token_ids), sp, resume in zip(tokenized, params, resumes):
            validate_prompt(token_ids, vocab_size, self.max_model_len)
            validate_params(sp, vocab_size)
            if resume:
                validate_resume(resume, len(token_ids), sp, vocab_size, self.max_model_len)
        if self.engine is None and any(sp.prompt_logprobs is not None for sp in params):
            raise ValueError("prompt_logprobs needs the paged engine (engine='paged')")
        if self.engine is None and any(resumes):
            raise ValueError("resume_token_ids needs the paged engine (engine='paged')")
        request_ids = [str(next(self._ids)) for _ in tokenized]
        failed: dict[str, str] = {}  # request id -> why, filled as requests fail
        deltas = (
            self._run_engine(request_ids, tokenized, params, priorities, failed, resumes)
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
        resumes: list[list[int] | None],
    ) -> Iterator[RequestOutput]:
        """Every step's deltas until all requests finish; those that fail alone go in
        `failed` (the engine has aborted them)."""
        engine = self.engine
        assert engine is not None
        try:
            for rid, (text, ids), sp, prio, resume in zip(
                request_ids, prompts, params, priorities, resumes
            ):
                engine.add_request(rid, text, ids, sp, prio, resume)
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
            self.loaded.tokenizer, self.plugins.sample_output_cls, self.plugins.stop_matcher_cls
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


def _resume_of(prompt: Prompt) -> list[int] | None:
    """A prompt dict's "resume_token_ids" (None: it starts afresh)."""
    if not isinstance(prompt, dict) or prompt.get("resume_token_ids") is None:
        return None
    return list(prompt["resume_token_ids"])


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
