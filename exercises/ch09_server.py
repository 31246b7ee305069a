# Your workspace for chapter 09 (Assembling the server): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 09` from the repository root.
# Generated from minserve/router/policy.py, minserve/server/streaming.py by `python -m minserve.course.generate`.
# stub fingerprint: e18a5475785b (lets the generator tell your edits from a stale stub)
"""Chapter 09, Assembling the server: routing by cached prefix, and streaming.

You write `CacheAware.choose`, the router's pick of a replica (the longest prefix
it is expected to hold, unless that replica is too busy), then `new_piece`, what
one streamed chunk carries. Plug your policy into the router with
`build_router(config, policy=CacheAware(PrefixIndex(2)))`.
"""

from collections.abc import Sequence

from minserve.outputs import CompletionOutput
from minserve.router.policy import Decision, _Turns
from minserve.router.prefix_index import Key, PrefixIndex
from minserve.server.responses import Piece
from minserve.server.streaming import Sent


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


# Exercise 9.2: from cumulative outputs to streamed pieces
def new_piece(index: int, completion: CompletionOutput, sent: Sent) -> Piece | None:
    """The part of `completion` (the choice's whole output so far) not sent yet, as the
    Piece for choice `index`; None when there is nothing new or the choice has finished.

    A piece carries the new text, the new token ids and their logprobs (None if the
    request asked for none), and the finish and stop reasons. There is a piece whenever
    there are new tokens, even when their text is empty (the detokenizer holds back half a
    UTF-8 character), and when the choice has just finished (the piece carries the finish
    reason). Update `sent` as you go: chars, tokens, and finished once the finish reason
    is out (`started` is the caller's).
    """
    raise NotImplementedError("Exercise 9.2: from cumulative outputs to streamed pieces")
