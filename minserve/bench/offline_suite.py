"""`minserve bench offline`: every peer in its own process, one after another, then the report.

A process per peer keeps memory, thread pools and allocator state from leaking between
engines. minserve and Hugging Face run under this interpreter (`python -m
minserve.bench.offline`); vLLM runs under its own venv's (benchmarks/install_vllm_cpu.sh)
and reads the same saved workload, so every engine gets identical requests.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from minserve.bench.offline import (
    TEMPERATURE,
    OfflineRequest,
    PeerResult,
    offline_workload,
    requested_tokens,
    save_workload,
)
from minserve.bench.offline_report import OfflineReport

PEERS = ("minserve", "reference", "hf16", "hf64", "vllm")
DTYPES = ("float32", "bfloat16")
INSTALL_VLLM = "bash benchmarks/install_vllm_cpu.sh"
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


# ---------------------------------------------------------------- the model, for each engine


def model_path(model: str | None) -> Path:
    from minserve.model.default_model import default_model_path

    return default_model_path() if model is None else Path(model)


def vocab_size(model: str | None) -> int:
    """The checkpoint's vocabulary size, read from its config (no weights loaded)."""
    from minserve.model.gguf_loader import config_from_gguf, open_gguf
    from minserve.model.hf_loader import config_from_hf

    path = model_path(model)
    config = config_from_hf(path) if path.is_dir() else config_from_gguf(open_gguf(path))
    return config.vocab_size


def hf_model_folder(folder: Path = Path(".cache/smollm2-hf"), model: str | None = None) -> Path:
    """A Hugging Face folder of `model` for vLLM: the model itself, or a converted GGUF.

    transformers dequantizes the GGUF once and saves model and tokenizer; a `source.txt`
    beside them names the GGUF, so a different --model is converted again.
    """
    path = model_path(model)
    if path.is_dir():
        return path
    marker = folder / "source.txt"
    if marker.exists() and marker.read_text() == str(path.resolve()):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # the weights are dequantized already: save them as plain fp32
    del model.config.quantization_config
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    marker.write_text(str(path.resolve()))
    return folder


# ---------------------------------------------------------------- one peer, one process


def busy_cores(interval_s: float = 2.0) -> float:
    """Cores kept busy over the last `interval_s` seconds, from /proc/stat (0 if unreadable).

    The load average trails by a minute; this sees a job that started a second ago.
    """

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, IndexError, ValueError):
        return 0.0
    busy = 1 - (idle1 - idle0) / max(total1 - total0, 1)
    return busy * (os.cpu_count() or 1)


def wait_for_quiet(max_load: float | None, max_wait_s: float) -> float:
    """Sleep until the 1-minute load average is below `max_load` and the cores are idle now
    (or until `max_wait_s` runs out); the load average at the end."""
    deadline = time.monotonic() + max_wait_s
    while max_load is not None and time.monotonic() < deadline:
        if os.getloadavg()[0] < max_load and busy_cores() < 0.5:
            break
        time.sleep(5)
    return round(os.getloadavg()[0], 2)


def vllm_env() -> dict[str, str]:
    """vLLM's CPU settings: OpenMP on every core we may use, Intel's OpenMP, a 4 GiB KV cache."""
    cores = sorted(os.sched_getaffinity(0))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),  # "auto" reserves a core
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }


def peer_command(
    peer: str, dtype: str, workload: Path, result: Path, settings: SuiteSettings
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that run one peer in its own process."""
    files = ["--workload", str(workload), "--result", str(result), "--seed", str(settings.seed)]
    if peer != "vllm":
        model = [] if settings.model is None else ["--model", settings.model]
        args = ["-m", "minserve.bench.offline", "--peer", peer, "--dtype", dtype, *model]
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
    peer: str, dtype: str, workdir: Path, workload: Path, settings: SuiteSettings
) -> PeerResult:
    """Run one peer in a subprocess and read back its result (or say why there is none)."""
    if peer == "vllm" and not settings.vllm_python.exists():
        note = f"{settings.vllm_python} not found; install with `{INSTALL_VLLM}`"
        return PeerResult(peer, dtype, "not installed", note=note)
    result_path = workdir / f"{peer}-{dtype}.json"
    log_path = workdir / f"{peer}-{dtype}.log"
    command, extra_env = peer_command(peer, dtype, workload, result_path, settings)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra_env}
    load_start = wait_for_quiet(settings.max_load, settings.max_wait_s)
    with log_path.open("w") as log:
        try:
            code = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=settings.timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    load = {"load_average_start": load_start, "load_average_end": round(os.getloadavg()[0], 2)}
    if code != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        note = f"exit code {code}: " + " / ".join(tail)[-400:]
        return PeerResult(peer, dtype, "failed", note=note, details=load)
    result = PeerResult.from_dict(json.loads(result_path.read_text()))
    return replace(result, details={**result.details, **load})


# ---------------------------------------------------------------- the suite


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (platform.processor() is often empty)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


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


def _progress_line(r: PeerResult) -> str:
    if not r.ok:
        return f"{r.label} [{r.dtype}]: {r.status} ({r.note})"
    return f"{r.label} [{r.dtype}]: {r.tokens_per_s:.1f} output tok/s in {r.seconds:.1f} s"
