"""`LLM.generate` honours every SamplingParams field end to end (tiny random model)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import solutions.ch00_model
from minserve import LLM, CoursePlugins, SamplingParams
from minserve.model.ops import ModelOps
from minserve.model.sampler import Sampler

PROMPTS = ["Hello there", "The quick brown fox", "1, 2, 3,"]


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"))


def texts(outputs) -> list[list[str]]:
    return [[c.text for c in out.outputs] for out in outputs]


def test_outputs_come_back_in_prompt_order_with_prompt_ids(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == PROMPTS
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(p) for p in PROMPTS]
    assert all(o.finished for o in outputs)


def test_batched_greedy_equals_one_at_a_time(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate(p, params, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_text_is_the_decoded_token_ids(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    completion = out[0].outputs[0]
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Hello there", seeded, use_tqdm=False)
    mixed = llm.generate(["The quick", "Hello there"], [other, seeded], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids


def test_different_seeds_give_different_samples(llm: LLM) -> None:
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2)
    ]
    a, b = llm.generate(["Hello there"] * 2, params, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_n_returns_n_distinct_samples(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    completions = llm.generate("Hello there", params, use_tqdm=False)[0].outputs
    assert [c.index for c in completions] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in completions}) == 3


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert out[0].outputs[0].finish_reason == "length"


def test_stop_token_ids_end_generation_and_report_the_token(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = reference[4]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    cut = reference.index(stop_at) + 1
    assert completion.token_ids == reference[:cut]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_at)


def test_stop_string_cuts_the_text_exactly(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].text
    stop = full[5:8]  # three characters that may straddle tokens
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert completion.text == full[: full.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    kept = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    with_stop = llm.generate("Hello", kept, use_tqdm=False)[0].outputs[0].text
    assert with_stop == full[: full.index(stop) + len(stop)]


def test_eos_ends_generation_unless_ignored(llm: LLM, tiny_model, tmp_path) -> None:
    """Make the greedy first token the model's EOS (via generation_config.json)."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    folder = shutil.copytree(tiny_model("llama"), tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    eos_llm = LLM(folder)
    stopped = eos_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == (
        [first],
        "stop",
        None,
    )
    ignored = eos_llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == 6 and ignored.finish_reason == "length"


def test_min_tokens_delays_stop_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[first], min_tokens=3
    )
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) >= 3
    assert first not in completion.token_ids[:3]


def test_logprobs_hold_top_n_and_the_sampled_token(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert entry[token] == max(entry.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )


def test_a_students_sampler_plugs_into_the_engine(tiny_model) -> None:
    """The solution module, passed as the engine's sampler, samples exactly like minserve's
    (its filters and its penalties)."""
    params = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3, max_tokens=10,
        repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
    )  # fmt: skip
    ours = LLM(tiny_model("llama")).generate(PROMPTS, params, use_tqdm=False)
    student = LLM(
        tiny_model("llama"),
        plugins=CoursePlugins(sampler=Sampler.from_module(solutions.ch00_model)),
    )
    theirs = student.generate(PROMPTS, params, use_tqdm=False)
    assert texts(ours) == texts(theirs)


@pytest.mark.parametrize("engine", ["paged", "reference"])
def test_a_students_model_ops_plug_into_the_engine(tiny_model, engine: str) -> None:
    """The solution's RMSNorm, RoPE, SwiGLU and attention, as model_ops, decode greedily
    exactly like minserve's own layers and paged attention."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = LLM(tiny_model("llama")).generate(PROMPTS, params, use_tqdm=False)
    student = LLM(
        tiny_model("llama"),
        plugins=CoursePlugins(model_ops=ModelOps.from_module(solutions.ch00_model)),
        engine=engine,
    )
    assert student.get_execution_config().attention == (
        "per-sequence" if engine == "paged" else "contiguous"
    )
    assert texts(ours) == texts(student.generate(PROMPTS, params, use_tqdm=False))


def test_a_students_rope_frequencies_plug_into_the_engine(tiny_model) -> None:
    """On a model with Llama 3's RoPE scaling, the solution's model_ops (their RoPE
    frequencies included) set the same frequencies and decode the same greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = LLM(tiny_model("llama3_rope"))
    student = LLM(
        tiny_model("llama3_rope"),
        plugins=CoursePlugins(model_ops=ModelOps.from_module(solutions.ch00_model)),
    )
    builtin_freq = ours.loaded.model.rope.inv_freq
    torch.testing.assert_close(student.loaded.model.rope.inv_freq, builtin_freq)
    expected = ours.generate(PROMPTS, params, use_tqdm=False)
    assert texts(expected) == texts(student.generate(PROMPTS, params, use_tqdm=False))


def test_chat_accepts_one_conversation_or_many(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    one = llm.chat(conversation, params, use_tqdm=False)
    many = llm.chat([conversation, conversation], params, use_tqdm=False)
    assert len(one) == 1 and len(many) == 2
    expected = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True)
    assert one[0].prompt == expected
    assert many[0].outputs[0].token_ids == one[0].outputs[0].token_ids


def test_prompt_forms_agree(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.get_tokenizer().encode("Hello there")
    forms = ["Hello there", ids, {"prompt": "Hello there"}, {"prompt_token_ids": ids}]
    results = [llm.generate(f, params, use_tqdm=False)[0].outputs[0].token_ids for f in forms]
    assert all(r == results[0] for r in results)
