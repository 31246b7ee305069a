"""`minserve bench perplexity`: a model's perplexity on a text (the bundled one by default).

    minserve bench perplexity --dtype float32
    minserve bench perplexity --model file.gguf --quantization gguf --text notes.txt \
        --window 512 --stride 256
    minserve bench perplexity --dtype bfloat16 --kv-cache-dtype int8

A correctness check more than a speed one: the same weights in float32, bfloat16 or kept
quantized should give close perplexities; a broken kernel or loader shows as a jump.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from minserve.bench.options import set_threads
from minserve.bench.perplexity import PerplexityResult, bundled_text, perplexity


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `perplexity` subcommand of `minserve bench`."""
    p = kinds.add_parser("perplexity", help="perplexity of a model on a text")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="LLM's quantization option (gguf, ...)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8_e4m3, fp8_e5m2 or int8")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text (default: bundled)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window (default: max_model_len - 1)")  # fmt: skip
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: the window)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    from minserve import LLM  # torch import only when running

    set_threads(args.threads)
    text = args.text.read_text("utf-8") if args.text else bundled_text()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len)  # fmt: skip
    token_ids = llm.get_tokenizer().encode(text)
    window = args.window or llm.max_model_len - 1
    result = perplexity(llm, token_ids, window, args.stride or window)
    print(report(result, args))
    return 0


def report(result: PerplexityResult, args: argparse.Namespace) -> str:
    """The result and the options that produced it, one `name: value` per line."""
    rows = {
        "model": args.model or "SmolLM2-135M-Instruct (bundled)",
        "dtype": args.dtype,
        "quantization": args.quantization or "none",
        "kv cache dtype": args.kv_cache_dtype,
        "text": str(args.text) if args.text else "bundled (Pride and Prejudice, chapter 1)",
        "tokens scored": result.num_scored_tokens,
        "windows": f"{result.num_windows} (window {result.window}, stride {result.stride})",
        "mean NLL": f"{result.mean_nll:.4f}",
        "perplexity": f"{result.perplexity:.4f}",
    }
    return "\n".join(f"{name:>14}: {value}" for name, value in rows.items())
