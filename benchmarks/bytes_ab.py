"""Bytes per token, A/B: offline throughput and batch-1 decode of one minserve tree, in one
dtype, optionally with `quantization="gguf"`; one JSON line on stdout.

    HF_HUB_OFFLINE=1 PYTHONPATH=<tree> python benchmarks/bytes_ab.py bfloat16 [gguf]

Offline: 48 requests of random token ids (seed 0), prompt and output lengths uniform in
[32, 256], temperature 0.6, ignore_eos, one generate call (a 4-token warm-up first). Batch 1:
one 128-token prompt, 128 greedy output tokens, prefill included. Run each configuration in
its own process, one after another, on a quiet machine; `bytes_ab.md` has the results.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from minserve.llm import LLM
from minserve.sampling_params import SamplingParams

NUM_REQUESTS, MIN_LEN, MAX_LEN = 48, 32, 256


def measure(dtype: str, quantization: str | None = None) -> dict:
    """Output tokens per second, offline and at batch 1, with the execution summary."""
    extra = {"quantization": quantization} if quantization else {}
    llm = LLM(dtype=dtype, max_num_seqs=64, **extra)
    rng = random.Random(0)
    requests = [
        ([rng.randint(0, 10000) for _ in range(rng.randint(MIN_LEN, MAX_LEN))],
         rng.randint(MIN_LEN, MAX_LEN))
        for _ in range(NUM_REQUESTS)
    ]  # fmt: skip
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": requests[0][0]}], warm, use_tqdm=False)
    params = [
        SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=i)
        for i, (_, n) in enumerate(requests)
    ]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    offline = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    prompt = [rng.randint(0, 10000) for _ in range(128)]
    greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    batch1 = len(out[0].outputs[0].token_ids) / (time.perf_counter() - start)
    return {
        "dtype": dtype,
        "quantization": quantization,
        "offline_tok_s": round(offline, 1),
        "batch1_tok_s": round(batch1, 1),
        "execution": llm.get_execution_config().summary(),
    }


if __name__ == "__main__":
    result = measure(sys.argv[1], *sys.argv[2:3])
    print(json.dumps({"tree": os.environ.get("PYTHONPATH", ""), **result}), flush=True)
