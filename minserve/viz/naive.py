"""Why decoding is memory-bound, measured: generation loops, decode rates and the bandwidth floor.

Each decode step reads every weight once to produce one token per sequence, so at batch 1
no engine beats `bandwidth / weight_bytes` tokens per second: the bandwidth floor. A KV
cache keeps a step's work constant as the sequence grows; batching spreads one read of
the weights over many sequences. Chapter 00 and `benchmarks/naive_decode.py` use these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minserve.attention.contiguous import ContiguousAttention, ContiguousSlice, SequenceKV
from minserve.model.llama import CausalLM
from minserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.llm import LLM


def seconds(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds one call of `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------- the roofline


def measure_memory_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second a sum over a large fp32 CPU tensor reads: the roofline's memory slope.

    The tensor is far bigger than any CPU cache, so every byte comes from DRAM. The best of
    `repeats` is kept (noise only ever slows a run down). The rate is for torch's current
    thread count, the same threads a decode step gets.
    """
    data = torch.ones(num_bytes // 4, dtype=torch.float32)  # [num_bytes / 4]
    data.sum()  # warm up: wake the thread pool before timing
    best = min(seconds(data.sum) for _ in range(repeats))
    return data.numel() * data.element_size() / best


def measure_matmul_flops(
    size: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32
) -> float:
    """Floating-point operations per second of a [size, size] @ [size, size] matmul in
    `dtype` (2 * size^3 of them): the roofline's compute ceiling, best of `repeats`."""
    a = torch.randn(size, size).to(dtype)  # [size, size]
    a @ a  # warm up
    best = min(seconds(lambda: a @ a) for _ in range(repeats))
    return 2 * size**3 / best


def weight_bytes(model: CausalLM) -> int:
    """Bytes of weights one decode step reads: every parameter once.

    `parameters()` yields a shared tensor once, so a tied embedding / LM head counts once.
    An untied embedding table is left out: a step gathers only a few of its rows.
    """
    embedding = model.model.embed_tokens.weight
    tied = embedding is model.lm_head.weight
    return sum(
        p.numel() * p.element_size() for p in model.parameters() if tied or p is not embedding
    )


def bandwidth_floor(bandwidth: float, num_weight_bytes: int, batch_size: int = 1) -> float:
    """Best possible decode tokens/s when each step must read all weights once.

    One read of the weights serves every sequence in the batch, so the floor grows with
    the batch until compute, not memory, is the limit (KV reads are ignored: they are
    small next to the weights for short sequences).
    """
    return batch_size * bandwidth / num_weight_bytes


# ---------------------------------------------------------------- generation loops


@dataclass(frozen=True)
class Generation:
    """A greedy generation's new tokens and the wall time of each step."""

    prompt_len: int
    token_ids: list[int]
    step_seconds: list[float]

    @property
    def context_lengths(self) -> list[int]:
        """Tokens the model looks at in each step: the prompt, then one more per step."""
        return [self.prompt_len + i for i in range(len(self.step_seconds))]


def forward_last(
    model: CausalLM, kv: SequenceKV, token_ids: Sequence[int], start: int
) -> torch.Tensor:
    """Feed `token_ids` at positions start.. through `kv`; logits of the last one [vocab]."""
    device = model.lm_head.weight.device
    n = len(token_ids)
    ids = torch.tensor(token_ids, device=device)  # [n]
    positions = torch.arange(start, start + n, device=device)  # [n]
    hidden = model(ids, positions, ContiguousAttention([ContiguousSlice(kv, start, n)]))
    return model.compute_logits(hidden[-1:])[0]  # [vocab]


def new_kv(model: CausalLM, capacity: int) -> SequenceKV:
    """An empty contiguous KV cache for one sequence of up to `capacity` tokens."""
    weight = model.lm_head.weight
    return SequenceKV(model.config, capacity, weight.dtype, weight.device)


@torch.inference_mode()
def next_token_logits(model: CausalLM, token_ids: Sequence[int]) -> torch.Tensor:
    """The next-token logits [vocab] after `token_ids`, computed from scratch (no cache)."""
    return forward_last(model, new_kv(model, len(token_ids)), token_ids, 0)


@torch.inference_mode()
def naive_generate_no_cache(
    model: CausalLM, token_ids: Sequence[int], new_tokens: int
) -> Generation:
    """The textbook loop: every step re-runs the whole sequence to get one more token.

    Step i recomputes the keys and values of all prompt_len + i tokens, so a step's cost
    grows with the sequence and a whole generation grows quadratically.
    """
    tokens, times = list(token_ids), []
    for _ in range(new_tokens):
        start = time.perf_counter()
        tokens.append(int(next_token_logits(model, tokens).argmax()))
        times.append(time.perf_counter() - start)
    return Generation(len(token_ids), tokens[len(token_ids) :], times)


@torch.inference_mode()
def generate_with_cache(model: CausalLM, token_ids: Sequence[int], new_tokens: int) -> Generation:
    """The same greedy loop with a KV cache: the prompt once, then one new token per step.

    Keys and values of earlier tokens never change, so they are stored and reused; a
    decode step feeds one token and reads the cache instead of recomputing it.
    """
    kv = new_kv(model, len(token_ids) + new_tokens)
    tokens, cached, times = list(token_ids), 0, []
    for _ in range(new_tokens):
        start = time.perf_counter()
        logits = forward_last(model, kv, tokens[cached:], cached)  # the prompt, then 1 token
        cached = len(tokens)
        tokens.append(int(logits.argmax()))
        times.append(time.perf_counter() - start)
    return Generation(len(token_ids), tokens[len(token_ids) :], times)


# ---------------------------------------------------------------- decode rates


def fixed_prompts(
    batch_size: int, prompt_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """`batch_size` prompts of `prompt_len` random token ids, the same on every run."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab_size, (batch_size, prompt_len), generator=generator)
    return ids.tolist()  # [batch_size][prompt_len]; ids below 100 hold special tokens


def decode_rate(
    generate: Callable[[int], Any], batch_size: int, new_tokens: int, repeats: int = 1
) -> float:
    """Decode tokens/s of `generate(max_tokens)`, with the prefill subtracted out.

    A run of `new_tokens` is one prefill (which yields the first token) plus new_tokens - 1
    decode steps; a run of 1 token is the prefill alone. Their difference is pure decode.
    Runs alternate and the best of `repeats` of each is kept.
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 to time a decode step, got {new_tokens}")
    generate(2)  # warm up allocators and caches
    full, prefill = float("inf"), float("inf")
    for _ in range(repeats):
        full = min(full, seconds(lambda: generate(new_tokens)))
        prefill = min(prefill, seconds(lambda: generate(1)))
    if full <= prefill:
        raise RuntimeError(
            f"{new_tokens} tokens took {full:.3f} s, no longer than 1 token ({prefill:.3f} s): "
            "the machine is too busy to time decode; generate more tokens or retry"
        )
    return batch_size * (new_tokens - 1) / (full - prefill)


def decode_tokens_per_second(
    llm: LLM, batch_size: int, prompt_len: int, new_tokens: int, repeats: int = 1
) -> float:
    """minserve's decode rate on fixed prompts: greedy, ignore_eos, every sequence in one batch."""
    vocab = llm.loaded.config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in fixed_prompts(batch_size, prompt_len, vocab)]

    def generate(max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)

    return decode_rate(generate, batch_size, new_tokens, repeats)


# ---------------------------------------------------------------- the Hugging Face peer


def load_hf_model(path: str | Path) -> Any:
    """transformers' model for the same checkpoint (a .gguf file or a folder), fp32, eval."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def hf_decode_tokens_per_second(
    hf_model: Any, batch_size: int, prompt_len: int, new_tokens: int, repeats: int = 1
) -> float:
    """Hugging Face `generate`'s decode rate on the same prompts and protocol as minserve's.

    Greedy, static batching (all prompts have one length, so no padding), and
    min_new_tokens = max_new_tokens, transformers' way of ignoring EOS.
    """
    vocab = hf_model.config.vocab_size
    input_ids = torch.tensor(fixed_prompts(batch_size, prompt_len, vocab))  # [batch, prompt_len]
    mask = torch.ones_like(input_ids)

    def generate(max_tokens: int) -> None:
        hf_model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )

    return decode_rate(generate, batch_size, new_tokens, repeats)
