"""`DeltaTracker`: each step with new tokens is one streamed piece, as vLLM streams them.

A token whose text the detokenizer holds back (half a UTF-8 character) still makes a piece,
with its token id and empty text, so a client sees it when it was sampled; the text comes
with a later piece, and the pieces join to the whole text.
"""

from __future__ import annotations

from minserve.outputs import CompletionOutput, RequestOutput
from minserve.server.streaming import DeltaTracker


def output(*completions: CompletionOutput) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], list(completions))


def test_a_held_back_token_streams_an_empty_piece_and_its_text_follows() -> None:
    tracker = DeltaTracker(n=1)
    steps = [
        output(CompletionOutput(0, "", [226])),  # the first half of "é": nothing to show yet
        output(CompletionOutput(0, "é", [226, 102])),
        output(CompletionOutput(0, "é!", [226, 102, 0], finish_reason="length")),
    ]
    pieces = [tracker.update(0, step) for step in steps]
    assert [[(p.text, p.token_ids, first) for p, first in step] for step in pieces] == [
        [("", [226], True)],
        [("é", [102], False)],
        [("!", [0], False)],
    ]
    assert pieces[-1][0][0].finish_reason == "length"
    assert tracker.update(0, steps[-1]) == []  # finished: nothing more
    assert tracker.completion_tokens() == 3


def test_only_the_choices_that_moved_get_a_piece() -> None:
    tracker = DeltaTracker(n=2)
    tracker.update(0, output(CompletionOutput(0, "a", [1]), CompletionOutput(1, "b", [2])))
    moved = output(CompletionOutput(0, "a", [1]), CompletionOutput(1, "bc", [2, 3]))
    assert [(p.index, p.text, p.token_ids) for p, _ in tracker.update(0, moved)] == [(1, "c", [3])]
