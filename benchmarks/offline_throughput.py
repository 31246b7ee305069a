"""Offline throughput against peers: minserve, its reference path, HF generate and vLLM CPU.

    python -m benchmarks.offline_throughput --max-load 1.5   # writes offline_throughput.*

nano-vllm's protocol (`minserve bench offline` measures minserve alone): every peer runs
the same saved workload in its own process, one after another, so memory, thread pools and
allocator state do not leak between engines. minserve and Hugging Face run under this
interpreter (`benchmarks/offline_peers.py`); vLLM under its own venv's
(benchmarks/install_vllm_cpu.sh, `benchmarks/vllm_peer.py`). Writes JSON, markdown and a plot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.offline_peers import load_result, save_workload
from benchmarks.offline_report import OfflineReport, label, markdown, write_report
from benchmarks.run_env import (
    REPO_ROOT,
    command_line,
    machine_info,
    record_parser,
    wait_for_quiet,
)
from benchmarks.vllm_peer import INSTALL_VLLM, vllm_env
from minserve import openmp_env
from minserve.bench import offline
from minserve.bench.checkpoint import hf_model_folder, model_path, vocab_size
from minserve.bench.offline import (
    DTYPES,
    TEMPERATURE,
    OfflineRequest,
    OfflineResult,
    offline_workload,
    requested_tokens,
)
from minserve.bench.options import choices

PEERS = ("minserve", "reference", "hf16", "hf64", "vllm")
VLLM_PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")


@dataclass(frozen=True)
class SuiteSettings:
    """What to run: the workload, the peers and dtypes, and where vLLM lives."""

    num_requests: int = 64
    min_len: int = 32
    max_len: int = 256
    seed: int = 0
    peers: tuple[str, ...] = PEERS
    dtypes: tuple[str, ...] = DTYPES
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    vllm_python: Path = Path(".venv-vllm/bin/python")
    hf_folder: Path = Path(".cache/smollm2-hf")  # vLLM's copy of a GGUF model
    max_load: float | None = None  # wait before each peer until the 1-min load is below this
    max_wait_s: float = 600.0
    timeout_s: float = 3600.0
    llm_options: tuple[tuple[str, Any], ...] = ()  # more LLM arguments for minserve's peers


# ---------------------------------------------------------------- one peer, one process


def peer_command(
    peer: str, dtype: str, workload: Path, result: Path, settings: SuiteSettings
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that run one peer in its own process."""
    files = ["--workload", str(workload), "--result", str(result), "--seed", str(settings.seed)]
    if peer != "vllm":
        model = [] if settings.model is None else ["--model", settings.model]
        args = ["-m", "benchmarks.offline_peers", "--peer", peer, "--dtype", dtype, *model]
        if settings.llm_options:
            args += ["--llm-options", json.dumps(dict(settings.llm_options))]
        return [sys.executable, *args, *files], {}
    folder = hf_model_folder(settings.hf_folder, settings.model)
    python = settings.vllm_python
    args = ["-P", str(VLLM_PEER_SCRIPT), "--model", str(folder), "--dtype", dtype]
    env = vllm_env()
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # fastest on these CPUs
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp.resolve())
    return [str(python), *args, *files], env


def run_one(
    peer: str,
    dtype: str,
    workdir: Path,
    workload: Path,
    settings: SuiteSettings,
    extra_env: dict[str, str] | None = None,
) -> OfflineResult:
    """Run one peer in a subprocess and read back its result (or say why there is none)."""
    if peer == "vllm" and not settings.vllm_python.exists():
        note = f"{settings.vllm_python} not found; install with `{INSTALL_VLLM}`"
        return OfflineResult(peer, dtype, "not installed", note=note)
    result_path = workdir / f"{peer}-{dtype}.json"
    log_path = workdir / f"{peer}-{dtype}.log"
    command, peer_env = peer_command(peer, dtype, workload, result_path, settings)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **peer_env}
    if not openmp_env.USER_CHOICE:  # each peer makes its own (minserve's import sets it)
        env.pop(openmp_env.SPIN_COUNT, None)
    env.update(extra_env or {})
    load_start = wait_for_quiet(settings.max_load, settings.max_wait_s)
    with log_path.open("w") as log:
        try:
            code = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                timeout=settings.timeout_s,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = -1
    load = {"load_average_start": load_start, "load_average_end": round(os.getloadavg()[0], 2)}
    if code != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        note = f"exit code {code}: " + " / ".join(tail)[-400:]
        return OfflineResult(peer, dtype, "failed", note=note, details=load)
    result = load_result(result_path)
    return replace(result, details={**result.details, **load})


# ---------------------------------------------------------------- the suite


def run_suite(
    settings: SuiteSettings,
    command: str,
    on_result: Callable[[OfflineReport], None] | None = None,
) -> OfflineReport:
    """Run every (peer, dtype) in turn on one saved workload; the report of all of them.

    `on_result` gets the report so far after each peer, so a long run leaves partial results.
    """
    vocab = vocab_size(settings.model)
    workload = offline_workload(
        settings.num_requests, settings.min_len, settings.max_len, settings.seed, vocab
    )
    machine = {**machine_info(), "load_average_start": round(os.getloadavg()[0], 2)}
    report = OfflineReport(command, _now(), machine, _run_settings(settings, workload), [])
    runs = [(p, d) for p in settings.peers for d in settings.dtypes]
    with tempfile.TemporaryDirectory(prefix="minserve-bench-") as tmp:
        workdir = Path(tmp)
        save_workload(workload, workdir / "workload.json")
        bar = tqdm(runs, desc="offline throughput", unit="run")
        for peer, dtype in bar:
            bar.set_postfix_str(f"{peer} {dtype}")
            result = run_one(peer, dtype, workdir, workdir / "workload.json", settings)
            bar.write(_progress_line(result))
            machine["load_average_end"] = round(os.getloadavg()[0], 2)
            report = replace(report, date=_now(), results=[*report.results, result])
            if on_result is not None:
                on_result(report)
    return report


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _run_settings(settings: SuiteSettings, workload: list[OfflineRequest]) -> dict[str, Any]:
    """The settings as the report shows them, with the workload's total output."""
    details = {k: v for k, v in asdict(settings).items() if k not in ("peers", "dtypes")}
    return {
        **details,
        "vllm_python": str(settings.vllm_python),
        "hf_folder": str(settings.hf_folder),
        "model": str(model_path(settings.model).name),
        "temperature": TEMPERATURE,
        "requested_tokens": requested_tokens(workload),
    }


def _progress_line(r: OfflineResult) -> str:
    if not r.ok:
        return f"{label(r.peer)} [{r.dtype}]: {r.status} ({r.note})"
    return f"{label(r.peer)} [{r.dtype}]: {r.tokens_per_s:.1f} output tok/s in {r.seconds:.1f} s"


# ---------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    # the workload and the model, as `minserve bench offline`; then the peers
    parser = record_parser(__spec__.name, __doc__, offline.add_arguments)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    args = parser.parse_args(argv)
    try:
        peers = choices(args.peers, PEERS, "peer")
        dtypes = choices(args.dtype, DTYPES, "dtype")
    except ValueError as e:
        parser.error(str(e))
    settings = SuiteSettings(
        num_requests=args.num_requests,
        min_len=args.min_len,
        max_len=args.max_len,
        seed=args.seed,
        peers=peers,
        dtypes=dtypes,
        model=args.model,
        vllm_python=args.vllm_python,
        max_load=args.max_load,
        max_wait_s=args.max_wait,
    )
    command = command_line(__spec__.name, argv)
    report = run_suite(settings, command, lambda r: write_report(r, args.output))
    written = write_report(report, args.output)
    print(markdown(report))
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
