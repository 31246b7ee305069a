"""`minserve serve`: the engine's options as flags (vLLM's names); HTTP and the engine loop."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minserve.config import KV_CACHE_DTYPES, SCHEDULING_POLICIES, KVEventsConfig
from minserve.disagg.topology import PDTopology
from minserve.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    from minserve.disagg.proxy_engine import DisaggregatedEngine
    from minserve.engine import LLMEngine
    from minserve.server.app import Server

SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'
KV_EVENTS_EXAMPLE = '{"enable_kv_cache_events": true}'


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("serve", help="serve the OpenAI API (completions, chat, streaming)")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--served-model-name", default=None, help="default: the model's file name")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--quantization", default=None, choices=["gguf", "int8"],
                   help="gguf: a .gguf file's Q8_0/Q4_0/Q4_1 weights as stored; "
                   "int8: weights int8 per output channel")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: budget)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool budget")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9,
        help="on a GPU: the share of its memory for weights, activations and the KV pool",
    )  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model's dtype) or 8 bits")  # fmt: skip
    p.add_argument("--swap-space", type=float, default=0.0, help="GiB of host swap for KV")
    p.add_argument("--enable-prefix-caching", action="store_true", help="radix prefix cache")
    p.add_argument("--kv-offloading-size", type=float, default=0.0,
                   help="GiB of host memory for evicted prefix-cache blocks")  # fmt: skip
    p.add_argument("--kv-disk-path", default=None, metavar="DIR",
                   help="the disk tier: cached blocks written through to files here, read "
                   "back on a match (a directory several servers may share)")  # fmt: skip
    p.add_argument("--kv-disk-size", type=float, default=16.0, help="GiB the disk tier keeps")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help=f"publish the prefix cache's blocks for a router, e.g. "
                   f"'{KV_EVENTS_EXAMPLE}' (docs/state_plane.md)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
    p.add_argument(
        "--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"]
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (local processes)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests accepted beyond max-num-seqs; more get 503")  # fmt: skip
    p.add_argument("--target-tpot-ms", type=float, default=80.0,
                   help="under overload: the mean step time decodes keep (prompt chunks "
                   "shrink; admission refuses what would exceed it); 0: off")  # fmt: skip
    p.add_argument("--target-ttft-ms", type=float, default=800.0,
                   help="under overload: refuse (503, Retry-After) a request predicted to "
                   "get its first token later; 0: off")  # fmt: skip
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger bodies: 413")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help=f"speculative decoding, e.g. '{SPECULATIVE_EXAMPLE}'")  # fmt: skip
    p.add_argument("--disaggregation", type=_topology, default=None, metavar="<P>P<D>D",
                   help="P prefill + D decode instances (processes), e.g. 1P1D or 1P2D; "
                   "default: colocated")  # fmt: skip
    p.set_defaults(run=_serve)


def served_name(loaded_path: Path) -> str:
    """The name clients pass as `model`: the file's stem or the folder's name."""
    return loaded_path.stem if loaded_path.is_file() else loaded_path.name


def speculative_config(text: str | None) -> dict[str, Any] | None:
    """--speculative-config's JSON object, checked before the model loads (docs/server.md)."""
    return _json_option("--speculative-config", text, SpeculativeConfig.from_dict,
                        SPECULATIVE_EXAMPLE)  # fmt: skip


def kv_events_config(text: str | None) -> dict[str, Any] | None:
    """--kv-events-config's JSON object, checked before the model loads."""
    return _json_option("--kv-events-config", text, KVEventsConfig.from_dict, KV_EVENTS_EXAMPLE)


def _json_option(
    flag: str, text: str | None, check: Callable[[dict[str, Any]], object], example: str
) -> dict[str, Any] | None:
    """A flag's JSON object, `check`ed; a ValueError that shows an example otherwise."""
    if text is None:
        return None
    try:
        options = json.loads(text)
        if not isinstance(options, dict):
            raise ValueError(f"expected a JSON object, got {type(options).__name__}")
        check(options)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{flag} {text!r}: {e}\n  for example: {flag} '{example}'") from e
    return options


def _topology(text: str) -> PDTopology:
    try:
        return PDTopology.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _serve(args: argparse.Namespace) -> int:
    from minserve.server.app import build_server
    from minserve.server.async_engine import EngineStoppedError
    from minserve.server.serving import ServerConfig

    engine: LLMEngine | DisaggregatedEngine
    if args.disaggregation is None:
        from minserve.engine_args import EngineArgs
        from minserve.engine_builder import build_engine

        log_to_stderr()  # the execution line the engine logs as it loads
        engine = build_engine(EngineArgs.from_options(model=args.model, **_engine_options(args)))
        path = engine.loaded.path
    else:
        engine = _start_cluster(args)  # the proxy: rank 0 of the prefill/decode instances
        path = Path(engine.spec.model)
    config = ServerConfig(
        model_name=args.served_model_name or served_name(path),
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        scheduling_policy=args.scheduling_policy,
    )
    server = build_server(engine, config, args.max_queued_requests)
    try:
        run_until_stopped(server, args.host, args.port)
    except EngineStoppedError as crashed:  # an orchestrator restarts what exits non-zero
        print(f"minserve: {crashed}; exiting with status 1", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()  # stops tensor-parallel workers or disaggregated instances, if any
    return 0


def run_until_stopped(server: Server, host: str, port: int) -> None:
    """HTTP (uvicorn) in a thread, the engine loop in this one, the main thread, where
    OpenMP runs the model fastest; until Ctrl-C or SIGTERM. Raises EngineStoppedError if
    the engine loop crashed (`/health` has answered 503 since)."""
    from minserve.server.background import BackgroundServer

    http = BackgroundServer(server, host, port, log_level="info", start_engine=False)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        http.start()
        print(f"minserve: serving {server.config.model_name!r} on http://{host}:{port}/v1")
        server.engine.run()
    except KeyboardInterrupt:
        print("minserve: shutting down")
    finally:
        signal.signal(signal.SIGTERM, previous)
        http.stop()


def log_to_stderr() -> None:
    """minserve's info-level log records to stderr, as `minserve: ...` lines."""
    logger = logging.getLogger("minserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("minserve: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _start_cluster(args: argparse.Namespace) -> DisaggregatedEngine:
    from minserve.disagg.proxy_engine import DisaggregatedEngine

    if args.tensor_parallel_size != 1 or args.speculative_config is not None:
        raise ValueError(
            "--disaggregation runs each instance as one process without speculation; "
            "drop --tensor-parallel-size and --speculative-config"
        )
    options = _engine_options(args)
    del options["tensor_parallel_size"], options["speculative_config"]
    return DisaggregatedEngine(args.model, args.disaggregation, **options)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineArgs` by name from the flags (every instance gets the same)."""
    return dict(
        dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
        block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, swap_space=args.swap_space,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_offloading_size=args.kv_offloading_size,
        kv_disk_path=args.kv_disk_path, kv_disk_size=args.kv_disk_size,
        kv_events_config=kv_events_config(args.kv_events_config),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy, attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=speculative_config(args.speculative_config),
        target_tpot_ms=args.target_tpot_ms, target_ttft_ms=args.target_ttft_ms,
    )  # fmt: skip
