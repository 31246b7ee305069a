"""Throughput with a busy core beside it: minserve against Hugging Face `generate`.

    python -m benchmarks.contention          # writes benchmarks/contention.{json,md}

A laptop always runs something else. Each peer runs the same saved offline workload (32
requests of random token ids, prompt and output lengths uniform in [32, 256], greedy,
ignore_eos) in its own process twice: on a quiet machine, then with a CPU burner (one
process spinning in a loop, pinned to nothing) running beside it. The slowdown is the quiet
throughput over the busy one; an engine that degrades gracefully loses about the share of
the cores the burner takes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.offline_peers import save_workload
from benchmarks.offline_throughput import SuiteSettings, run_one
from benchmarks.run_env import REPO_ROOT, machine_info
from minserve.bench.checkpoint import vocab_size
from minserve.bench.offline import OfflineResult, offline_workload

BURNER = "while True:\n    pass\n"  # one core's worth of someone else's work
PEERS = ("minserve", "hf16")
# Hugging Face as it runs without minserve: libgomp's default wait (300000 spins, then sleep)
# rather than the short spins minserve's import sets (`minserve/openmp_env.py`)
PEER_ENV = {"hf16": {"GOMP_SPINCOUNT": "300000"}, "hf64": {"GOMP_SPINCOUNT": "300000"}}


@dataclass(frozen=True)
class ContentionRow:
    """One peer's throughput quiet and busy."""

    peer: str
    dtype: str
    quiet_tok_s: float
    busy_tok_s: float

    @property
    def slowdown(self) -> float:
        return self.quiet_tok_s / self.busy_tok_s


def run_busy(
    peer: str, dtype: str, workdir: Path, settings: SuiteSettings, burners: int
) -> OfflineResult:
    """`run_one` with `burners` spinning processes beside it."""
    procs = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(burners)]
    busy = replace(settings, max_load=None)  # the burners are the load: do not wait for quiet
    try:
        return run_one(peer, dtype, workdir, workdir / "workload.json", busy, PEER_ENV.get(peer))
    finally:
        for p in procs:
            p.kill()
            p.wait()


def measure(settings: SuiteSettings, burners: int) -> list[ContentionRow]:
    """Every (peer, dtype) quiet, then busy, on one saved workload."""
    workload = offline_workload(
        settings.num_requests,
        settings.min_len,
        settings.max_len,
        settings.seed,
        vocab_size(settings.model),
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="minserve-contention-") as tmp:
        workdir = Path(tmp)
        save_workload(workload, workdir / "workload.json")
        for peer in settings.peers:
            for dtype in settings.dtypes:
                workload_path = workdir / "workload.json"
                quiet = run_one(peer, dtype, workdir, workload_path, settings, PEER_ENV.get(peer))
                busy = run_busy(peer, dtype, workdir, settings, burners)
                for r in (quiet, busy):
                    if not r.ok:
                        raise RuntimeError(f"{peer} {dtype}: {r.status}: {r.note}")
                row = ContentionRow(peer, dtype, quiet.tokens_per_s, busy.tokens_per_s)
                print(f"{peer} {dtype}: quiet {row.quiet_tok_s:.1f}, busy {row.busy_tok_s:.1f}"
                      f" output tok/s ({row.slowdown:.2f}x slower)", flush=True)  # fmt: skip
                rows.append(row)
    return rows


def markdown(
    rows: list[ContentionRow], command: str, machine: dict, burners: int, num_requests: int
) -> str:
    lines = [
        "# Throughput with a busy core beside it",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.now(UTC).date()}; machine: {machine.get('cpu', '?')}, "
        f"{machine.get('cores', '?')} cores; burners: {burners} spinning process(es)",
        f"- workload: {num_requests} requests, random token ids, prompt and output lengths "
        "uniform in [32, 256], greedy, ignore_eos; each run in its own process",
        "",
        "| peer | dtype | quiet tok/s | busy tok/s | slowdown |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r.peer} | {r.dtype} | {r.quiet_tok_s:.1f} | {r.busy_tok_s:.1f} | {r.slowdown:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--burners", type=int, default=1)
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "contention")
    args = parser.parse_args(argv)
    settings = SuiteSettings(
        num_requests=args.num_requests,
        peers=tuple(args.peers.split(",")),
        dtypes=tuple(args.dtype.split(",")),
        max_load=args.max_load,
    )
    machine = machine_info()
    rows = measure(settings, args.burners)
    command = "python -m benchmarks.contention " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {
        "command": command.strip(),
        "machine": machine,
        "burners": args.burners,
        "settings": {k: str(v) for k, v in asdict(settings).items()},
        "results": [{**asdict(r), "slowdown": round(r.slowdown, 2)} for r in rows],
    }
    args.output.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    table = markdown(rows, command.strip(), machine, args.burners, args.num_requests)
    args.output.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
