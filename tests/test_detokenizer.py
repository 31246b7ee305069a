"""Incremental detokenization: text deltas that never split a character and add up to `decode`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from minserve.model.default_model import default_model_path
from minserve.model.detokenizer import IncrementalDetokenizer
from minserve.model.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "😀",
    "🦙 llama",
    "日本語のテキスト",
    "café naïve Ångström",
    "Ж",
    "👨‍👩‍👧",
    "½ × π ≈ 1.57",
]
PROMPTS = ["", "Hello", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "日本語"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def stream(tok: Tokenizer, prompt_ids: list[int], output_ids: list[int], skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    return [detok.step(token_id) for token_id in output_ids]


def test_ascii_tokens_stream_as_their_own_text(tokenizer):
    ids = tokenizer.encode("Hello world, again")
    assert stream(tokenizer, [], ids) == ["Hello", " world", ",", " again"]


def test_an_emoji_split_over_three_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("😀!")
    assert len(ids) == 4  # three byte-level pieces of the emoji, then "!"
    assert stream(tokenizer, [], ids) == ["", "", "😀", "!"]


def test_the_leading_space_of_the_first_output_token_is_kept(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    assert stream(tokenizer, prompt, tokenizer.encode(" Paris")) == [" Paris"]


def test_prompt_context_keeps_the_space_a_sentencepiece_decoder_would_strip():
    vocab = {"\u2581Hello": 0, "\u2581world": 1, "!": 2, "<unk>": 3}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()  # drops the space of the first token it decodes
    tok = Tokenizer(backend, bos_token=None, eos_token=None, chat_template=None)
    assert tok.decode([1, 2]) == "world!"
    assert stream(tok, [0], [1, 2]) == [" world", "!"]


def test_special_tokens_are_skipped_by_default(tokenizer):
    ids = tokenizer.encode("yes<|im_end|>")
    assert stream(tokenizer, [], ids) == ["yes", ""]
    assert stream(tokenizer, [], ids, skip=False) == ["yes", "<|im_end|>"]


def test_flush_releases_an_incomplete_character_as_decode_shows_it(tokenizer):
    ids = tokenizer.encode("😀")[:2]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.step(i) for i in ids] == ["", ""]
    assert detok.flush() == tokenizer.decode(ids) == "\ufffd"
    assert detok.text == "\ufffd"


def test_text_is_everything_emitted_so_far(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Q:"))
    for token_id in tokenizer.encode(" café 😀"):
        detok.step(token_id)
    assert detok.text == " café 😀"


_mixed_text = st.lists(
    st.sampled_from([*"abc XYZ\n.,!é日本語テ½Жß", "😀", "🦙", "👍🏽"]), max_size=30
).map("".join)


@settings(max_examples=150, deadline=None)
@given(prompt=st.sampled_from(PROMPTS), text=_mixed_text)
def test_streaming_valid_text_reproduces_it_without_broken_characters(tokenizer, prompt, text):
    deltas = stream(tokenizer, tokenizer.encode(prompt), tokenizer.encode(text))
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


@st.composite
def _token_ids(draw: st.DrawFn, tokenizer: Tokenizer) -> list[int]:
    """Any token ids, biased towards pieces of multi-byte characters and special tokens."""
    pieces = sorted({i for text in MULTIBYTE_TEXTS for i in tokenizer.encode(text)})
    any_id = st.integers(0, tokenizer.vocab_size - 1)
    special = st.sampled_from(tokenizer.all_special_ids)
    return draw(st.lists(st.one_of(st.sampled_from(pieces), any_id, special), max_size=25))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), prompt=st.sampled_from(PROMPTS), skip=st.booleans())
def test_deltas_add_up_to_decode_for_any_token_sequence(tokenizer, data, prompt, skip):
    output_ids = data.draw(_token_ids(tokenizer))
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), skip_special_tokens=skip)
    deltas = [detok.step(token_id) for token_id in output_ids]
    assert not any(delta.endswith("\ufffd") for delta in deltas)  # incomplete: held back
    assert "".join(deltas) + detok.flush() == tokenizer.decode(output_ids, skip)
    assert detok.text == tokenizer.decode(output_ids, skip)
