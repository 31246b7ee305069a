"""The load generator: sessions arrive as a Poisson (or gamma) process and stream their turns.

Arrival gaps follow vLLM's `bench serve`: gamma(shape=burstiness, scale=1/(rate*burstiness)),
which is Poisson (exponential gaps) at burstiness 1, burstier below 1, steadier above.
An infinite rate sends everything at once. `max_concurrency` caps requests in flight.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm.auto import tqdm

from minserve.bench.serve_client import Endpoint, chat_body, completion_body, send
from minserve.bench.serve_metrics import RequestRecord
from minserve.bench.serve_workloads import Session


@dataclass(frozen=True)
class LoadSpec:
    """How requests arrive."""

    request_rate: float = math.inf  # sessions per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf for all at once), got {self.request_rate}"
            )
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")


def arrival_times(count: int, load: LoadSpec) -> list[float]:
    """Seconds after the start at which each session is sent (the first at 0)."""
    if math.isinf(load.request_rate):
        return [0.0] * count
    rng = np.random.default_rng(load.seed)
    theta = 1.0 / (load.request_rate * load.burstiness)
    gaps = rng.gamma(shape=load.burstiness, scale=theta, size=count)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:count]


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float


async def run_load(
    endpoint: Endpoint, sessions: Sequence[Session], load: LoadSpec, progress: bool = True
) -> LoadResult:
    """Send every session at its arrival time; wait for all; time the whole run."""
    limit = asyncio.Semaphore(load.max_concurrency or 1 << 30)
    records: list[RequestRecord] = []
    total = sum(s.num_turns for s in sessions)
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    with tqdm(total=total, desc="bench serve", disable=not progress) as bar:
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

            async def one(number: int, session: Session, at: float, start: float) -> None:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                user = f"session-{number}"
                for record in await _run_session(client, endpoint, session, limit, bar, user):
                    records.append(record)

            start = time.perf_counter()
            times = arrival_times(len(sessions), load)
            await asyncio.gather(*(one(i, s, t, start)
                                   for i, (s, t) in enumerate(zip(sessions, times))))  # fmt: skip
            duration = time.perf_counter() - start
    return LoadResult(records, duration)


async def _run_session(
    client: httpx.AsyncClient, endpoint: Endpoint, session: Session,
    limit: asyncio.Semaphore, bar: tqdm, user: str,
) -> list[RequestRecord]:  # fmt: skip
    """A session's turns in order, each carrying the session's `user` (OpenAI's field: a
    router may keep a session on one replica)."""
    records, messages = [], []
    for turn in range(session.num_turns):
        if session.is_chat:
            messages.append({"role": "user", "content": session.user_messages[turn]})
            body = chat_body(endpoint, messages, session.output_len)
        else:
            body = completion_body(endpoint, session.prompts[turn], session.output_len)
        async with limit:
            record, reply = await send(client, endpoint, {**body, "user": user})
        record.turn = turn
        records.append(record)
        bar.update(1)
        if not record.success:
            break  # a conversation cannot go on without its reply
        messages.append({"role": "assistant", "content": reply})
    return records
