"""Structured output under speculative decoding and jump-forward: exact, and the masks
filled beside the forward.

Oracles: the non-speculative constrained engine (greedy outputs token for token), xgrammar's
own matcher moved by `accept` (each verified position's mask), `jsonschema` (seeded outputs).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.messages import ScheduledChunk
from minserve.model.sampler import SamplingRow
from minserve.sampling_params import StructuredOutputsParams
from minserve.structured.step_masks import MaskFiller
from minserve.structured.token_matcher import valid_prefix

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
LONG_KEYS = {
    "type": "object",
    "properties": {
        "full_name_of_the_person": {"type": "string", "maxLength": 12},
        "age_in_years_at_last_birthday": {"type": "integer", "minimum": 0, "maximum": 120},
        "favourite_colour_of_the_person": {"enum": ["red", "green", "blue"]},
    },
    "required": [
        "full_name_of_the_person",
        "age_in_years_at_last_birthday",
        "favourite_colour_of_the_person",
    ],
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "tags"],
}


def constrained(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


CASES = [
    constrained(json=LONG_KEYS, disable_any_whitespace=True),
    constrained(json=PERSON),
    constrained(json_object=True),
    constrained(regex=r"[0-9]{3}-[0-9]{4}"),
    constrained(choice=["positive", "negative", "neutral"]),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_blocks=256)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    """The greedy constrained outputs without speculation."""
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=c) for c in CASES]
    return [o.outputs[0].token_ids for o in llm.chat([ASK] * len(CASES), params, use_tqdm=False)]


@pytest.mark.parametrize(
    "speculative_config",
    [
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "jump_forward", "num_speculative_tokens": 8},
    ],
    ids=["ngram", "jump_forward"],
)
def test_speculation_keeps_greedy_constrained_outputs_token_for_token(
    llm: LLM, reference: list[list[int]], speculative_config: dict
) -> None:
    spec = LLM(llm.loaded, num_blocks=256, speculative_config=speculative_config)
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=c) for c in CASES]
    outputs = spec.chat([ASK] * len(CASES), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    metrics = spec.engine.get_metrics()
    assert metrics["spec_decode_num_accepted_tokens"] > 0  # drafts were verified and kept


def test_jump_forward_drafts_the_forced_keys_and_saves_forwards(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=CASES[0], ignore_eos=False
    )
    jump = LLM(llm.loaded, num_blocks=256, speculative_config={
        "method": "jump_forward", "num_speculative_tokens": 8,
    })  # fmt: skip
    text = jump.chat([ASK], [params], use_tqdm=False)[0].outputs[0].text
    jsonschema.validate(json.loads(text), LONG_KEYS)
    metrics = jump.engine.get_metrics()
    assert metrics["spec_decode_tokens_per_forward"] > 1.0


def test_seeded_sampling_under_speculation_still_follows_the_schema(llm: LLM) -> None:
    spec = LLM(llm.loaded, num_blocks=256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4,
    })  # fmt: skip
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=96, structured_outputs=CASES[1])
        for s in range(4)
    ]
    for output in spec.chat([ASK] * 4, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)


# --- the mask thread and the draft cut, against xgrammar's matcher moved by hand ---


def _matcher(llm: LLM, params: StructuredOutputsParams):
    return llm.engine.grammars().matcher(params)


def _chunk(seq_id: int, row: SamplingRow) -> ScheduledChunk:
    return ScheduledChunk(seq_id, f"r{seq_id}", (1,), 5, (0,), samples=(row,))


def test_drafts_are_cut_at_the_first_token_the_grammar_forbids(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    matcher = _matcher(llm, constrained(regex=r"[0-9]{3}-[0-9]{4}"))
    digits = tokenizer.encode("123-4", add_special_tokens=False)
    letters = tokenizer.encode("x", add_special_tokens=False)
    assert valid_prefix(matcher, digits + letters + digits) == len(digits)
    assert matcher.forced_tokens() == []  # untouched: nothing is forced at the start
    row = SamplingRow(SamplingParams(temperature=0), [1], [], None, constraint=matcher)
    drafts = {7: digits + letters + digits}
    chunks, masks = MaskFiller(llm.engine.vocab_size).start([_chunk(7, row)], drafts)
    assert masks is not None
    masks.finish()
    assert drafts[7] == digits


def test_each_verified_position_reads_the_mask_after_the_drafts_before_it(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.vocab_size
    params = constrained(json=PERSON)
    matchers = [_matcher(llm, params), _matcher(llm, constrained(choice=["yes", "no"]))]
    drafts = {0: tokenizer.encode('{"name": "Al', add_special_tokens=False), 1: []}
    rows = [
        SamplingRow(SamplingParams(temperature=0), [1], [], None, constraint=m) for m in matchers
    ]
    chunks, masks = MaskFiller(vocab).start([_chunk(i, r) for i, r in enumerate(rows)], drafts)
    assert masks is not None
    filled = masks.bitmask()
    assert filled.shape == (len(drafts[0]) + 2, (vocab + 31) // 32)
    expected = torch.zeros_like(filled)
    by_hand = _matcher(llm, params)
    for k in range(len(drafts[0]) + 1):  # the state after k drafts
        by_hand.fill_bitmask(expected, k)
        if k < len(drafts[0]):
            assert by_hand.accept(drafts[0][k])
    _matcher(llm, constrained(choice=["yes", "no"])).fill_bitmask(expected, len(drafts[0]) + 1)
    assert torch.equal(filled, expected)
    # the sampler's view of position k: the row after k drafts
    row = chunks[0].samples[0]
    got = torch.zeros((1, filled.shape[1]), dtype=torch.int32)
    row.constraint.after(drafts[0][:3]).fill_bitmask(got, 0)
    assert torch.equal(got[0], expected[3])
    # the sample's matcher is left where it was: at the start
    matchers[0].fill_bitmask(got, 0)
    assert torch.equal(got[0], expected[0])
    assert not torch.equal(expected[0], expected[3])


def test_a_position_behind_an_eos_draft_gets_a_mask_and_nothing_after_it_is_drafted(
    llm: LLM,
) -> None:
    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.vocab_size
    matcher = _matcher(llm, constrained(choice=["yes", "no"]))
    eos = llm.loaded.eos_token_ids[0]
    yes = tokenizer.encode("yes", add_special_tokens=False)
    row = SamplingRow(SamplingParams(temperature=0), [1], [], None, constraint=matcher)
    drafts = {0: [*yes, eos, *yes]}
    _, masks = MaskFiller(vocab).start([_chunk(0, row)], drafts)
    assert masks is not None
    filled = masks.bitmask()
    assert drafts[0] == [*yes, eos]  # nothing may follow EOS
    assert filled.shape[0] == len(yes) + 2
    assert bool((filled[-1] == -1).all())  # behind EOS: any token, never kept
    eos_word, eos_bit = divmod(eos, 32)
    assert (int(filled[len(yes), eos_word]) >> eos_bit) & 1  # after "yes": EOS allowed


def test_greedy_choice_under_ngram_drafts_that_run_into_eos(llm: LLM) -> None:
    """The chat template's end token sits in the prompt, so prompt lookup drafts it."""
    choice = constrained(choice=["yes", "no"])
    ask = [{"role": "user", "content": "Answer yes or no. Is water wet? Answer yes or no."}]
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice)
    plain = llm.chat([ask], [params], use_tqdm=False)[0].outputs[0]
    spec = LLM(llm.loaded, num_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
    })  # fmt: skip
    out = spec.chat([ask], [params], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids and out.text in ("yes", "no")
