"""The server speaks OpenAI's API: the official client gets what `LLM` generates offline.

Oracle: `LLM.generate` / `LLM.chat` on the same weights (a second engine sharing the loaded
model), token for token under greedy decoding. Invariant: when the server is idle every KV
block is free, after disconnects and under 32 concurrent streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from minserve import LLM, SamplingParams
from minserve.server.app import Server, build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MODEL = "tiny-llama"
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


def in_process_client(server: Server, api_key: str = "unused") -> AsyncOpenAI:
    """The official async client, talking to the app through httpx's ASGI transport."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t")
    return AsyncOpenAI(base_url="http://t/v1", api_key=api_key, http_client=http, max_retries=0)


def wait_until_idle(server: Server, timeout_s: float = 10.0) -> dict[str, float]:
    """The engine's stats once no request is in flight and every block is free or held only
    by the prefix cache (aborts are applied asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.engine.stats
        unheld = stats["num_free_blocks"] + stats["prefix_cache_evictable_blocks"]
        if unheld == stats["num_blocks"] and not server.engine.num_in_flight:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"requests still hold blocks after {timeout_s}s: {server.engine.stats}")


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), num_blocks=256, block_size=4, max_num_seqs=64)


@pytest.fixture(scope="module")
def oracle(llm: LLM) -> LLM:
    """A second engine over the same weights: the server's engine belongs to its thread."""
    return LLM(llm.loaded, num_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def live(llm: LLM) -> Iterator[BackgroundServer]:
    """One server for the module: uvicorn on 127.0.0.1:<ephemeral>, and its app in-process."""
    background = BackgroundServer(build_server(llm.engine, ServerConfig(MODEL)))
    background.start()
    yield background
    background.stop()


def expected_text(oracle: LLM, prompt: str, **params) -> str:
    params = SamplingParams(**{**GREEDY, **params})
    return oracle.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def test_completion_in_process_equals_llm_generate(live, oracle) -> None:
    async def ask():
        client = in_process_client(live.server)
        return await client.completions.create(model=MODEL, prompt="Hello, my name is", **_api())

    response = asyncio.run(ask())
    choice = response.choices[0]
    assert choice.text == expected_text(oracle, "Hello, my name is")
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == len(oracle.get_tokenizer().encode("Hello, my name is"))


def test_streamed_completion_joins_to_the_same_text_and_reports_usage(live, oracle) -> None:
    async def stream():
        client = in_process_client(live.server)
        chunks = await client.completions.create(
            model=MODEL, prompt="Once upon a time", stream=True,
            stream_options={"include_usage": True}, **_api(),
        )  # fmt: skip
        return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(oracle, "Once upon a time")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) == 12  # one chunk per token, as vLLM streams


def test_chat_over_real_uvicorn_equals_llm_chat(live, oracle) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model=MODEL, messages=messages, **_api())
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 **_api()))  # fmt: skip
    expected = oracle.chat(messages, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_completion_over_real_uvicorn_equals_llm_generate(live, oracle) -> None:
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    response = client.completions.create(model=MODEL, prompt="The weather today", **_api())
    assert response.choices[0].text == expected_text(oracle, "The weather today")


def test_n_seed_and_penalties_give_the_samples_llm_generate_gives(live, oracle) -> None:
    options = dict(n=3, seed=7, temperature=0.9, top_p=0.9, top_k=50, presence_penalty=0.5,
                   frequency_penalty=0.3, max_tokens=8)  # fmt: skip
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    extra = {"top_k": options.pop("top_k"), "ignore_eos": True}
    response = client.completions.create(model=MODEL, prompt="A", extra_body=extra, **options)
    params = SamplingParams(**options, **extra)
    expected = oracle.generate("A", params, use_tqdm=False)[0].outputs
    assert [c.text for c in response.choices] == [c.text for c in expected]
    assert [c.index for c in response.choices] == [0, 1, 2]


def test_a_batch_of_prompts_answers_in_prompt_order(live, oracle) -> None:
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    prompts = ["one", "two two", "three three three"]
    response = client.completions.create(model=MODEL, prompt=prompts, **_api(max_tokens=4))
    assert [c.text for c in response.choices] == [
        expected_text(oracle, p, max_tokens=4) for p in prompts
    ]


def test_stop_string_ends_the_text_where_llm_generate_does(live, oracle) -> None:
    full = expected_text(oracle, "Hello, my name is")
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    response = client.completions.create(model=MODEL, prompt="Hello, my name is", stop=[stop],
                                         **_api())  # fmt: skip
    assert response.choices[0].text == expected_text(oracle, "Hello, my name is", stop=[stop])
    assert response.choices[0].finish_reason == "stop"


def test_logprobs_are_the_engines(live, oracle) -> None:
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    response = client.completions.create(model=MODEL, prompt="Hi", logprobs=2, **_api(max_tokens=4))
    params = SamplingParams(**{**GREEDY, "max_tokens": 4, "logprobs": 2})
    expected = oracle.generate("Hi", params, use_tqdm=False)[0].outputs[0]
    got = response.choices[0].logprobs
    want = [lp[t] for t, lp in zip(expected.token_ids, expected.logprobs)]
    assert got.token_logprobs == pytest.approx(want, abs=1e-5)
    assert all(len(top) == 2 for top in got.top_logprobs)  # greedy: the sampled token is top


def test_models_health_and_metrics(live) -> None:
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    client.completions.create(model=MODEL, prompt="count", **_api(max_tokens=3))
    [card] = client.models.list().data
    assert card.id == MODEL
    assert httpx.get(live.url + "/health").status_code == 200
    text = httpx.get(live.url + "/metrics").text
    assert _metric(text, "minserve:time_to_first_token_seconds_count") >= 1
    assert _metric(text, "minserve:inter_token_latency_seconds_count") >= 2
    assert _metric(text, "minserve:e2e_request_latency_seconds_count") >= 1
    assert _metric(text, "minserve:generation_tokens_total") >= 3
    assert _metric(text, "minserve:kv_cache_total_blocks") == 256


def test_disconnect_mid_stream_aborts_and_frees_blocks(live) -> None:
    before = wait_until_idle(live.server)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", live.url + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(4)][0].startswith("data: {")
    stats = wait_until_idle(live.server)
    assert stats["num_requests_aborted"] == before["num_requests_aborted"] + 1
    assert stats["generation_tokens"] - before["generation_tokens"] < 400  # stopped early


def test_disconnect_while_waiting_for_a_whole_response_aborts_it(live) -> None:
    before = wait_until_idle(live.server)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    stats = wait_until_idle(live.server)
    assert stats["num_requests_aborted"] == before["num_requests_aborted"] + 1
    assert stats["generation_tokens"] - before["generation_tokens"] < 400


def test_32_concurrent_streams_finish_without_errors_or_leaks(live, oracle) -> None:
    prompts = [f"Request number {i} says" for i in range(32)]

    async def one(client: AsyncOpenAI, prompt: str) -> str:
        chunks = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **_api())
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def all_at_once() -> list[str]:
        async with AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(all_at_once())
    expected = oracle.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    assert texts == [out.outputs[0].text for out in expected]
    wait_until_idle(live.server)


def test_priority_classes_need_the_priority_policy(llm, live) -> None:
    engine = LLM(llm.loaded, num_blocks=32, block_size=4, scheduling_policy="priority")
    server = build_server(engine.engine, ServerConfig(MODEL, scheduling_policy="priority")).start()
    try:

        async def ask(client: AsyncOpenAI, priority):
            extra = {"priority": priority, "ignore_eos": True}
            return await client.completions.create(
                model=MODEL, prompt="x", max_tokens=2, extra_body=extra
            )

        reply = asyncio.run(ask(in_process_client(server), "interactive"))
        assert reply.usage.completion_tokens == 2
        with pytest.raises(Exception, match="unknown SLO class 'urgent'"):
            asyncio.run(ask(in_process_client(server), "urgent"))
        with pytest.raises(Exception, match="--scheduling-policy priority"):
            asyncio.run(ask(in_process_client(live.server), "batch"))
    finally:
        server.shutdown()


def _api(**overrides) -> dict:
    """GREEDY as openai-client arguments (ignore_eos is a vLLM extra: extra_body)."""
    params = {**GREEDY, **overrides}
    return {"temperature": params["temperature"], "max_tokens": params["max_tokens"],
            "extra_body": {"ignore_eos": params["ignore_eos"]}}  # fmt: skip


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
def test_smollm2_chat_uses_the_models_template_and_answers_like_llm_chat() -> None:
    smol = LLM(num_blocks=64, max_num_seqs=4)
    server = build_server(smol.engine, ServerConfig("smollm2")).start()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    try:

        async def ask():
            client = in_process_client(server)
            return await client.chat.completions.create(
                model="smollm2", messages=messages, temperature=0, max_tokens=12
            )

        reply = asyncio.run(ask()).choices[0].message.content
    finally:
        server.shutdown()
    expected = smol.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert reply == expected[0].outputs[0].text
    assert "Paris" in reply
