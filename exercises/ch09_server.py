# Your workspace for chapter 09 (Assembling the server): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 09` from the repository root.
# Generated from minserve/router/policy.py, minserve/output_processor.py, minserve/bench/serve_metrics.py by `python -m minserve.course.generate`.
# stub fingerprint: 658ae62e88cf (lets the generator tell your edits from a stale stub)
"""Chapter 09, Assembling the server: prefix routing, streaming, goodput.

You write `CacheAware.choose`, the router's pick of a replica (the longest prefix
it is expected to hold, unless that replica is too busy), then
`SampleOutput.update`, the output processor's turn of new tokens into the text
delta a stream sends, then a request's TTFT, ITL and TPOT from its timestamps
and the goodput of a run at an SLO. Plug your policy into the router with
`build_router(config, policy=CacheAware(PrefixIndex(2)))` and your outputs into
the engine with `LLM(sample_output_cls=SampleOutput)`; feed your timings and
goodput the records of a load test (`run_load(...).records`).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from minserve.bench.serve_metrics import RequestRecord
from minserve.messages import NewTokens
from minserve.model.detokenizer import IncrementalDetokenizer
from minserve.outputs import CompletionOutput
from minserve.router.policy import Decision, _Turns
from minserve.router.prefix_index import Key, PrefixIndex
from minserve.stop_strings import StopStringMatcher


# Exercise 9.1: cache-aware routing
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
        raise NotImplementedError("Exercise 9.1: cache-aware routing")

    def record(self, key: Key | None, replica: int) -> None:
        if key is not None:
            self.index.insert(key, replica)


# Exercise 9.2: from new token ids to a streamed delta
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
        raise NotImplementedError("Exercise 9.2: from new token ids to a streamed delta")


# Exercise 9.3: TTFT, ITL and TPOT from timestamps
def request_timings(sent_at: float, chunk_at: Sequence[float]) -> tuple[float, list[float], float]:
    """(TTFT, ITL gaps, E2E latency) of a request sent at `sent_at` whose chunks with a
    choice arrived at `chunk_at` (ascending, at least one; seconds from one clock).

    TTFT runs from sending to the first chunk, each ITL gap between two consecutive
    chunks, E2E from sending to the last chunk.
    """
    raise NotImplementedError("Exercise 9.3: TTFT, ITL and TPOT from timestamps")


def time_per_output_token(ttft: float, latency: float, output_tokens: int) -> float:
    """TPOT: the decode time after the first token, per token after the first.

    A request with one output token (or none) has no decode: its TPOT is 0, as in vLLM.
    """
    raise NotImplementedError("Exercise 9.3: TTFT, ITL and TPOT from timestamps")


# Exercise 9.4: goodput at an SLO
def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO it is held to: {"ttft" | "tpot" | "e2el": seconds}.

    A value equal to its limit meets it; the request's E2E latency is `record.latency`.
    """
    raise NotImplementedError("Exercise 9.4: goodput at an SLO")


def request_goodput(
    records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float]
) -> float:
    """Goodput (DistServe): completed requests that met every SLO, per second of the run.

    A failed request (`record.success` False) never counts, whatever its timings.
    """
    raise NotImplementedError("Exercise 9.4: goodput at an SLO")
