"""Offline throughput, nano-vllm's protocol scaled to a CPU: one `generate` over N requests.

Each request has a prompt of random token ids and asks for a number of output tokens, both
lengths uniform in [min_len, max_len]; the engine ignores EOS and samples at nano-vllm's
temperature, 0.6. Throughput is output tokens over the wall time of the one generate call
(model loading and a short warm-up excluded).

    minserve bench offline --num-requests 64 --min-len 32 --max-len 256 --dtype float32

prints a row per dtype. `benchmarks/offline_throughput.py` runs the same workload through
the reference path, Hugging Face `generate` and vLLM too, each in its own process.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from minserve.bench import checkpoint
from minserve.bench.options import choices, set_threads

TEMPERATURE = 0.6  # nano-vllm's bench.py samples at 0.6 (it has no greedy mode)
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class OfflineRequest:
    """One request of the workload: a prompt of token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int


def offline_workload(
    num_requests: int = 64, min_len: int = 32, max_len: int = 256, seed: int = 0,
    vocab_size: int = 49152,
) -> list[OfflineRequest]:  # fmt: skip
    """nano-vllm's bench.py workload: random prompts, then random output lengths, seeded.

    Prompt lengths, output lengths and token ids are uniform (inclusive bounds); the draws
    come in nano-vllm's order: every prompt (its length, then its ids), then every output length.
    """
    if not 0 < min_len <= max_len:
        raise ValueError(f"need 0 < min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, vocab_size - 1) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_requests)
    ]
    return [OfflineRequest(p, rng.randint(min_len, max_len)) for p in prompts]


def requested_tokens(workload: Sequence[OfflineRequest]) -> int:
    """The useful output of a run: the tokens the requests asked for."""
    return sum(r.max_tokens for r in workload)


@dataclass(frozen=True)
class OfflineResult:
    """One engine's run: useful output tokens, tokens actually generated, and wall time.

    status is "ok", "not installed" or "failed" (then `note` says why or how to fix it).
    """

    peer: str
    dtype: str
    status: str = "ok"
    output_tokens: int = 0  # useful output: what the requests asked for
    generated_tokens: int = 0  # what the engine computed (static batches pad to the longest)
    seconds: float = 0.0  # wall time of the generate call(s)
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.seconds > 0

    @property
    def tokens_per_s(self) -> float:
        """Useful output tokens per second of generate wall time (0 if the run did not happen)."""
        return self.output_tokens / self.seconds if self.ok else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)}


# ---------------------------------------------------------------- minserve


def run_minserve(
    workload: Sequence[OfflineRequest],
    engine: str = "paged",
    dtype: str = "float32",
    model: str | Path | None = None,
    options: Mapping[str, Any] | None = None,
) -> OfflineResult:
    """minserve's `LLM.generate` over the whole workload at once (paged engine or reference);
    `options`: more `LLM` keyword arguments (quantization, kv_cache_dtype, ...)."""
    from minserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device="cpu", engine=engine, **(options or {}))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=r.max_tokens, ignore_eos=True)
        for r in workload
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    before = llm.get_metrics() if engine == "paged" else {}
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    details = {
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "options": dict(options or {}),
        "execution": llm.get_execution_config().summary(),
    }
    if engine == "paged":
        after = llm.get_metrics()
        for name in ("num_steps", "num_preemptions"):
            details[name] = after[name] - before[name]
        details["kv_cache_usage_peak"] = round(after["kv_cache_usage_peak"], 3)
    peer = "minserve" if engine == "paged" else "reference"
    return OfflineResult(peer, dtype, "ok", tokens, tokens, seconds, details=details)


# ---------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The workload and the model: `minserve bench offline`'s options."""
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32, help="shortest prompt and output")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt and output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `offline` subcommand of `minserve bench`."""
    p = kinds.add_parser("offline", help="offline throughput, nano-vllm's protocol")
    add_arguments(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(run=run_command)


def workload_from(args: argparse.Namespace) -> list[OfflineRequest]:
    """The seeded workload the options describe, token ids drawn from the model's vocabulary."""
    return offline_workload(
        args.num_requests, args.min_len, args.max_len, args.seed, checkpoint.vocab_size(args.model)
    )


def run_command(args: argparse.Namespace) -> int:
    dtypes = choices(args.dtype, DTYPES, "dtype")
    set_threads(args.threads)
    workload = workload_from(args)
    results = []
    for dtype in dtypes:
        torch.manual_seed(args.seed)
        results.append(run_minserve(workload, "paged", dtype, args.model))
    print(table(workload, results))
    return 0


def table(workload: Sequence[OfflineRequest], results: Sequence[OfflineResult]) -> str:
    """A markdown table, a row per run: throughput, tokens, time, steps, preemptions."""
    lines = [
        f"{len(workload)} requests, {requested_tokens(workload)} output tokens, "
        f"temperature {TEMPERATURE}, EOS ignored",
        "",
        "| engine | dtype | output tok/s | output tokens | generate s | steps | preemptions "
        "| peak KV usage |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        d = r.details
        cells = [r.peer, r.dtype, f"{r.tokens_per_s:.1f}", str(r.output_tokens), f"{r.seconds:.1f}"]
        cells += [
            str(d.get(k, "-")) for k in ("num_steps", "num_preemptions", "kv_cache_usage_peak")
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
