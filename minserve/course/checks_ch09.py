"""Checks for chapter 09 (the server), run against any module that defines `CacheAware` and
`new_piece`: minserve's own, the solutions, or a student's exercise file.

Routing checks use chunks of 4 token ids, so a prompt of 12 ids is 3 chunks and a replica
that was sent it is expected to hold all 12; prompts that share their first 8 ids share 2
chunks. Streaming checks feed `new_piece` one choice's whole output after each step, as the
engine reports it, and look at what each chunk would carry.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from minserve.outputs import CompletionOutput
from minserve.router.prefix_index import PrefixIndex
from minserve.server.streaming import Sent

CHUNK = 4
PROMPT = tuple(range(100, 112))  # 3 chunks of 4
SIBLING = PROMPT[:8] + (7, 7, 7, 7)  # shares 2 chunks with PROMPT


def _router(impl: ModuleType, sent: dict[int, tuple[int, ...]], threshold: int = 2) -> Any:
    """A CacheAware over 3 replicas; `sent` {replica: prompt} is what it was sent before."""
    policy = impl.CacheAware(PrefixIndex(3, chunk_size=CHUNK), balance_threshold=threshold)
    for replica, prompt in sent.items():
        policy.record(prompt, replica)
    return policy


def _expect(decision: Any, replica: int, reason: str, matched: int, why: str) -> None:
    got = (decision.replica, decision.reason, decision.matched)
    assert got == (replica, reason, matched), (
        f"{why}: expected replica {replica}, reason {reason!r}, matched {matched}; got "
        f"replica {got[0]}, reason {got[1]!r}, matched {got[2]}"
    )


def check_an_unknown_prompt_goes_to_the_least_loaded(impl: ModuleType) -> None:
    """Nothing was sent anywhere yet: loads [3, 1, 2] -> replica 1, "least_loaded"."""
    decision = _router(impl, {}).choose(PROMPT, [3, 1, 2], [0, 1, 2])
    _expect(decision, 1, "least_loaded", 0, "no replica holds any of the prompt")


def check_no_key_goes_to_the_least_loaded(impl: ModuleType) -> None:
    """A request with no prompt to key on (key None): the least loaded, "least_loaded"."""
    decision = _router(impl, {0: PROMPT}).choose(None, [2, 2, 0], [0, 1, 2])
    _expect(decision, 2, "least_loaded", 0, "a request without a key")


def check_a_known_prompt_goes_where_it_was_sent(impl: ModuleType) -> None:
    """PROMPT went to replica 2 before: it holds all 12 ids, so it gets it again."""
    decision = _router(impl, {2: PROMPT}).choose(PROMPT, [0, 0, 1], [0, 1, 2])
    _expect(decision, 2, "prefix", 12, "replica 2 was sent this prompt before")


def check_the_longest_match_wins(impl: ModuleType) -> None:
    """Replica 0 holds 2 chunks of PROMPT (it was sent SIBLING), replica 1 all 3: replica 1."""
    decision = _router(impl, {0: SIBLING, 1: PROMPT}).choose(PROMPT, [0, 1, 0], [0, 1, 2])
    _expect(decision, 1, "prefix", 12, "replica 1 holds 12 ids of the prompt, replica 0 only 8")


def check_equal_matches_go_to_the_less_loaded(impl: ModuleType) -> None:
    """Replicas 0 and 1 both hold all of PROMPT; replica 1 is less loaded."""
    decision = _router(impl, {0: PROMPT, 1: PROMPT}).choose(PROMPT, [2, 1, 0], [0, 1, 2])
    _expect(decision, 1, "prefix", 12, "both hold the prompt; the tie goes to the less loaded")


def check_a_busy_replica_is_passed_over(impl: ModuleType) -> None:
    """Replica 0 holds PROMPT but has 3 more requests than replica 2 (threshold 2): balance.

    The decision names the prefix the chosen replica holds (here SIBLING's 8 ids)."""
    policy = _router(impl, {0: PROMPT, 2: SIBLING})
    decision = policy.choose(PROMPT, [4, 2, 1], [0, 1, 2])
    _expect(decision, 2, "balance", 8, "replica 0 is 3 requests busier than replica 2")


def check_busier_by_exactly_the_threshold_still_wins(impl: ModuleType) -> None:
    """Replica 0 holds PROMPT and has exactly 2 (the threshold) more requests: still prefix."""
    decision = _router(impl, {0: PROMPT}).choose(PROMPT, [3, 1, 1], [0, 1, 2])
    _expect(decision, 0, "prefix", 12, "more than the threshold is needed to pass it over")


def check_only_candidates_are_chosen(impl: ModuleType) -> None:
    """Replica 1 holds PROMPT but is down (not a candidate): the least-loaded candidate."""
    decision = _router(impl, {1: PROMPT}).choose(PROMPT, [2, 0, 1], [0, 2])
    _expect(decision, 2, "least_loaded", 0, "replica 1 is down; among 0 and 2 nothing matches")


def check_equal_replicas_take_turns(impl: ModuleType) -> None:
    """No prefix anywhere and equal loads: consecutive requests do not all go to one replica."""
    policy = _router(impl, {})
    chosen = [policy.choose((i,) * 8, [0, 0, 0], [0, 1, 2]).replica for i in range(3)]
    assert sorted(chosen) == [0, 1, 2], (
        f"three requests to three idle replicas should spread over all of them (use "
        f"self._turns.order(candidates) to break ties), got replicas {chosen}"
    )


# --- exercise 9.2: new_piece, fed one choice's whole output after each step ---


def _steps(impl: ModuleType, outputs: list[CompletionOutput]) -> list[tuple | None]:
    """What new_piece gives after each step: (text, token ids, logprobs, finish) or None."""
    sent, got = Sent(), []
    for completion in outputs:
        piece = impl.new_piece(3, completion, sent)
        if piece is not None:
            assert piece.index == 3, f"the piece should be for choice 3, got {piece.index}"
            got.append((piece.text, piece.token_ids, piece.logprobs, piece.finish_reason))
        else:
            got.append(None)
    return got


def check_each_step_sends_only_what_is_new(impl: ModuleType) -> None:
    """Outputs "Hi" then "Hi there": the second piece carries " there" and token 9 alone."""
    got = _steps(impl, [CompletionOutput(0, "Hi", [5]), CompletionOutput(0, "Hi there", [5, 9])])
    assert got == [("Hi", [5], None, None), (" there", [9], None, None)], (
        f"expected ('Hi', [5]) then (' there', [9]); got {got}"
    )


def check_a_held_back_token_still_sends_a_piece(impl: ModuleType) -> None:
    """Token 226 is half of "é": a piece with its id and empty text; the text comes next."""
    outputs = [CompletionOutput(0, "", [226]), CompletionOutput(0, "é", [226, 169])]
    got = _steps(impl, outputs)
    assert got == [("", [226], None, None), ("é", [169], None, None)], (
        "a new token whose text is held back should still make a piece (text '', its id), "
        f"so that the client sees it when it was sampled; got {got}"
    )


def check_nothing_new_sends_nothing(impl: ModuleType) -> None:
    """The same output twice (another choice moved): None the second time."""
    same = CompletionOutput(0, "Hi", [5])
    got = _steps(impl, [same, CompletionOutput(0, "Hi", [5])])
    assert got[1] is None, f"no new text or tokens: expected None, got {got[1]}"


def check_the_finish_reason_goes_out_once(impl: ModuleType) -> None:
    """The last token comes with finish_reason "length"; after that, nothing more."""
    done = CompletionOutput(0, "Hi!", [5, 0], finish_reason="length")
    got = _steps(impl, [CompletionOutput(0, "Hi", [5]), done, done])
    assert got[1] == ("!", [0], None, "length") and got[2] is None, (
        f"expected ('!', [0], finish 'length') and then None; got {got[1]} and {got[2]}"
    )


def check_finishing_without_new_tokens_still_says_so(impl: ModuleType) -> None:
    """Stopped by a stop string that was cut out: nothing new, yet the finish reason goes out.

    No new text or tokens, but the client must still get the finish and stop reasons."""
    sent = Sent()
    impl.new_piece(0, CompletionOutput(0, "Hi", [5]), sent)
    stopped = CompletionOutput(0, "Hi", [5], finish_reason="stop", stop_reason="END")
    piece = impl.new_piece(0, stopped, sent)
    assert piece is not None and (piece.text, piece.token_ids) == ("", []), (
        f"expected a piece with no text and no tokens, got {piece}"
    )
    assert (piece.finish_reason, piece.stop_reason) == ("stop", "END"), (
        f"expected finish 'stop', stop reason 'END'; got {piece.finish_reason!r}, "
        f"{piece.stop_reason!r}"
    )
    assert sent.finished, "after the finish reason went out, `sent.finished` should be True"


def check_logprobs_travel_with_their_tokens(impl: ModuleType) -> None:
    """With logprobs, each piece carries the new tokens' entries, in step with token_ids."""
    first = CompletionOutput(0, "Hi", [5], logprobs=[{5: -0.1}])
    second = CompletionOutput(0, "Hi there", [5, 9], logprobs=[{5: -0.1}, {9: -0.7, 4: -1.2}])
    got = _steps(impl, [first, second])
    assert got[1] == (" there", [9], [{9: -0.7, 4: -1.2}], None), (
        f"the second piece should carry token 9's logprobs only, got {got[1]}"
    )


CHECKS = [
    check_an_unknown_prompt_goes_to_the_least_loaded,
    check_no_key_goes_to_the_least_loaded,
    check_a_known_prompt_goes_where_it_was_sent,
    check_the_longest_match_wins,
    check_equal_matches_go_to_the_less_loaded,
    check_a_busy_replica_is_passed_over,
    check_busier_by_exactly_the_threshold_still_wins,
    check_only_candidates_are_chosen,
    check_equal_replicas_take_turns,
    check_each_step_sends_only_what_is_new,
    check_a_held_back_token_still_sends_a_piece,
    check_nothing_new_sends_nothing,
    check_the_finish_reason_goes_out_once,
    check_finishing_without_new_tokens_still_says_so,
    check_logprobs_travel_with_their_tokens,
]
