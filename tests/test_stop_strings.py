"""Stop strings on a stream: cut at the first one to complete, never show part of one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minserve.stop_strings import StopStringMatcher


def reference_cut(full_text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """What the whole text should become: cut at the stop string that completes first."""
    hits = [(full_text.find(s) + len(s), full_text.find(s), s) for s in stops if s in full_text]
    if not hits:
        return full_text, None
    end, start, stop = min(hits)
    return full_text[: end if include else start], stop


def stream(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], str | None]:
    """Feed deltas until a stop string matches; flush if none does. Returns what was shown."""
    shown = []
    for delta in deltas:
        text, stop = matcher.feed(delta)
        shown.append(text)
        if stop is not None:
            return shown, stop
    shown.append(matcher.flush())
    return shown, None


def test_text_without_stop_strings_passes_through_unchanged():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=False)
    assert matcher.feed("Hello, world") == ("Hello, world", None)


def test_cuts_before_a_stop_string_inside_one_delta():
    matcher = StopStringMatcher(["\n\n"], include_stop_str_in_output=False)
    assert matcher.feed("first line\n\nsecond") == ("first line", "\n\n")
    assert matcher.matched == "\n\n"


def test_include_stop_str_in_output_keeps_the_stop_string():
    matcher = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert matcher.feed("abc END def") == ("abc END", "END")


def test_stop_string_split_across_deltas_is_never_shown():
    matcher = StopStringMatcher(["</answer>"], include_stop_str_in_output=False)
    assert matcher.feed("42 </ans") == ("42 ", None)  # "</ans" could be the stop string
    assert matcher.feed("wer> trailing") == ("", "</answer>")


def test_held_back_text_is_released_once_it_cannot_be_a_stop_string():
    matcher = StopStringMatcher(["</answer>"], include_stop_str_in_output=False)
    assert matcher.feed("a </an") == ("a ", None)
    assert matcher.feed("d b") == ("</and b", None)


def test_flush_releases_the_held_tail_when_generation_ends_otherwise():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=False)
    assert matcher.feed("almost ST") == ("almost ", None)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_stop_string_spread_over_one_character_deltas():
    matcher = StopStringMatcher(["<|end|>"], include_stop_str_in_output=True)
    shown, stop = stream(matcher, list("ok<|end|>more"))
    assert ("".join(shown), stop) == ("ok<|end|>", "<|end|>")


def test_the_stop_string_completed_first_wins_even_if_another_starts_earlier():
    # Streaming "abcd" character by character completes "bc" (at "abc") before "abcd".
    matcher = StopStringMatcher(["abcd", "bc"], include_stop_str_in_output=True)
    assert matcher.feed("xabcd") == ("xabc", "bc")


def test_on_a_tie_the_longer_stop_string_wins():
    matcher = StopStringMatcher(["b", "ab"], include_stop_str_in_output=True)
    assert matcher.feed("xab") == ("xab", "ab")


def test_overlapping_partial_match_still_finds_the_stop_string():
    matcher = StopStringMatcher(["aab"], include_stop_str_in_output=False)
    assert matcher.feed("xaa") == ("x", None)
    assert matcher.feed("ab") == ("a", "aab")


def test_no_stop_strings_means_nothing_is_held():
    matcher = StopStringMatcher([], include_stop_str_in_output=False)
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_feeding_after_a_match_is_an_error():
    matcher = StopStringMatcher(["x"], include_stop_str_in_output=False)
    matcher.feed("x")
    with pytest.raises(RuntimeError, match="already matched"):
        matcher.feed("more")


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""], include_stop_str_in_output=False)


def test_a_bare_string_is_rejected():
    with pytest.raises(TypeError, match="not a single string"):
        StopStringMatcher("STOP", include_stop_str_in_output=False)  # type: ignore[arg-type]


# Small alphabets make stop strings, overlaps and partial matches common.
_ALPHABET = "ab<>\n"
_texts = st.text(alphabet=_ALPHABET, max_size=40)
_stops = st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), max_size=3)


@st.composite
def _split(draw: st.DrawFn, text: str) -> list[str]:
    """`text` cut into deltas at random places (empty deltas included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@given(data=st.data(), text=_texts, stops=_stops, include=st.booleans())
def test_streamed_output_equals_the_reference_cut_for_any_split(data, text, stops, include):
    deltas = data.draw(_split(text))
    shown, stop = stream(StopStringMatcher(stops, include_stop_str_in_output=include), deltas)
    assert ("".join(shown), stop) == reference_cut(text, stops, include)


@given(data=st.data(), text=_texts, stops=_stops)
def test_stream_never_shows_part_of_a_stop_string(data, text, stops):
    expected, _ = reference_cut(text, stops, include=False)
    matcher = StopStringMatcher(stops, include_stop_str_in_output=False)
    shown, fed = "", ""
    for delta in data.draw(_split(text)):
        fed += delta
        piece, stop = matcher.feed(delta)
        shown += piece
        assert expected.startswith(shown)  # nothing past the cut, ever
        if stop is not None:
            break
        # ...and nothing held back that could not be the start of a stop string.
        assert len(fed) - len(shown) < max((len(s) for s in stops), default=1)
