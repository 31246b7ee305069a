"""No request can take the server down.

Settings the sampler cannot hold get a 400; a request that fails alone mid-generation (NaN
logits) gets its 500 while the requests beside it finish; should the engine loop itself
crash, `/health` answers 503 and `minserve serve` exits with status 1, so an orchestrator
restarts it. Oracles: `LLM.generate` on the same weights for the requests that go on,
every KV block free once the server is idle, and the process's exit status.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_engine_failures import POISON_SEED, PoisoningSampler
from test_server import GREEDY, MODEL, expected_text, wait_until_idle
from test_server_errors import send

from minserve import LLM, CoursePlugins
from minserve.server.app import Server, build_server
from minserve.server.async_engine import EngineStoppedError
from minserve.server.cli import run_until_stopped
from minserve.server.serving import ServerConfig

REPO = Path(__file__).resolve().parents[1]
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(
        tiny_model("llama"),
        plugins=CoursePlugins(sampler=PoisoningSampler()),
        num_blocks=256,
        block_size=4,
    )


@pytest.fixture(scope="module")
def oracle(llm: LLM) -> LLM:
    return LLM(llm.loaded, num_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[Server]:
    started = build_server(llm.engine, ServerConfig(MODEL)).start()
    yield started
    started.shutdown()


def send_together(server: Server, *bodies: bytes) -> list[httpx.Response]:
    """POST every body to /v1/completions at once, in-process."""

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            json_body = {"Content-Type": "application/json"}
            posts = (c.post("/v1/completions", content=b, headers=json_body) for b in bodies)
            return list(await asyncio.gather(*posts))

    return asyncio.run(go())


def counter(metrics: str, name: str) -> float:
    (line,) = [line for line in metrics.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-40}', "repetition_penalty"),
        (b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-200}', "repetition_penalty"),
        (b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": Infinity}', None),
        (b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}', None),
        (b'{"prompt": "hi", "max_tokens": 2, "stop_token_ids": [' + b"1" + b"0" * 30 + b"]}",
         "stop_token_ids"),
    ],
)  # fmt: skip
def test_settings_the_sampler_cannot_hold_get_400_and_the_server_serves_on(
    server, oracle, body: bytes, named: str | None
) -> None:
    refused = send(server, "POST", "/v1/completions", body)
    assert refused.status_code == 400, refused.text
    if named is not None:
        assert named in refused.json()["error"]["message"]
    answered = send(server, "POST", "/v1/completions", json.dumps({**GOOD, **GREEDY}).encode())
    assert answered.status_code == 200
    assert answered.json()["choices"][0]["text"] == expected_text(oracle, "hi")
    assert send(server, "GET", "/health").status_code == 200


def test_a_request_that_fails_alone_gets_500_and_the_others_their_text(server, oracle) -> None:
    before = send(server, "GET", "/metrics").text
    prompts = ["Tell me a story", "Hello there", "1, 2, 3,"]
    good = [json.dumps({**GOOD, **GREEDY, "prompt": p}).encode() for p in prompts]
    poisoned = json.dumps({**GOOD, "temperature": 0.8, "seed": POISON_SEED}).encode()
    first, failed, *others = send_together(server, good[0], poisoned, *good[1:])
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error"
    assert error["message"] == (
        "generation failed: the sampler could not draw a token: its logits hold NaN; "
        "request aborted"
    )
    for prompt, response in zip(prompts, [first, *others], strict=True):
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == expected_text(oracle, prompt)
    wait_until_idle(server)  # every block is free again
    after = send(server, "GET", "/metrics").text
    for name, grew in [("request_failure_total", 1), ("engine_step_failures_total", 0)]:
        assert counter(after, f"minserve:{name}") == counter(before, f"minserve:{name}") + grew
    assert send(server, "GET", "/health").status_code == 200


def test_a_crashed_engine_loop_ends_the_serve_loop_and_health_answers_503(llm, monkeypatch):
    own = LLM(llm.loaded, num_blocks=64, block_size=4)  # the module's server keeps its engine

    def crash() -> bool:
        raise RuntimeError("injected: a bug in the engine loop")

    monkeypatch.setattr(own.engine, "has_unfinished_requests", crash)
    server = build_server(own.engine, ServerConfig(MODEL))
    with pytest.raises(EngineStoppedError, match=r"^the engine loop crashed: RuntimeError\("):
        run_until_stopped(server, "127.0.0.1", 0)
    assert isinstance(server.engine.crash, RuntimeError)
    assert send(server, "GET", "/health").status_code == 503


def test_minserve_serve_exits_non_zero_when_the_engine_loop_crashes(tiny_model) -> None:
    script = (
        "import sys\n"
        "from minserve.engine import LLMEngine\n"
        "def crash(self):\n"
        "    raise RuntimeError('injected: a bug in the engine loop')\n"
        "LLMEngine.has_unfinished_requests = crash\n"
        "from minserve.cli import main\n"
        f"sys.exit(main(['serve', '--model', {str(tiny_model('llama'))!r}, '--port', '0',"
        " '--num-blocks', '64']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert (
        "minserve: the engine loop crashed: RuntimeError('injected: a bug in the engine loop'); "
        "exiting with status 1"
    ) in done.stderr
