# Your workspace for chapter 09 (Assembling the server): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 09` from the repository root.
# Generated from minserve/bench/serve_metrics.py, minserve/router/policy.py, minserve/output_processor.py, minserve/stop_strings.py, minserve/server/limits.py by `python -m minserve.course.generate`.
# stub fingerprint: 383e9c81a3fa (lets the generator tell your edits from a stale stub)
"""Chapter 09, Assembling the server: prefix routing, streaming, goodput, stop
strings.

You write a request's TTFT, ITL and TPOT from its timestamps and the goodput of a
run at an SLO, then `CacheAware.choose`, the router's pick of a replica (the
longest prefix it is expected to hold, unless that replica is too busy), then
`SampleOutput.update`, the output processor's turn of new tokens into the text
delta a stream sends, then `StopStringMatcher`, which cuts a
stream of text at its first stop string, then `ServerLimits`, the server's
refusal of what a request can never get. Plug your policy into the router with
`build_router(config, policy=CacheAware(PrefixIndex(2)))` and your outputs into
the engine with `LLM(plugins=CoursePlugins(sample_output_cls=SampleOutput,
stop_matcher_cls=StopStringMatcher))`; feed your timings and goodput the records
of a load test (`run_load(...).records`), and your limits into the server with
`build_server(llm.engine, ServerConfig(...), limits_cls=ServerLimits)`.
"""

from __future__ import annotations  # 9.4 names 9.5's StopStringMatcher

from collections.abc import Sequence
from dataclasses import dataclass

from minserve.bench.serve_metrics import RequestRecord
from minserve.messages import NewTokens
from minserve.model.detokenizer import IncrementalDetokenizer
from minserve.outputs import CompletionOutput
from minserve.router.policy import Decision, _Turns
from minserve.router.prefix_index import Key, PrefixIndex
from minserve.sampling_params import SamplingParams
from minserve.server.errors import APIError


# Exercise 9.1: TTFT, ITL and TPOT from timestamps
def request_timings(sent_at: float, chunk_at: Sequence[float]) -> tuple[float, list[float], float]:
    """(TTFT, ITL gaps, E2E latency) of a request sent at `sent_at` whose chunks with a
    choice arrived at `chunk_at` (ascending, at least one; seconds from one clock).

    TTFT runs from sending to the first chunk, each ITL gap between two consecutive
    chunks, E2E from sending to the last chunk.
    """
    raise NotImplementedError("Exercise 9.1: TTFT, ITL and TPOT from timestamps")


def time_per_output_token(ttft: float, latency: float, output_tokens: int) -> float:
    """TPOT: the decode time after the first token, per token after the first.

    A request with one output token (or none) has no decode: its TPOT is 0, as in vLLM.
    """
    raise NotImplementedError("Exercise 9.1: TTFT, ITL and TPOT from timestamps")


# Exercise 9.2: goodput at an SLO
def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO it is held to: {"ttft" | "tpot" | "e2el": seconds}.

    A value equal to its limit meets it; the request's E2E latency is `record.latency`.
    """
    raise NotImplementedError("Exercise 9.2: goodput at an SLO")


def request_goodput(
    records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float]
) -> float:
    """Goodput (DistServe): completed requests that met every SLO, per second of the run.

    A failed request (`record.success` False) never counts, whatever its timings.
    """
    raise NotImplementedError("Exercise 9.2: goodput at an SLO")


# Exercise 9.3: cache-aware routing
class CacheAware:
    """Longest expected prefix match, balanced against load (SGLang's cache-aware router)."""

    name = "cache_aware"

    def __init__(self, index: PrefixIndex, balance_threshold: int = 4) -> None:
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold}")
        self.index, self.balance_threshold = index, balance_threshold
        self._turns = _Turns()

    def choose(self, key: Key | None, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        """The replica for a request with prompt `key`, among `candidates` (those up).

        `self.index.match(key)` says, per replica, how many leading prompt units it is
        expected to hold. Send the request to the candidate with the longest match (ties:
        the less loaded), reason "prefix", unless it is busier than the least-loaded
        candidate by more than `balance_threshold` requests: then to that least-loaded one,
        reason "balance", with the match it has. Nothing matched anywhere (or no key): the
        least-loaded, reason "least_loaded". Break ties in load by `self._turns.order`
        (a rotating start, so that equal replicas take turns).
        """
        raise NotImplementedError("Exercise 9.3: cache-aware routing")

    def record(self, key: Key | None, replica: int) -> None:
        if key is not None:
            self.index.insert(key, replica)


# Exercise 9.4: from new token ids to a streamed delta
@dataclass
class SampleOutput:
    """What one sample has shown so far: its detokenizer and stop-string matcher hold the
    text still held back; the running logprob sum; why it finished."""

    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    with_logprobs: bool = False  # the request asked for logprobs
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, new: NewTokens) -> CompletionOutput:
        """This step's delta of the sample: the text `new.token_ids` add, cut at a stop string.

        Feed each token to `self.detokenizer.step(token)` and its text to
        `self.stops.feed(text)`, which returns (text safe to show now, the stop string it
        completed or None). A stop string finishes the sample on the token that completed it
        (finish_reason "stop", stop_reason the string): that token is the delta's last, the
        step's later tokens are dropped. The scheduler may have finished the sample already
        (`new.finish_reason`): "stop" means the last token is EOS or a stop token, whose
        text is never shown; on "stop" and "length" release the held-back text,
        `self.stops.feed(self.detokenizer.flush())` then `self.stops.flush()`.

        The delta (`CompletionOutput`) holds this step's text and kept token ids, their
        logprobs when the request asked for them (`new.logprobs`, else None), the finish and
        stop reasons, and the cumulative logprob of every kept token so far (None without
        logprobs). Record the finish on `self`.
        """
        raise NotImplementedError("Exercise 9.4: from new token ids to a streamed delta")


# Exercise 9.5: stop strings across deltas
def first_stop(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the stop string that completes first in `text`, or None.

    First means the earliest end (start + length) of each string's first occurrence; on a
    tie, the longer string, which starts earlier ("ab" and "b" both end in "xab": "ab").
    """
    raise NotImplementedError("Exercise 9.5: stop strings across deltas")


def partial_stop_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is the beginning of some stop string.

    Only proper beginnings count (a whole stop string would have matched already), so the
    answer is below the longest stop string's length; 0 when no tail can grow into one.
    """
    raise NotImplementedError("Exercise 9.5: stop strings across deltas")


class StopStringMatcher:
    """Streams text through, cut exactly at the first stop string (OpenAI's / vLLM's `stop`)."""

    def __init__(self, stop_strings: Sequence[str], include_stop_str_in_output: bool = False):
        if isinstance(stop_strings, str):
            raise TypeError("stop_strings must be a sequence of strings, not a single string")
        if not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop_strings)!r}")
        self.stop_strings = tuple(stop_strings)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Take the next piece of text; return (text safe to show now, stop string or None).

        The text is what was held back plus `delta`. If a stop string completes in it, return
        the text up to its start (through its end with `include_stop_str_in_output`) and the
        string, record it in `self.matched` and hold nothing. Otherwise hold back the
        longest tail that could still become a stop string (`self._held`) and return the
        rest. Feeding after a match is a RuntimeError.
        """
        raise NotImplementedError("Exercise 9.5: stop strings across deltas")

    def flush(self) -> str:
        """Generation ended for another reason: the held-back tail was no stop string after all.

        Return it, and hold nothing from now on.
        """
        raise NotImplementedError("Exercise 9.5: stop strings across deltas")


# Exercise 9.6: what a request can never get
@dataclass(frozen=True)
class ServerLimits:
    """The engine's bounds, as the HTTP layer sees them.

    Every refusal is `APIError(400, message, param=..., code=...)` whose message gives the
    numbers: what the request asked for and the bound it breaks.
    """

    max_model_len: int
    max_num_seqs: int
    capacity: int  # requests in flight at most: max_num_seqs + max_queued
    vocab_size: int  # token ids run below it (the engine checks a prompt's)

    def check(
        self, prompt_lengths: list[int], params: SamplingParams, max_tokens_param: str,
        max_tokens_given: bool,
    ) -> None:  # fmt: skip
        """Refuse what cannot fit; `max_tokens_given`: the client chose it (a default stops
        at the end of the context instead).

        In this order: the number of prompts, n, stop_token_ids, then the context: the
        longest prompt plus max_tokens, checked only when the client gave max_tokens
        ("the prompt" for one prompt, "the longest prompt" for several).
        """
        raise NotImplementedError("Exercise 9.6: what a request can never get")

    def check_batch(self, num_prompts: int) -> None:
        """More prompts than `capacity`: param "prompt", code "too_many_prompts"."""
        raise NotImplementedError("Exercise 9.6: what a request can never get")

    def _check_samples(self, n: int) -> None:
        """n above `max_num_seqs` (samples run side by side): param "n", "too_many_samples"."""
        raise NotImplementedError("Exercise 9.6: what a request can never get")

    def _check_stop_token_ids(self, token_ids: list[int]) -> None:
        """Ids at or above `vocab_size`: param "stop_token_ids", no code; name a few of them."""
        raise NotImplementedError("Exercise 9.6: what a request can never get")

    def _check_context(self, what: str, prompt_len: int, max_tokens: int, param: str) -> None:
        """prompt + max_tokens above `max_model_len`: param `param`, "context_length_exceeded",
        the message saying how many tokens can be generated. A prompt that alone fills the
        context is left to the engine, which says so itself."""
        raise NotImplementedError("Exercise 9.6: what a request can never get")
