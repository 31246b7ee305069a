"""OpenAI's `logit_bias` over HTTP: {"token id": bias in [-100, 100]} added to that logit.

On the tiny random Llama, whose logits are small: +100 on a token makes greedy decoding
pick it at every step, -100 on the greedy token makes it pick another, and a key that is
not one of the model's token ids is a 400 naming `logit_bias`.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from minserve import LLM, SamplingParams
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MODEL = "tiny"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), num_blocks=64)


@pytest.fixture(scope="module")
def url(llm: LLM) -> Iterator[str]:
    served = LLM(llm.loaded, num_blocks=64)  # its own engine: the server's thread owns it
    with BackgroundServer(build_server(served.engine, ServerConfig(MODEL))) as base:
        yield base


def complete(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 3, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def greedy_ids(llm: LLM, **sampling) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, **sampling)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_bias_of_plus_100_makes_greedy_decoding_pick_that_token(url: str, llm) -> None:
    token = llm.get_tokenizer().encode(" banana", add_special_tokens=False)[0]
    response = complete(url, logit_bias={str(token): 100}, ignore_eos=True)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == llm.get_tokenizer().decode([token] * 3)


def test_a_bias_of_minus_100_on_the_greedy_token_changes_it(url: str, llm) -> None:
    first = greedy_ids(llm)[0]
    assert greedy_ids(llm, logit_bias={first: -100})[0] != first  # offline, the same rule
    plain = complete(url, max_tokens=1).json()["choices"][0]["text"]
    biased = complete(url, max_tokens=1, logit_bias={str(first): -100}).json()
    assert plain == llm.get_tokenizer().decode([first])
    assert biased["choices"][0]["text"] != plain


def test_chat_takes_logit_bias_too(url: str, llm) -> None:
    token = llm.get_tokenizer().encode(" banana", add_special_tokens=False)[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "temperature": 0, "ignore_eos": True, "logit_bias": {str(token): 100}}  # fmt: skip
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["message"]["content"] == llm.get_tokenizer().decode([token] * 2)


@pytest.mark.parametrize("key", ["vocab", "huge", "-1", "1.5", "abc", ""])
def test_a_key_that_is_not_a_token_id_is_a_400_naming_logit_bias(url: str, llm, key) -> None:
    key = {"vocab": str(llm.vocab_size), "huge": "9" * 30}.get(key, key)
    response = complete(url, logit_bias={key: 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and error["type"] == "invalid_request_error"


def test_the_last_token_id_is_a_valid_key(url: str, llm) -> None:
    assert complete(url, logit_bias={str(llm.vocab_size - 1): 1}).status_code == 200


@pytest.mark.parametrize("bias", [1000, -100.5])
def test_a_bias_outside_minus_100_to_100_is_a_400(url: str, bias: float) -> None:
    response = complete(url, logit_bias={"5": bias})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "logit_bias" in error["message"] and error["param"] == "logit_bias"
