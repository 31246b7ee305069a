"""`minserve router`: the replicas and the policy as flags, then uvicorn."""

from __future__ import annotations

import argparse
from dataclasses import fields

from minserve.router.kv_aware import KVAwareConfig
from minserve.router.policy import POLICIES


def add_router_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("router", help="route OpenAI requests over several replicas")
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat)")  # fmt: skip
    p.add_argument("--policy", default="cache_aware", choices=POLICIES)
    p.add_argument("--balance-threshold", type=int, default=4,
                   help="cache_aware: in-flight requests a replica may have above the least "
                   "loaded before the request goes to the least loaded")  # fmt: skip
    p.add_argument("--chunk-size", type=int, default=16, help="prefix granularity (chars/tokens)")
    p.add_argument(
        "--cooldown", type=float, default=5.0, help="seconds a failed replica is skipped"
    )
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger bodies: 413")
    p.add_argument("--max-resumes", type=int, default=2,
                   help="times a request is sent again after its replica broke; a stream "
                   "goes on from another replica after the tokens relayed (0: never)")  # fmt: skip
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="kv_aware: the served model's .gguf file or Hugging Face folder, "
                   "to tokenize prompts as replicas do (default: the bundled model's)")  # fmt: skip
    for f in fields(KVAwareConfig):  # --prefill-tokens-per-s, ..., --session-margin-s
        p.add_argument("--" + f.name.replace("_", "-"), type=float, default=f.default,
                       help=f"kv_aware: {f.metadata['help']} (default %(default)s)")  # fmt: skip
    p.add_argument("--kv-events-check", type=float, default=1.0,
                   help="kv_aware: seconds between asking each replica for its events' "
                   "source (/v1/kv_events)")  # fmt: skip
    p.set_defaults(run=_route)


def _route(args: argparse.Namespace) -> int:
    import uvicorn

    from minserve.router.app import RouterConfig, build_router

    kv_aware = KVAwareConfig(**{f.name: getattr(args, f.name) for f in fields(KVAwareConfig)})
    config = RouterConfig(
        replicas=tuple(args.replica), policy=args.policy,
        balance_threshold=args.balance_threshold, chunk_size=args.chunk_size,
        cooldown_s=args.cooldown, max_request_bytes=args.max_request_bytes,
        max_resumes=args.max_resumes,
        tokenizer=args.tokenizer, kv_aware=kv_aware, kv_events_check_s=args.kv_events_check,
    )  # fmt: skip
    router = build_router(config)
    replicas = ", ".join(r.url for r in router.replicas)
    print(
        f"minserve: routing ({config.policy}) over {replicas} on http://{args.host}:{args.port}/v1"
    )
    uvicorn.run(router.app, host=args.host, port=args.port, log_level="info")
    return 0
