"""/v1/completions with `echo`: the prompt before the completion, and with logprobs the
prompt tokens' logprobs (lm-eval's loglikelihood requests: echo, logprobs, max_tokens 0).

Oracle: `LLM.generate` on the same weights, its `prompt_logprobs` and outputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from minserve import LLM, SamplingParams
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), num_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def oracle(llm: LLM) -> LLM:
    return LLM(llm.loaded, num_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def url(llm: LLM) -> Iterator[str]:
    background = BackgroundServer(build_server(llm.engine, ServerConfig(MODEL)))
    background.start()
    yield background.url
    background.stop()


def complete(url: str, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **fields}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_max_tokens_0_returns_the_prompt_with_its_logprobs(url: str, oracle: LLM) -> None:
    body = complete(url, echo=True, logprobs=2, max_tokens=0)
    [choice] = body["choices"]
    ids = oracle.get_tokenizer().encode(PROMPT)
    params = SamplingParams(prompt_logprobs=2, max_tokens=1, temperature=0)
    expected = oracle.generate([ids], params, use_tqdm=False)[0].prompt_logprobs
    logprobs = choice["logprobs"]
    assert choice["text"] == PROMPT
    assert len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    want = [expected[p][ids[p]].logprob for p in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    tokenizer = oracle.get_tokenizer()
    for p in range(1, len(ids)):
        top = {tokenizer.decode([t], skip_special_tokens=False): lp.logprob
               for t, lp in expected[p].items()}  # fmt: skip
        assert logprobs["top_logprobs"][p] == pytest.approx(top, abs=1e-5)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_echo_without_logprobs_returns_prompt_then_completion(url: str, oracle: LLM) -> None:
    [choice] = complete(url, echo=True, max_tokens=6)["choices"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    completion = oracle.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert choice["text"] == PROMPT + completion.text
    assert choice["logprobs"] is None


def test_echo_with_logprobs_covers_prompt_and_completion(url: str, oracle: LLM) -> None:
    [choice] = complete(url, echo=True, logprobs=1, max_tokens=3)["choices"]
    ids = oracle.get_tokenizer().encode(PROMPT)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    completion = oracle.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    want = [lp[t] for t, lp in zip(completion.token_ids, completion.logprobs)]
    assert logprobs["token_logprobs"][len(ids) :] == pytest.approx(want, abs=1e-5)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_echo_of_token_ids_decodes_them(url: str, oracle: LLM) -> None:
    ids = oracle.get_tokenizer().encode(PROMPT)
    [choice] = complete(url, prompt=ids, echo=True, max_tokens=0)["choices"]
    assert choice["text"] == oracle.get_tokenizer().decode(ids, skip_special_tokens=False)


def test_max_tokens_0_without_echo_is_an_empty_completion(url: str) -> None:
    body = complete(url, max_tokens=0, logprobs=1)
    [choice] = body["choices"]
    assert choice["text"] == "" and choice["logprobs"]["tokens"] == []
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] > 0


def test_streamed_echo_sends_the_prompt_first(url: str, oracle: LLM) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True,
            "max_tokens": 5, "echo": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    texts = [json.loads(line)["choices"][0]["text"] for line in lines[:-1]]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    completion = oracle.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert texts[0].startswith(PROMPT)
    assert "".join(texts) == PROMPT + completion.text


def test_streamed_echo_with_logprobs_and_max_tokens_0_is_the_prompt(url: str) -> None:
    whole = complete(url, echo=True, logprobs=1, max_tokens=0)["choices"][0]
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 0, "echo": True,
            "logprobs": 1, "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line)["choices"][0] for line in lines[:-1]]
    assert "".join(c["text"] for c in chunks) == PROMPT
    assert chunks[0]["logprobs"]["tokens"] == whole["logprobs"]["tokens"]
    assert chunks[0]["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"]
    assert chunks[-1]["finish_reason"] == "length"
