"""The recovery benchmark's parts: streams read as their clients see them, which blocks a
disk tier holds, and what a resumed stream could have read of them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from minserve.bench.recovery import RELAY_GRACE_S, Kill, Pass, keys_on_disk, stream_row
from minserve.bench.stream_reads import StreamRead, stream_all
from minserve.kvcache.block_key import UNSHARED_ROOT, block_keys
from minserve.kvcache.disk_store import DiskBlockStore
from minserve.router.app import REPLICA_HEADER
from minserve.server.background import BackgroundServer


def test_keys_on_disk_are_the_blocks_a_disk_store_wrote(tmp_path):
    keys = block_keys(UNSHARED_ROOT, list(range(64)), 16)
    store = DiskBlockStore(tmp_path, 1 << 20)
    for key in keys[:3]:
        store.put(key, torch.zeros(2, 4))
    store.close()
    assert keys_on_disk(tmp_path) == frozenset(keys[:3])


def test_a_resumed_stream_can_read_its_blocks_on_disk_up_to_the_one_of_its_last_token():
    prompt, generated = list(range(100, 140)), list(range(500, 540))  # 40 + 40 tokens
    keys = block_keys(UNSHARED_ROOT, prompt + generated, 16)
    got = StreamRead("http://a", times=[float(t) for t in range(40)], counts=[1] * 40,
                     text="x", token_ids=generated, done=True)  # fmt: skip
    kill = Kill("http://a", "http://b", 7.5 - RELAY_GRACE_S, {}, frozenset(keys[:3]))
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
    row = stream_row(0, body, got, got, Pass([got], kill, root=UNSHARED_ROOT), kill_at=8)
    # 8 tokens had come by the kill: 48 tokens, 3 whole blocks on disk, but the third ends
    # with the last token, which the survivor computes to sample the next one
    assert row["resumed"] and row["identical"] and row["tokens_at_resume"] == 48
    assert (row["blocks_on_disk"], row["usable_blocks"], row["not_written"]) == (3, 2, 16)
    assert row["resume_gap_s"] == row["stall_s"] == 1.0


class Streaming:
    """A stand-in server: every request streams `max_tokens` chunks of one token each."""

    def __init__(self) -> None:
        self.app = FastAPI()

        @self.app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            body = await request.json()

            async def events() -> AsyncIterator[bytes]:
                for i in range(body["max_tokens"]):
                    choice = {"index": 0, "text": f" t{i}", "token_ids": [i]}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
                    await asyncio.sleep(0.005)
                yield b"data: [DONE]\n\n"

            headers = {REPLICA_HEADER: "stand-in"}
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    def start(self) -> Streaming:
        return self

    def shutdown(self) -> None:
        pass


def test_stream_all_reads_every_stream_to_its_end_and_acts_once_each_has_kill_at_tokens():
    seen: list[list[int]] = []

    def kill(reads: list[StreamRead]) -> str:
        seen.append([len(r.token_ids) for r in reads])
        return "k"

    server = BackgroundServer(Streaming(), log_level="critical")
    try:
        bodies = [{"prompt": [1], "max_tokens": 20}, {"prompt": [2], "max_tokens": 30}]
        reads, killed = stream_all(server.start(), bodies, 30.0, 8, kill)
    finally:
        server.stop()
    assert killed == "k" and len(seen) == 1 and min(seen[0]) >= 8
    assert [r.token_ids for r in reads] == [list(range(20)), list(range(30))]
    assert reads[1].text == "".join(f" t{i}" for i in range(30)) and reads[1].done
    assert reads[0].replica == "stand-in" and 0 < reads[0].longest_gap_s < 5
