"""One command that checks minserve on a GPU machine: six stages, each bounded in time.

    python -m benchmarks.gpu_check --output DIR            # on a CUDA machine, < 10 minutes
    python -m benchmarks.gpu_check --output DIR --dry-run  # the plumbing on a CPU
    python -m benchmarks.gpu_check --dry-run --stages features  # every check's config, < 1 min

Stages (benchmarks/gpu_check_stages.py, gpu_check_features.py, gpu_check_models.py):
1. environment: versions, the device, and how minserve resolves its execution config;
2. features: each feature once, PASS/FAIL with its numbers and start (load + compile),
   first-batch and steady-batch seconds: greedy parity with transformers (tiny model and
   SmolLM2, fp32, 2k-token contexts), bf16, TP over NCCL, P/D KV transfer, gguf and int8
   weights, fp8 and int8 KV, gpu_memory_utilization sizing, swap preemption, sampling
   filters and penalties, speculative decoding, the server's engine thread;
3. kernels: the Triton kernels against their torch references (dtypes, block sizes, head dims);
4. engine: greedy tokens of the Triton backend equal the torch backend's (chunked prefill,
   preemption, the prefix cache's host tier), seeded sampling reproducible;
5. bandwidth: decode kernel time as a share of the device's measured copy bandwidth;
6. throughput: `LLM.generate` against transformers' `generate`, random-weight models.

Each stage runs in its own process with a timeout: one that fails, crashes or runs out of
time is recorded with its error and the next one runs. DIR/gpu_check.json is rewritten as
each stage ends (a killed run still leaves what finished), DIR/gpu_check.md at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: `import minserve` from the source tree
    sys.path.insert(0, str(REPO_ROOT))


@dataclass(frozen=True)
class Stage:
    """A stage: its name, its timeout on a GPU, and its (shorter) timeout in a dry run."""

    name: str
    timeout_s: float
    dry_timeout_s: float


STAGES = (  # the budget (540 s) ends the run inside 10 minutes; later stages then skip
    Stage("environment", 20, 30),
    Stage("features", 300, 60),
    Stage("kernels", 90, 60),
    Stage("engine", 110, 60),
    Stage("bandwidth", 50, 30),
    Stage("throughput", 200, 60),
)
STAGE_NAMES = [s.name for s in STAGES]


# ---------------------------------------------------------------- the parent: run stages


def run_stage(stage: Stage, output: Path, dry_run: bool, timeout_s: float) -> dict[str, Any]:
    """Run one stage in a child process; its record, whatever happened to the child."""
    partial = output / "stages" / f"{stage.name}.json"
    partial.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", stage.name,
               "--output", str(output)] + (["--dry-run"] if dry_run else [])  # fmt: skip
    start = time.monotonic()
    try:
        done = subprocess.run(command, env=child_environment(dry_run), timeout=timeout_s,
                              capture_output=True, text=True)  # fmt: skip
        status, log = None, done.stderr
    except subprocess.TimeoutExpired as expired:
        status, log = "timeout", _text(expired.stderr)
    record = read_partial(partial)
    if status == "timeout":
        record["status"] = "timeout"
        record["error"] = f"stopped after its {timeout_s:g} s timeout"
    elif "status" not in record:  # the child died before it could say how it ended
        record["status"] = "error"
        record["error"] = f"the stage process exited with code {done.returncode}"
    if record["status"] in ("error", "timeout"):
        record["log_tail"] = log[-2000:]
    return {"stage": stage.name, **record, "seconds": round(time.monotonic() - start, 1)}


def child_environment(dry_run: bool) -> dict[str, str]:
    """The stage's environment: the source tree importable, nothing downloaded, and in a
    dry run Triton's interpreter (set before minserve defines its kernels)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    return env


def _text(stream: str | bytes | None) -> str:
    if isinstance(stream, bytes):
        return stream.decode(errors="replace")
    return stream or ""


def read_partial(path: Path) -> dict[str, Any]:
    """What a stage wrote before it ended: its rows, and its status if it finished."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"rows": []}


def run_all(names: Sequence[str], output: Path, dry_run: bool, budget_s: float) -> list[dict]:
    """Each named stage in order, within the budget; gpu_check.json rewritten after each."""
    output.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    records: list[dict[str, Any]] = []
    for stage in (s for s in STAGES if s.name in names):
        left = deadline - time.monotonic()
        if left < 5:
            records.append({"stage": stage.name, "status": "skipped", "rows": [],
                            "error": f"the {budget_s:g} s budget ran out"})  # fmt: skip
        else:
            timeout = stage.dry_timeout_s if dry_run else stage.timeout_s
            records.append(run_stage(stage, output, dry_run, min(timeout, left)))
        print(f"{stage.name}: {records[-1]['status']}", flush=True)
        write_json(output / "gpu_check.json", {"dry_run": dry_run, "stages": records})
    return records


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write through a temporary file, so a killed run never leaves half a JSON file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def markdown(records: list[dict[str, Any]], command: str) -> str:
    """One line per stage: its status, time, how many checks passed, and any error."""
    lines = ["# minserve GPU check", "", f"`{command}`", "",
             "| stage | status | seconds | checks passed | note |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        checks = [row["ok"] for row in r.get("rows", []) if "ok" in row]
        note = (r.get("error") or r.get("note") or " ").splitlines()[0]
        lines.append(f"| {r['stage']} | {r['status']} | {r.get('seconds', '-')} | "
                     f"{sum(checks)}/{len(checks)} | {note} |")  # fmt: skip
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the child: one stage


class Rows:
    """A stage's results, rewritten to DIR/stages/NAME.json as each row is added."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        self.save()
        return row

    def save(self, **fields: Any) -> None:
        write_json(self.path, {"rows": self.rows, **fields})


def run_child(name: str, output: Path, dry_run: bool) -> None:
    """Run stage `name` here; its rows and status go to DIR/stages/NAME.json."""
    from benchmarks import gpu_check_features, gpu_check_models, gpu_check_stages

    rows = Rows(output / "stages" / f"{name}.json")
    stages = {**gpu_check_stages.STAGES, **gpu_check_features.STAGES, **gpu_check_models.STAGES}
    try:
        note = stages[name](rows, dry_run) or ""
    except ModuleNotFoundError as missing:
        rows.save(status="error", error=f"missing package {missing.name!r}: {missing}")
        raise
    except Exception as error:
        rows.save(status="error", error=f"{type(error).__name__}: {error}")
        raise
    failed = [row for row in rows.rows if row.get("ok") is False]
    rows.save(status="failed" if failed else "passed", note=note)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path("gpu_check_results"),
                        help="folder for the results (default: ./gpu_check_results)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--stages", default=",".join(STAGE_NAMES),
                        help=f"comma-separated, of {','.join(STAGE_NAMES)}")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=540.0, help="for all stages")
    parser.add_argument("--child", choices=STAGE_NAMES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.stages.split(",")) - set(STAGE_NAMES)
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join(STAGE_NAMES)}")  # fmt: skip
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.child:
        run_child(args.child, args.output, args.dry_run)
        return []
    records = run_all(args.stages.split(","), args.output, args.dry_run, args.budget_s)
    command = " ".join(
        ["python benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]
    )
    page = markdown(records, command)
    (args.output / "gpu_check.md").write_text(page)
    print(page)
    return records


if __name__ == "__main__":
    main()
