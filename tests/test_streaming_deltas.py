"""Streaming: each engine delta is one piece per choice, as vLLM streams them.

A token whose text the output processor holds back (half a UTF-8 character) still makes a
piece, with its token id and empty text, so a client sees it when it was sampled; the text
comes with a later piece, and the pieces join to the whole text. Whole (non-streaming)
outputs are the same deltas added up.
"""

from __future__ import annotations

from minserve.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from minserve.server.streaming import ChoiceStream, token_counts, whole_pieces


def delta(*completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], list(completions), finished=finished)


STEPS = [
    delta(CompletionOutput(0, "", [226])),  # the first half of "é": nothing to show yet
    delta(CompletionOutput(0, "é", [102])),
    delta(CompletionOutput(0, "!", [0], finish_reason="length"), finished=True),
]


def test_a_held_back_token_streams_an_empty_piece_and_its_text_follows() -> None:
    choices = ChoiceStream(n=1)
    pieces = [choices.pieces(0, step) for step in STEPS]
    assert [[(p.text, p.token_ids, first) for p, first in step] for step in pieces] == [
        [("", [226], True)],
        [("é", [102], False)],
        [("!", [0], False)],
    ]
    assert pieces[-1][0][0].finish_reason == "length"
    assert (choices.prompt_tokens, choices.completion_tokens) == (2, 3)


def test_choices_are_numbered_across_prompts() -> None:
    choices = ChoiceStream(n=2)
    step = delta(CompletionOutput(0, "a", [1]), CompletionOutput(1, "b", [2]))
    assert [p.index for p, _ in choices.pieces(1, step)] == [2, 3]
    only_second = delta(CompletionOutput(1, "c", [3]))
    assert [(p.index, p.text, first) for p, first in choices.pieces(1, only_second)] == [
        (3, "c", False)
    ]


def test_deltas_add_up_to_the_whole_output() -> None:
    whole = OutputAccumulator()
    for step in STEPS:
        out = whole.add(step)
    (completion,) = out.outputs
    assert (completion.text, completion.token_ids) == ("é!", [226, 102, 0])
    assert completion.finish_reason == "length" and out.finished
    assert STEPS[0].outputs[0].token_ids == [226]  # the deltas themselves are left as they were
    (piece,) = whole_pieces({0: out}, n=1)
    assert (piece.text, piece.token_ids) == ("é!", [226, 102, 0])
    assert token_counts({0: out}) == (2, 3)


def test_samples_that_start_later_keep_their_index_order() -> None:
    whole = OutputAccumulator()
    whole.add(delta(CompletionOutput(1, "b", [2], logprobs=[{2: -0.5}], cumulative_logprob=-0.5)))
    out = whole.add(delta(CompletionOutput(0, "a", [1]), CompletionOutput(1, "c", [3],
                          logprobs=[{3: -0.25}], cumulative_logprob=-0.75)))  # fmt: skip
    assert [(c.index, c.text) for c in out.outputs] == [(0, "a"), (1, "bc")]
    assert out.outputs[1].logprobs == [{2: -0.5}, {3: -0.25}]
    assert out.outputs[1].cumulative_logprob == -0.75
