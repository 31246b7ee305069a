"""Tensor parallelism on this machine's CPU cores: step time and tokens/s at TP=1 vs TP=2,
and the all-reduce time inside each step.

    python -m benchmarks.tensor_parallel   # writes benchmarks/tensor_parallel.{json,md}

SmolLM2 has 9 query heads, which 2 ranks cannot split, so the model is SmolLM2's shape
(30 layers, hidden 576, MLP 1536, vocab 49152) with 8 heads of 72 and 2 KV heads, random
weights: step times do not depend on the values. TP=1 runs with all cores; TP=2 runs
one rank per core (the cores are shared, not added). Each configuration decodes `batch`
sequences of `prompt_len` tokens for `decode_steps` steps, ignoring EOS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.run_env import REPO_ROOT, RunRecord, command_line, write_json
from minserve.distributed import demo
from minserve.distributed.comm import CommStats
from minserve.distributed.ranks import run_on_ranks
from minserve.llm import LLM
from minserve.model.default_model import default_model_path
from minserve.model.tokenizer import Tokenizer
from minserve.sampling_params import SamplingParams

SHAPE = dict(hidden=576, inner=1536, layers=30, heads=8, kv_heads=2, head_dim=72, vocab=49152)


@dataclass
class TPResult:
    """One configuration's measurements (seconds; medians over decode steps)."""

    tensor_parallel_size: int
    threads_per_rank: int
    batch: int
    prefill_seconds: float
    decode_step_seconds: float
    decode_tokens_per_second: float
    all_reduces_per_step: float
    all_reduce_seconds_per_step: float  # rank 0's time inside all-reduces (waits included)


def make_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A random Llama with SmolLM2's shape but 8 heads, saved as a Hugging Face folder."""
    s = SHAPE
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": s["vocab"], "hidden_size": s["hidden"], "intermediate_size": s["inner"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "rope_theta": 10000.0,
    }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    shapes = {"model.embed_tokens.weight": (s["vocab"], s["hidden"]), "model.norm.weight": None}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, s["hidden"]),
            p + "self_attn.k_proj.weight": (kv, s["hidden"]),
            p + "self_attn.v_proj.weight": (kv, s["hidden"]),
            p + "self_attn.o_proj.weight": (s["hidden"], q),
            p + "mlp.gate_proj.weight": (s["inner"], s["hidden"]),
            p + "mlp.up_proj.weight": (s["inner"], s["hidden"]),
            p + "mlp.down_proj.weight": (s["hidden"], s["inner"]),
            p + "input_layernorm.weight": None,
            p + "post_attention_layernorm.weight": None,
        }
    tensors = {
        name: torch.ones(s["hidden"]) if shape is None else torch.randn(shape, generator=g) * 0.05
        for name, shape in shapes.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    Tokenizer.from_gguf(default_model_path()).backend.save(str(folder / "tokenizer.json"))
    return folder


def measure(llm: LLM, batch: int, prompt_len: int, decode_steps: int) -> TPResult:
    """Prefill `batch` prompts in one step, then time `decode_steps` decode steps."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * i + j) % 1000 + 100 for j in range(prompt_len)]
        engine.add_request(f"r{i}", None, ids, params)
    comm = llm.tensor_parallel.group.comm if llm.tensor_parallel else None
    start = time.perf_counter()
    engine.step()  # the whole batch prefills in one step (budget 2048 tokens)
    prefill = time.perf_counter() - start
    stats = CommStats()
    if comm is not None:
        comm.stats = stats  # count the decode steps' collectives only
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    return TPResult(
        llm.tensor_parallel.spec.world_size if llm.tensor_parallel else 1,
        torch.get_num_threads(), batch, prefill, step, batch / step,
        stats.num_all_reduces / len(steps), stats.all_reduce_seconds / len(steps),
    )  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    record = RunRecord.start(args.command, None, args.max_load, 120.0)
    cores = os.cpu_count() or 1
    results: list[TPResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "smollm2_shape_8_heads")
        for tp, threads in ((1, 1), (1, cores), (2, max(1, cores // 2))):
            torch.set_num_threads(threads)  # rank 0's threads; a worker gets cores // tp
            llm = LLM(path, num_blocks=256, tensor_parallel_size=tp)
            try:
                llm.generate([[100] * 8], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
                for batch in args.batch:
                    results.append(measure(llm, batch, args.prompt_len, args.decode_steps))
                    print(results[-1], file=sys.stderr)
            finally:
                llm.shutdown()
    latency = run_on_ranks(demo.time_mlp_vs_all_reduce, 2, tuple(args.batch))[0]
    record.finish()
    return {
        "run": asdict(record),
        "settings": {**SHAPE, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps},
        "results": [asdict(r) for r in results],
        "isolated_all_reduce": {str(t): v for t, v in latency.items()},
    }


def markdown(data: dict, record_line: str) -> str:
    results = sorted(data["results"], key=lambda r: (r["batch"], r["tensor_parallel_size"]))
    lines = [
        "# Tensor parallelism on CPU: TP=1 vs TP=2",
        "",
        f"Command: `{data['run']['command']}` ({data['run']['date']})",
        record_line,
        "- model: SmolLM2's shape with 8 heads / 2 KV heads (random weights), fp32; "
        f"prompts of {data['settings']['prompt_len']} tokens, "
        f"{data['settings']['decode_steps']} decode steps (median shown)",
        "- all-reduce ms / step: rank 0's time inside all-reduces during a decode step, "
        "waiting for the other rank included; isolated: the latency of one all-reduce of "
        "the same size between 2 idle processes, times the count",
        "",
        "| batch | TP | threads / rank | prefill (s) | decode step (ms) | decode tok/s"
        " | step vs TP=1, 1 thread | all-reduces / step | all-reduce ms / step"
        " | isolated all-reduce ms / step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = next(
            b["decode_step_seconds"]
            for b in results
            if b["batch"] == r["batch"] and b["tensor_parallel_size"] == 1
            and b["threads_per_rank"] == 1
        )  # fmt: skip
        iso = data["isolated_all_reduce"].get(str(r["batch"]), {}).get("all_reduce_seconds", 0.0)
        lines.append(
            f"| {r['batch']} | {r['tensor_parallel_size']} | {r['threads_per_rank']}"
            f" | {r['prefill_seconds']:.3f} | {r['decode_step_seconds'] * 1e3:.1f}"
            f" | {r['decode_tokens_per_second']:.1f} | {r['decode_step_seconds'] / base:.2f}"
            f" | {r['all_reduces_per_step']:.0f} | {r['all_reduce_seconds_per_step'] * 1e3:.1f}"
            f" | {iso * r['all_reduces_per_step'] * 1e3:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tensor_parallel", description=__doc__
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--max-load", type=float, default=None, help="wait for a quieter machine")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "tensor_parallel")
    args = parser.parse_args(argv)
    args.command = command_line(__spec__.name, argv)
    data = run(args)
    write_json(data, args.output.with_suffix(".json"))
    record = RunRecord(**data["run"])
    args.output.with_suffix(".md").write_text(markdown(data, record.load_line()))
    print(args.output.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
