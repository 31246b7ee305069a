"""The tokenizer: text to token ids and back, and the chat template that turns messages into text.

One class, two sources. A Hugging Face folder carries a ready `tokenizer.json`. A GGUF file
carries no such file: its vocabulary, merges and special tokens are metadata under llama.cpp's key
names, and `from_gguf` rebuilds a Hugging Face `tokenizers` byte-level BPE from them, splitting
text before BPE the way llama.cpp does for the file's `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from gguf import Keys, TokenType
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from minserve.errors import ModelLoadError
from minserve.model.gguf_file import read_gguf_metadata

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

# ---------------------------------------------------------------- GGUF byte-level BPE

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenization:
    """How llama.cpp cuts text into pieces before BPE, for one `tokenizer.ggml.pre` value."""

    split_regex: str | None = None  # None: GPT-2's regex, built into ByteLevel
    isolate_digits: bool = False  # every digit a piece of its own (llama.cpp's "\p{N}" rule)
    ignore_merges: bool = False  # a piece found whole in the vocabulary skips BPE (Llama 3)

    def build(self) -> pre_tokenizers.PreTokenizer:
        steps = [pre_tokenizers.Digits(individual_digits=True)] if self.isolate_digits else []
        if self.split_regex is not None:
            steps.append(pre_tokenizers.Split(Regex(self.split_regex), behavior="isolated"))
        use_gpt2_regex = self.split_regex is None
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_gpt2_regex))
        return pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]


_GPT2 = _PreTokenization()
_DIGITS_THEN_GPT2 = _PreTokenization(isolate_digits=True)
_LLAMA3 = _PreTokenization(_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = _PreTokenization(_QWEN2_SPLIT)
PRE_TOKENIZATIONS = {
    "default": _GPT2, "gpt2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}  # fmt: skip
SUPPORTED_GGUF_TOKENIZERS = ("gpt2",)  # byte-level BPE; sentencepiece ("llama") is not built yet


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character table: every byte spelled as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    extra = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(extra)}


@cache
def _byte_characters() -> frozenset[str]:
    return frozenset(_byte_alphabet().values())


def _byte_spelled(token: str) -> str:
    """A vocabulary entry in the byte alphabet (a few files store special tokens raw)."""
    if set(token) <= _byte_characters():
        return token
    return "".join(_byte_alphabet()[b] for b in token.encode("utf-8"))


def _gguf_added_tokens(meta: Mapping[str, Any]) -> list[AddedToken]:
    """Tokens matched whole in text: CONTROL ones special, USER_DEFINED ones not (as llama.cpp).

    A control token spelled outside the byte alphabet is a mislabel in the file: skipped.
    """
    tokens, kinds = meta[Keys.Tokenizer.LIST], meta.get(Keys.Tokenizer.TOKEN_TYPE, ())
    special = {TokenType.CONTROL: True, TokenType.USER_DEFINED: False}
    return [
        AddedToken(token, special=special[kind], normalized=False)
        for token, kind in zip(tokens, kinds, strict=False)
        if kind in special and set(token) <= _byte_characters()
    ]


def _gguf_byte_level_bpe(meta: Mapping[str, Any]) -> BackendTokenizer:
    """GPT-2-style BPE over bytes, from the vocabulary and merges in a GGUF file."""
    pre = meta.get(Keys.Tokenizer.PRE, "default")
    if pre not in PRE_TOKENIZATIONS:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(PRE_TOKENIZATIONS)}"
        )
    if Keys.Tokenizer.MERGES not in meta:
        raise ModelLoadError("this GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    vocab = {_byte_spelled(token): i for i, token in enumerate(meta[Keys.Tokenizer.LIST])}
    merges = [tuple(merge.split(" ", 1)) for merge in meta[Keys.Tokenizer.MERGES]]
    rules = PRE_TOKENIZATIONS[pre]
    backend = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=rules.ignore_merges))
    backend.pre_tokenizer = rules.build()
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(_gguf_added_tokens(meta))
    return backend


def _bos_eos_processor(
    backend: BackendTokenizer, bos: str | None, eos: str | None
) -> processors.TemplateProcessing:
    """The post-processor that wraps every encoding in `bos` / `eos` (either may be None)."""
    ends = [(token, backend.token_to_id(token)) for token in (bos, eos) if token is not None]
    missing = [token for token, token_id in ends if token_id is None]
    if missing:
        raise ModelLoadError(f"special tokens {missing} are not in the vocabulary")
    single = [*([bos] if bos else []), "$A", *([eos] if eos else [])]
    return processors.TemplateProcessing(single=single, special_tokens=ends)


# ---------------------------------------------------------------- Hugging Face folders


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: str | Mapping[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, Mapping) else value


def _folder_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` (transformers 5) wins over tokenizer_config.json's `chat_template`."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


# ---------------------------------------------------------------- chat template


@cache
def _jinja_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox configured like transformers' chat-template environment."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def check_messages(messages: object) -> None:
    """Reject anything but a non-empty list of {"role": known role, "content": str} dicts."""
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no {key!r} key")
        if message["role"] not in CHAT_ROLES:
            roles = ", ".join(CHAT_ROLES)
            raise ValueError(f"messages[{i}] has role {message['role']!r}; expected one of {roles}")
        if not isinstance(message["content"], str):
            kind = type(message["content"]).__name__
            raise TypeError(f"messages[{i}]['content'] must be a string, got {kind}")


# ---------------------------------------------------------------- the tokenizer


class Tokenizer:
    """A `tokenizers` tokenizer, its BOS/EOS tokens and its chat template (no transformers).

    Whether `encode` adds BOS is decided once, at load time, by the backend's post-processor.
    `model_vocab_size`: the model's ids, which may run past the tokenizer's (`for_model`).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        model_vocab_size: int = 0,
    ) -> None:
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template
        self.model_vocab_size = model_vocab_size

    def for_model(self, model_vocab_size: int) -> Tokenizer:
        """This tokenizer, for a model with `model_vocab_size` token ids.

        Checkpoints often pad the embedding matrix past the tokenizer's vocabulary (to a
        multiple of 64, say). The model can sample a padding id; it decodes as empty text,
        as in transformers, instead of failing the request.
        """
        return Tokenizer(
            self.backend,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            chat_template=self.chat_template,
            model_vocab_size=model_vocab_size,
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Rebuild the tokenizer described by a GGUF file's metadata."""
        meta = read_gguf_metadata(path)
        kind = meta.get(Keys.Tokenizer.MODEL)
        if kind not in SUPPORTED_GGUF_TOKENIZERS:
            raise ModelLoadError(
                f"{path} has tokenizer.ggml.model {kind!r}; minserve builds "
                f"{', '.join(SUPPORTED_GGUF_TOKENIZERS)} (byte-level BPE) tokenizers from GGUF. "
                "Load the model's Hugging Face folder instead (Tokenizer.from_pretrained_dir)."
            )
        backend = _gguf_byte_level_bpe(meta)
        tokens = meta[Keys.Tokenizer.LIST]
        bos, eos = (meta.get(key) for key in (Keys.Tokenizer.BOS_ID, Keys.Tokenizer.EOS_ID))
        bos_token = _byte_spelled(tokens[bos]) if bos is not None else None
        eos_token = _byte_spelled(tokens[eos]) if eos is not None else None
        backend.post_processor = _bos_eos_processor(
            backend,
            bos_token if meta.get(Keys.Tokenizer.ADD_BOS, False) else None,
            eos_token if meta.get(Keys.Tokenizer.ADD_EOS, False) else None,
        )
        template = meta.get(Keys.Tokenizer.CHAT_TEMPLATE)
        return cls(backend, bos_token=bos_token, eos_token=eos_token, chat_template=template)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face folder: tokenizer.json plus its config and chat template files."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{folder} has no tokenizer.json; minserve loads fast (tokenizers) tokenizers only"
            )
        backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        config |= _read_json(folder / "special_tokens_map.json")  # it wins, as in transformers
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        # BOS/EOS come from tokenizer.json's post-processor alone: transformers 5 ignores
        # add_bos_token / add_eos_token in tokenizer_config.json when tokenizer.json exists.
        template = _folder_chat_template(folder, config)
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=template)

    @cached_property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def num_ids(self) -> int:
        """Ids `decode` accepts: the tokenizer's, then any padding ids of the model's."""
        return max(self.vocab_size, self.model_vocab_size)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of the special added tokens: the ones `decode(skip_special_tokens=True)` drops."""
        added = self.backend.get_added_tokens_decoder()
        return sorted(i for i, token in added.items() if token.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS only if the tokenizer adds them and `add_special_tokens`."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; the model's padding ids (past the vocabulary) add none."""
        self._check_ids(ids)
        size = self.vocab_size
        known = [i for i in ids if i < size]
        return self.backend.decode(known, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries themselves (byte-level spelling: a space shows as 'Ġ');
        a padding id of the model's is ""."""
        self._check_ids(ids)
        return [self.backend.id_to_token(i) or "" for i in ids]

    def _check_ids(self, ids: Sequence[int]) -> None:
        size = self.num_ids
        bad = [i for i in ids if not 0 <= i < size]
        if bad:  # the backend would silently drop them
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {size})")

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template; send a plain prompt (completions) instead"
            )
        try:
            return _jinja_environment().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template is not valid Jinja: {error}") from error

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render OpenAI-style messages into the prompt text the model was trained on."""
        check_messages(messages)
        template = self._compiled_template
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            text = template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **{name: token for name, token in special.items() if token is not None},
            )
        except jinja2.TemplateError as error:  # raise_exception(), or the sandbox saying no
            raise ValueError(f"the chat template rejected these messages: {error}") from error
        # The template writes BOS itself when the model wants one.
        return self.encode(text, add_special_tokens=False) if tokenize else text
