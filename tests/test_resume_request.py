"""A request resumed from its journal (`resume_token_ids`) carries on as if never interrupted.

An instance dies mid-stream; the request is sent again elsewhere with the tokens already
generated, and the client's stream must carry on exactly. The oracle is the uninterrupted
run, streamed token by token: for each split point k, the deltas of a request resumed after
its first k tokens must be the uninterrupted run's deltas from k on (text, token ids,
logprobs, finish), under greedy, seeded, penalised, stop-string, structured-output and
min_tokens settings, and with characters split across the resume point. Then the server:
`return_token_ids`, resumed streams (chat and completions), and the 400s.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx
import pytest
from test_server_errors import send

import minserve.output_processor as output_processor
from minserve import LLM, SamplingParams
from minserve.engine import LLMEngine
from minserve.errors import ResumeTokensError
from minserve.outputs import CompletionOutput
from minserve.sampling_params import StructuredOutputsParams
from minserve.server.app import Server, build_server
from minserve.server.serving import ServerConfig

PROMPT = "The history of the city begins"
SPLITS = (1, 7, 16, 33)
LENGTH = 40
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "founded": {"type": "integer"},
                   "history": {"type": "string"}},
    "required": ["name", "founded", "history"],
}  # fmt: skip
JSON_ASK = "Describe Paris as JSON with a name, a founding year and a one-sentence history."
# name: (prompt: a text or a chat message, SamplingParams but max_tokens, LENGTH if not given)
SETTINGS: dict[str, tuple[str | dict, dict]] = {
    "greedy": (PROMPT, {"temperature": 0, "ignore_eos": True}),
    "seeded": (PROMPT, {"temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True}),
    "penalties": (PROMPT, {"temperature": 0, "frequency_penalty": 0.6, "presence_penalty": 0.4,
                           "repetition_penalty": 1.3, "ignore_eos": True}),
    "logprobs": (PROMPT, {"temperature": 0.8, "top_p": 0.9, "seed": 3, "logprobs": 3,
                          "ignore_eos": True}),
    # greedy stops after 24 tokens; min_tokens holds EOS back until 36
    "min_tokens": ({"role": "user", "content": "Say hi."}, {"temperature": 0, "min_tokens": 36}),
    "json_schema": ({"role": "user", "content": JSON_ASK},
                    {"temperature": 0, "max_tokens": 80,
                     "structured_outputs": StructuredOutputsParams(json=SCHEMA)}),
    # Japanese comes out of this model as byte tokens: 16 and 33 fall inside a character
    "multibyte": ("日本の首都は", {"temperature": 0, "ignore_eos": True}),
}  # fmt: skip
_ids = itertools.count()


@dataclass(frozen=True)
class Case:
    """One setting: its prompt and params, the uninterrupted run's deltas (one token each)
    and, per split point k, the deltas of the request resumed after its first k tokens."""

    prompt: list[int]
    params: SamplingParams
    full: list[CompletionOutput]
    resumed: dict[int, list[CompletionOutput]]

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.full for t in d.token_ids]


Run = tuple[list[int], SamplingParams, list[int] | None]  # prompt, params, resume tokens


def stream(engine: LLMEngine, runs: list[Run]) -> list[list[CompletionOutput]]:
    """Every run's deltas, in one batch, as the engine's steps give them."""
    request_ids = [f"run-{next(_ids)}" for _ in runs]
    for request_id, (prompt, params, resume) in zip(request_ids, runs):
        engine.add_request(request_id, None, prompt, params, resume_token_ids=resume)
    deltas: dict[str, list[CompletionOutput]] = {rid: [] for rid in request_ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas[output.request_id] += output.outputs
    return [deltas[rid] for rid in request_ids]


def text(deltas: list[CompletionOutput]) -> str:
    return "".join(d.text for d in deltas)


def ids(deltas: list[CompletionOutput]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def encode(llm: LLM, prompt: str | dict) -> list[int]:
    tokenizer = llm.get_tokenizer()
    if isinstance(prompt, dict):
        prompt = tokenizer.apply_chat_template([prompt], add_generation_prompt=True)
    return tokenizer.encode(prompt)


def spanning_stop(full: list[CompletionOutput]) -> tuple[str, int]:
    """A stop string made of the last 2 characters of one token's text and the first 2 of
    the next, found first where it spans them, and the split point between the two."""
    texts = [d.text for d in full]
    whole = "".join(texts)
    for j in range(15, len(texts) - 1):
        if len(texts[j]) >= 2 and len(texts[j + 1]) >= 2:
            stop = texts[j][-2:] + texts[j + 1][:2]
            if whole.find(stop) == len("".join(texts[: j + 1])) - 2:
                return stop, j + 1
    raise AssertionError(f"no stop string spans two tokens of {whole!r}")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def cases(llm: LLM) -> dict[str, Case]:
    """Every setting run uninterrupted (one batch), a stop string spanning a split point
    of the greedy run, then every resumed run (one batch)."""
    engine = llm.engine
    prompts = {name: encode(llm, prompt) for name, (prompt, _) in SETTINGS.items()}
    params = {name: SamplingParams(**{"max_tokens": LENGTH, **extra})
              for name, (_, extra) in SETTINGS.items()}  # fmt: skip
    names = list(SETTINGS)
    fulls = dict(zip(names, stream(engine, [(prompts[n], params[n], None) for n in names])))
    stop, split = spanning_stop(fulls["greedy"])
    names.append("stop_string")
    prompts["stop_string"] = prompts["greedy"]
    params["stop_string"] = SamplingParams(
        temperature=0, max_tokens=LENGTH, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True,
    )  # fmt: skip
    (fulls["stop_string"],) = stream(
        engine, [(prompts["stop_string"], params["stop_string"], None)]
    )
    splits = {name: SPLITS for name in names} | {"stop_string": (1, 7, split)}
    todo = [(n, k) for n in names for k in splits[n] if k < len(fulls[n])]
    runs = [(prompts[n], params[n], ids(fulls[n][:k])) for n, k in todo]
    resumed: dict[str, dict[int, list[CompletionOutput]]] = {n: {} for n in names}
    for (name, k), deltas in zip(todo, stream(engine, runs)):
        resumed[name][k] = deltas
    return {n: Case(prompts[n], params[n], fulls[n], resumed[n]) for n in names}


def assert_continues(case: Case, k: int, deltas: list[CompletionOutput]) -> None:
    """The resumed deltas are the uninterrupted run's from token k on."""
    rest = case.full[k:]
    assert text(case.full[:k]) + text(deltas) == text(case.full), k
    assert [d.text for d in deltas] == [d.text for d in rest], k
    assert ids(deltas) == case.token_ids[k:], k
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (
        rest[-1].finish_reason, rest[-1].stop_reason,
    ), k  # fmt: skip


@pytest.mark.parametrize("name", [*SETTINGS, "stop_string"])
def test_a_resumed_request_streams_the_rest_of_the_uninterrupted_run(cases, name) -> None:
    case = cases[name]
    assert all(len(d.token_ids) == 1 for d in case.full)  # one token a step: k deltas, k tokens
    assert len(case.resumed) >= 3, f"{name}: only {len(case.full)} tokens"
    for k, deltas in case.resumed.items():
        assert_continues(case, k, deltas)


def test_the_settings_reach_what_they_test(cases, llm) -> None:
    """min_tokens held EOS back past a split; the grammar ended the JSON; the stop string
    ended the run with its first part held back at the split; 16 and 33 fall inside a
    character (the text of the tokens before them ends in half of one)."""
    assert cases["min_tokens"].full[-1].finish_reason == "stop"
    assert len(cases["min_tokens"].full) >= 36
    json_case = cases["json_schema"]
    assert json_case.full[-1].finish_reason == "stop" and json_case.full[-1].stop_reason is None
    assert set(json.loads(text(json_case.full))) == {"name", "founded", "history"}
    stop_case = cases["stop_string"]
    (stop,) = stop_case.params.stop
    split = max(stop_case.resumed)
    assert stop_case.full[-1].stop_reason == stop and len(stop_case.full) == split + 1
    assert text(stop_case.full[split:]) == stop  # its first part, sampled before, held back
    decode = llm.get_tokenizer().decode
    multibyte = cases["multibyte"].token_ids
    assert all(decode(multibyte[:k], True).endswith("\ufffd") for k in (16, 33))


def test_resumed_logprobs_are_those_of_the_new_tokens(cases) -> None:
    case = cases["logprobs"]
    for k, deltas in case.resumed.items():
        expected = [lp for d in case.full[k:] for lp in d.logprobs]
        got = [lp for d in deltas for lp in d.logprobs]
        assert [set(lp) for lp in got] == [set(lp) for lp in expected]
        for mine, theirs in zip(got, expected):
            assert mine == pytest.approx(theirs, abs=1e-3)
        new_sum = sum(lp[t] for lp, t in zip(expected, case.token_ids[k:]))
        assert deltas[-1].cumulative_logprob == pytest.approx(new_sum, abs=1e-2)


# --- the checks can fail: what resuming without priming would give ---


def test_a_longer_prompt_instead_of_a_resume_changes_a_penalised_run(cases, llm) -> None:
    """Sending the generated tokens as part of the prompt forgets that they were output:
    the frequency and presence penalties no longer count them."""
    case = cases["penalties"]
    splits = (7, 16)
    runs = [
        (case.prompt + case.token_ids[:k], replace(case.params, max_tokens=LENGTH - k), None)
        for k in splits
    ]
    naive = stream(llm.engine, runs)
    assert any(ids(d) != case.token_ids[k:] for d, k in zip(naive, splits))


def test_an_unprimed_detokenizer_would_break_a_split_character(cases, llm, monkeypatch) -> None:
    case = cases["multibyte"]
    monkeypatch.setattr(output_processor, "_primed_finished", lambda sample, resumed: False)
    (deltas,) = stream(llm.engine, [(case.prompt, case.params, case.token_ids[:33])])
    assert ids(deltas) == case.token_ids[33:]  # the same tokens...
    assert text(deltas) != text(case.full[33:])  # ...but the character's first bytes are lost


# --- what the resume tokens count for, and lists that finish the request at once ---


def generate(llm: LLM, prompt: list[int], params: SamplingParams, resume: list[int] | None):
    (output,) = llm.generate({"prompt_token_ids": prompt, "resume_token_ids": resume}, params,
                             use_tqdm=False)  # fmt: skip
    return output


def test_max_tokens_counts_the_resume_tokens(cases, llm) -> None:
    case = cases["greedy"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    output = generate(llm, case.prompt, params, case.token_ids[:5])
    assert output.outputs[0].token_ids == case.token_ids[5:20]
    assert output.outputs[0].finish_reason == "length"
    assert output.prompt_token_ids == case.prompt


def test_the_model_length_limit_counts_the_resume_tokens(cases, llm) -> None:
    case = cases["greedy"]
    short = LLM(llm.loaded, max_model_len=len(case.prompt) + 30)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    output = generate(short, case.prompt, params, case.token_ids[:24])
    assert output.outputs[0].token_ids == case.token_ids[24:30]
    assert output.outputs[0].finish_reason == "length"


def finished_at_once(llm: LLM, prompt: list[int], params: SamplingParams, resume: list[int]):
    """The request's one output, and the steps it took: none runs the model."""
    engine = llm.engine
    steps_before = engine.counters.num_steps
    (deltas,) = stream(engine, [(prompt, params, resume)])
    assert engine.counters.num_steps == steps_before
    (delta,) = deltas
    assert (delta.text, delta.token_ids) == ("", [])
    return delta


def test_a_resume_list_at_max_tokens_finishes_at_once_with_length(cases, llm) -> None:
    case = cases["greedy"]
    delta = finished_at_once(llm, case.prompt, case.params, case.token_ids)
    assert (delta.finish_reason, delta.stop_reason) == ("length", None)


def test_a_resume_list_ending_in_eos_or_a_stop_token_finishes_at_once_with_stop(cases, llm) -> None:
    case = cases["greedy"]
    eos = llm.loaded.eos_token_ids[0]
    delta = finished_at_once(llm, case.prompt, SamplingParams(temperature=0),
                             case.token_ids[:5] + [eos])  # fmt: skip
    assert (delta.finish_reason, delta.stop_reason) == ("stop", None)
    stop_id = case.token_ids[5]
    params = SamplingParams(temperature=0, stop_token_ids=[stop_id])
    delta = finished_at_once(llm, case.prompt, params, case.token_ids[:6])
    assert (delta.finish_reason, delta.stop_reason) == ("stop", stop_id)


def test_a_resume_list_completing_a_stop_string_finishes_at_once_with_it(cases, llm) -> None:
    case = cases["stop_string"]
    delta = finished_at_once(llm, case.prompt, case.params, case.token_ids)
    assert (delta.finish_reason, delta.stop_reason) == ("stop", case.params.stop[0])


def test_a_resume_list_completing_the_grammar_finishes_at_once(cases, llm) -> None:
    case = cases["json_schema"]
    delta = finished_at_once(llm, case.prompt, case.params, case.token_ids)
    assert (delta.finish_reason, delta.stop_reason) == ("stop", None)


# --- refused resume lists ---


@pytest.mark.parametrize("params, resume, message", [
    (SamplingParams(n=2, seed=1), [5], r"n must be 1, got 2"),
    (SamplingParams(), [5, 49152], r"integers in \[0, 49152\).*got \[49152\]"),
    (SamplingParams(), [-1], r"got \[-1\]"),
    (SamplingParams(max_tokens=3), [5, 6, 7, 8], r"4 tokens, more than max_tokens \(3\)"),
    (SamplingParams(prompt_logprobs=1), [5], r"prompt_logprobs cannot go with"),
    (SamplingParams(stop_token_ids=[6]), [5, 6, 7], r"resume_token_ids\[1\] already finishes"),
])  # fmt: skip
def test_a_resume_list_that_cannot_continue_is_refused(llm, params, resume, message) -> None:
    with pytest.raises(ResumeTokensError, match=message):
        generate(llm, llm.get_tokenizer().encode(PROMPT), params, resume)
    assert not llm.engine.has_unfinished_requests()


def test_a_resume_list_past_max_model_len_says_the_numbers(llm) -> None:
    prompt = llm.get_tokenizer().encode(PROMPT)
    resume = [5] * (llm.max_model_len - len(prompt) + 1)
    with pytest.raises(ResumeTokensError, match=rf"\({len(prompt)} tokens\).*\({len(resume)} "
                       rf"tokens\) make {llm.max_model_len + 1} tokens; max_model_len is "
                       rf"{llm.max_model_len}"):  # fmt: skip
        generate(llm, prompt, SamplingParams(), resume)


def test_a_token_the_grammar_refuses_is_named_by_its_position(cases, llm) -> None:
    case = cases["json_schema"]
    bad = llm.get_tokenizer().encode("x")[0]
    resume = case.token_ids[:3] + [bad]
    with pytest.raises(ResumeTokensError, match=rf"resume_token_ids\[3\] \(token {bad}\) is not "
                       "allowed there by the structured output's grammar"):  # fmt: skip
        generate(llm, case.prompt, case.params, resume)


def test_tokens_after_a_completed_stop_string_are_refused(cases, llm) -> None:
    case = cases["stop_string"]
    resume = case.token_ids + case.token_ids[:2]
    last = len(case.token_ids) - 1
    with pytest.raises(ResumeTokensError, match=rf"resume_token_ids\[{last}\] completes the stop "
                       rf"string {case.params.stop[0]!r}, so the 2 tokens"):  # fmt: skip
        generate(llm, case.prompt, case.params, resume)
    assert not llm.engine.has_unfinished_requests()


# --- the server: return_token_ids, resumed streams, refusals ---

MODEL = "smol"


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[Server]:
    """A server on an engine of its own over the same weights."""
    served = LLM(llm.loaded, max_model_len=256)
    started = build_server(served.engine, ServerConfig(MODEL), max_queued=4).start()
    yield started
    started.shutdown()


async def _post_all(server: Server, path: str, bodies: list[dict]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        posts = [client.post(path, json={"model": MODEL, **b}, timeout=60) for b in bodies]
        return list(await asyncio.gather(*posts))


def post(server: Server, path: str, body: dict) -> httpx.Response:
    (response,) = asyncio.run(_post_all(server, path, [body]))
    return response


def chunks(server: Server, path: str, *bodies: dict) -> list[list[dict]]:
    """Each streamed response's chunks (sent together; the [DONE] line checked, dropped)."""
    streams = []
    for response in asyncio.run(_post_all(server, path, [{**b, "stream": True} for b in bodies])):
        assert response.status_code == 200, response.text
        events = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        streams.append([json.loads(event) for event in events[:-1]])
    return streams


def choice_parts(chunk: dict) -> dict:
    """A chunk without what differs between two responses (id, created)."""
    return {k: v for k, v in chunk.items() if k not in ("id", "created")}


def shown(choice: dict) -> str:
    """A streamed choice's text (completions) or content (chat)."""
    return choice["text"] if "text" in choice else choice["delta"]["content"]


COMPLETION = {"prompt": "日本の首都は", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 20,
        "temperature": 0.8, "seed": 4, "return_token_ids": True}  # fmt: skip


def test_a_stream_with_return_token_ids_lists_every_token_once(server, llm) -> None:
    """Each chunk lists the ids sampled in its step, even while its text is held back
    (half a character); only the first carries the prompt's ids."""
    (got,) = chunks(server, "/v1/completions", COMPLETION)
    prompt = llm.get_tokenizer().encode(COMPLETION["prompt"])
    assert got[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c for c in got[1:])
    generated = [t for c in got for t in c["choices"][0]["token_ids"]]
    (whole,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert generated == whole.outputs[0].token_ids
    assert "".join(c["choices"][0]["text"] for c in got) == whole.outputs[0].text
    assert any(c["choices"][0]["text"] == "" for c in got)  # a held-back half character


def test_a_whole_response_with_return_token_ids(server, llm) -> None:
    body = post(server, "/v1/chat/completions", CHAT).json()
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True)
    )
    assert body["prompt_token_ids"] == prompt
    (choice,) = body["choices"]
    assert tokenizer.decode(choice["token_ids"], True) == choice["message"]["content"]
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])


@pytest.mark.parametrize("path, request_body", [
    ("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)
], ids=["completions", "chat"])  # fmt: skip
def test_a_resumed_stream_sends_the_chunks_the_uninterrupted_one_sends_after_k(
    server, path, request_body
) -> None:
    """Chunk for chunk, what follows the resume point (no role or prompt ids again); usage
    counts the new tokens. Resumed after the last token: one chunk, with the finish only."""
    (full,) = chunks(server, path, request_body)
    all_ids = [t for c in full for t in c["choices"][0]["token_ids"]]
    splits = (1, 7, 16, len(all_ids))
    usage = {"stream_options": {"include_usage": True}}
    resumed = chunks(server, path, *({**request_body, **usage, "resume_token_ids": all_ids[:k]}
                                     for k in splits))  # fmt: skip
    for k, (*got, last) in zip(splits[:-1], resumed):
        assert [choice_parts(c) for c in got] == [choice_parts(c) for c in full[k:]], k
        assert last["usage"]["completion_tokens"] == len(all_ids) - k
    (finished, last) = resumed[-1]
    (choice,) = finished["choices"]
    assert (shown(choice), choice["token_ids"]) == ("", [])
    assert choice["finish_reason"] == full[-1]["choices"][0]["finish_reason"]
    assert last["usage"]["completion_tokens"] == 0
    assert "role" in full[0]["choices"][0].get("delta", {"role": "completions have none"})


@pytest.mark.parametrize("change, message", [
    ({"resume_token_ids": [5, 49152]}, "integers in [0, 49152)"),
    ({"resume_token_ids": [5], "n": 2}, "n must be 1, got 2"),
    ({"resume_token_ids": [5] * 300}, "max_model_len is 256"),
    ({"resume_token_ids": [5] * 30}, "30 tokens, more than max_tokens (24)"),
    ({"resume_token_ids": [5], "prompt": ["a", "b"]}, "continues one prompt; the request has 2"),
    ({"resume_token_ids": [5], "max_tokens": 0}, "max_tokens 0 generates nothing"),
    ({"resume_token_ids": ["5"]}, None),
])  # fmt: skip
def test_a_bad_resume_is_a_400_naming_the_field(server, change, message) -> None:
    response = post(server, "/v1/completions", {**COMPLETION, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("resume_token_ids")
    if message is not None:
        assert message in error["message"]


def test_the_schema_documents_both_fields(server, llm) -> None:
    spec = send(server, "GET", "/openapi.json").json()
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        fields = spec["components"]["schemas"][model]["properties"]
        assert fields["return_token_ids"]["type"] == "boolean"
        resume = fields["resume_token_ids"]["anyOf"][0]
        assert resume["items"]["maximum"] == llm.vocab_size - 1
        assert resume["maxItems"] == 255  # max_model_len less a one-token prompt
