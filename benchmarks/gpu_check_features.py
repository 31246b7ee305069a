"""The GPU check's features stage: each serving feature once on the GPU, checked and timed.

Every check builds its LLM (load, KV sizing, the Triton warm-up: `start_s`), runs a batch
once (`first_s`: what compiling is left) and again (`steady_s`), and compares tokens with an
oracle: transformers in fp32 for parity, else minserve's own fp32 greedy run. A dry run
builds every check's options and validates them on the CPU (configs constructed, modules
imported) and runs the tiny model's parity check, so a lent GPU's minutes go to the checks.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.gpu_check_models import first_mismatch, prompts, random_model, release

if TYPE_CHECKING:
    from benchmarks.gpu_check import Rows

NEW_TOKENS = 16
SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                presence_penalty=0.5, frequency_penalty=0.5, seed=1)  # fmt: skip


@dataclass(frozen=True)
class Check:
    """One feature: its LLM options, the modules it needs, and how it runs on a GPU."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    modules: tuple[str, ...] = ()
    gpus: int = 1


def greedy(new: int = NEW_TOKENS) -> Any:
    from minserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)


def timed_run(model: str | None, ids: list[list[int]], params: Any, **options: Any) -> dict:
    """Tokens and timings of a fresh LLM: start (load + warm-up), first batch, steady batch."""
    from minserve import LLM

    clock = time.perf_counter()
    llm = LLM(model, **options)
    start_s = time.perf_counter() - clock
    batch = [{"prompt_token_ids": p} for p in ids]
    try:
        times, tokens = [], []
        for _ in range(2):
            clock = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - clock)
            tokens = [o.outputs[0].token_ids for o in outs]
        pool = llm.engine.worker.pool if llm.engine is not None else None
        blocks = None if pool is None else pool.num_blocks
    finally:
        llm.shutdown()
        del llm
        release()
    return dict(tokens=tokens, start_s=round(start_s, 2), first_s=round(times[0], 3),
                steady_s=round(times[1], 3), num_blocks=blocks)  # fmt: skip


def transformers_greedy(model: Any, ids: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time (no padding)."""
    out = []
    with torch.inference_mode():
        for p in ids:
            x = torch.tensor([p], device=model.device)
            y = model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0, attention_mask=torch.ones_like(x))  # fmt: skip
            out.append(y[0, len(p) :].tolist())
    return out


def smollm2_transformers() -> Any:
    from transformers import AutoModelForCausalLM

    from minserve.model.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 torch_dtype=torch.float32)  # fmt: skip
    return model.to("cuda").eval()


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of tokens equal at the same position."""
    pairs = [(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w)]
    return sum(a == b for a, b in pairs) / max(1, len(pairs))


# ---------------------------------------------------------------- the checks on a GPU


def parity(run: dict, want: list[list[int]]) -> dict:
    miss = first_mismatch(run["tokens"], want)
    return dict(first_mismatch=miss, ok=miss is None)


def check_parity_tiny(ids: list[list[int]]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model("tiny", Path(tmp), "cuda", torch.float32)
        want = transformers_greedy(model, ids, NEW_TOKENS)
        del model
        release()
        run = timed_run(tmp, ids, greedy(), dtype="float32", device="cuda")
    return {**run, **parity(run, want)}


def check_parity_smollm2(ids: list[list[int]]) -> dict:
    model = smollm2_transformers()
    want = transformers_greedy(model, ids, NEW_TOKENS)
    del model
    release()
    run = timed_run(None, ids, greedy(), dtype="float32", device="cuda")
    return {**run, **parity(run, want)}


def against_fp32(ids: list[list[int]], least: float, **options: Any) -> dict:
    """A lossy option (bf16, 8-bit weights or KV) against fp32 greedy: its agreement."""
    want = timed_run(None, ids, greedy(), dtype="float32", device="cuda")["tokens"]
    run = timed_run(None, ids, greedy(), device="cuda", **options)
    share = agreement(run["tokens"], want)
    return {**run, "agreement_with_fp32": round(share, 3), "ok": share >= least}


def check_tensor_parallel(ids: list[list[int]]) -> dict:
    if torch.cuda.device_count() < 2:
        return dict(skipped=f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    want = timed_run(None, ids, greedy(), dtype="float32", device="cuda")["tokens"]
    run = timed_run(None, ids, greedy(), dtype="float32", device="cuda", tensor_parallel_size=2)
    return {**run, **parity(run, want)}


def check_pd_transfer(ids: list[list[int]]) -> dict:
    from minserve.disagg.pd_pair import PrefillDecodePair

    want = timed_run(None, ids, greedy(), dtype="float32", device="cuda")["tokens"]
    clock = time.perf_counter()
    pair = PrefillDecodePair(None, dtype="float32", device="cuda")
    start_s = time.perf_counter() - clock
    try:
        clock = time.perf_counter()
        outs = pair.generate(ids, greedy())
        first_s = time.perf_counter() - clock
    finally:
        pair.shutdown()
    got = [o.outputs[0].token_ids for o in outs]
    miss = first_mismatch(got, want)
    return dict(start_s=round(start_s, 2), first_s=round(first_s, 3), first_mismatch=miss,
                ok=miss is None)  # fmt: skip


def check_memory_sizing(ids: list[list[int]]) -> dict:
    total = torch.cuda.mem_get_info()[1]
    run = timed_run(None, ids, greedy(), device="cuda", gpu_memory_utilization=0.5)
    peak = torch.cuda.max_memory_reserved()
    fits = run["num_blocks"] > 0 and peak <= 0.5 * total
    return {**run, "total_gib": round(total / 2**30, 1),
            "peak_reserved_gib": round(peak / 2**30, 2), "ok": fits}  # fmt: skip


def check_swap(ids: list[list[int]]) -> dict:
    want = timed_run(None, ids, greedy(), dtype="float32", device="cuda")["tokens"]
    run = timed_run(None, ids, greedy(), dtype="float32", device="cuda", num_blocks=12,
                    max_model_len=len(ids[0]) + NEW_TOKENS, swap_space=1)  # fmt: skip
    return {**run, **parity(run, want)}


def check_sampling(ids: list[list[int]]) -> dict:
    from minserve import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **SAMPLING)
    run = timed_run(None, ids, params, device="cuda")
    again = timed_run(None, ids, params, device="cuda")
    miss = first_mismatch(run["tokens"], again["tokens"])
    return {**run, "seeded_repeat_mismatch": miss, "ok": miss is None}


def check_speculative(ids: list[list[int]]) -> dict:
    want = timed_run(None, ids, greedy(), dtype="float32", device="cuda")["tokens"]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    run = timed_run(None, ids, greedy(), dtype="float32", device="cuda", speculative_config=spec)
    return {**run, **parity(run, want)}


def check_long_context(ids: list[list[int]]) -> dict:
    long_ids = prompts(2, 2048, seed=3)
    model = smollm2_transformers()
    want = transformers_greedy(model, long_ids, 8)
    del model
    release()
    run = timed_run(None, long_ids, greedy(8), dtype="float32", device="cuda")
    return {**run, "prompt_tokens": 2048, **parity(run, want)}


def check_server(ids: list[list[int]]) -> dict:
    """`minserve serve` on 127.0.0.1 (engine loop and HTTP threads), one completion."""
    from minserve.distributed.group import free_port

    port = free_port()
    command = [sys.executable, "-m", "minserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    clock = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        start_s = wait_for_health(port, server, timeout_s=180)
        body = json.dumps({"model": "default", "prompt": "The capital of France is",
                           "max_tokens": 8, "temperature": 0}).encode()  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        clock = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as answer:
            reply = json.loads(answer.read())
        text = reply["choices"][0]["text"]
        return dict(start_s=start_s, first_s=round(time.perf_counter() - clock, 3),
                    text=text, ok=bool(text))  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)


def wait_for_health(port: int, server: subprocess.Popen, timeout_s: float) -> float:
    clock = time.perf_counter()
    while time.perf_counter() - clock < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"minserve serve exited: {server.stderr.read().decode()[-800:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return round(time.perf_counter() - clock, 2)
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"minserve serve was not healthy within {timeout_s:g} s")


CHECKS: dict[str, tuple[Check, Callable[[list[list[int]]], dict]]] = {
    c.name: (c, fn)
    for c, fn in [
        (Check("parity: tiny random model, fp32 vs transformers", {"dtype": "float32"}),
         check_parity_tiny),
        (Check("parity: SmolLM2, fp32 vs transformers", {"dtype": "float32"}),
         check_parity_smollm2),
        (Check("bf16 vs fp32", {"dtype": "bfloat16"}),
         lambda ids: against_fp32(ids, 0.5, dtype="bfloat16")),
        (Check("tensor parallel over NCCL, 2 ranks", {"tensor_parallel_size": 2},
               ("minserve.distributed.launcher",), gpus=2), check_tensor_parallel),
        (Check("P/D KV transfer", {}, ("minserve.disagg.pd_pair",)), check_pd_transfer),
        (Check("gguf weights", {"quantization": "gguf"}, ("minserve.model.quantized_linear",)),
         lambda ids: against_fp32(ids, 0.5, quantization="gguf")),
        (Check("int8 weights", {"quantization": "int8"}),
         lambda ids: against_fp32(ids, 0.5, quantization="int8")),
        (Check("fp8 KV cache", {"kv_cache_dtype": "fp8"}, ("minserve.attention.triton_kv8",)),
         lambda ids: against_fp32(ids, 0.5, kv_cache_dtype="fp8")),
        (Check("int8 KV cache", {"kv_cache_dtype": "int8"}, ("minserve.attention.triton_kv8",)),
         lambda ids: against_fp32(ids, 0.5, kv_cache_dtype="int8")),
        (Check("gpu_memory_utilization sizing", {"gpu_memory_utilization": 0.5},
               ("minserve.worker.memory",)), check_memory_sizing),
        (Check("swap preemption", {"num_blocks": 12, "swap_space": 1}), check_swap),
        (Check("sampling filters and penalties, seeded", {}), check_sampling),
        (Check("speculative decoding (ngram)",
               {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}),
         check_speculative),
        (Check("server engine thread", {}, ("minserve.cli", "minserve.server.app")), check_server),
        (Check("2k-token contexts vs transformers", {"max_model_len": 4096}),
         check_long_context),
    ]
}  # fmt: skip


# ---------------------------------------------------------------- the stage


def validate(check: Check) -> str:
    """A check's configuration without a GPU: its modules import, its options and the
    sampling parameters construct (the same validation LLM runs before loading)."""
    from minserve import SamplingParams
    from minserve.config import CacheConfig
    from minserve.speculative.config import SpeculativeConfig

    for module in check.modules:
        importlib.import_module(module)
    options = check.options
    CacheConfig(num_blocks=options.get("num_blocks"), swap_space=options.get("swap_space", 0),
                gpu_memory_utilization=options.get("gpu_memory_utilization", 0.9))  # fmt: skip
    if "speculative_config" in options:
        SpeculativeConfig(**options["speculative_config"])
    SamplingParams(max_tokens=NEW_TOKENS, **SAMPLING)
    return "configuration valid"


def features(rows: Rows, dry_run: bool) -> str:
    """Every check on a GPU; in a dry run, each one validated and the tiny parity run."""
    ids = prompts(4, 32, seed=1)
    for name, (check, run) in CHECKS.items():
        if dry_run:
            rows.add(check=name, note=validate(check), ok=True)
            continue
        try:
            result = run(ids)
        except Exception as error:  # one feature's failure is a row, not the stage's end
            result = dict(ok=False, error=f"{type(error).__name__}: {error}"[:600])
        result.pop("tokens", None)
        status = "SKIP" if "skipped" in result else ("PASS" if result.get("ok") else "FAIL")
        print(f"{status} {name}: {json.dumps(result, default=str)}", flush=True)
        rows.add(check=name, status=status, **result)
    if dry_run:
        rows.add(check="tiny parity on the CPU", **dry_parity(ids[:2]))
        return "dry run: configurations validated, the tiny model's parity run on the CPU"
    return f"{len(CHECKS)} checks"


def dry_parity(ids: list[list[int]]) -> dict:
    """The tiny model's greedy tokens equal transformers' on the CPU (2 prompts, 4 tokens)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model("tiny", Path(tmp), "cpu", torch.float32)
        want = transformers_greedy(model, ids, 4)
        from minserve import LLM

        llm = LLM(tmp, dtype="float32", device="cpu", num_blocks=16)
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(4), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    miss = first_mismatch(got, want)
    return dict(first_mismatch=miss, ok=miss is None)


STAGES = {"features": features}
