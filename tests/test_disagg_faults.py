"""Faults in disaggregated serving: instances killed mid-stream cost no stream.

Specification: a decode instance killed mid-stream (and mid-migration: the stream moving
to it) -> every stream finishes with the text of a run without the kill, greedy and
seeded, with no error event and nothing hung: the migration aborts and its source serves
on, and the killed instance's request resumes on the survivor from its prompt and the
tokens it streamed. With no decode instance left, a stream resumes on a prefill instance.
A dead prefill instance's request (no token yet) is prefilled again on another; with no
prefill instance left, it fails (naming the instance), and new requests are refused at once.
Its own cluster (2 prefill + 2 decode, recompute hand-offs), since the tests kill it piece by
piece; each test kills what it needs among what is still alive.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from disagg_cluster import cluster_fixtures
from test_server import wait_until_idle

from minserve import LLM, SamplingParams
from minserve.disagg.migration import StagePolicy
from minserve.disagg.proxy_engine import DisaggregatedEngine
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

PROMPTS = ["The capital of France is", "One two three four five six seven eight nine ten"]
MAX_TOKENS = 100  # long enough that both streams still decode when the victim dies
OPTIONS = dict(block_size=4, num_blocks=64)
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]  # greedy, seeded
BODY = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
SLOW_PRE_COPY = StagePolicy(min_stages=50, max_stages=50)  # a migration that takes 50 rounds


model_dir, oracle, cluster = cluster_fixtures("2P2D", "recompute", step_timeout_s=20, **OPTIONS)


def expected_text(oracle: LLM, prompt: str, sampling: dict, max_tokens: int = MAX_TOKENS) -> str:
    params = SamplingParams(**sampling, max_tokens=max_tokens, ignore_eos=True)
    return oracle.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


async def read_stream(
    client: httpx.AsyncClient, prompt: str, sampling: dict, started: asyncio.Barrier
) -> tuple[str, dict | None]:
    """(text, error event or None); waits at `started` once two chunks have arrived."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            **sampling}  # fmt: skip
    text, error, chunks = "", None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]
                continue
            text += event["choices"][0]["text"]
            chunks += 1
            if chunks == 2:
                await started.wait()
    return text, error


async def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def kill(cluster: DisaggregatedEngine, rank: int) -> None:
    os.kill(cluster.procs[rank].pid, signal.SIGKILL)


def live_decode(cluster: DisaggregatedEngine) -> list[int]:
    return [r for r in cluster.topology.decode_ranks if r in cluster.alive]


def test_a_decode_instance_killed_mid_migration_costs_no_stream(cluster, oracle):
    """Two streams, one on each decode instance; the first starts moving to the second,
    which is killed after a pre-copy stage reached it."""
    if len(live_decode(cluster)) < 2:
        pytest.skip("needs two live decode instances")
    server = build_server(cluster, ServerConfig("tiny"))
    source, victim = live_decode(cluster)
    resumed = cluster.get_metrics()["num_requests_resumed"]

    async def two_streams_a_migration_and_a_kill():
        started = asyncio.Barrier(3)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            streams = [
                asyncio.create_task(read_stream(client, prompt, sampling, started))
                for prompt, sampling in zip(PROMPTS, SAMPLING)
            ]
            await asyncio.wait_for(started.wait(), 60)  # both decoding, one on each instance
            where = {p["instance"]: p["request_id"] for p in cluster.placements()}
            assert sorted(where) == [source, victim]
            cluster.migrate(where[source], victim, SLOW_PRE_COPY)
            await until(lambda: cluster.migrations.stats.blocks_precopied > 0)
            kill(cluster, victim)
            return where[source], await asyncio.wait_for(asyncio.gather(*streams), 60)

    with BackgroundServer(server) as url:
        start = time.monotonic()
        moving, results = asyncio.run(two_streams_a_migration_and_a_kill())
        assert time.monotonic() - start < 30  # nothing hung
        stats = wait_until_idle(server)
    expected = [expected_text(oracle, p, s) for p, s in zip(PROMPTS, SAMPLING)]
    assert [error for _, error in results] == [None, None]
    assert [text for text, _ in results] == expected  # as if nothing had happened
    outcome = cluster.migrations.outcomes[moving]  # the link broke, or the victim's report
    assert outcome.startswith("aborted: ") and f"rank {victim}" in outcome, outcome
    assert stats["num_requests_resumed"] == resumed + 1  # the killed instance's request
    assert {d["from_rank"] for d in cluster.decisions.values()} == {1, 2}  # both prefilled
    assert stats["num_instances_alive"] == 3 and stats["num_free_blocks"] == stats["num_blocks"]


def test_with_no_decode_instance_left_a_stream_goes_on_on_a_prefill_instance(cluster, oracle):
    server = build_server(cluster, ServerConfig("tiny"))

    async def a_stream_and_the_kills():
        started = asyncio.Barrier(2)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            stream = asyncio.create_task(read_stream(client, PROMPTS[1], SAMPLING[1], started))
            await asyncio.wait_for(started.wait(), 60)
            for rank in live_decode(cluster):
                kill(cluster, rank)
            return await asyncio.wait_for(stream, 60)

    with BackgroundServer(server) as url:
        start = time.monotonic()
        text, error = asyncio.run(a_stream_and_the_kills())
        assert time.monotonic() - start < 30
        after = httpx.post(url + "/v1/completions", json=BODY, timeout=30)  # served all the same
        stats = wait_until_idle(server)
    assert error is None and text == expected_text(oracle, PROMPTS[1], SAMPLING[1])
    assert after.json()["choices"][0]["text"] == expected_text(oracle, PROMPTS[0], SAMPLING[0], 8)
    assert live_decode(cluster) == [] and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_dead_prefill_instance_costs_its_request_only_with_none_left(cluster, oracle):
    server = build_server(cluster, ServerConfig("tiny"))
    first, last = cluster.topology.prefill_ranks

    def post() -> httpx.Response:
        return httpx.post(url + "/v1/completions", json=BODY, timeout=30)

    with BackgroundServer(server) as url:
        kill(cluster, first)
        orphan = post()  # placed on the dead one, prefilled again on the other
        kill(cluster, last)
        orphan_2, refused = post(), post()  # the last one: nowhere left to go
    short = expected_text(oracle, PROMPTS[0], SAMPLING[0], 8)
    assert orphan.status_code == 200 and orphan.json()["choices"][0]["text"] == short
    assert orphan_2.status_code == 500
    assert f"the prefill instance (rank {last}, pid" in orphan_2.json()["error"]["message"]
    assert "exit code -9" in orphan_2.json()["error"]["message"]
    assert refused.status_code == 500
    assert "no prefill instance is alive" in refused.json()["error"]["message"]
