"""The tokenizer, checked against transformers on the bundled SmolLM2 GGUF and its saved folder."""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from minserve.errors import ModelLoadError
from minserve.model.default_model import default_model_path
from minserve.model.tokenizer import (
    PRE_TOKENIZATIONS,
    Tokenizer,
    read_gguf_metadata,
)

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "3.14159 is pi; 1,000,000 people; 2024-01-31 at 12:30",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\ttabs",
    "\n\n\nnewlines\r\nwindows line\r\n",
    "I'm sure they'll say it's fine, we've done what we'd do.",
    "Emoji 😀🦙👍🏽 and family 👨‍👩‍👧",
    "日本語のテキストと中文文本",
    "café naïve Ångström façade",
    "Ελληνικά, русский, العربية",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello!"},
    ],
    [
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3."},
        {"role": "user", "content": "Now in 日本語 😀"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path: Path):
    """transformers' own reading of the same GGUF file: the oracle (about 6 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def saved_dir(hf, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ours_from_dir(saved_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(saved_dir)


def _with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(
        tokenizer.backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        chat_template=template,
    )


# ---------------------------------------------------------------- from_gguf


def test_from_gguf_is_fast(gguf_path):
    start = time.perf_counter()
    Tokenizer.from_gguf(gguf_path)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf.encode(text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(ours, hf, skip_special_tokens):
    for text in SAMPLES:
        ids = hf.encode(text)
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_smollm_isolates_every_digit_like_llama_cpp(ours, hf):
    """A known difference: SmolLM2's own tokenizer.json (and llama.cpp's "smollm" rule) split
    every numeric character off before BPE; transformers' GGUF converter does not."""
    assert ours.convert_ids_to_tokens(ours.encode(" ¹")) == ["Ġ", "Â¹"]
    assert hf.convert_ids_to_tokens(hf.encode(" ¹")) == ["ĠÂ", "¹"]


@pytest.fixture(scope="module")
def hf_with_digit_split(hf):
    """transformers' tokenizer with SmolLM2's original pre-tokenizer put back."""
    backend = BackendTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    return backend


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40))
def test_encode_matches_transformers_on_any_text(ours, hf_with_digit_split, text):
    assert ours.encode(text) == hf_with_digit_split.encode(text).ids


def test_special_tokens_match_transformers(ours, hf):
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert ours.vocab_size == len(hf) == 49152
    assert ours.chat_template == hf.chat_template


def test_all_special_ids_are_the_control_tokens(ours, hf):
    control = sorted(i for i, token in hf.added_tokens_decoder.items() if token.special)
    assert ours.all_special_ids == control == list(range(17))


def test_smollm_adds_no_bos(ours):
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False) == [6004]


def test_convert_ids_to_tokens_shows_byte_level_spelling(ours, hf):
    ids = ours.encode("Hello world 😀")
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids)[1] == "Ġworld"


def test_ids_outside_the_vocabulary_are_rejected(ours):
    with pytest.raises(ValueError, match=r"token ids \[49152\] are outside the vocabulary"):
        ours.decode([1, 49152])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.convert_ids_to_tokens([-1])


def test_pre_tokenizer_regexes_match_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    for pre, rules in PRE_TOKENIZATIONS.items():
        if rules.split_regex is None:
            continue  # GPT-2's regex, inside ByteLevel
        theirs = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        for text in SAMPLES:
            assert rules.build().pre_tokenize_str(text) == theirs.pre_tokenize_str(text), pre


# ---------------------------------------------------------------- GGUF files we write


def _write_gguf(path: Path, source: dict, **overrides) -> Path:
    """A tokenizer-only GGUF: `source` metadata (tokenizer.* keys) with `overrides` applied."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    meta = {k: v for k, v in source.items() if k.startswith("tokenizer.")}
    meta.update({f"tokenizer.ggml.{k}": v for k, v in overrides.items()})
    for key, value in meta.items():
        if value is None:
            continue
        if key == "tokenizer.ggml.token_type":
            writer.add_array(key, value)  # int32 elements, as llama.cpp writes them
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def smollm_meta(gguf_path) -> dict:
    return read_gguf_metadata(gguf_path)


def test_metadata_reader_agrees_with_gguf_reader(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_uint32("u32", 7)
    writer.add_int64("i64", -3)
    writer.add_float32("f32", 0.5)
    writer.add_bool("flag", True)
    writer.add_string("name", "naïve 😀")
    writer.add_array("ints", [1, 2, 3])
    writer.add_array("words", ["a b", "", "日本"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert read_gguf_metadata(path) == fields


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_pre_tokenizer_follows_tokenizer_ggml_pre(tmp_path, smollm_meta, pre):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", smollm_meta, pre=pre))
    pieces = [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str("abc   1234")]
    expected = {
        "llama-bpe": ["abc", "ĠĠ", "Ġ", "123", "4"],  # digits in threes
        "qwen2": ["abc", "ĠĠ", "Ġ", "1", "2", "3", "4"],  # digit by digit
        "default": ["abc", "ĠĠ", "Ġ1234"],  # GPT-2: a space joins the next word
    }
    assert pieces == expected[pre]
    # Llama 3's tokenizer.json (and llama.cpp) look whole pieces up before merging.
    assert tok.backend.model.ignore_merges == (pre == "llama-bpe")


def test_add_bos_token_flag_in_gguf_prepends_bos(tmp_path, smollm_meta):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", smollm_meta, add_bos_token=True))
    assert tok.encode("hi") == [1, 6004]
    assert tok.encode("hi", add_special_tokens=False) == [6004]


def test_sentencepiece_gguf_is_rejected_naming_what_is_supported(tmp_path, smollm_meta):
    path = _write_gguf(tmp_path / "t.gguf", smollm_meta, model="llama")
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.model 'llama'; minserve builds gpt2"):
        Tokenizer.from_gguf(path)


def test_unknown_pre_tokenizer_is_rejected(tmp_path, smollm_meta):
    path = _write_gguf(tmp_path / "t.gguf", smollm_meta, pre="martian")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'martian' is not supported; known:"):
        Tokenizer.from_gguf(path)


def test_a_file_that_is_not_gguf_is_rejected(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        Tokenizer.from_gguf(path)


def test_a_truncated_gguf_is_rejected(tmp_path, gguf_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_path.read_bytes()[:100_000])  # cut inside the vocabulary
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        Tokenizer.from_gguf(path)


# ---------------------------------------------------------------- from_pretrained_dir


def test_pretrained_dir_encodes_like_transformers(ours_from_dir, hf):
    for text in SAMPLES:
        ids = hf.encode(text)
        assert ours_from_dir.encode(text) == ids
        for skip in (True, False):
            assert ours_from_dir.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_pretrained_dir_reads_special_tokens_and_chat_template_file(ours_from_dir, saved_dir):
    from transformers import AutoTokenizer

    assert (saved_dir / "chat_template.jinja").is_file()  # transformers 5 layout
    assert (ours_from_dir.bos_token, ours_from_dir.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (ours_from_dir.bos_token_id, ours_from_dir.eos_token_id) == (1, 2)
    hf_from_dir = AutoTokenizer.from_pretrained(saved_dir)
    for messages in CONVERSATIONS:
        expected = hf_from_dir.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours_from_dir.apply_chat_template(messages) == expected


def _copy_dir(saved_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "tok"
    shutil.copytree(saved_dir, folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_pretrained_dir_bos_comes_from_tokenizer_json(saved_dir, tmp_path):
    """As in transformers 5: tokenizer.json's post-processor decides; config flags are ignored."""
    from transformers import AutoTokenizer

    folder = _copy_dir(saved_dir, tmp_path)
    _edit_config(folder, add_bos_token=False)
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single=["<|im_start|>", "$A"], special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(folder / "tokenizer.json"))
    ours = Tokenizer.from_pretrained_dir(folder)
    assert ours.encode("hi") == AutoTokenizer.from_pretrained(folder).encode("hi") == [1, 6004]
    assert ours.encode("hi", add_special_tokens=False) == [6004]


def test_pretrained_dir_legacy_layout(saved_dir, tmp_path):
    """Older folders: template inside tokenizer_config.json, special_tokens_map.json with dicts."""
    folder = _copy_dir(saved_dir, tmp_path)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    _edit_config(folder, chat_template=[{"name": "default", "template": template}])
    eos = {"content": "<|endoftext|>", "lstrip": False, "rstrip": False, "normalized": False}
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos}))
    tok = Tokenizer.from_pretrained_dir(folder)
    assert tok.chat_template == template
    assert tok.eos_token_id == 0  # special_tokens_map.json wins over tokenizer_config.json


def test_pretrained_dir_without_tokenizer_json_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


# ---------------------------------------------------------------- chat template


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, messages, add_generation_prompt):
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_chat_template_tokenized_matches_transformers(ours, hf):
    expected = hf.apply_chat_template(CONVERSATIONS[1], tokenize=True, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATIONS[1], tokenize=True) == expected["input_ids"]


CUSTOM_TEMPLATES = [
    # trim_blocks and lstrip_blocks: block tags leave no blank lines or indentation behind
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n"
    "{% endfor %}",
    # tojson keeps non-ASCII characters, and takes an indent
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
    # loop controls, and the special-token variables
    "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    "{{ m.content }}{% endfor %}{{ eos_token }}",
]


@pytest.mark.parametrize("template", CUSTOM_TEMPLATES)
def test_jinja_environment_renders_like_transformers(ours, hf, template):
    messages = CONVERSATIONS[2]
    expected = hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert _with_template(ours, template).apply_chat_template(messages) == expected


def test_strftime_now_is_available_to_templates(ours):
    tok = _with_template(ours, "{{ strftime_now('%Y') }}")
    assert tok.apply_chat_template(CONVERSATIONS[0]) == str(datetime.now().year)


def test_raise_exception_in_a_template_becomes_a_value_error(ours):
    tok = _with_template(ours, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="chat template rejected these messages: roles must"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_templates_are_sandboxed(ours):
    tok = _with_template(ours, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template rejected"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_invalid_jinja_is_a_clear_error(ours):
    with pytest.raises(ValueError, match="chat template is not valid Jinja"):
        _with_template(ours, "{% for m in messages %}").apply_chat_template(CONVERSATIONS[0])


def test_no_chat_template_is_a_clear_error(ours):
    with pytest.raises(ValueError, match="has no chat template"):
        _with_template(ours, None).apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ("hello", TypeError, "messages must be a list of dicts, got str"),
        ([], ValueError, "messages is empty"),
        (["hello"], TypeError, r"messages\[0\] must be a dict, got str"),
        ([{"content": "hi"}], ValueError, r"messages\[0\] has no 'role' key"),
        ([{"role": "user"}], ValueError, r"messages\[0\] has no 'content' key"),
        (
            [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}],
            ValueError,
            r"messages\[1\] has role 'bot'; expected one of system, user, assistant",
        ),
        ([{"role": "user", "content": None}], TypeError, r"'content'\] must be a string, got None"),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            TypeError,
            "must be a string, got list",
        ),
    ],
)
def test_bad_messages_are_rejected(ours, messages, error, match):
    with pytest.raises(error, match=match):
        ours.apply_chat_template(messages)
