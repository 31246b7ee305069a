"""Streams that survive a dying replica: the router keeps each stream's journal and, when its
replica fails mid-stream, continues the stream on another replica, spliced into one.

Oracles: the same request answered by a replica that does not fail (the client's chunks
must equal its chunks, apart from the stream's id and creation time), and the replicas' own
records of the bodies they received (the token ids the router said were generated). Stand-in
replicas speak the continuation contract and fail on cue; at the end, two `minserve serve`
processes, one killed mid-stream, against a run in which nobody died.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from safetensors.torch import load_file, save_file

from minserve.router import RouterConfig, build_router
from minserve.router.app import REPLICA_HEADER
from minserve.router.journal import Journal
from minserve.router.policy import Decision
from minserve.router.sse import EventCutter, event_data
from minserve.router.stall_histogram import StallHistogram
from minserve.server.background import BackgroundServer
from minserve.server.responses import sse as server_sse

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]


# ---------------------------------------------------------------- the journal, offline


def completion_chunk(text: str, ids: list[int], finish: str | None = None, **extra) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
              "token_ids": ids, **extra}  # fmt: skip
    return {"id": "cmpl-a", "object": "text_completion", "created": 100, "model": "m",
            "choices": [choice]}  # fmt: skip


def test_the_journal_records_what_it_relays_and_resends_it_as_resume_token_ids():
    body = {"prompt": PROMPT, "stream": True, "echo": True, "max_tokens": 9}
    journal = Journal.of(json.dumps(body).encode(), chat=False)
    assert json.loads(journal.upstream_body()) == {**body, "return_token_ids": True}
    first = journal.take(completion_chunk(PROMPT + " a", [5], prompt_token_ids=[1, 2, 3]))
    second = journal.take(completion_chunk(" b", [6, 7]))
    assert "token_ids" not in first["choices"][0] and "prompt_token_ids" not in first["choices"][0]
    assert second == {**completion_chunk(" b", [])} | {
        "choices": [{"index": 0, "text": " b", "logprobs": None, "finish_reason": None}]
    }
    assert journal.token_ids == [5, 6, 7] and journal.prompt_token_ids == [1, 2, 3]
    assert journal.text == PROMPT + " a b" and journal.started and not journal.finished
    resumed = json.loads(journal.resume_body())
    body.pop("echo")  # the prompt was already echoed
    assert resumed == {**body, "return_token_ids": True, "resume_token_ids": [5, 6, 7]}


def test_a_continued_stream_takes_the_first_streams_identity_and_counts_usage_once():
    body = {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}}
    journal = Journal.of(json.dumps(body).encode(), chat=False)
    journal.take(completion_chunk(" a", [5], prompt_token_ids=[1, 2, 3]))
    journal.resumed()
    later = {**completion_chunk(" b", [6], "length", prompt_token_ids=[1, 2, 3]),
             "id": "cmpl-b", "created": 200}  # fmt: skip
    out = journal.take(later)
    assert (out["id"], out["created"]) == ("cmpl-a", 100)
    assert "prompt_token_ids" not in out["choices"][0] and journal.finished
    usage = {"id": "cmpl-b", "object": "text_completion", "created": 200, "model": "m",
             "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                      "total_tokens": 4}}  # fmt: skip
    combined = journal.take(usage)
    assert combined["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert combined["id"] == "cmpl-a" and journal.ending() is None  # usage already sent


def test_a_continued_chat_stream_drops_its_second_role_whichever_way_it_comes():
    body = {"messages": MESSAGES, "stream": True}
    journal = Journal.of(json.dumps(body).encode(), chat=True)

    def chunk(delta: dict, ids: list[int]) -> dict:
        return {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": None, "token_ids": ids}]}  # fmt: skip

    first = journal.take(chunk({"role": "assistant", "content": "Hi"}, [4]))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    journal.resumed()
    assert journal.take(chunk({"role": "assistant", "content": ""}, [])) is None  # role alone
    piece = journal.take(chunk({"role": "assistant", "content": " there"}, [5]))  # role + text
    assert piece["choices"][0]["delta"] == {"content": " there"}
    held_back = journal.take(chunk({"content": ""}, [6]))  # a token whose text comes later
    assert held_back["choices"][0]["delta"] == {"content": ""}
    assert journal.token_ids == [4, 5, 6] and journal.text == "Hi there"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPT},  # not streamed
        {"prompt": PROMPT, "stream": True, "n": 2},  # two choices in one stream
        {"prompt": [PROMPT, PROMPT], "stream": True},  # a batch: a choice per prompt
        {"prompt": PROMPT, "stream": True, "resume_token_ids": ["x"]},  # refused by the replica
    ],
)
def test_only_a_stream_of_one_choice_is_journaled(body):
    assert Journal.of(json.dumps(body).encode(), chat=False) is None
    assert Journal.of(b"{oops", chat=False) is None


def test_events_are_whole_however_the_bytes_are_cut():
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\n: a comment\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        cutter = EventCutter()
        events = cutter.feed(stream[:cut]) + cutter.feed(stream[cut:])
        assert [event_data(e) for e in events] == ['{"a": 1}', '{"b": 2}', None, "[DONE]"]
        assert cutter.pending == b""
    cutter = EventCutter()
    assert cutter.feed(b'data: {"a": 1}\n\ndata: {"b"') == [b'data: {"a": 1}\n\n']
    assert cutter.pending == b'data: {"b"'  # a replica that died mid-event: never relayed


def test_the_stall_histogram_counts_each_wait_in_its_bucket():
    stalls = StallHistogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0):
        stalls.observe(seconds)
    assert stalls.counts == [2, 1, 1] and stalls.count == 4 and stalls.longest == 3.0
    samples = {s.labels.get("le", s.name): s.value for s in stalls.family("x", "d").samples}
    assert samples == {"0.1": 2, "1": 3, "+Inf": 4, "x_count": 4, "x_sum": pytest.approx(3.65)}
    with pytest.raises(ValueError, match="histogram buckets must increase"):
        StallHistogram((1.0, 0.5))


# ---------------------------------------------------------------- stand-in replicas


def prompt_ids(body: dict) -> list[int]:
    """A stand-in tokenizer: one id per character of the prompt (or of the messages)."""
    if "messages" in body:
        return [ord(c) for m in body["messages"] for c in m["content"]]
    prompt = body["prompt"]
    return [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)


def generated(body: dict) -> list[int]:
    """The tokens every stand-in generates for a request: a function of prompt, seed and
    position, as a model's greedy or seeded draws are."""
    base = sum(prompt_ids(body)) * 31 + (body.get("seed") or 0)
    return [(base + 7 * position) % 997 + 3 for position in range(body.get("max_tokens", 12))]


@dataclass
class ContractReplica:
    """A replica that speaks the continuation contract (`return_token_ids`,
    `resume_token_ids`) and can fail: after `die_after` chunks of each stream it drops the
    connection ("drop") or sends an error event of its own ("error")."""

    created: int
    die_after: int | None = None
    how: str = "drop"
    role_chunk: bool = False  # a continued chat stream opens with a role-only chunk
    received: list[dict] = field(default_factory=list)

    @property
    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.answer(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.answer(await request.json(), chat=True)

        return app

    async def answer(self, body: dict, chat: bool) -> Response:
        self.received.append(body)
        resume, tokens = body.get("resume_token_ids", []), generated(body)
        if resume != tokens[: len(resume)]:
            message = f"resume_token_ids {resume} were not generated by this request"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        new = tokens[len(resume) :]
        if not body.get("stream"):
            text = "".join(f" t{t}" for t in new)
            return JSONResponse({"id": "cmpl-whole", "choices": [{"index": 0, "text": text}]})
        events = self.events(body, new, chat, resumed=bool(resume))
        return StreamingResponse(events, media_type="text/event-stream")

    async def events(
        self, body: dict, new: list[int], chat: bool, resumed: bool
    ) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": f"x-{self.created}", "object": kind, "created": self.created, "model": "m"}
        ids = body.get("return_token_ids") is True
        if chat and resumed and self.role_chunk:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}  # fmt: skip
            yield sse({**head, "choices": [choice]})
        for i, token in enumerate(new):
            if i == self.die_after:
                if self.how == "drop":
                    raise ConnectionAbortedError("a stand-in replica dies")
                error = {"message": "generation failed: injected", "type": "server_error"}
                yield sse({"error": {**error, "param": None, "code": None}})
                yield b"data: [DONE]\n\n"
                return
            finish = "length" if i == len(new) - 1 else None
            choice = {"index": 0, "text": f" t{token}", "logprobs": None, "finish_reason": finish}
            if chat:
                opening = i == 0 and (not resumed or not self.role_chunk)
                delta = {"role": "assistant"} if opening else {}
                choice = {"index": 0, "delta": {**delta, "content": f" t{token}"},
                          "logprobs": None, "finish_reason": finish}  # fmt: skip
            chunk = {**head, "choices": [choice]}
            if ids:
                choice["token_ids"] = [token]
                if i == 0:  # chat: at the top, as vLLM puts them; completions: in the choice
                    (chunk if chat else choice)["prompt_token_ids"] = prompt_ids(body)
            yield sse(chunk)
            await asyncio.sleep(0.002)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt_ids(body)), "completion_tokens": len(new),
                     "total_tokens": len(prompt_ids(body)) + len(new)}  # fmt: skip
            yield sse({**head, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    def start(self) -> ContractReplica:
        return self

    def shutdown(self) -> None:
        pass


def sse(payload: dict) -> bytes:
    return server_sse(payload).encode()  # as `minserve serve` writes an event


class InOrder:
    """A policy that sends each request to the first replica it may, in the order given."""

    name = "in_order"

    def choose(self, key, loads, candidates) -> Decision:
        return Decision(min(candidates), "in_order")

    def record(self, key, replica: int) -> None:
        pass


@contextmanager
def routed(*replicas: ContractReplica | str, **options) -> Iterator[str]:
    """Stand-ins (or URLs) behind a router that tries them in order; yields its URL."""
    stand_ins = [r for r in replicas if not isinstance(r, str)]
    servers = [BackgroundServer(r, log_level="critical") for r in stand_ins]
    urls = iter(server.start() for server in servers)
    config = RouterConfig(tuple(r if isinstance(r, str) else next(urls) for r in replicas),
                          **options)  # fmt: skip
    router = BackgroundServer(build_router(config, policy=InOrder()))
    try:
        yield router.start()
    finally:
        router.stop()
        for server in servers:
            server.stop()


def read_stream(url: str, path: str, body: dict) -> list[dict | str]:
    """Every event of a streamed answer: chunks as JSON, "[DONE]" as it is."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200, response.read()
        cutter, events = EventCutter(), []
        for data in response.iter_bytes():
            events += [event_data(e) for e in cutter.feed(data)]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def without_identity(events: list[dict | str]) -> list[dict | str]:
    return [e if isinstance(e, str) else {**e, "id": None, "created": None} for e in events]


def direct(body: dict, path: str = "/v1/completions") -> list[dict | str]:
    """The oracle: the stream of a replica that does not fail."""
    with routed(ContractReplica(created=999), max_resumes=0) as url:
        return read_stream(url, path, body)


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics").text


@pytest.mark.parametrize("how", ["drop", "error"])
def test_a_stream_whose_replica_fails_goes_on_from_another_as_one_stream(how):
    body = {"prompt": PROMPT, "max_tokens": 12, "stream_options": {"include_usage": True}}
    dying, healthy = ContractReplica(created=1, die_after=5, how=how), ContractReplica(created=2)
    with routed(dying, healthy) as url:
        got = read_stream(url, "/v1/completions", body)
    assert without_identity(got) == without_identity(direct(body))
    assert {e["id"] for e in got[:-1]} == {"x-1"} and {e["created"] for e in got[:-1]} == {1}
    assert got[-2]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 12,
                                "total_tokens": len(PROMPT) + 12}  # fmt: skip
    assert dying.received[0]["return_token_ids"] is True
    assert healthy.received == [{**body, "stream": True, "return_token_ids": True,
                                 "resume_token_ids": generated(body)[:5]}]  # fmt: skip


@pytest.mark.parametrize("role_chunk", [False, True])
def test_a_chat_stream_goes_on_with_one_role_and_the_token_ids_the_client_asked_for(role_chunk):
    body = {"messages": MESSAGES, "max_tokens": 10, "return_token_ids": True}
    dying = ContractReplica(created=1, die_after=3)
    healthy = ContractReplica(created=2, role_chunk=role_chunk)
    with routed(dying, healthy) as url:
        got = read_stream(url, "/v1/chat/completions", body)
    want = direct(body, "/v1/chat/completions")
    assert without_identity(got) == without_identity(want)
    roles = [c["delta"].get("role") for e in got[:-1] for c in e["choices"]]
    assert roles == ["assistant"] + [None] * 9
    assert [t for e in got[:-1] for t in e["choices"][0]["token_ids"]] == generated(body)
    assert [e.get("prompt_token_ids") for e in got[:-1]] == [prompt_ids(body)] + [None] * 9


def test_the_metrics_count_resumes_and_carried_tokens_per_replica():
    dying, healthy = ContractReplica(created=1, die_after=4), ContractReplica(created=2)
    servers = [BackgroundServer(r, log_level="critical") for r in (dying, healthy)]
    a, b = (server.start() for server in servers)
    router = BackgroundServer(build_router(RouterConfig((a, b), policy="round_robin")))
    try:
        url = router.start()
        read_stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
        text = metrics(url)
    finally:
        router.stop()
        for server in servers:
            server.stop()
    assert f'minserve_router:stream_resumes_total{{replica="{b}"}} 1.0' in text
    assert f'minserve_router:stream_resumes_total{{replica="{a}"}} 0.0' in text
    assert f'minserve_router:resumed_tokens_total{{replica="{b}"}} 4.0' in text
    assert f'minserve_router:replica_errors_total{{replica="{a}"}} 1.0' in text
    assert f'minserve_router:replica_up{{replica="{a}"}} 0.0' in text
    assert "minserve_router:resume_stall_seconds_count 1.0" in text
    assert f'minserve_router:requests_in_flight{{replica="{b}"}} 0.0' in text


def test_past_max_resumes_or_without_a_replica_left_the_stream_ends_with_an_error_event():
    body = {"prompt": PROMPT, "max_tokens": 12}
    for max_resumes, replicas, code in [(1, 3, "bad_gateway"), (2, 2, "no_replica_available")]:
        stand_ins = [ContractReplica(created=i, die_after=3) for i in range(replicas)]
        with routed(*stand_ins, max_resumes=max_resumes) as url:
            got = read_stream(url, "/v1/completions", body)
            text = metrics(url)
        # the first replica's 3 chunks, then the second's 3 after them, then the error
        assert "".join(e["choices"][0]["text"] for e in got[:6]) == "".join(
            f" t{t}" for t in generated(body)[:6]
        )
        assert got[6]["error"]["code"] == code and got[6]["error"]["type"] in (
            "server_error", "overloaded_error"
        )  # fmt: skip
        assert len(got) == 7  # no [DONE]: the stream broke
        assert [len(r.received) for r in stand_ins] == [1, 1] + [0] * (replicas - 2)
        broken = [line.split()[-1] for line in text.splitlines() if "streams_broken_total{" in line]
        assert broken == ["0.0", "1.0"] + ["0.0"] * (replicas - 2)  # where it broke for good


def test_a_replica_that_refuses_the_continuation_passes_it_to_the_next():
    class Refusing(ContractReplica):
        async def answer(self, body: dict, chat: bool) -> Response:
            if "resume_token_ids" not in body:
                return await super().answer(body, chat)
            self.received.append(body)
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)

    body = {"prompt": PROMPT, "max_tokens": 12}
    dying, refusing = ContractReplica(created=1, die_after=3), Refusing(created=2)
    healthy = ContractReplica(created=3)
    with routed(dying, refusing, healthy) as url:
        got = read_stream(url, "/v1/completions", body)
        text = metrics(url)
    assert without_identity(got) == without_identity(direct(body))
    assert refusing.received[0]["resume_token_ids"] == healthy.received[0]["resume_token_ids"]
    resumes = [line.split()[-1] for line in text.splitlines() if "stream_resumes_total{" in line]
    assert resumes == ["0.0", "0.0", "1.0"]  # the refusal is not a resume, nor a failure
    assert [line.split()[-1] for line in text.splitlines() if "replica_up{" in line] == [
        "0.0", "1.0", "1.0"
    ]  # fmt: skip


def test_with_max_resumes_0_streams_are_relayed_unchanged_and_not_continued():
    body = {"prompt": PROMPT, "max_tokens": 12}
    dying, healthy = ContractReplica(created=1, die_after=3), ContractReplica(created=2)
    with routed(dying, healthy, max_resumes=0) as url:
        got = read_stream(url, "/v1/completions", body)
    assert dying.received == [{**body, "stream": True}] and healthy.received == []
    assert len(got) == 4 and got[3]["error"]["code"] == "bad_gateway"
    assert "failed mid-stream" in got[3]["error"]["message"]


def test_a_replica_that_breaks_after_the_last_token_owes_only_usage_and_done():
    body = {"prompt": PROMPT, "max_tokens": 6, "stream_options": {"include_usage": True}}
    dying, healthy = ContractReplica(created=1, die_after=6), ContractReplica(created=2)

    async def no_usage(*args, **kwargs) -> AsyncIterator[bytes]:  # the finish, then a drop
        async for event in ContractReplica.events(dying, *args, **kwargs):
            if b'"usage"' in event:
                raise ConnectionAbortedError("a stand-in replica dies after its last token")
            yield event

    dying.events = no_usage
    dying.die_after = None
    with routed(dying, healthy) as url:
        got = read_stream(url, "/v1/completions", body)
    assert without_identity(got) == without_identity(direct(body))
    assert got[-2]["id"] == "x-1" and healthy.received == []  # nothing left to generate


@contextmanager
def hanging_up() -> Iterator[str]:
    """A replica that accepts each request, reads it, and closes without an answer."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.recv(65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_a_request_whose_replica_dies_before_answering_is_sent_to_another():
    healthy = ContractReplica(created=2)
    with hanging_up() as dead:
        for body in ({"prompt": PROMPT}, {"prompt": PROMPT, "stream": True}):
            with routed(dead, healthy) as url:
                response = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert response.status_code == 200
            assert response.headers[REPLICA_HEADER] != dead
        with routed(dead, healthy, max_resumes=0) as url:  # never sent twice: 502
            response = httpx.post(url + "/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert response.status_code == 502 and response.json()["error"]["code"] == "bad_gateway"
    assert len(healthy.received) == 2


def test_a_json_answer_broken_mid_body_is_sent_again_from_scratch():
    class BrokenJSON(ContractReplica):
        async def answer(self, body: dict, chat: bool) -> Response:
            self.received.append(body)

            async def half() -> AsyncIterator[bytes]:
                yield b'{"id": "cmpl-half", "choi'
                raise ConnectionAbortedError("a stand-in replica dies mid-answer")

            return StreamingResponse(half(), media_type="application/json")

    broken, healthy = BrokenJSON(created=1), ContractReplica(created=2)
    with routed(broken, healthy) as url:
        response = httpx.post(url + "/v1/completions", json={"prompt": PROMPT}, timeout=30)
    want = "".join(f" t{t}" for t in generated({"prompt": PROMPT}))
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == want
    assert len(broken.received) == len(healthy.received) == 1


# ---------------------------------------------------------------- two `minserve serve` processes

SHARED = "Caches are everywhere in computing. " * 40  # about 280 tokens, shared by the prompts
STREAMS = [
    {"temperature": 0},
    {"temperature": 0},
    {"temperature": 0.8, "seed": 11},
    {"temperature": 0.8, "seed": 12},
]
KILL_AT = 15  # tokens every stream has relayed when its replica is killed


@pytest.fixture(scope="module")
def peaked_model(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with its final norm's gain times 8: logits spread as a trained model's.
    An untrained model's next token is near uniform over 49152, so a seeded draw there is
    decided by the last bits of the logits, which prefill and decode round differently."""
    folder = tmp_path_factory.mktemp("peaked")
    shutil.copytree(tiny_model("llama"), folder, dirs_exist_ok=True)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] *= 8
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@contextmanager
def serve_processes(model: Path, count: int, tmp: Path, timeout_s: float = 180.0):
    """`count` `minserve serve` processes on ports the OS picks; yields (process, URL) pairs,
    found in each one's log; every process is killed on exit."""
    script = "import sys; from minserve.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["serve", "--model", str(model), "--port", "0", "--num-blocks", "512",
            "--enable-prefix-caching", "--target-ttft-ms", "0",
            "--target-tpot-ms", "0"]  # fmt: skip
    logs = [tmp / f"replica{i}.log" for i in range(count)]
    processes = []
    try:
        for log in logs:
            with log.open("w") as sink:  # a file, not a pipe: a full pipe would block a replica
                command = [sys.executable, "-c", script, *argv]
                processes.append(subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT))
        yield [(p, _served_url(p, log, timeout_s)) for p, log in zip(processes, logs)]
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=30)


def _served_url(process: subprocess.Popen, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not (found := re.search(r"Uvicorn running on (http://[\d.]+:\d+)", log.read_text())):
        assert process.poll() is None, f"minserve serve exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"minserve serve did not start in {timeout_s} s"
        time.sleep(0.05)
    return found.group(1)


@dataclass
class Reader:
    """One stream read in a thread: its events, when each came, and the tokens so far."""

    response: httpx.Response
    events: list[dict | str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    tokens: int = 0

    def read(self, progressed: threading.Condition) -> None:
        cutter = EventCutter()
        try:
            for data in self.response.iter_bytes():
                for event in map(event_data, cutter.feed(data)):
                    self.events.append(event if event == "[DONE]" else json.loads(event))
                    self.times.append(time.monotonic())
                    self.tokens += event != "[DONE]" and bool(self.events[-1].get("choices"))
                    with progressed:
                        progressed.notify_all()
        finally:
            self.response.close()

    @property
    def text(self) -> str:
        return "".join(c["text"] for e in self.events[:-1] for c in e.get("choices", []))

    @property
    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


def run_streams(http: httpx.Client, kill: Callable[[str], None] | None = None) -> list[Reader]:
    """The four streams through the router, opened one after another (so the policy sends
    them where the first went), read together; `kill(replica)` once each has KILL_AT tokens."""
    readers = []
    for i, sampling in enumerate(STREAMS):
        body = {"prompt": SHARED + f"Question {i}: why do caches matter?", "max_tokens": 60,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                **sampling}  # fmt: skip
        request = http.build_request("POST", "/v1/completions", json=body)
        readers.append(Reader(http.send(request, stream=True)))
    progressed = threading.Condition()
    threads = [threading.Thread(target=r.read, args=(progressed,), daemon=True) for r in readers]
    for thread in threads:
        thread.start()
    if kill is not None:
        with progressed:
            assert progressed.wait_for(lambda: min(r.tokens for r in readers) >= KILL_AT, 60)
        kill(readers[0].response.headers[REPLICA_HEADER])
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a stream did not end"
    return readers


def test_streams_survive_a_killed_minserve_serve_with_the_text_of_an_uninterrupted_run(
    peaked_model, tmp_path
):
    with serve_processes(peaked_model, 2, tmp_path) as replicas:
        urls = {url: process for process, url in replicas}
        router = BackgroundServer(build_router(RouterConfig(tuple(urls), policy="cache_aware")))
        http = httpx.Client(base_url=router.start(), timeout=120)
        try:
            oracle = run_streams(http)  # nobody dies: the uninterrupted run
            killed: list[str] = []

            def kill(replica: str) -> None:
                killed.append(replica)
                urls[replica].send_signal(signal.SIGKILL)

            survived = run_streams(http, kill)
            text = metrics(router.url)
        finally:
            http.close()
            router.stop()
    served = {r.response.headers[REPLICA_HEADER] for r in oracle + survived}
    assert served == set(killed)  # the prefix kept all eight on the replica that was killed
    (other,) = set(urls) - served
    for want, got in zip(oracle, survived, strict=True):
        assert got.text == want.text and len(want.text) > 0
        assert not any("error" in e for e in got.events if isinstance(e, dict))
        assert got.events[-1] == "[DONE]" and got.events[-2]["usage"] == want.events[-2]["usage"]
        assert len({e["id"] for e in got.events[:-1]}) == 1  # one stream, as the client sees it
        assert without_identity(got.events) == without_identity(want.events)  # chunk by chunk
    assert f'minserve_router:stream_resumes_total{{replica="{other}"}} 4.0' in text
    carried = float(text.split(f'resumed_tokens_total{{replica="{other}"}} ')[1].split()[0])
    assert 4 * KILL_AT <= carried < 4 * 60
    stalls = router.server.stalls
    gap = max(r.longest_gap for r in survived)
    print(
        f"\nresume stall: longest {stalls.longest:.3f} s (router), mean "
        f"{stalls.sum / stalls.count:.3f} s; longest gap between chunks {gap:.3f} s (client)"
    )
    assert stalls.count == 4 and stalls.longest < 10.0 and gap < 10.0
