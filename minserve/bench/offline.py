"""Offline throughput, nano-vllm's protocol scaled to a CPU: one `generate` over N requests.

Each request has a prompt of random token ids and asks for a number of output tokens, both
lengths uniform in [min_len, max_len]; every engine ignores EOS and samples at nano-vllm's
temperature, 0.6. Throughput is output tokens over the wall time of the one generate call
(model loading and a short warm-up excluded). Hugging Face `generate` runs the same requests
in static batches: each batch decodes to its longest request, and only the requested tokens
count as useful output, which is exactly what continuous batching wins back.

`python -m minserve.bench.offline --peer P --dtype D --workload W --result R` runs one peer
in its own process; `minserve bench offline` (minserve/bench/offline_suite.py) runs them all.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

TEMPERATURE = 0.6  # nano-vllm's bench.py samples at 0.6 (it has no greedy mode)
IN_PROCESS_PEERS = ("minserve", "reference", "hf16", "hf64")
PEER_LABELS = {
    "minserve": "minserve (paged engine)",
    "reference": "minserve (reference path)",
    "hf16": "HF generate, static batches of 16",
    "hf64": "HF generate, static batches of 64",
    "vllm": "vLLM CPU 0.32.0",
}
HF_BATCH_SIZES = {"hf16": 16, "hf64": 64}


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


def save_workload(workload: Sequence[OfflineRequest], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) for r in workload]))


def load_workload(path: Path) -> list[OfflineRequest]:
    return [OfflineRequest(**r) for r in json.loads(path.read_text())]


def requested_tokens(workload: Sequence[OfflineRequest]) -> int:
    """The useful output of a run: the tokens the requests asked for."""
    return sum(r.max_tokens for r in workload)


@dataclass(frozen=True)
class PeerResult:
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

    @property
    def label(self) -> str:
        return PEER_LABELS.get(self.peer, self.peer)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerResult:
        """Read back `to_dict()` or a report row, skipping derived keys (tokens_per_s, ratios)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# ---------------------------------------------------------------- minserve


def run_minserve(
    workload: Sequence[OfflineRequest],
    engine: str = "paged",
    dtype: str = "float32",
    model: str | Path | None = None,
) -> PeerResult:
    """minserve's `LLM.generate` over the whole workload at once (paged engine or reference)."""
    from minserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device="cpu", engine=engine)
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
    details = {"torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    if engine == "paged":
        after = llm.get_metrics()
        for name in ("num_steps", "num_preemptions"):
            details[name] = after[name] - before[name]
        details["kv_cache_usage_peak"] = round(after["kv_cache_usage_peak"], 3)
    peer = "minserve" if engine == "paged" else "reference"
    return PeerResult(peer, dtype, "ok", tokens, tokens, seconds, details=details)


# ---------------------------------------------------------------- Hugging Face static batching


def static_batches(
    workload: Sequence[OfflineRequest], batch_size: int
) -> list[list[OfflineRequest]]:
    """The workload cut into consecutive batches, in order (no sorting by length)."""
    return [list(workload[i : i + batch_size]) for i in range(0, len(workload), batch_size)]


def left_padded(batch: Sequence[OfflineRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest prompt], prompts flush right (left padding)."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n :] = 1
    return ids, mask


def hf_generate_batch(hf_model: Any, batch: Sequence[OfflineRequest], max_new: int) -> int:
    """One static batch through HF `generate`, all rows to `max_new` tokens; tokens generated."""
    pad_id = hf_model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id  # masked out either way
    input_ids, mask = left_padded(batch, pad_id)
    out = hf_model.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        min_new_tokens=max_new,  # transformers' way of ignoring EOS
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad_id,
    )  # [B, width + max_new]
    return out.numel() - input_ids.numel()


def run_hf_static(
    workload: Sequence[OfflineRequest],
    batch_size: int,
    dtype: str = "float32",
    model: str | Path | None = None,
) -> PeerResult:
    """Hugging Face `generate` with static batches: each batch runs to its longest request."""
    import transformers

    from minserve.model.default_model import default_model_path
    from minserve.viz.naive import load_hf_model

    hf_model = load_hf_model(model or default_model_path()).to(getattr(torch, dtype))
    batches = static_batches(workload, batch_size)
    with torch.inference_mode():
        hf_generate_batch(hf_model, batches[0][:2], 4)  # warm-up
        start = time.perf_counter()
        generated = sum(
            hf_generate_batch(hf_model, b, max(r.max_tokens for r in b)) for b in batches
        )
        seconds = time.perf_counter() - start
    details = {
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch_size": batch_size,
    }
    peer = f"hf{batch_size}"
    return PeerResult(
        peer, dtype, "ok", requested_tokens(workload), generated, seconds, details=details
    )


# ---------------------------------------------------------------- one peer per process


def run_peer(
    peer: str, workload: Sequence[OfflineRequest], dtype: str, model: str | Path | None = None
) -> PeerResult:
    """Run one in-process peer by name (see IN_PROCESS_PEERS; vLLM runs in its own venv)."""
    if peer in ("minserve", "reference"):
        return run_minserve(workload, "paged" if peer == "minserve" else "reference", dtype, model)
    if peer in HF_BATCH_SIZES:
        return run_hf_static(workload, HF_BATCH_SIZES[peer], dtype, model)
    raise ValueError(f"unknown peer {peer!r}; choose one of {', '.join(IN_PROCESS_PEERS)}")


def main(argv: list[str] | None = None) -> int:
    """Worker entry: run one peer on a saved workload and write its result as JSON."""
    p = argparse.ArgumentParser(description="run one offline-throughput peer")
    p.add_argument("--peer", required=True, choices=IN_PROCESS_PEERS)
    p.add_argument("--dtype", required=True, choices=("float32", "bfloat16"))
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    result = run_peer(args.peer, load_workload(args.workload), args.dtype, args.model)
    args.result.write_text(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
