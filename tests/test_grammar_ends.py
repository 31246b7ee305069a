"""Whether a grammar can end (minserve/structured/grammar_ends.py, exercise 12.5): the
chapter's checks pass the solutions and catch the usual wrong answers, and the compiler
runs whichever `can_end` it is given (the engine passes `CoursePlugins(grammar_can_end=)`:
tests/test_structured_output.py)."""

from __future__ import annotations

from types import ModuleType

import pytest
import xgrammar as xgr

from minserve.course import checks_ch12
from minserve.course.chapters import REPO_ROOT, get_chapter
from minserve.course.check import load_implementation
from minserve.errors import StructuredOutputError
from minserve.sampling_params import StructuredOutputsParams
from minserve.structured.compiler import GrammarCompiler

CHECKS_12_5 = [
    checks_ch12.check_productive_rules_is_a_fixpoint_over_the_rules,
    checks_ch12.check_parse_alternatives_reads_items_groups_and_quantifiers,
    checks_ch12.check_can_end_on_what_xgrammar_prints,
    checks_ch12.check_random_grammars_end_as_their_shortest_derivation_says,
]
NEVER_ENDS = 'root ::= "a" root'


def _solutions() -> ModuleType:
    return load_implementation(get_chapter("12"), "solutions", REPO_ROOT).module


def _with_bug(original: str, bug: str) -> ModuleType:
    """The solutions module with one line of its source changed."""
    path = REPO_ROOT / get_chapter("12").generated_path("solution")
    source = path.read_text(encoding="utf-8")
    assert source.count(original) == 1, original
    module = ModuleType("wrong_ch12")
    exec(compile(source.replace(original, bug), str(path), "exec"), module.__dict__)  # noqa: S102
    return module


@pytest.mark.parametrize("check", CHECKS_12_5, ids=lambda c: c.__name__)
def test_the_solutions_pass(check) -> None:
    check(_solutions())


def test_a_single_pass_over_the_rules_is_caught() -> None:
    wrong = _with_bug("    while changed:\n", "    for _ in range(1):\n")
    with pytest.raises(AssertionError, match=r"(?s)root ::= a\n.*expected \['a', 'b', 'root'\]"):
        checks_ch12.check_productive_rules_is_a_fixpoint_over_the_rules(wrong)
    with pytest.raises(AssertionError, match="expected True"):
        checks_ch12.check_can_end_on_what_xgrammar_prints(wrong)


FIXPOINT = """\
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in productive and _any_ends(alternatives, productive):
                productive.add(name)
                changed = True
    return productive
"""
DEPTH_FIRST = """\
    known: dict[str, bool] = {}  # cached, even when found while an ancestor was open

    def ends(name: str, open_: frozenset) -> bool:
        if name not in known:
            if name in open_ or name not in rules:
                return False
            known[name] = search(rules[name], open_ | {name})
        return known[name]

    def search(alternatives, open_) -> bool:
        return any(all(opt or kind == "terminal" or (ends(value, open_) if kind == "rule"
                   else search(value, open_)) for (kind, value), opt in seq)
                   for seq in alternatives)

    return {name for name in rules if ends(name, frozenset())}
"""


def test_a_depth_first_search_that_caches_in_a_cycle_is_caught() -> None:
    wrong = _with_bug(FIXPOINT, DEPTH_FIRST)
    with pytest.raises(AssertionError, match=r"b ::= a \"x\"\nexpected \['a', 'b', 'root'\]"):
        checks_ch12.check_productive_rules_is_a_fixpoint_over_the_rules(wrong)
    with pytest.raises(AssertionError, match=r'b ::= \(\(a "x"\)\)\n.*expected True, got False'):
        checks_ch12.check_can_end_on_what_xgrammar_prints(wrong)


def test_every_repeat_taken_for_optional_is_caught() -> None:
    wrong = _with_bug(
        'quantifier.startswith("{") and int(quantifier[1:].split(",")[0]) == 0',
        'quantifier.startswith("{")',
    )
    with pytest.raises(AssertionError, match=r"tokens of 'x\* y\+ z\? w\{0, 3\} v\{2, -1\}'"):
        checks_ch12.check_parse_alternatives_reads_items_groups_and_quantifiers(wrong)
    with pytest.raises(AssertionError, match=r"expected False \(no derivation from root"):
        checks_ch12.check_random_grammars_end_as_their_shortest_derivation_says(wrong)


def test_quantifiers_ignored_are_caught() -> None:
    wrong = _with_bug(
        "alternatives[-1].append((item, optional))", "alternatives[-1].append((item, False))"
    )
    with pytest.raises(AssertionError, match=r"tokens of 'x\* y\+"):
        checks_ch12.check_parse_alternatives_reads_items_groups_and_quantifiers(wrong)
    with pytest.raises(AssertionError, match=r"expected True \(root derives '.*'\), got False"):
        checks_ch12.check_random_grammars_end_as_their_shortest_derivation_says(wrong)


def test_refusing_a_text_without_a_root_is_caught() -> None:
    wrong = _with_bug(
        "return root not in rules or root in productive_rules(rules)",
        "return root in productive_rules(rules)",
    )
    with pytest.raises(AssertionError, match=r"root='root'\): expected True, got False"):
        checks_ch12.check_can_end_on_what_xgrammar_prints(wrong)


def test_a_sequence_ending_on_one_item_is_caught() -> None:
    wrong = _with_bug("return any(all(_ends(", "return any(any(_ends(")
    with pytest.raises(AssertionError, match=r'root ::= "a" root\nexpected \[\], got \[\'root\'\]'):
        checks_ch12.check_productive_rules_is_a_fixpoint_over_the_rules(wrong)
    printed = r'root ::= \(\("a" root\)\)\n'  # xgrammar's print of 'root ::= "a" root'
    with pytest.raises(AssertionError, match=printed + "expected False, got True"):
        checks_ch12.check_can_end_on_what_xgrammar_prints(wrong)


@pytest.fixture(scope="module")
def hand_info() -> xgr.TokenizerInfo:
    texts = ["", "<eos>", *"abc"]
    return xgr.TokenizerInfo(texts, xgr.VocabType.RAW, vocab_size=len(texts), stop_token_ids=[1])


def _no_tokens(text: str) -> list[int]:
    return []


def _grammar(text: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(grammar=text)


def test_the_compiler_refuses_what_its_can_end_refuses(hand_info) -> None:
    read: list[str] = []

    def never(printed: str) -> bool:
        read.append(printed)
        return False

    with pytest.raises(StructuredOutputError, match="never ends"):
        GrammarCompiler(hand_info, _no_tokens, can_end=never).compile(_grammar('root ::= "a"'))
    assert read == ['root ::= (("a"))\n']  # xgrammar's print of the compiled grammar
    GrammarCompiler(hand_info, _no_tokens, can_end=lambda _: True).compile(_grammar(NEVER_ENDS))
    with pytest.raises(StructuredOutputError, match="never ends"):
        GrammarCompiler(hand_info, list).compile(_grammar(NEVER_ENDS))  # minserve's can_end
