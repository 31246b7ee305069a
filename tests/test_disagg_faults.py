"""Faults in disaggregated serving: a decode instance killed mid-request, then prefill ones.

Specification: the clients whose requests it held get an error (an SSE error event naming
the instance), nothing hangs, the other request streams on to the tokens colocated serving
gives, the survivors' KV pools end up free, and the server keeps serving new requests.
A dead prefill instance fails the request it held; new ones go to the other, and with no
prefill instance left, requests get an error saying so, at once.
Its own cluster (2 prefill + 2 decode, recompute hand-offs), since the test kills part of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from test_server import wait_until_idle

from minserve import LLM, SamplingParams
from minserve.disagg.proxy_engine import DisaggregatedEngine
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

PROMPTS = ["The capital of France is", "One two three four five six seven eight nine ten"]
MAX_TOKENS = 100  # long enough that both streams still decode when the victim dies
OPTIONS = dict(block_size=4, num_blocks=64)
BODY = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def cluster(model_dir) -> Iterator[DisaggregatedEngine]:
    with DisaggregatedEngine(model_dir, "2P2D", "recompute", step_timeout_s=20, **OPTIONS) as c:
        yield c


async def read_stream(client: httpx.AsyncClient, prompt: str, started: asyncio.Barrier):
    """(text, error event or None); waits at `started` once two chunks have arrived."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
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


def test_dead_instances_fail_only_their_requests(cluster, model_dir):
    server = build_server(cluster, ServerConfig("tiny"))
    victim = cluster.topology.decode_ranks[-1]

    async def two_streams_and_a_kill():
        started = asyncio.Barrier(3)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            streams = [asyncio.create_task(read_stream(client, p, started)) for p in PROMPTS]
            await asyncio.wait_for(started.wait(), 60)  # both decoding, one on each instance
            os.kill(cluster.procs[victim].pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*streams), 60)

    def post() -> httpx.Response:
        return httpx.post(url + "/v1/completions", json=BODY, timeout=30)

    with BackgroundServer(server) as url:
        start = time.monotonic()
        results = asyncio.run(two_streams_and_a_kill())
        assert time.monotonic() - start < 30  # nothing hung
        stats = wait_until_idle(server)
        os.kill(cluster.procs[1].pid, signal.SIGKILL)  # then a prefill instance dies
        orphan, rerouted = post(), post()  # the first was placed on it; the next is not
        os.kill(cluster.procs[2].pid, signal.SIGKILL)  # and the last prefill instance
        orphan_2, refused = post(), post()
    oracle = LLM(model_dir, **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in oracle.generate(PROMPTS, params)]
    errors = [error for _, error in results if error is not None]
    assert len(errors) == 1, results  # exactly the request on the killed instance
    assert f"decode instance (rank {victim}, pid" in errors[0]["message"]
    assert "exit code -9" in errors[0]["message"] and errors[0]["type"] == "server_error"
    assert {d["from_rank"] for d in cluster.decisions.values()} == {1, 2}  # both prefilled
    survivor = next(i for i, (_, error) in enumerate(results) if error is None)
    assert results[survivor][0] == expected[survivor]  # streamed on, unaffected
    assert stats["num_instances_alive"] == 3 and stats["num_free_blocks"] == stats["num_blocks"]
    for response, rank in ((orphan, 1), (orphan_2, 2)):
        assert response.status_code == 500
        assert f"the prefill instance (rank {rank}, pid" in response.json()["error"]["message"]
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert (
        rerouted.json()["choices"][0]["text"]
        == oracle.generate(PROMPTS[0], short)[0].outputs[0].text
    )
    assert refused.status_code == 500
    assert "no prefill instance is alive" in refused.json()["error"]["message"]
