"""`LLM`: the offline API, shaped like vLLM's (`generate`, `chat`, `SamplingParams`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from minserve.errors import PromptTooLongError
from minserve.model.loader import LoadedModel, load_model
from minserve.model.sampler import Sampler
from minserve.model.tokenizer import Tokenizer
from minserve.outputs import RequestOutput
from minserve.reference import ReferenceGenerator
from minserve.request import Request, StopRules
from minserve.sampling_params import SamplingParams

# A prompt is text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...}.
Prompt = str | list[int] | dict[str, Any]
Message = dict[str, str]


class LLM:
    """Load a model once, then generate for batches of prompts.

    model: a .gguf file or a Hugging Face checkpoint folder; None means the bundled
    SmolLM2-135M-Instruct. dtype: "auto" (fp32 on CPU, bf16 on GPU), "float32",
    "bfloat16" or "float16". sampler: a `Sampler`, e.g. one built from your exercise module.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        sampler: Sampler | None = None,
    ) -> None:
        self.loaded: LoadedModel = load_model(model, dtype=dtype, device=device)
        limit = self.loaded.config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be in [1, {limit}] for this model, got {max_model_len}"
            )
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.max_model_len = max_model_len or limit
        self.rules = StopRules(self.loaded.eos_token_ids, self.max_model_len)
        self.generator = ReferenceGenerator(
            self.loaded.model, sampler or Sampler(), self.rules, max_num_seqs
        )
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        requests = [self._make_request(p, sp) for p, sp in zip(prompt_list, params, strict=True)]
        with tqdm(total=len(requests), desc="Generating", disable=not use_tqdm) as bar:
            self.generator.run(requests, on_finish=lambda _: bar.update(1))
        return [r.to_output() for r in requests]

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

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        request_id = str(next(self._ids))
        return Request.create(request_id, text, token_ids, params, self.loaded.tokenizer)

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

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(token_ids) >= self.max_model_len:  # leave room for at least one new token
            raise PromptTooLongError(len(token_ids), self.max_model_len)


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
