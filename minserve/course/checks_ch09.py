"""Checks for chapter 09 (the server), run against any module that defines `CacheAware`,
`SampleOutput`, the timing and goodput functions, `StopStringMatcher` and `ServerLimits`:
minserve's own,
the solutions, or a student's exercise file.

Routing checks use chunks of 4 token ids, so a prompt of 12 ids is 3 chunks and a replica
that was sent it is expected to hold all 12; prompts that share their first 8 ids share 2
chunks. Output checks feed `SampleOutput.update` a sample's tokens step by step, as the
scheduler reports them, and compare the deltas with the tokenizer's own decode of the
whole text (cut at the first stop string). Timing checks use round seconds (a request
sent at 10.0 whose chunks came at 10.5, 10.6 and 10.8 has TTFT 0.5, ITL 0.1 and 0.2, E2E
0.8) and then random timestamps and records, compared with minserve's own
`minserve.bench.serve_metrics`.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.bench import serve_metrics
from minserve.bench.serve_metrics import RequestRecord
from minserve.messages import NewTokens
from minserve.model.default_model import default_model_path
from minserve.model.detokenizer import IncrementalDetokenizer
from minserve.model.tokenizer import Tokenizer
from minserve.outputs import CompletionOutput
from minserve.router.prefix_index import PrefixIndex
from minserve.sampling_params import SamplingParams
from minserve.server.errors import APIError
from minserve.server.limits import ServerLimits
from minserve.stop_strings import StopStringMatcher, first_stop, partial_stop_length

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


# --- exercise 9.4: SampleOutput.update, fed a sample's new tokens step by step ---

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


# --- exercises 9.1 and 9.2: timings and goodput, against minserve.bench.serve_metrics ---

_PROPERTY = settings(max_examples=150, deadline=None, database=None, derandomize=True)


def _close(got: Any, want: Any) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_close, got, want))
    return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


def check_timings_of_a_request_on_paper(impl: ModuleType) -> None:
    """Sent at 10.0, chunks at 10.5, 10.6, 10.8: TTFT 0.5, ITL [0.1, 0.2], E2E 0.8."""
    got = impl.request_timings(10.0, [10.5, 10.6, 10.8])
    assert isinstance(got, tuple) and len(got) == 3, f"expected (ttft, itl, e2e), got {got!r}"
    assert _close(list(got), [0.5, [0.1, 0.2], 0.8]), (
        f"expected TTFT 0.5, ITL [0.1, 0.2], E2E 0.8; got TTFT {got[0]}, ITL {got[1]}, E2E {got[2]}"
    )
    one = impl.request_timings(3.0, [3.25])
    assert _close(list(one), [0.25, [], 0.25]), (
        f"one chunk at 3.25 after sending at 3.0: expected (0.25, [], 0.25), got {one}"
    )


def check_tpot_on_paper(impl: ModuleType) -> None:
    """TTFT 0.5, E2E 0.8, 3 tokens: 0.3 s for the 2 tokens after the first, TPOT 0.15."""
    got = impl.time_per_output_token(0.5, 0.8, 3)
    assert _close(got, 0.15), f"expected TPOT (0.8 - 0.5) / (3 - 1) = 0.15, got {got}"
    for tokens in (1, 0):
        alone = impl.time_per_output_token(0.5, 0.5, tokens)
        assert alone == 0.0, f"a request with {tokens} output token(s) has TPOT 0, got {alone}"


def check_timings_match_minserve_on_random_timestamps(impl: ModuleType) -> None:
    """Random send times, chunk gaps and token counts: the same TTFT, ITL, E2E and TPOT."""
    impl.request_timings(0.0, [1.0])  # a stub stops here, before any example runs

    @_PROPERTY
    @given(
        sent=st.floats(0, 1e4, allow_nan=False),
        gaps=st.lists(st.floats(1e-4, 5.0, allow_nan=False), min_size=1, max_size=12),
        extra_tokens=st.integers(0, 3),  # chunks can carry several tokens (accepted drafts)
    )
    def agrees(sent: float, gaps: list[float], extra_tokens: int) -> None:
        chunks = [sent + sum(gaps[: i + 1]) for i in range(len(gaps))]
        tokens = len(chunks) + extra_tokens
        want = serve_metrics.request_timings(sent, chunks)
        got = impl.request_timings(sent, chunks)
        assert _close(list(got), list(want)), (
            f"request_timings(sent_at={sent!r}, chunk_at={chunks!r}): expected {want}, got {got}"
        )
        want_tpot = serve_metrics.time_per_output_token(want[0], want[2], tokens)
        got_tpot = impl.time_per_output_token(want[0], want[2], tokens)
        assert _close(got_tpot, want_tpot), (
            f"time_per_output_token(ttft={want[0]!r}, latency={want[2]!r}, output_tokens="
            f"{tokens}): expected {want_tpot}, got {got_tpot}"
        )

    agrees()


def _record(ttft: float, tpot: float, tokens: int, success: bool = True) -> RequestRecord:
    latency = ttft + tpot * max(tokens - 1, 0)
    return RequestRecord(output_tokens=tokens, ttft=ttft, latency=latency, success=success)


def check_goodput_on_paper(impl: ModuleType) -> None:
    """4 requests in 2 s under TTFT 1 s and TPOT 0.1 s: 2 meet both, goodput 1.0 per second.

    One is too slow to start, one too slow per token, and a failed request never counts."""
    records = [
        _record(0.5, 0.05, 10),  # meets both
        _record(1.0, 0.1, 5),  # exactly at both limits: meets them
        _record(1.5, 0.05, 10),  # TTFT over
        _record(0.5, 0.2, 10),  # TPOT over
        _record(0.1, 0.01, 10, success=False),  # failed
    ]
    slos = {"ttft": 1.0, "tpot": 0.1}
    met = [impl.meets_slos(r, slos) for r in records[:4]]
    assert met == [True, True, False, False], (
        f"expected [meets, meets (at the limits), TTFT over, TPOT over] = "
        f"[True, True, False, False], got {met}"
    )
    got = impl.request_goodput(records, 2.0, slos)
    assert _close(got, 1.0), f"2 good requests in 2.0 s: expected goodput 1.0, got {got}"


def check_goodput_with_an_e2e_slo_and_one_token_requests(impl: ModuleType) -> None:
    """A one-token request has TPOT 0, so it meets any TPOT SLO; "e2el" limits E2E latency."""
    one_token = _record(0.9, 0.0, 1)
    assert impl.meets_slos(one_token, {"tpot": 0.001}), (
        "a one-token request has TPOT 0 and meets a TPOT SLO of 1 ms"
    )
    records = [_record(0.2, 0.1, 9), _record(0.2, 0.1, 3)]  # E2E 1.0 s and 0.4 s
    got = impl.request_goodput(records, 4.0, {"e2el": 0.5})
    assert _close(got, 0.25), (
        f"under E2E 0.5 s only the 0.4 s request counts: expected 1 / 4.0 = 0.25, got {got}"
    )


def check_goodput_matches_minserve_on_random_runs(impl: ModuleType) -> None:
    """Random records and SLOs: the same goodput as minserve's `summarize`."""
    impl.request_goodput([_record(0.1, 0.1, 2)], 1.0, {"ttft": 1.0})  # a stub stops here

    times = st.floats(0.0, 2.0, allow_nan=False)
    record = st.builds(_record, times, st.floats(0.0, 0.3, allow_nan=False),
                       st.integers(0, 20), st.booleans())  # fmt: skip
    limits = st.dictionaries(st.sampled_from(serve_metrics.SLO_METRICS),
                             st.floats(0.01, 2.0, allow_nan=False), min_size=1)  # fmt: skip

    @_PROPERTY
    @given(records=st.lists(record, max_size=12), slos=limits,
           duration=st.floats(0.5, 60.0, allow_nan=False))  # fmt: skip
    def agrees(records: list[RequestRecord], slos: dict[str, float], duration: float) -> None:
        want = serve_metrics.summarize(records, duration, slos)["request_goodput"]
        got = impl.request_goodput(records, duration, slos)
        shown = [(r.ttft, r.tpot, r.latency, r.output_tokens, r.success) for r in records]
        assert _close(got, want), (
            f"request_goodput over records (ttft, tpot, e2e, tokens, success) {shown}, "
            f"duration {duration} s, SLOs {slos}: expected {want}, got {got}"
        )

    agrees()


# Exercise 9.5: stop strings on paper, then random texts, stop strings and splits.
def _stream(matcher: Any, deltas: list[str], flush: bool) -> list[tuple[str, str | None]]:
    """What a matcher returns for each delta until a stop string matches, then its flush."""
    out = []
    for delta in deltas:
        out.append(matcher.feed(delta))
        if out[-1][1] is not None:
            return out
    return out + [(matcher.flush(), None)] if flush else out


def check_first_stop_is_the_one_completed_first(impl: ModuleType) -> None:
    """In "the end. stop", "end" ends first; in "xab", "ab" beats "b" (same end, longer)."""
    cases = [("the end. stop", ["stop", "end"]), ("xab", ["b", "ab"]), ("xabcd", ["bcd", "abc"]),
             ("no match here", ["stop"]), ("aaa", ["aa", "a"]), ("", ["x"])]  # fmt: skip
    for text, stops in cases:
        want, got = first_stop(text, stops), impl.first_stop(text, stops)
        assert got == want, f"first_stop({text!r}, {stops!r}): expected {want}, got {got}"


def check_partial_stop_length_is_the_longest_tail_that_can_grow(impl: ModuleType) -> None:
    """A tail "</an" could become "</answer>": hold 4; a whole stop string or no prefix: 0"""
    cases = [("The </an", ["</answer>"]), ("abc", ["abc"]), ("xx<", ["<<a"]), ("x<<", ["<<a"]),
             ("hello", ["stop", "lo!", "o?"]), ("", ["stop"]), ("ab", ["b", "bc"]),
             ("aaaa", ["aaab"])]  # fmt: skip
    for text, stops in cases:
        want, got = partial_stop_length(text, stops), impl.partial_stop_length(text, stops)
        assert got == want, f"partial_stop_length({text!r}, {stops!r}): expected {want}, got {got}"


def check_a_stop_string_across_two_deltas_is_cut(impl: ModuleType) -> None:
    """Across deltas "The </ans" + "wer> more": "The ", then "" (or the stop string) and it"""
    for include in (False, True):
        want = _stream(StopStringMatcher(["</answer>"], include), ["The </ans", "wer> more"], False)
        got = _stream(impl.StopStringMatcher(["</answer>"], include), ["The </ans", "wer> more"],
                      False)  # fmt: skip
        assert got == want, (
            f"deltas ['The </ans', 'wer> more'], stop '</answer>', include_stop_str_in_output="
            f"{include}: expected {want}, got {got}"
        )


def check_flush_releases_the_held_tail_and_a_match_ends_the_text(impl: ModuleType) -> None:
    """Text "a </an" ends without a stop: flush gives "</an"; feeding after a match raises."""
    matcher = impl.StopStringMatcher(["</answer>"])
    got = [matcher.feed("a </an"), matcher.flush(), matcher.flush()]
    want = [("a ", None), "</an", ""]
    assert got == want, f"feed('a </an'), flush(), flush(): expected {want}, got {got}"
    matcher = impl.StopStringMatcher(["x"])
    matcher.feed("ax")
    try:
        matcher.feed("more")
    except RuntimeError:
        return
    raise AssertionError("feed after the stop string 'x' matched: expected a RuntimeError")


def _stream_case(impl: ModuleType, text: str, cuts: list[int], stops: list[str], include: bool,
                 flush: bool) -> None:  # fmt: skip
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    want = _stream(StopStringMatcher(stops, include), deltas, flush)
    got = _stream(impl.StopStringMatcher(stops, include), deltas, flush)
    assert got == want, (
        f"deltas {deltas!r}, stop strings {stops!r}, include_stop_str_in_output={include}, "
        f"flush at the end: {flush}: expected (text, stop) per call {want}, got {got}"
    )


def check_random_streams_match_minserves_matcher(impl: ModuleType) -> None:
    """Random texts, stop strings and splits into deltas: the same output call by call."""
    _stream_case(impl, "ab<ab>", [2, 3], ["<ab>", "b<"], False, True)  # a stub stops here

    @_PROPERTY
    @given(
        text=st.text("ab<>", max_size=14),
        cuts=st.lists(st.integers(0, 14), max_size=6),
        stops=st.lists(st.text("ab<>", min_size=1, max_size=4), min_size=1, max_size=3),
        include=st.booleans(),
        flush=st.booleans(),
    )
    def agrees(text: str, cuts: list[int], stops: list[str], include: bool, flush: bool) -> None:
        _stream_case(impl, text, cuts, stops, include, flush)

    agrees()


# Exercise 9.6: a server with max_model_len 100, 4 sequences, 10 requests, vocabulary 50.
LIMITS = ServerLimits(max_model_len=100, max_num_seqs=4, capacity=10, vocab_size=50)


def _refusal(limits: Any, lengths: list[int], params: SamplingParams, given: bool) -> tuple:
    """(status, param, code, message) of the APIError `check` raises, or None."""
    try:
        limits.check(lengths, params, "max_tokens", given)
    except APIError as error:
        return error.status, error.param, error.code, error.message
    return None


def _refused_as_minserve(impl: ModuleType, lengths: list[int], params: SamplingParams,
                         given: bool, numbers: tuple[int, ...] = ()) -> None:  # fmt: skip
    """The student's check refuses exactly what minserve's does, with its status, param and
    code, and a message naming `numbers` (and every number minserve's message names)."""
    yours = impl.ServerLimits(100, 4, 10, 50)
    want, got = _refusal(LIMITS, lengths, params, given), _refusal(yours, lengths, params, given)
    case = (
        f"max_model_len 100, max_num_seqs 4, capacity 10, vocab 50; prompts of {lengths} "
        f"tokens, n={params.n}, max_tokens={params.max_tokens} (given: {given}), "
        f"stop_token_ids={params.stop_token_ids}"
    )
    if want is None or got is None:
        assert got == want, f"{case}: expected {want or 'no refusal'}, got {got or 'no refusal'}"
        return
    assert got[:3] == want[:3], (
        f"{case}: expected APIError status {want[0]}, param {want[1]!r}, code {want[2]!r} "
        f"({want[3]!r}); got status {got[0]}, param {got[1]!r}, code {got[2]!r} ({got[3]!r})"
    )
    for number in numbers:
        assert str(number) in got[3], f"{case}: the message should say {number}; got {got[3]!r}"


def check_a_prompt_and_max_tokens_past_the_context_are_refused(impl: ModuleType) -> None:
    """60 + 50 > 100: a 400 "context_length_exceeded" on max_tokens naming 60, 50, 100, 40."""
    _refused_as_minserve(impl, [60], SamplingParams(max_tokens=50), True, (60, 50, 100, 40))
    _refused_as_minserve(impl, [60, 90], SamplingParams(max_tokens=5), True, (90, 5, 100, 10))
    _refused_as_minserve(impl, [60], SamplingParams(max_tokens=40), True)  # exactly fits
    _refused_as_minserve(impl, [60], SamplingParams(max_tokens=50), False)  # a default: no
    _refused_as_minserve(impl, [100], SamplingParams(max_tokens=5), True)  # the engine's


def check_too_many_samples_prompts_or_a_bad_stop_token_are_refused(impl: ModuleType) -> None:
    """n 5 > 4 sequences, 11 prompts > 10 requests, stop token 50 >= vocabulary 50: each a 400."""
    sampled = SamplingParams(n=5, temperature=1.0, max_tokens=5)
    _refused_as_minserve(impl, [3], sampled, True, (5, 4))
    _refused_as_minserve(impl, [3] * 11, SamplingParams(max_tokens=5), True, (11, 10))
    stops = SamplingParams(max_tokens=5, stop_token_ids=[7, 50, 99])
    _refused_as_minserve(impl, [3], stops, True, (50, 99))
    _refused_as_minserve(impl, [3], SamplingParams(max_tokens=5, stop_token_ids=[50]), True)
    fine = SamplingParams(n=4, temperature=1.0, max_tokens=5, stop_token_ids=[49])
    _refused_as_minserve(impl, [3] * 10, fine, True)


def check_random_requests_are_refused_as_minserves_limits_refuse_them(impl: ModuleType) -> None:
    """Random prompts, n, max_tokens and stop ids: the same refusals, in the same order."""
    _refused_as_minserve(impl, [60], SamplingParams(max_tokens=50), True)  # a stub stops here

    @_PROPERTY
    @given(
        lengths=st.lists(st.integers(1, 120), min_size=1, max_size=12),
        n=st.integers(1, 6),
        max_tokens=st.integers(1, 120),
        given_=st.booleans(),
        stop_ids=st.lists(st.integers(0, 60), max_size=3),
    )
    def agrees(lengths: list[int], n: int, max_tokens: int, given_: bool, stop_ids: list[int]):
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens,
                                stop_token_ids=stop_ids)  # fmt: skip
        _refused_as_minserve(impl, lengths, params, given_)

    agrees()


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
    check_timings_of_a_request_on_paper,
    check_tpot_on_paper,
    check_timings_match_minserve_on_random_timestamps,
    check_goodput_on_paper,
    check_goodput_with_an_e2e_slo_and_one_token_requests,
    check_goodput_matches_minserve_on_random_runs,
    check_first_stop_is_the_one_completed_first,
    check_partial_stop_length_is_the_longest_tail_that_can_grow,
    check_a_stop_string_across_two_deltas_is_cut,
    check_flush_releases_the_held_tail_and_a_match_ends_the_text,
    check_random_streams_match_minserves_matcher,
    check_a_prompt_and_max_tokens_past_the_context_are_refused,
    check_too_many_samples_prompts_or_a_bad_stop_token_are_refused,
    check_random_requests_are_refused_as_minserves_limits_refuse_them,
]


HINTS: dict[str, tuple[str, str, str]] = {
    "9.3": (
        "Route to the replica that already holds the most of this prompt (its prefix cache "
        "will serve it), but not at any price: a replica far busier than the idlest one "
        "loses to load.",
        "First find the least-loaded candidate (ties broken by the rotating order) and the "
        "match per replica (all zeros without a key). Then pick the best match among the "
        "candidates; no match at all means least_loaded; too busy means balance; else prefix.",
        "least: the min over self._turns.order(candidates) by load; best: the max over the "
        "candidates by (matched tokens, minus load); compare loads[best] - "
        "loads[least] with self.balance_threshold (strictly greater passes it over).",
    ),
    "9.4": (
        "A delta is what this step adds: token ids become text through the incremental "
        "detokenizer, and text passes the stop-string matcher, which may hold some back or "
        "cut it; a token whose text is held back still goes out, with empty text.",
        "Loop over new.token_ids: keep the token, step the detokenizer, feed its text to the "
        "matcher, stop the loop when a stop string completes. Then, if the scheduler finished "
        "the sample, release what is held back. Build the CompletionOutput from what you kept.",
        "piece, hit = self.stops.feed(self.detokenizer.step(token)); on hit: finish_reason "
        "'stop', stop_reason hit, break; on new.finish_reason: text += "
        "self.stops.feed(self.detokenizer.flush())[0] + self.stops.flush(); the EOS token "
        "('stop') adds no text of its own.",
    ),
    "9.1": (
        "Every latency a client reports is a difference of two timestamps on one clock: "
        "when the request went out and when each chunk with a token came back.",
        "TTFT: first chunk minus the send time; ITL: the gaps between neighbouring chunks; "
        "E2E: last chunk minus the send time. TPOT spreads the time after the first token "
        "over the tokens after the first, and is 0 when there are none.",
        "zip(chunk_at, chunk_at[1:]) walks the neighbouring pairs; the first and last "
        "elements of chunk_at give TTFT and E2E against sent_at; for TPOT, return 0.0 early "
        "when output_tokens <= 1.",
    ),
    "9.2": (
        "Goodput counts only the requests that met every SLO they are held to, per second "
        "of the run: a request that finished too late is not served.",
        "meets_slos: look up the request's value for each SLO name (ttft, tpot, e2el) and "
        "require each to be at most its limit. request_goodput: count the successful "
        "requests that meet them, divide by the run's duration.",
        "Map each SLO name to the record's own value (ttft, tpot, and latency for e2el), "
        "then all(value <= limit ...) over slos.items(); the goodput is a sum over the "
        "records of (succeeded and met them), divided by duration_s.",
    ),
}

HINTS["9.5"] = (
    "A stop string can straddle deltas, so the matcher must never show text that might "
    "still become part of one: it holds back the longest tail that is the start of some "
    "stop string, and decides when more text arrives. Which string wins is decided as if "
    "text came one character at a time: the one that is complete soonest.",
    "first_stop: for each stop string, find its first occurrence; keep the one with the "
    "smallest end, ties to the earliest start. partial_stop_length: try tails from the "
    "longest possible (shorter than the longest stop string, no longer than the text) "
    "down to 1; the first one that begins a stop string wins. feed: join the held text "
    "and the delta, look for a full match, else hold the partial tail back. flush: hand "
    "over the held text and forget it.",
    "`text.find(s)` gives a start or -1; `min` over (end, start, s) tuples breaks ties for "
    "you; `s.startswith(tail)` tests a tail; in feed, `text[:start]` (or through "
    "`start + len(...)` with include_stop_str_in_output) is the shown text once a stop "
    "string matched; otherwise the last `keep` characters go into `self._held`.",
)
HINTS["9.6"] = (
    "A 503 means busy, try later; a request that could never run deserves a 400 now, "
    "with the numbers that rule it out, so a client can fix it instead of retrying "
    "forever. Each bound is one comparison against a number the engine was built with.",
    "check runs the four tests in order: the batch size against capacity, n against "
    "max_num_seqs, the stop token ids against vocab_size, and, only when the client set "
    "max_tokens, the longest prompt plus max_tokens against max_model_len. Each of the four "
    "raises an APIError with status 400, the parameter at fault and the code, or returns.",
    "`len(prompt_lengths)` is the batch; `max(prompt_lengths)` the prompt that decides the "
    "context; the room left is `self.max_model_len - prompt_len`; a prompt already at or "
    'past max_model_len returns early; `APIError(400, f"...", param=..., code=...)` '
    "carries the refusal.",
)

PROGRESS: dict[str, str] = {
    "9.5": "partial_stop_length: each pass must try a shorter tail of the text, down to length 1",
}
