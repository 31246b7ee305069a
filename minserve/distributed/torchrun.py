"""Tensor parallelism across machines: one torchrun process per rank.

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank $NODE --master-addr $HOST \\
        --master-port 29500 -m minserve.distributed.torchrun --model /models/llama \\
        --prompt "The capital of France is" --max-tokens 32

torchrun starts the processes and sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
Rank 0 builds `LLM(tensor_parallel_size=WORLD_SIZE)`, which joins the group torchrun
describes instead of spawning workers, and generates; every other rank runs the worker
loop (`worker.torchrun_worker`) until rank 0 shuts down. Every rank must see the model at
the same path. Use the same loop in your own script to put a server on rank 0.
"""

from __future__ import annotations

import argparse
import os

from minserve.distributed.worker import TPSpec, torchrun_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun ... -m minserve.distributed.torchrun")
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder on every node")
    parser.add_argument("--prompt", action="append", required=True, help="repeatable")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run me under torchrun (RANK and WORLD_SIZE are not set)")
    world_size = int(os.environ["WORLD_SIZE"])
    if int(os.environ["RANK"]) != 0:
        torchrun_worker(TPSpec(args.model, world_size, args.dtype, block_size=args.block_size))
        return 0
    from minserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size,
              tensor_parallel_size=world_size)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        for out in llm.generate(args.prompt, params, use_tqdm=False):
            print(repr(out.prompt), "->", repr(out.outputs[0].text))
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
