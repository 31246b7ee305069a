"""Structured output: every output follows its JSON schema, regex, choice or grammar.

Oracles: the `jsonschema` package judges JSON outputs against their schema, Python's `re`
regex outputs; the bundled SmolLM2 generates them, greedy and seeded, alone and batched with
free text (whose greedy tokens must not change). Over HTTP, OpenAI's `response_format` and
vLLM's `structured_outputs` give the same guarantees, and a malformed schema is a 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI
from pydantic import BaseModel, Field

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.errors import RequestsFailedError, StructuredOutputBusyError, StructuredOutputError
from minserve.model.sampler import Sampler, SamplingRow, apply_token_bitmasks
from minserve.model.token_mask import apply_token_bitmask
from minserve.sampling_params import StructuredOutputsParams
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MODEL = "smollm2"
SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "bounded integer": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["age"],
    },
    "required fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1000},
            "ok": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["id", "ok"],
    },
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 192  # room for strings of non-ASCII characters, several tokens each


def json_params(schema: dict, **sampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=schema), **sampling
    )


def valid_json(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_blocks=256)


def chat(llm: LLM, params: list[SamplingParams]) -> list:
    """One conversation per params, in one batch."""
    return llm.chat([ASK] * len(params), params, use_tqdm=False)


# --- the mask, on its own ---


class AllowOnly:
    """A constraint that allows a fixed set of token ids."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token in self.allowed:
            word, bit = divmod(token, 32)
            bitmask[row, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: the tokens a bitmask allows, read through the sampler's mask."""
    return apply_token_bitmask(torch.zeros(len(bitmask), vocab), bitmask).isfinite()


def test_a_bitmask_allows_token_32w_plus_j_by_bit_j_of_word_w() -> None:
    bitmask = torch.tensor([[0b101, -(2**31)], [-1, 0]], dtype=torch.int32)  # 64 bits a row
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]  # bit 31 of word 1 is token 63
    assert allowed[1].nonzero().flatten().tolist() == list(range(32))


def test_a_constrained_row_keeps_only_its_allowed_tokens_and_others_are_untouched() -> None:
    logits = torch.randn(2, 70)
    params = SamplingParams(temperature=0)
    rows = [
        SamplingRow(params, [1], [], None, constraint=AllowOnly({3, 33, 64})),
        SamplingRow(params, [1], [], None),
    ]
    masked = apply_token_bitmasks(logits, rows)
    assert masked[0].isfinite().nonzero().flatten().tolist() == [3, 33, 64]
    assert torch.equal(masked[1], logits[1])
    assert torch.equal(logits, logits.clone())  # the input is not written


def test_every_sampling_path_draws_only_allowed_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 100) * 4
    allowed = {5, 50, 77}
    settings = [
        dict(temperature=0),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=2),
        dict(temperature=1.0, top_p=0.5, min_p=0.1),
        dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5),
        dict(temperature=0, logprobs=2),
    ]
    rows = [
        SamplingRow(SamplingParams(**s), [5, 6], [50], torch.Generator().manual_seed(i),
                    constraint=AllowOnly(allowed))
        for i, s in enumerate(settings)
    ]  # fmt: skip
    result = Sampler()(logits, rows)
    assert not result.failed
    assert set(result.token_ids) <= allowed
    assert result.token_ids[0] == max(allowed, key=lambda t: logits[0, t])


# --- the engine ---


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=7)])
def test_json_outputs_validate_against_their_schemas(llm: LLM, sampling: dict) -> None:
    outputs = chat(llm, [json_params(schema, **sampling) for schema in SCHEMAS.values()])
    for (name, schema), out in zip(SCHEMAS.items(), outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        valid_json(completion.text, schema)


def test_n_samples_each_follow_the_schema_with_their_own_matcher(llm: LLM) -> None:
    schema = SCHEMAS["required fields"]
    (out,) = chat(llm, [json_params(schema, n=3, temperature=0.8, seed=3)])
    values = [valid_json(c.text, schema) for c in out.outputs]
    assert len(values) == 3


def test_regex_and_choice_outputs_match(llm: LLM) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["yes", "no", "maybe later"]
    constraints = [
        StructuredOutputsParams(regex=phone),
        StructuredOutputsParams(choice=choices),
        StructuredOutputsParams(grammar='root ::= "(" [0-9]{1,3} " + " [0-9]{1,3} ")"'),
    ]
    params = [
        SamplingParams(temperature=t, seed=11, max_tokens=48, structured_outputs=c)
        for c in constraints
        for t in (0, 0.8)
    ]
    texts = [out.outputs[0].text for out in chat(llm, params)]
    assert all(re.fullmatch(phone, t) for t in texts[0:2]), texts
    assert all(t in choices for t in texts[2:4]), texts
    assert all(re.fullmatch(r"\(\d+ \+ \d+\)", t) for t in texts[4:6]), texts


def test_json_object_without_whitespace_is_one_line_of_json(llm: LLM) -> None:
    question = 'Give the capital of France as JSON, like {"capital": "..."}.'
    ask = [{"role": "user", "content": question}]
    constraint = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=t, seed=1, max_tokens=64, structured_outputs=constraint)
        for t in (0, 0.8)
    ]
    texts = [out.outputs[0].text for out in llm.chat([ask, ask], params, use_tqdm=False)]
    assert [json.loads(t) for t in texts] == [{"capital": "Paris"}] * 2
    assert texts == ['{"capital": "Paris"}'] * 2


def test_a_complete_grammar_ends_the_sample_even_with_ignore_eos(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]),
    )  # fmt: skip
    (out,) = chat(llm, [params])
    assert out.outputs[0].text in ("alpha", "beta")
    assert out.outputs[0].finish_reason == "stop"


def test_free_greedy_rows_are_unchanged_beside_constrained_rows(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = chat(llm, [free])[0].outputs[0].token_ids
    mixed = chat(llm, [json_params(SCHEMAS["enum"], temperature=0), free])
    assert mixed[1].outputs[0].token_ids == alone


def test_a_schema_is_compiled_once_whatever_its_spelling(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    compiler = llm.engine.grammars()
    before = compiler.num_cached
    chat(llm, [json_params(schema, temperature=0), json_params(json.dumps(schema, indent=2))])
    assert compiler.num_cached == before + 1


CRASHES_XGRAMMAR = "root ::= root{0,2}"  # xgrammar 0.2.8 segfaults compiling it


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(json={"type": "objekt"}), "invalid JSON schema"),
        (dict(json={"type": "number", "multipleOf": 3}), "multipleOf"),
        (dict(regex="[a-"), "invalid regex"),
        (dict(grammar="root ::= undefined_rule"), "invalid grammar"),
        (dict(grammar='root ::= "a" root'), "never ends"),
        (dict(grammar=CRASHES_XGRAMMAR), "crashes on it"),
        (
            dict(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            "never ends",
        ),
        (
            dict(json={"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}),
            "maxLength beside pattern",
        ),
        (dict(json_object=True, whitespace_pattern=r"[ ]?"), "whitespace_pattern"),
    ],
)
def test_a_bad_constraint_is_a_value_error_naming_it(llm: LLM, constraint, message) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=message):
        llm.generate("Hi", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_plugged_can_end_decides_which_grammars_are_refused(llm: LLM) -> None:
    """Chapter 12's plug-in replaces the engine's test: trusting every grammar, a grammar
    that never ends is served, and runs to max_tokens."""
    trusting_plugins = CoursePlugins(grammar_can_end=lambda _: True)
    trusting = LLM(llm.loaded, num_blocks=256, plugins=trusting_plugins)
    never_ends = StructuredOutputsParams(grammar='root ::= "a" root')
    params = SamplingParams(temperature=0, max_tokens=6, structured_outputs=never_ends)
    (out,) = trusting.generate("Hi", params, use_tqdm=False)
    assert set(out.outputs[0].text) == {"a"} and out.outputs[0].finish_reason == "length"


# U+B7FC1 is the bytes F2 B7 BF 81, and SmolLM2's vocabulary has no token with byte F2
UNSPELLABLE = "\U000b7fc1"


def test_a_grammar_the_vocabulary_cannot_spell_fails_its_request_alone(llm: LLM) -> None:
    stuck = SamplingParams(structured_outputs=StructuredOutputsParams(choice=[UNSPELLABLE]))
    free = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(RequestsFailedError, match="allows no token of the model's vocabulary"):
        llm.generate(["Hi", "Hi"], [stuck, free], use_tqdm=False)


def test_structured_outputs_take_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_compiling_is_bounded_in_time_and_overdue_compiles_hold_off_new_ones(llm) -> None:
    from minserve.structured.compiler import GrammarCompiler

    grammars = llm.engine.grammars()
    quick = GrammarCompiler(grammars.info, grammars.encode, timeout_s=0.05, max_overdue=1)
    slow = StructuredOutputsParams(json={"type": "string", "minLength": 100_000})  # ~0.7 s
    with pytest.raises(StructuredOutputError, match="took longer than 0.05 s"):
        quick.compile(slow)
    other = StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(StructuredOutputBusyError, match="still compiling"):
        quick.compile(other)
    quick.timeout_s = 30.0
    assert quick.compile(slow) is not None  # the same compile, finished in the background
    assert quick.compile(other) is not None


def test_padding_ids_past_the_tokenizer_are_never_allowed(llm: LLM) -> None:
    from minserve.structured.compiler import GrammarCompiler, tokenizer_info

    tokenizer = llm.get_tokenizer()
    padded = tokenizer.vocab_size + 64
    info = tokenizer_info(tokenizer, padded, llm.loaded.eos_token_ids)
    matcher = GrammarCompiler(info, tokenizer.encode).matcher(
        StructuredOutputsParams(json_object=True)
    )
    bitmask = torch.full((1, (padded + 31) // 32), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, padded)[0]
    assert allowed[: tokenizer.vocab_size].any()
    assert not allowed[tokenizer.vocab_size :].any()


def test_the_reference_engine_refuses_structured_outputs(llm) -> None:
    params = json_params(SCHEMAS["enum"], temperature=0)
    with pytest.raises(ValueError, match="paged engine"):
        LLM(llm.loaded, engine="reference").generate("Hi", params, use_tqdm=False)


# --- over HTTP ---


@pytest.fixture(scope="module")
def live(llm: LLM) -> Iterator[BackgroundServer]:
    served = LLM(llm.loaded, num_blocks=256)  # its own engine: the server's thread owns it
    background = BackgroundServer(build_server(served.engine, ServerConfig(MODEL)))
    background.start()
    yield background
    background.stop()


@pytest.fixture(scope="module")
def client(live: BackgroundServer) -> OpenAI:
    return OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_response_format_json_schema_gives_valid_json(client: OpenAI) -> None:
    schema = SCHEMAS["nested object"]
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}},
    )  # fmt: skip
    valid_json(reply.choices[0].message.content, schema)
    assert reply.choices[0].finish_reason == "stop"


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=18, le=99)


def test_the_openai_clients_parse_fills_a_pydantic_model(client: OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL, messages=ASK, temperature=0, max_tokens=MAX_TOKENS, response_format=Person
    )
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and 18 <= person.age <= 99


def test_response_format_json_object_and_structured_outputs_on_completions(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0.8, seed=5, max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    completion = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", temperature=0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert completion.choices[0].text in ("yes", "no")


def test_a_malformed_schema_is_a_400_and_the_server_keeps_serving(live, client) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "bad", "schema": {"type": 5}}}}  # fmt: skip
    response = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "response_format"
    assert "JSON schema" in error["message"]
    bad_regex = {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "(unclosed"}}
    response = httpx.post(f"{live.url}/v1/completions", json=bad_regex, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "structured_outputs"
    crashes = {"model": MODEL, "prompt": "x", "structured_outputs": {"grammar": CRASHES_XGRAMMAR}}
    response = httpx.post(f"{live.url}/v1/completions", json=crashes, timeout=60)
    assert response.status_code == 400
    assert "crashes on it" in response.json()["error"]["message"]
    unspellable = {"model": MODEL, "prompt": "x", "structured_outputs": {"choice": [UNSPELLABLE]}}
    response = httpx.post(f"{live.url}/v1/completions", json=unspellable, timeout=30)
    assert response.status_code == 400
    assert "cannot be completed by this model" in response.json()["error"]["message"]
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert reply.choices[0].message.content


def test_the_c_mask_equals_the_torch_mask_and_leaves_other_rows_alone() -> None:
    from minserve.kernels import cpu_ops
    from minserve.kernels.build import cpu_kernels

    if cpu_kernels() is None:
        pytest.fail("the C kernels did not build on this machine: the CPU engine needs them")
    generator = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 33, 70, 49152):
        words = torch.randint(-(2**31), 2**31, (4, (vocab + 31) // 32), generator=generator)
        bitmask = words.to(torch.int32)
        bitmask[0], bitmask[1] = 0, -1  # nothing allowed; everything allowed
        logits = torch.randn(4, vocab, generator=generator)
        expected = apply_token_bitmask(logits, bitmask)
        assert torch.equal(cpu_ops.mask_rows(logits.clone(), bitmask), expected)
    rows = [SamplingRow(SamplingParams(temperature=0), [1], [], None, constraint=AllowOnly({3}))]
    rows.append(SamplingRow(SamplingParams(temperature=0), [1], [], None))
    logits = torch.randn(2, 70)
    masked = apply_token_bitmasks(logits, rows)  # the sampler's default path: C on a CPU
    assert masked[0].isfinite().nonzero().flatten().tolist() == [3]
    assert torch.equal(masked[1], logits[1]) and logits.isfinite().all()
