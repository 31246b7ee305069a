"""The offline-throughput peers that run under minserve's interpreter, one per process.

    python -m benchmarks.offline_peers --peer hf16 --dtype float32 --workload W --result R

`benchmarks/offline_throughput.py` starts one process per peer and reads its result back:
minserve's paged engine and its reference path (`minserve.bench.offline.run_minserve`), and
Hugging Face `generate` in static batches of 16 and 64. Static batches decode each batch to
its longest request, and only the requested tokens count as useful output: exactly what
continuous batching wins back. vLLM runs under its own interpreter (`vllm_peer.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

# isort: off
# before torch, as `import minserve` is in a user's program: OpenMP's waits (openmp_env.py)
from minserve import openmp_env  # noqa: F401
import torch
# isort: on

from minserve.bench.offline import (
    TEMPERATURE,
    OfflineRequest,
    OfflineResult,
    requested_tokens,
    run_minserve,
)

IN_PROCESS_PEERS = ("minserve", "reference", "hf16", "hf64")
HF_BATCH_SIZES = {"hf16": 16, "hf64": 64}


def save_workload(workload: Sequence[OfflineRequest], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) for r in workload]))


def load_workload(path: Path) -> list[OfflineRequest]:
    return [OfflineRequest(**r) for r in json.loads(path.read_text())]


def load_result(path: Path) -> OfflineResult:
    """A peer's result as it wrote it (`OfflineResult.to_dict()`, here or in `vllm_peer.py`),
    skipping derived keys (tokens_per_s)."""
    names = {f.name for f in fields(OfflineResult)}
    return OfflineResult(**{k: v for k, v in json.loads(path.read_text()).items() if k in names})


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
) -> OfflineResult:
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
    return OfflineResult(
        peer, dtype, "ok", requested_tokens(workload), generated, seconds, details=details
    )


# ---------------------------------------------------------------- one peer per process


def run_peer(
    peer: str,
    workload: Sequence[OfflineRequest],
    dtype: str,
    model: str | Path | None = None,
    options: dict[str, Any] | None = None,
) -> OfflineResult:
    """Run one in-process peer by name (see IN_PROCESS_PEERS; vLLM runs in its own venv);
    `options`: more `LLM` keyword arguments for minserve."""
    if peer in ("minserve", "reference"):
        engine = "paged" if peer == "minserve" else "reference"
        return run_minserve(workload, engine, dtype, model, options)
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
    p.add_argument(
        "--llm-options", type=json.loads, default=None, metavar="JSON",
        help="more LLM arguments for minserve, as a JSON object",
    )  # fmt: skip
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    workload = load_workload(args.workload)
    result = run_peer(args.peer, workload, args.dtype, args.model, args.llm_options)
    args.result.write_text(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
