"""Checks for chapter 09 (the server), run against any module that defines `CacheAware` and
`SampleOutput`: minserve's own, the solutions, or a student's exercise file.

Routing checks use chunks of 4 token ids, so a prompt of 12 ids is 3 chunks and a replica
that was sent it is expected to hold all 12; prompts that share their first 8 ids share 2
chunks. Output checks feed `SampleOutput.update` a sample's tokens step by step, as the
scheduler reports them, and compare the deltas with the tokenizer's own decode of the
whole text (cut at the first stop string).
"""

from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import Any

from minserve.messages import NewTokens
from minserve.model.default_model import default_model_path
from minserve.model.detokenizer import IncrementalDetokenizer
from minserve.model.tokenizer import Tokenizer
from minserve.outputs import CompletionOutput
from minserve.router.prefix_index import PrefixIndex
from minserve.stop_strings import StopStringMatcher

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


# --- exercise 9.2: SampleOutput.update, fed a sample's new tokens step by step ---

TEXT = "Hello there, café 😀 world. The answer is 42. END of it"


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def _sample(impl: ModuleType, stops: tuple[str, ...] = (), include: bool = False, logprobs=False):
    tokenizer = _tokenizer()
    prompt = tokenizer.encode("Q: say it. A:")
    return impl.SampleOutput(
        index=0,
        detokenizer=IncrementalDetokenizer(tokenizer, prompt),
        stops=StopStringMatcher(stops, include_stop_str_in_output=include),
        with_logprobs=logprobs,
    )


def _feed(
    impl: ModuleType, token_ids: list[int], per_step: int, finish: tuple[str, int | None],
    **options: Any,
) -> tuple[Any, list[Any]]:  # fmt: skip
    """Feed `token_ids`, `per_step` at a time (the scheduler's finish on the last step);
    (the sample, every step's delta) up to the first finished delta."""
    sample, deltas = _sample(impl, **options), []
    steps = [token_ids[i : i + per_step] for i in range(0, len(token_ids), per_step)]
    for i, ids in enumerate(steps):
        last = i == len(steps) - 1
        logprobs = tuple({t: -0.5 - t % 3} for t in ids)
        new = NewTokens("r", 0, tuple(ids), logprobs, *(finish if last else (None, None)))
        delta = sample.update(new)
        assert isinstance(delta, CompletionOutput), (
            f"update should return a CompletionOutput, got {delta!r}"
        )
        deltas.append(delta)
        if delta.finish_reason is not None:
            break
    return sample, deltas


def _joined(deltas: list[Any]) -> tuple[str, list[int]]:
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


def check_the_deltas_add_up_to_the_decoded_text(impl: ModuleType) -> None:
    """One token a step, to max_tokens: the deltas join to the tokenizer's decode of them.

    Each delta carries exactly its step's token."""
    ids = _tokenizer().encode(TEXT)
    _, deltas = _feed(impl, ids, 1, ("length", None))
    text, tokens = _joined(deltas)
    assert tokens == ids, f"the deltas should carry every token once, in order; got {tokens}"
    assert [d.token_ids for d in deltas] == [[t] for t in ids], "one token per step, one per delta"
    assert text == _tokenizer().decode(ids), (
        f"the deltas' text should join to decode(token ids) = {TEXT!r}; got {text!r}"
    )
    assert deltas[-1].finish_reason == "length", "the last delta carries the finish reason"


def check_a_held_back_token_still_makes_a_delta(impl: ModuleType) -> None:
    """The emoji is 2 tokens: the first one's delta has its id and no text; the next has "😀"."""
    ids = _tokenizer().encode(TEXT)
    _, deltas = _feed(impl, ids, 1, ("length", None))
    texts = [d.text for d in deltas]
    held = [i for i, text in enumerate(texts) if text == ""]
    assert held and "😀" in texts[held[0] + 1], (
        f"half a UTF-8 character shows no text yet (and no U+FFFD): expected an empty delta "
        f"then one holding the emoji; got {texts}"
    )


def check_several_tokens_a_step_give_the_same_text(impl: ModuleType) -> None:
    """Accepted drafts give several tokens a step: 3 at a time joins to the same text."""
    ids = _tokenizer().encode(TEXT)
    _, deltas = _feed(impl, ids, 3, ("length", None))
    assert _joined(deltas) == (_tokenizer().decode(ids), ids), (
        f"3 tokens a step should give the same text and tokens as 1; got {_joined(deltas)}"
    )


def check_a_stop_string_cuts_the_text_and_the_tokens(impl: ModuleType) -> None:
    """Stop string "END", 4 tokens a step: text and tokens end there, finish "stop", "END".

    The text stops before "END"; the token that completed it is the last one kept (the
    rest of its step is dropped)."""
    ids = _tokenizer().encode(TEXT)
    sample, deltas = _feed(impl, ids, 4, ("length", None), stops=("END",))
    text, tokens = _joined(deltas)
    expected = TEXT[: TEXT.index("END")]
    assert text == expected, f"expected the text cut before 'END', {expected!r}; got {text!r}"
    end = next(i for i in range(len(ids)) if "END" in _tokenizer().decode(ids[: i + 1]))
    assert tokens == ids[: end + 1], (
        f"the tokens should end with the one that completed 'END' (token {ids[end]}); "
        f"got {tokens[-3:]} at the end"
    )
    last = deltas[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", "END"), (
        f"expected finish 'stop', stop reason 'END'; got {last.finish_reason!r}, "
        f"{last.stop_reason!r}"
    )
    assert sample.finished, "record the finish on the sample (finish_reason)"


def check_include_stop_str_in_output_keeps_it(impl: ModuleType) -> None:
    """With include_stop_str_in_output the text ends with the stop string itself."""
    ids = _tokenizer().encode(TEXT)
    _, deltas = _feed(impl, ids, 1, ("length", None), stops=("END",), include=True)
    expected = TEXT[: TEXT.index("END") + 3]
    assert _joined(deltas)[0] == expected, f"expected {expected!r}, got {_joined(deltas)[0]!r}"


def check_a_stop_token_shows_no_text_and_releases_what_was_held(impl: ModuleType) -> None:
    """Finished on a stop token: it shows no text, and the held-back text comes out.

    The stop token (EOS, id 2) is the last id; "42." was held back, as it could start the
    stop string "42. ENX"."""
    tokenizer = _tokenizer()
    ids = tokenizer.encode("The answer is 42.") + [2]  # 2: the model's EOS
    _, deltas = _feed(impl, ids, 1, ("stop", None), stops=("42. ENX",))
    text, tokens = _joined(deltas)
    assert tokens == ids, f"the stop token is kept among the token ids; got {tokens}"
    assert text == "The answer is 42.", (
        f"expected the held-back '42.' released and no text for the stop token; got {text!r}"
    )
    assert deltas[-1].finish_reason == "stop", "the scheduler's finish reason goes out"


def check_length_releases_held_back_text(impl: ModuleType) -> None:
    """Finished at max_tokens: text held back for a stop string comes out with the last delta.

    "42. END" could start the stop string "42. ENX" until the end."""
    tokenizer = _tokenizer()
    ids = tokenizer.encode("The answer is 42. END")
    _, deltas = _feed(impl, ids, 1, ("length", None), stops=("42. ENX",))
    assert _joined(deltas)[0] == "The answer is 42. END", (
        f"the held-back text should be released at the end; got {_joined(deltas)[0]!r}"
    )


def check_logprobs_travel_with_their_tokens(impl: ModuleType) -> None:
    """With logprobs: each delta has its tokens' entries and the running sum; without: None."""
    ids = _tokenizer().encode("The answer is 42.")
    _, deltas = _feed(impl, ids, 2, ("length", None), logprobs=True)
    running = 0.0
    for delta in deltas:
        want = [{t: -0.5 - t % 3} for t in delta.token_ids]
        assert delta.logprobs == want, f"expected logprobs {want}, got {delta.logprobs}"
        running += sum(-0.5 - t % 3 for t in delta.token_ids)
        assert math.isclose(delta.cumulative_logprob or 0.0, running, abs_tol=1e-9), (
            f"cumulative_logprob should be the sum over every token so far ({running}), "
            f"got {delta.cumulative_logprob}"
        )
    _, plain = _feed(impl, ids, 2, ("length", None))
    assert all(d.logprobs is None and d.cumulative_logprob is None for d in plain), (
        "without logprobs asked for, logprobs and cumulative_logprob are None"
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
    check_the_deltas_add_up_to_the_decoded_text,
    check_a_held_back_token_still_makes_a_delta,
    check_several_tokens_a_step_give_the_same_text,
    check_a_stop_string_cuts_the_text_and_the_tokens,
    check_include_stop_str_in_output_keeps_it,
    check_a_stop_token_shows_no_text_and_releases_what_was_held,
    check_length_releases_held_back_text,
    check_logprobs_travel_with_their_tokens,
]
