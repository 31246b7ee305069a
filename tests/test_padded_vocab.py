"""A checkpoint whose embedding has more rows than its tokenizer has ids.

Checkpoints often pad the vocabulary to a round size. The model can then pick a padding id;
transformers returns it and decodes it as empty text, and so does minserve, instead of
failing the request. Oracle: transformers' greedy generation on the same weights, token for
token, and its decoding of the same ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_model_parity import hf_greedy, hf_model

from minserve import LLM, SamplingParams
from minserve.model.detokenizer import IncrementalDetokenizer
from minserve.model.tokenizer import Tokenizer

TOKENIZER_SIZE, VOCAB_SIZE = 766, 768
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there lived"]


@pytest.fixture(scope="module")
def padded(smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_padded_vocab_model

    folder = tmp_path_factory.mktemp("padded_vocab")
    return make_padded_vocab_model(folder, smollm_tokenizer_dir, PROMPTS, TOKENIZER_SIZE)


@pytest.fixture(scope="module")
def hf_tokenizer(padded: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(padded)


def test_greedy_on_a_padded_vocabulary_equals_transformers(padded: Path, hf_tokenizer) -> None:
    model = hf_model(padded)
    assert (len(hf_tokenizer), model.config.vocab_size) == (TOKENIZER_SIZE, VOCAB_SIZE)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = LLM(padded, dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    padding_ids_seen = 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = hf_greedy(model, hf_tokenizer, prompt, 16)
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == hf_tokenizer.decode(expected, skip_special_tokens=True)
        padding_ids_seen += sum(t >= TOKENIZER_SIZE for t in expected)
    assert padding_ids_seen > 0  # the oracle itself picks padding ids: the case is exercised


def test_padding_ids_decode_as_empty_text_as_in_transformers(padded: Path, hf_tokenizer) -> None:
    tokenizer = Tokenizer.from_pretrained_dir(padded).for_model(VOCAB_SIZE)
    ids = tokenizer.encode("Hello world")
    with_padding = [ids[0], 766, *ids[1:], 767]
    assert tokenizer.decode(with_padding) == tokenizer.decode(ids) == "Hello world"
    assert hf_tokenizer.decode(with_padding, skip_special_tokens=True) == "Hello world"
    assert tokenizer.convert_ids_to_tokens([766, 767]) == ["", ""]


def test_ids_past_the_models_vocabulary_are_still_refused(padded: Path) -> None:
    plain = Tokenizer.from_pretrained_dir(padded)
    with pytest.raises(
        ValueError, match=r"token ids \[766\] are outside the vocabulary \[0, 766\)"
    ):
        plain.decode([5, 766])  # without the model, 766 is no padding id
    tokenizer = plain.for_model(VOCAB_SIZE)
    for bad in (768, -1):
        with pytest.raises(ValueError, match=rf"\[{bad}\] are outside the vocabulary \[0, 768\)"):
            tokenizer.decode([5, bad])


def test_a_padding_id_streams_no_text_and_leaves_the_next_tokens_text_alone(
    padded: Path,
) -> None:
    tokenizer = Tokenizer.from_pretrained_dir(padded).for_model(VOCAB_SIZE)
    prompt, output = tokenizer.encode("The capital"), tokenizer.encode(" of France")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.step(t) for t in [767, output[0], 766, *output[1:]]]
    assert deltas[0] == deltas[2] == ""
    assert "".join(deltas) + detokenizer.flush() == " of France"
