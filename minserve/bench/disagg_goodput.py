"""Colocated versus disaggregated serving on this machine, through real servers and HTTP.

- colocated: two `minserve serve` replicas (one torch thread each) behind
  `minserve router --policy round_robin`;
- disaggregated: `minserve serve --disaggregation 1P1D` (a prefill process and a decode
  process, one torch thread each).

Both get the same mixed workload (same seed, same Poisson arrivals, same lengths) from
`bench serve`'s load generator at each rate; goodput counts requests meeting both SLOs.
Every server is its own process group of this program's children, stopped at the end.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import IO

import httpx

from minserve.bench.disagg_workload import CPU_MIX, MixSpec, mixed_workload, to_sessions
from minserve.bench.serve import first_model
from minserve.bench.serve_client import Endpoint, completion_body, send
from minserve.bench.serve_load import LoadSpec, run_load
from minserve.bench.serve_metrics import summarize
from minserve.distributed.group import free_port

SETUPS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class GoodputSpec:
    """Which setups, at which total rates (req/s), how many requests each, the server flags."""

    setups: tuple[str, ...] = SETUPS
    rates: tuple[float, ...] = (0.8, 1.2)
    num_requests: int = 24
    mix: MixSpec = CPU_MIX
    model: str | None = None
    max_num_batched_tokens: int = 2048
    seed: int = 0
    startup_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        unknown = set(self.setups) - set(SETUPS)
        if unknown or not self.setups:
            raise ValueError(f"unknown setup {sorted(unknown)}; choose from {', '.join(SETUPS)}")
        if not self.rates or min(self.rates) <= 0 or self.num_requests < 1:
            raise ValueError(f"need rates > 0 and num_requests >= 1, got {self}")


def server_commands(setup: str, spec: GoodputSpec) -> tuple[list[list[str]], str]:
    """The command lines of one setup's processes, and the URL the load goes to."""
    serve = [
        sys.executable,
        "-m",
        "minserve.cli",
        "serve",
        "--max-num-batched-tokens",
        str(spec.max_num_batched_tokens),
    ]
    if spec.model is not None:
        serve += ["--model", spec.model]
    if setup == "disaggregated":
        port = free_port()
        return [[*serve, "--disaggregation", "1P1D", "--port", str(port)]], _url(port)
    ports = [free_port() for _ in range(3)]
    replicas = [[*serve, "--port", str(p)] for p in ports[:2]]
    router = [
        sys.executable,
        "-m",
        "minserve.cli",
        "router",
        "--policy",
        "round_robin",
        "--port",
        str(ports[2]),
    ]
    for p in ports[:2]:
        router += ["--replica", _url(p)]
    return [*replicas, router], _url(ports[2])


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@dataclass
class Launched:
    """A server process and the file its log goes to (not a pipe: uvicorn's access log would
    fill a pipe nobody reads, and block the server)."""

    proc: subprocess.Popen
    log: IO[bytes]

    def log_tail(self, chars: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]


@contextmanager
def running(command: list[str]) -> Iterator[Launched]:
    """One server process with one torch thread, in its own process group; stopped on exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=log
        )
        try:
            yield Launched(proc, log)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group (a disaggregated server's decode worker too), then KILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_ready(url: str, servers: list[Launched], timeout_s: float) -> None:
    """Poll GET /v1/models until it answers; fail with the server's log if one exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for server in servers:
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"{shlex.join(server.proc.args)} exited with {server.proc.returncode}:\n"
                    f"{server.log_tail()}"
                )
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no answer from {url} within {timeout_s:.0f} s")


async def _warm_up(endpoint: Endpoint, count: int) -> None:
    """A few short requests, one after another, so no measured request pays a first call."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for i in range(count):
            record, _ = await send(client, endpoint, completion_body(endpoint, [100 + i] * 8, 4))
            if not record.success:
                raise RuntimeError(f"warm-up request failed: {record.error}")


def measure_setup(setup: str, spec: GoodputSpec, vocab_size: int, progress=None) -> list[dict]:
    """Start `setup`'s servers, run the workload at every rate, stop them; a summary per rate."""
    commands, url = server_commands(setup, spec)
    slos = {"ttft": spec.mix.slo.ttft_s, "tpot": spec.mix.slo.tpot_s}
    rows = []
    with ExitStack() as stack:
        servers = [stack.enter_context(running(c)) for c in commands]
        wait_ready(url, servers, spec.startup_timeout_s)
        endpoint = Endpoint(url, first_model(Endpoint(url, "")))
        asyncio.run(_warm_up(endpoint, 2))
        for rate in spec.rates:
            work = mixed_workload(rate, spec.num_requests, spec.mix, spec.seed)
            sessions = to_sessions(work, vocab_size, spec.seed)
            load = LoadSpec(rate, seed=spec.seed)
            result = asyncio.run(run_load(endpoint, sessions, load, progress=False))
            summary = summarize(result.records, result.duration_s, slos)
            rows.append({"setup": setup, "rate": rate, "summary": summary})
            if progress is not None:
                progress.update(1)
    return rows
