"""Compiling a structured-output request into a grammar over the model's tokens, once.

xgrammar (Dong et al., 2024) turns a JSON schema, regex or EBNF grammar into a pushdown
automaton over characters, then precomputes, for each of its states, which vocabulary
entries are allowed whatever the stack holds (most of them: "context-independent" tokens)
and leaves only the rest to be checked at run time. That precomputation walks the whole
vocabulary (49k entries for SmolLM2), so it is the expensive part: tens to hundreds of
milliseconds for a typical schema, and without bound for a pathological one.

Hence three rules here:
- **once per grammar text**: compiled grammars are kept in a bounded LRU cache keyed by the
  grammar's text (`GrammarSpec`), shared by every request and sample that asks for it;
- **bounded in time**: a compile runs in a thread of its own (xgrammar releases the GIL)
  and the caller waits at most `timeout_s`; past that the request is refused
  (StructuredOutputError, a 400 on the server) while the compile finishes in the
  background. While `max_overdue` such compiles still run, new grammars are refused
  (StructuredOutputBusyError, a 503), so runaway grammars cannot take every core;
- **errors name the problem**: xgrammar's message, prefixed with what failed; a grammar
  that can never end (`root ::= "a" root`, or a schema that requires itself) is refused
  too (`grammar_ends.can_end`, exercise 12.5): its every output would run to max_tokens;
- **no grammar takes the process down**: an EBNF grammar is compiled first in a child
  process (`crash_probe.py`), since xgrammar dies rather than raises on a few of them.

The cache holds futures, so a second request for a grammar still compiling waits for the
same compile, and a grammar that failed is refused at once the next time.
"""

from __future__ import annotations

import atexit
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from minserve.errors import StructuredOutputBusyError, StructuredOutputError
from minserve.model.tokenizer import Tokenizer
from minserve.sampling_params import StructuredOutputsParams
from minserve.structured.crash_probe import CrashProbe
from minserve.structured.grammar_ends import can_end
from minserve.structured.grammar_spec import JSON_MAX_WHITESPACE, GrammarSpec, grammar_spec
from minserve.structured.matcher import GrammarMatcher

EXIT_WAIT_S = 30.0  # how long a process at exit waits for compiles still running

# Compile threads still running, process-wide: at exit, xgrammar's C++ compile would
# outlive the interpreter and abort the process ("terminate called without an active
# exception"), so exit waits for them (up to EXIT_WAIT_S).
_compiles_in_flight: set[threading.Thread] = set()


@atexit.register
def _wait_for_compiles() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in list(_compiles_in_flight):
        thread.join(max(0.0, deadline - time.monotonic()))


def tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar reads it, sized to the model's logits (`vocab_size`, which
    may run past the tokenizer's), ending on the model's EOS ids (a complete grammar allows
    them, and only them where nothing else may follow).

    An empty entry is never allowed: the model's padding ids, and the special tokens
    (`<|im_start|>`, ...), which xgrammar would otherwise take for their spelling inside a
    JSON string, though their text is dropped when decoded. xgrammar's reading of the
    Hugging Face tokenizer says how the entries are spelled (byte-level, byte-fallback)."""
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    stops = list(stop_token_ids)
    detected = xgr.TokenizerInfo.from_huggingface(
        wrapped, vocab_size=vocab_size, stop_token_ids=stops
    )
    special = set(tokenizer.all_special_ids)
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    return xgr.TokenizerInfo(
        encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
        add_prefix_space=detected.add_prefix_space,
    )  # fmt: skip


class GrammarCompiler:
    """Structured-output requests -> compiled grammars for one model's vocabulary; `encode`
    spells text in that vocabulary (its matchers' `forced_tokens`); `can_end` reads a
    compiled grammar's print and says whether it can end (chapter 12's plug-in replaces it);
    `probe`, when given, compiles each EBNF grammar in a child process first (the engine
    gives one: a grammar that crashes xgrammar is then refused instead of ending the
    server)."""

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        encode: Callable[[str], list[int]],
        *,
        cache_size: int = 64,
        timeout_s: float = 10.0,
        max_overdue: int = 2,
        compile_threads: int = 1,
        can_end: Callable[[str], bool] = can_end,
        probe: CrashProbe | None = None,
    ) -> None:
        self.info, self.encode, self.can_end, self.probe = info, encode, can_end, probe
        self.cache_size, self.timeout_s, self.max_overdue = cache_size, timeout_s, max_overdue
        # xgrammar's own cache would grow without bound: this class keeps the LRU instead
        self._xgr = xgr.GrammarCompiler(info, max_threads=compile_threads, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles from its handlers' threads too
        self._overdue: set[GrammarSpec] = set()  # compiles still running past timeout_s

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar `params` asks for."""
        return GrammarMatcher(xgr.GrammarMatcher(self.compile(params)), self.encode)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar (from the cache when it was compiled before); a
        StructuredOutputError if it is invalid or takes longer than `timeout_s`."""
        spec = grammar_spec(params)
        future = self._future(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except StructuredOutputError as error:  # a fresh one: a cached failure is raised often
            raise StructuredOutputError(str(error)) from None
        except FutureTimeout:
            with self._lock:
                if not future.done():
                    self._overdue.add(spec)
            raise StructuredOutputError(
                f"compiling the {spec.what} took longer than {self.timeout_s:g} s; "
                "simplify it (fewer alternatives, smaller repetition counts)"
            ) from None

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _future(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            if len(self._overdue) >= self.max_overdue:
                raise StructuredOutputBusyError(
                    f"{len(self._overdue)} grammars of earlier requests are still compiling "
                    f"past the {self.timeout_s:g} s bound; retry later"
                )
            future = Future()
            self._cache[spec] = future
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        compile_thread = threading.Thread(
            target=self._compile, args=(spec, future), name="minserve-grammar", daemon=True
        )  # daemon: a runaway compile holds the process at exit EXIT_WAIT_S at most
        _compiles_in_flight.add(compile_thread)
        compile_thread.start()
        return future

    def _compile(self, spec: GrammarSpec, future: Future[xgr.CompiledGrammar]) -> None:
        try:
            future.set_result(self._compile_now(spec))
        except Exception as error:  # xgrammar raises RuntimeError, ValueError, ...
            message = f"invalid {spec.what}: {_first_line(error)}"
            future.set_exception(StructuredOutputError(message))
        finally:
            with self._lock:
                self._overdue.discard(spec)
            _compiles_in_flight.discard(threading.current_thread())

    def _compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "ebnf" and self.probe is not None:
            self.probe.check(spec.text, self.timeout_s)  # raises if xgrammar would crash
        compiled = self._compile_kind(spec)
        if not self.can_end(str(compiled.grammar)):
            raise ValueError(
                "it never ends: its root rule cannot derive a finite text (every "
                "alternative recurses), so every output would run to max_tokens"
            )
        return compiled

    def _compile_kind(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":  # without any whitespace: {"a": 1, "b": [2, 3]}
            return self._xgr.compile_json_schema(
                spec.text, any_whitespace=spec.any_whitespace,
                max_whitespace_cnt=JSON_MAX_WHITESPACE if spec.any_whitespace else None,
            )  # fmt: skip
        if spec.kind == "regex":
            return self._xgr.compile_regex(spec.text)
        return self._xgr.compile_grammar(spec.text)


def _first_line(error: Exception) -> str:
    """xgrammar's message without the C++ source location before it or the backtrace after
    it: "[20:44:21] /project/cpp/regex_converter.cc:83: Regex parsing error ..."."""
    text = (str(error).strip() or type(error).__name__).splitlines()[0]
    return _CPP_LOCATION.sub("", text)


_CPP_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
