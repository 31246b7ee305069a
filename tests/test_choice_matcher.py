"""Chapter 12's `ChoiceMatcher` (minserve/structured/choice_dfa.py) against xgrammar, the
engine's grammar library: the same mask at every state of a choice's DFA, and, plugged into
the engine (`CoursePlugins(choice_matcher_cls=...)`), the same greedy tokens, with and
without speculative decoding."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.course.checks_ch12 import _paths
from minserve.engine_args import EngineArgs
from minserve.loader import default_model_path
from minserve.model.tokenizer import Tokenizer
from minserve.sampling_params import StructuredOutputsParams
from minserve.structured.choice_dfa import DONE, ChoiceMatcher, Vocabulary, choice_dfa
from minserve.structured.compiler import tokenizer_info
from minserve.structured.grammar_spec import choice_grammar

CHOICES = [
    ["positive", "negative", "neutral"],
    ["yes", "yes sir", "no"],
    ["café", "cafè", "naïve 😀"],
    ["The customer is happy", "The customer is unhappy"],
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[Vocabulary, xgr.GrammarCompiler]:
    tokenizer = Tokenizer.from_gguf(default_model_path())
    info = tokenizer_info(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return Vocabulary.from_tokenizer_info(info, encode), xgr.GrammarCompiler(info)


@pytest.mark.parametrize("choices", CHOICES, ids=lambda c: c[0])
def test_every_state_s_mask_is_xgrammar_s(smollm2, choices: list[str]) -> None:
    vocab, compiler = smollm2
    matcher = ChoiceMatcher.build(choices, vocab)
    compiled = compiler.compile_grammar(choice_grammar(choices))
    paths = _paths(matcher.dfa)
    for state, path in paths.items():  # every state, mid-character ones too
        reference = xgr.GrammarMatcher(compiled)
        for byte in path:
            assert reference.accept_token(vocab.by_text[bytes([byte])][0])
        expected = xgr.allocate_token_bitmask(1, vocab.size)
        reference.fill_next_token_bitmask(expected, 0)
        assert torch.equal(matcher.masks[state], expected[0]), f"state after {path!r}"


def test_a_rolled_back_eos_leaves_the_matcher_live(smollm2) -> None:
    vocab, _ = smollm2
    matcher = ChoiceMatcher.build(["yes", "no"], vocab)
    for token in vocab.encode("yes"):
        assert matcher.accept(token)
    assert matcher.accept(vocab.stop_token_ids[0]) and matcher.state == DONE
    matcher.rollback(1)
    assert not matcher.is_terminated and matcher.state in matcher.dfa.accepting


def test_forced_tokens_spell_the_common_prefix(smollm2) -> None:
    vocab, _ = smollm2
    matcher = ChoiceMatcher.build(["The customer is happy", "The customer is unhappy"], vocab)
    forced = matcher.forced_tokens()
    assert b"".join(vocab.texts[t] for t in forced) == b"The customer is "
    assert choice_dfa(["ab"]).num_states == 3


def test_a_choice_matcher_class_without_build_is_refused() -> None:
    with pytest.raises(ValueError, match="build"):
        CoursePlugins(choice_matcher_cls=object).check(EngineArgs())


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM()


PROMPTS = [
    [{"role": "user", "content": "Review: it broke on day two. Is the customer happy or unhappy?"}],
    [{"role": "user", "content": "Is Paris in France? Say yes or no."}],
]


def _outputs(llm: LLM, choices: list[str]) -> list[list[int]]:
    params = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    return [o.outputs[0].token_ids for o in llm.chat(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "speculative",
    [
        None,
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "jump_forward", "num_speculative_tokens": 8},
    ],
    ids=["plain", "ngram", "jump_forward"],
)
def test_the_engine_on_the_choice_matcher_writes_xgrammar_s_tokens(plain, speculative) -> None:
    plugged = LLM(
        model=plain.loaded,
        plugins=CoursePlugins(choice_matcher_cls=ChoiceMatcher),
        speculative_config=speculative,
    )
    for choices in (CHOICES[0], CHOICES[1], CHOICES[3]):
        assert _outputs(plugged, choices) == _outputs(plain, choices), choices
