"""Checks for chapter 12 (structured output), run against any module that defines
`apply_token_bitmask`, `choice_dfa`, `walk`, `token_masks`, `ChoiceMatcher`,
`rollback_states`, `forced_text`, `can_end`, `parse_alternatives` and `productive_rules`:
minserve's own, the solutions, or a student's file.

The oracles are real: a bit-by-bit torch loop for 12.1, xgrammar (the engine's grammar
library) for 12.2-12.4: its token masks at every state of a choice's DFA, its matcher's
answers on random walks with rollbacks, its jump-forward string; for 12.5, hand-worked
grammars and JSON schemas in xgrammar's print, and 300 random grammars whose shortest text
(or the lack of one) is worked out on the grammar as written, before xgrammar rewrites it. Two
vocabularies: a hand-made one of 70 tokens (not a multiple of 32; one special token, one
EOS) that xgrammar reads as raw strings, and SmolLM2's own 49,152 as the engine decodes them.
"""

from __future__ import annotations

import random
from functools import cache
from types import ModuleType

import torch

from minserve.model.token_mask import bitmask_words
from minserve.structured import choice_dfa as reference
from minserve.structured.choice_dfa import DONE, ChoiceDFA, Vocabulary
from minserve.structured.grammar_spec import choice_grammar

EOS = 2
HAND_TEXTS = (
    ["", "<special>", "<eos>"]  # 0 a padding id, 1 a special token, 2 EOS: never spelled
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    + [" ", "ye", "yes", " sir", "no", "pos", "itive", "neg", "ative", "ut", "The", " answer"]
    + [" is", "é", "è"]
)  # 70 tokens
HAND_CHOICES = (
    ["yes", "no"],
    ["yes", "yes sir", "no"],  # a choice that is a prefix of another
    ["positive", "negative", "neutral"],
    ["The answer is yes", "The answer is no"],  # a long forced prefix
    ["café", "cafè"],  # two-byte characters that share their first byte
)


def _blank(text: str) -> bytes:
    """The bytes a token decodes to in the engine's vocabulary: none for special ones."""
    return b"" if text.startswith("<") else text.encode()


@cache
def hand_vocabulary() -> Vocabulary:
    texts = tuple(_blank(t) for t in HAND_TEXTS)
    return Vocabulary(texts, (EOS,), _hand_encode)


def _hand_encode(text: str) -> list[int]:
    """Greedy longest match over the hand-made vocabulary."""
    by_text, ids, data = hand_vocabulary().by_text, [], text.encode()
    while data:
        end = max(n for n in range(1, len(data) + 1) if data[:n] in by_text)
        ids.append(by_text[data[:end]][0])
        data = data[end:]
    return ids


@cache
def _hand_xgrammar():
    import xgrammar as xgr

    encoded = ["" if t.startswith("<") else t for t in HAND_TEXTS]
    info = xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=len(encoded), stop_token_ids=[EOS]
    )
    return xgr.GrammarCompiler(info, cache_enabled=False)


@cache
def smollm2() -> tuple[Vocabulary, object]:
    """SmolLM2's vocabulary as the engine reads it, and an xgrammar compiler over it."""
    import xgrammar as xgr

    from minserve.loader import default_model_path
    from minserve.model.tokenizer import Tokenizer
    from minserve.structured.compiler import tokenizer_info

    tokenizer = Tokenizer.from_gguf(default_model_path())
    info = tokenizer_info(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    vocab = Vocabulary.from_tokenizer_info(info, encode)
    return vocab, xgr.GrammarCompiler(info, cache_enabled=False)


def _xgrammar_matcher(compiler, choices: list[str]):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiler.compile_grammar(choice_grammar(choices)))


def _xgrammar_mask(matcher, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]


def _paths(dfa: ChoiceDFA) -> dict[int, bytes]:
    """Each state's bytes from the start."""
    paths, pending = {0: b""}, [0]
    while pending:
        at = pending.pop()
        for label, target in sorted(dfa.edges[at].items()):
            paths[target] = paths[at] + bytes([label])
            pending.append(target)
    return paths


def _token_paths(dfa: ChoiceDFA, vocab: Vocabulary) -> dict[int, list[int]]:
    """The fewest tokens that reach each state a token sequence can reach (breadth first;
    a state inside a character may have none, in a vocabulary without its bytes)."""
    paths: dict[int, list[int]] = {0: []}
    frontier = [0]
    while frontier:
        following = []
        for state in frontier:
            for token, text in enumerate(vocab.texts):
                next_state = reference.walk(dfa, state, text) if text else None
                if next_state is not None and next_state not in paths:
                    paths[next_state] = paths[state] + [token]
                    following.append(next_state)
        frontier = following
    return paths


def _byte_tokens(vocab: Vocabulary, data: bytes) -> list[int]:
    """`data` spelled one byte per token."""
    return [vocab.by_text[bytes([byte])][0] for byte in data]


def _allowed(row: torch.Tensor, vocab_size: int) -> list[int]:
    return [t for t in range(vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1]


def _spelled(ids: list[int], vocab: Vocabulary, limit: int = 12) -> str:
    shown = [vocab.texts[t].decode(errors="replace") or f"<{t}>" for t in ids[:limit]]
    return repr(shown) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


# Exercise 12.1: the bitmask on the logits.
def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Bit by bit: the obvious loop, slow and sure."""
    expected = logits.clone()
    rows, vocab = logits.shape
    for row in range(rows):
        for token in range(vocab):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    return expected


def _check_masked(impl: ModuleType, logits: torch.Tensor, bitmask: torch.Tensor, what: str):
    before = logits.clone()
    got = impl.apply_token_bitmask(logits, bitmask)
    expected = _reference_mask(logits, bitmask)
    assert torch.equal(logits, before), f"{what}: apply_token_bitmask changed its input logits"
    assert got.shape == expected.shape and got.dtype == logits.dtype, (
        f"{what}: expected a {tuple(expected.shape)} {logits.dtype} tensor, got "
        f"{tuple(got.shape)} {got.dtype}"
    )
    wrong = (got != expected) & ~(got.isnan() & expected.isnan())
    if wrong.any():
        row, token = (int(i) for i in wrong.nonzero()[0])
        bit = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
        raise AssertionError(
            f"{what}: row {row}, token {token} (word {token // 32}, bit {token % 32}, which is "
            f"{bit}): expected {float(expected[row, token])}, got {float(got[row, token])} "
            f"({int(wrong.sum())} entries wrong)"
        )


def check_a_cleared_bit_forbids_its_token_and_the_sign_bit_counts(impl: ModuleType) -> None:
    """Vocab 40: word 0 allows tokens 0, 5 and 31 (the sign bit), word 1 token 33."""
    logits = torch.arange(80, dtype=torch.float32).view(2, 40)
    word0 = (1 << 0) + (1 << 5) - 2**31  # bits 0, 5 and 31: a negative int32
    bitmask = torch.tensor([[word0, 1 << 1], [-1, -1]], dtype=torch.int32)
    _check_masked(impl, logits, bitmask, "row 0 allows tokens 0, 5, 31 and 33; row 1 all 40")


def check_random_bitmasks_match_a_bit_by_bit_loop(impl: ModuleType) -> None:
    """Random int32 words (both signs), vocabularies of 1, 31, 32, 33 and 70, fp32 and bf16."""
    generator = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 70):
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(3, vocab, generator=generator).to(dtype)
            bitmask = torch.randint(
                -(2**31), 2**31, (3, bitmask_words(vocab)), generator=generator, dtype=torch.int64
            ).to(torch.int32)
            _check_masked(impl, logits, bitmask, f"vocab {vocab}, {dtype}")


# Exercise 12.2: the DFA, its masks, the matcher.
def check_the_dfa_is_the_trie_of_the_choices_bytes(impl: ModuleType) -> None:
    """["ab", "ac", "b"]: states numbered as first met; "é" is two bytes, so two edges."""
    cases = [
        (["ab", "ac", "b"], ({97: 1, 98: 4}, {98: 2, 99: 3}, {}, {}, {}), {2, 3, 4}),
        (
            ["yes", "yes sir"],
            ({121: 1}, {101: 2}, {115: 3}, {32: 4}, {115: 5}, {105: 6}, {114: 7}, {}),
            {3, 7},
        ),
        (["é"], ({0xC3: 1}, {0xA9: 2}, {}), {2}),
    ]
    for choices, edges, accepting in cases:
        got = impl.choice_dfa(choices)
        assert tuple(got.edges) == edges and set(got.accepting) == accepting, (
            f"choice_dfa({choices}): expected edges {list(edges)} and accepting {accepting}, "
            f"got edges {list(got.edges)} and accepting {set(got.accepting)}"
        )


def check_every_state_s_mask_equals_xgrammar_s(impl: ModuleType) -> None:
    """For each choice list and each state of its DFA, the row of token_masks is xgrammar's
    mask after the same bytes (hand-made vocabulary of 70 tokens)."""
    vocab, compiler = hand_vocabulary(), _hand_xgrammar()
    for choices in HAND_CHOICES:
        dfa = impl.choice_dfa(choices)
        masks = impl.token_masks(dfa, vocab)
        words = bitmask_words(vocab.size)
        assert tuple(masks.shape) == (dfa.num_states, words) and masks.dtype == torch.int32, (
            f"token_masks for {choices}: expected int32 [{dfa.num_states}, {words}], got "
            f"{masks.dtype} {list(masks.shape)}"
        )
        spelled = _paths(dfa)
        for state, tokens in _token_paths(reference.choice_dfa(choices), vocab).items():
            matcher = _xgrammar_matcher(compiler, list(choices))
            for token in tokens:
                matcher.accept_token(token)
            expected = _xgrammar_mask(matcher, vocab.size)
            _same_mask(masks[state], expected, vocab, choices, spelled.get(state, b"?"))


def _same_mask(got, expected, vocab: Vocabulary, choices, path: bytes) -> None:
    if torch.equal(got, expected):
        return
    mine, theirs = set(_allowed(got, vocab.size)), set(_allowed(expected, vocab.size))
    raise AssertionError(
        f"choices {choices}, state after {path!r}: tokens allowed but forbidden by xgrammar: "
        f"{_spelled(sorted(mine - theirs), vocab)}; forbidden but allowed by xgrammar: "
        f"{_spelled(sorted(theirs - mine), vocab)}"
    )


def check_smollm2_s_masks_equal_xgrammar_s(impl: ModuleType) -> None:
    """The same on SmolLM2's 49,152 tokens (special tokens never allowed, EOS at the end)."""
    vocab, compiler = smollm2()
    for choices in (["positive", "negative", "neutral"], ["yes", "yes sir", "no"], ["café"]):
        matcher = impl.ChoiceMatcher.build(choices, vocab)
        paths = _paths(matcher.dfa)
        for state in sorted(paths, key=lambda s: len(paths[s]))[:12]:
            reference_matcher = _xgrammar_matcher(compiler, choices)
            for token in _byte_tokens(vocab, paths[state]):
                reference_matcher.accept_token(token)
            _same_mask(
                matcher.masks[state], _xgrammar_mask(reference_matcher, vocab.size), vocab,
                choices, paths[state],
            )  # fmt: skip


def _state_of(matcher) -> torch.Tensor:
    bitmask = torch.zeros(1, bitmask_words(matcher.vocab.size), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


def check_accept_refuses_what_the_mask_forbids_and_eos_terminates(impl: ModuleType) -> None:
    """["yes", "yes sir", "no"]: "ye" then "s", EOS (accepted: "yes" is whole), then nothing."""
    vocab = hand_vocabulary()
    matcher = impl.ChoiceMatcher.build(["yes", "yes sir", "no"], vocab)
    ids = vocab.by_text
    steps = [
        (EOS, False, "EOS before any choice is whole"),
        (ids[b"s"][0], False, "'s' first"),
        (1, False, "a special token (its text is empty)"),
        (ids[b"ye"][0], True, "'ye'"),
        (EOS, False, "EOS after 'ye'"),
        (ids[b"s"][0], True, "'s' after 'ye'"),
        (EOS, True, "EOS after 'yes'"),
        (ids[b"s"][0], False, "'s' after EOS"),
    ]
    written = []
    for token, expected, what in steps:
        before = _state_of(matcher) if not matcher.is_terminated else None
        got = matcher.accept(token)
        assert got == expected, f"after {written}: accept({what}) should be {expected}, got {got}"
        if got:
            written.append(what)
        elif before is not None:
            assert torch.equal(_state_of(matcher), before), (
                f"after {written}: a refused accept({what}) changed the matcher's mask"
            )
        assert matcher.is_terminated == (written[-1:] == ["EOS after 'yes'"]), (
            f"after {written}: is_terminated should be {not matcher.is_terminated}"
        )
    assert all(word == -1 for word in _state_of(matcher).tolist()), (
        "a terminated matcher should allow every token: what is drawn after EOS is dropped, "
        "and the sampler needs something to draw"
    )


def check_a_fork_moves_on_alone(impl: ModuleType) -> None:
    """Fork after "ye": the fork takes "s" and EOS; the original still allows "s" only."""
    vocab = hand_vocabulary()
    matcher = impl.ChoiceMatcher.build(["yes", "no"], vocab)
    assert matcher.accept(vocab.by_text[b"ye"][0])
    before = _state_of(matcher)
    fork = matcher.fork()
    assert fork.accept(vocab.by_text[b"s"][0]) and fork.accept(EOS) and fork.is_terminated
    assert not matcher.is_terminated and torch.equal(_state_of(matcher), before), (
        "accepting tokens on a fork changed the matcher it was forked from"
    )
    assert _allowed(before, vocab.size) == vocab.by_text[b"s"], (
        f"after 'ye' only 's' may follow, the mask allows {_spelled(_allowed(before, 70), vocab)}"
    )


def check_random_walks_agree_with_xgrammar(impl: ModuleType) -> None:
    """200 random walks over the hand-made vocabulary: each accept, mask and termination is
    xgrammar's (tokens drawn half from the allowed ones, half from all)."""
    _random_walks(impl.ChoiceMatcher.build, rollbacks=False)


def _random_walks(build, rollbacks: bool) -> None:
    vocab, compiler = hand_vocabulary(), _hand_xgrammar()
    rng = random.Random(0)
    for walk_number in range(200):
        choices = list(HAND_CHOICES[walk_number % len(HAND_CHOICES)])
        mine, theirs = build(choices, vocab), _xgrammar_matcher(compiler, choices)
        history: list[str] = []
        accepted = 0  # tokens accepted and not rolled back
        for _ in range(12):
            if theirs.is_terminated():
                assert mine.is_terminated, f"{choices} after {history}: should be terminated"
            else:
                expected = _xgrammar_mask(theirs, vocab.size)
                _same_mask(_state_of(mine), expected, vocab, choices, repr(history).encode())
            if rollbacks and accepted and rng.random() < 0.3:
                n = rng.randint(0, min(accepted, 3))
                mine.rollback(n)
                theirs.rollback(n)
                history.append(f"rollback({n})")
                accepted -= n
                continue
            done = theirs.is_terminated()
            allowed = [] if done else _allowed(_xgrammar_mask(theirs, vocab.size), vocab.size)
            pool = allowed if allowed and rng.random() < 0.5 else range(vocab.size)
            token = rng.choice(list(pool))
            expected_ok = not done and theirs.accept_token(token)
            got = mine.accept(token)
            assert got == expected_ok, (
                f"choices {choices} after {history}: accept({vocab.texts[token]!r}) should be "
                f"{expected_ok}, got {got}"
            )
            if got:
                history.append(vocab.texts[token].decode() or "EOS")
                accepted += 1


# Exercise 12.3: rollback.
def check_rollback_drops_the_last_states_in_place(impl: ModuleType) -> None:
    """[0, 1, 2, 3]: rollback 2 leaves [0, 1]; 0 changes nothing; 3 leaves the start."""
    for num_tokens, expected in ((2, [0, 1]), (0, [0, 1, 2, 3]), (3, [0]), (1, [0, 1, 2])):
        states = [0, 1, 2, 3]
        impl.rollback_states(states, num_tokens)
        assert states == expected, (
            f"rollback_states([0, 1, 2, 3], {num_tokens}): expected the list to become "
            f"{expected}, got {states}"
        )
    for num_tokens in (4, -1):
        states = [0, 1, 2, 3]
        try:
            impl.rollback_states(states, num_tokens)
        except ValueError:
            continue
        raise AssertionError(
            f"rollback_states([0, 1, 2, 3], {num_tokens}): 3 tokens were accepted; expected a "
            f"ValueError, got the list {states}"
        )


class _WithRollback(reference.ChoiceMatcher):
    """minserve's matcher, rolled back by the module under check."""

    impl: ModuleType

    def rollback(self, num_tokens: int) -> None:
        self.impl.rollback_states(self.states, num_tokens)


def _build_with(impl: ModuleType):
    cls = type("StudentRollback", (_WithRollback,), {"impl": impl})
    return cls.build


def check_rollback_undoes_eos_too(impl: ModuleType) -> None:
    """Accept "yes" and EOS, roll back 1: no longer terminated, the mask after "yes" again."""
    vocab = hand_vocabulary()
    matcher = _build_with(impl)(["yes", "yes sir"], vocab)
    assert matcher.accept(vocab.by_text[b"yes"][0])
    before = _state_of(matcher)
    assert matcher.accept(EOS) and matcher.is_terminated
    matcher.rollback(1)
    assert not matcher.is_terminated, "after rollback(1) of EOS the matcher is still terminated"
    assert torch.equal(_state_of(matcher), before), "rollback(1) of EOS: not the mask after 'yes'"


def check_random_walks_with_rollbacks_agree_with_xgrammar(impl: ModuleType) -> None:
    """200 random walks, with rollbacks of 0 to 3 tokens, against xgrammar's matcher."""
    _random_walks(_build_with(impl), rollbacks=True)


# Exercise 12.4: jump-forward.
def check_forced_text_on_hand_made_choices(impl: ModuleType) -> None:
    """ "The answer is " is forced at the start; "es" after "y"; nothing at a fork or where a
    choice may end (after "yes", of "yes" and "yes sir")."""
    cases = [
        (["The answer is yes", "The answer is no"], b"", b"The answer is "),
        (["The answer is yes", "The answer is no"], b"The answer is y", b"es"),
        (["The answer is yes", "The answer is no"], b"The answer is ", b""),
        (["yes", "yes sir"], b"yes", b""),
        (["yes", "yes sir"], b"yes ", b"sir"),
        (["yes", "no"], b"", b""),
        (["café", "cafè"], b"", b"caf\xc3"),
    ]
    for choices, path, expected in cases:
        dfa = reference.choice_dfa(choices)
        state = reference.walk(dfa, 0, path)
        got = impl.forced_text(dfa, state)
        assert got == expected, (
            f"choices {choices}, after {path!r}: expected the forced text {expected!r}, got {got!r}"
        )


def check_forced_text_is_xgrammar_s_jump_forward_string(impl: ModuleType) -> None:
    """At every state of every hand-made choice list: xgrammar's jump-forward string."""
    vocab, compiler = hand_vocabulary(), _hand_xgrammar()
    for choices in HAND_CHOICES[:4]:  # ASCII: xgrammar's string is text, ours bytes
        dfa = reference.choice_dfa(choices)
        for state, path in _paths(dfa).items():
            matcher = _xgrammar_matcher(compiler, list(choices))
            for token in _byte_tokens(vocab, path):
                matcher.accept_token(token)
            expected = matcher.find_jump_forward_string().encode()
            got = impl.forced_text(dfa, state)
            assert got == expected, (
                f"choices {choices}, after {path!r}: xgrammar forces {expected!r}, got {got!r}"
            )


def check_forced_tokens_walk_to_where_the_choices_part(impl: ModuleType) -> None:
    """A matcher's forced tokens are accepted one by one, and then nothing more is forced."""
    vocab = hand_vocabulary()
    cls = type("StudentForced", (reference.ChoiceMatcher,), {})
    cls.forced_tokens = _forced_tokens_with(impl)
    matcher = cls.build(["The answer is yes", "The answer is no"], vocab)
    forced = matcher.forced_tokens()
    assert forced, "nothing forced at the start of ['The answer is yes', 'The answer is no']"
    for token in forced:
        assert matcher.accept(token), f"forced token {vocab.texts[token]!r} was refused"
    assert matcher.forced_tokens() == [], "after the forced text, the choices part: no more"
    assert matcher.state != DONE and len(matcher.dfa.edges[matcher.state]) == 2


def _forced_tokens_with(impl: ModuleType):
    def forced_tokens(self) -> list[int]:
        if self.state == DONE:
            return []
        text = reference.whole_characters(impl.forced_text(self.dfa, self.state))
        return self.vocab.encode(text) if text else []

    return forced_tokens


# Exercise 12.5: whether a grammar can end.
_T = ("terminal", None)


def _r(name: str) -> tuple[str, str]:
    return ("rule", name)


def _g(*alternatives: list) -> tuple[str, list]:
    return ("group", list(alternatives))


def _rules(text: str) -> dict[str, list]:
    """`name ::= body` lines read by minserve's own parser (the input of productive_rules)."""
    from minserve.structured import grammar_ends

    rules = {}
    for line in text.splitlines():
        name, _, body = line.partition("::=")
        tokens = grammar_ends.rule_tokens(body)
        rules[name.strip()] = grammar_ends.parse_alternatives(tokens, 0)[0]
    return rules


PRODUCTIVE_CASES = [  # (rules, the productive ones)
    ('root ::= a\na ::= b\nb ::= "x"', {"root", "a", "b"}),  # found in reverse order
    ('root ::= "a" root', set()),
    ('root ::= "a" root | "b"', {"root"}),
    ("root ::= a\na ::= root", set()),  # each waits for the other
    ('root ::= "a" root?', {"root"}),
    ('root ::= ("a" root | b)\nb ::= "c" b{1, 2}', set()),
    ('root ::= x{0, 3} y\ny ::= ([a-z] y) | [a-z]\nx ::= "q" x', {"root", "y"}),
    ("root ::= undefined", set()),  # named, never defined
    ('root ::= "" | root', {"root"}),
    ('root ::= (a b) | (b c)\na ::= "a" a\nb ::= "b"\nc ::= c+ | "c"', {"root", "b", "c"}),
    ('root ::= a b\na ::= b | "a"\nb ::= a "x"', {"root", "a", "b"}),  # b ends via a's "a"
]


def check_productive_rules_is_a_fixpoint_over_the_rules(impl: ModuleType) -> None:
    """productive_rules finds every rule that can end, whatever their order (a fixpoint).
    Small grammars: rules listed before those they need (one pass cannot settle them),
    mutual recursion, optional items, groups, a rule never defined."""
    for text, expected in PRODUCTIVE_CASES:
        got = impl.productive_rules(_rules(text))
        assert set(got) == expected, (
            f"productive_rules of the rules\n{text}\nexpected {sorted(expected)}, got {sorted(got)}"
        )


PARSE_CASES = [  # (body, start, alternatives, end)
    ('"a" root', 0, [[(_T, False), (_r("root"), False)]], 2),
    ('"a" | [b-c] c', 0, [[(_T, False)], [(_T, False), (_r("c"), False)]], 4),
    (
        "x* y+ z? w{0, 3} v{2, -1}", 0,
        [[(_r("x"), True), (_r("y"), False), (_r("z"), True), (_r("w"), True),
          (_r("v"), False)]],
        10,
    ),
    (
        '(("a" root) | (root_1{0, 3}))', 0,
        [[(_g([(_g([(_T, False), (_r("root"), False)]), False)],
              [(_g([(_r("root_1"), True)]), False)]), False)]],
        11,
    ),
    ('"a" ) "b"', 0, [[(_T, False)]], 1),  # stops at a ")" it does not open
    ('( "a" | b ) c', 1, [[(_T, False)], [(_r("b"), False)]], 4),  # inside a group
    ('("" | ("-"))', 0, [[(_g([(_T, False)], [(_g([(_T, False)]), False)]), False)]], 7),
]  # fmt: skip
UNREADABLE_BODIES = ['"a" | *', '( "a"', '"a" * *', '? "a"', '("a" | (b)']


def check_parse_alternatives_reads_items_groups_and_quantifiers(impl: ModuleType) -> None:
    """parse_alternatives reads items, groups and quantifiers, and refuses nonsense.
    Sequences, "|", nested groups, each quantifier (*, +, ?, {0, n}, {m, n}), the ")" that
    ends a group; None for an op where an item should be, or a "(" never closed."""
    from minserve.structured.grammar_ends import rule_tokens

    for body, start, expected, end in PARSE_CASES:
        tokens = rule_tokens(body)
        got = impl.parse_alternatives(tokens, start)
        assert tuple(got) == (expected, end), (
            f"parse_alternatives(tokens of {body!r}, {start}), tokens {tokens}:\nexpected "
            f"({expected}, {end}),\ngot {tuple(got)}"
        )
    for body in UNREADABLE_BODIES:
        tokens = rule_tokens(body)
        got = impl.parse_alternatives(tokens, 0)
        assert got[0] is None, (
            f"parse_alternatives(tokens of {body!r}, 0), tokens {tokens}: they make no "
            f"sense, so expected (None, i), got {tuple(got)}"
        )


ENDS_EBNF = [  # (grammar, can end); compiled by xgrammar, its print read
    ('root ::= "a" root', False),
    ('root ::= "a" root | "b"', True),
    ('root ::= ra "a"\nra ::= root | "b"', True),  # a lookahead (=("a")) in the print
    ('root ::= ra\nra ::= rb "x"\nrb ::= ra', False),
    ("root ::= [a-z]+ root", False),
    ('root ::= ("a" root)* "c"', True),
    ('root ::= "a" item{2, 4} "b"\nitem ::= "x" item | [0-9]', True),
    ('root ::= "(" list ")"\nlist ::= item ("," item)*\nitem ::= "x" | "(" list ")"', True),
    ('root ::= "a" b\nb ::= "b" root', False),
    ('root ::= a b\na ::= b | "a"\nb ::= a "x"', True),  # a depth-first search meets a again
]
ENDS_SCHEMAS = [  # (JSON schema, can end)
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, True),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
    (
        {
            "type": "object", "required": ["name", "children"],
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#"}},
            },
        },
        True,
    ),
]  # fmt: skip
ENDS_TEXTS = [  # (text, root, can end): texts xgrammar does not print
    ('start ::= "a" start', "root", True),  # no rule named root: not proven
    ('start ::= "a" start', "start", False),
    ('# a comment line\nroot ::= "a" root', "root", False),
    ('root ::= "a" root @', "root", True),  # a token this reader does not know
    ('root ::= ("a" root', "root", True),  # a "(" never closed
    ('root ::= "a" root )', "root", True),  # a ")" never opened: tokens left over
]


@cache
def _printed_hand_grammars() -> list[tuple[str, str, bool]]:
    """(what, xgrammar's print of the compiled grammar, can end) for the hand-made ones."""
    import json

    compiler = _hand_xgrammar()
    out = [(text, str(compiler.compile_grammar(text).grammar), ends) for text, ends in ENDS_EBNF]
    for schema, ends in ENDS_SCHEMAS:
        text = json.dumps(schema)
        compiled = compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=16)
        out.append((f"the JSON schema {text}", str(compiled.grammar), ends))
    return out


def check_can_end_on_what_xgrammar_prints(impl: ModuleType) -> None:
    """can_end on grammars and JSON schemas as xgrammar prints them, and on odd texts.
    The print of the compiled grammar is what the engine hands over (a schema that requires
    itself among them); then texts with no root, or that cannot be read."""
    for what, printed, expected in _printed_hand_grammars():
        got = impl.can_end(printed)
        assert got == expected, (
            f"can_end of {what}, which xgrammar prints as\n{printed}expected {expected}, got {got}"
        )
    for text, root, expected in ENDS_TEXTS:
        got = impl.can_end(text, root)
        assert got == expected, f"can_end({text!r}, root={root!r}): expected {expected}, got {got}"


_QUANTIFIERS = ("", "", "", "", "*", "+", "?", "{0,2}", "{1,2}", "{2,3}")
_FEWEST = {"": 1, "*": 0, "+": 1, "?": 0, "{0,2}": 0, "{1,2}": 1, "{2,3}": 2}
_TERMINALS = {'"a"': "a", '"bc"': "bc", "[a-c]": "a", '""': ""}


def _random_alternatives(rng: random.Random, names: list[str], depth: int) -> list:
    """A rule's body: [[((kind, value), quantifier), ...], ...] (kind "t", "r" or "g")."""
    body = []
    for _ in range(rng.randint(1, 3)):
        sequence = []
        for _ in range(rng.randint(1, 3)):
            kind = rng.choices("trg", (3, 5, 2 if depth else 0))[0]
            if kind == "t":
                value = rng.choice(list(_TERMINALS))
            elif kind == "r":
                value = rng.choice(names)
            else:
                value = _random_alternatives(rng, names, depth - 1)
            quantifier = rng.choice(_QUANTIFIERS) if value != '""' else ""
            sequence.append(((kind, value), quantifier))
        body.append(sequence)
    return body


def _ebnf(body: list) -> str:
    def item(kind: str, value, quantifier: str) -> str:
        return (f"({_ebnf(value)})" if kind == "g" else value) + quantifier

    return " | ".join(" ".join(item(k, v, q) for (k, v), q in seq) for seq in body)


def _shortest_texts(rules: dict[str, list]) -> dict[str, str | None]:
    """The shortest text each rule derives (None: none), by relaxing until nothing
    changes: the oracle, on the grammar as written (xgrammar's rewrite of it not read)."""

    def of_item(kind: str, value, quantifier: str) -> str | None:
        if _FEWEST[quantifier] == 0:
            return ""
        text = _TERMINALS[value] if kind == "t" else best[value] if kind == "r" else of(value)
        return None if text is None else text * _FEWEST[quantifier]

    def of(body: list) -> str | None:
        texts = []
        for seq in body:
            parts = [of_item(k, v, q) for (k, v), q in seq]
            if all(part is not None for part in parts):
                texts.append("".join(parts))  # type: ignore[arg-type]
        return min(texts, key=lambda t: (len(t), t)) if texts else None

    best: dict[str, str | None] = dict.fromkeys(rules)
    while (relaxed := {name: of(body) for name, body in rules.items()}) != best:
        best = relaxed
    return best


@cache
def random_grammars(count: int = 300) -> list[tuple[str, str, str | None]]:
    """(grammar, xgrammar's print of it, root's shortest text or None), smallest first."""
    import xgrammar as xgr

    rng = random.Random(12)
    grammars = []
    for _ in range(count):
        names = ["root", "ra", "rb", "rc"][: rng.randint(1, 4)]
        rules = {name: _random_alternatives(rng, names, 1) for name in names}
        text = "\n".join(f"{name} ::= {_ebnf(body)}" for name, body in rules.items())
        printed = str(xgr.Grammar.from_ebnf(text))
        grammars.append((text, printed, _shortest_texts(rules)["root"]))
    return sorted(grammars, key=lambda g: len(g[1]))


def check_random_grammars_end_as_their_shortest_derivation_says(impl: ModuleType) -> None:
    """300 random grammars: can_end is True exactly when root derives a finite text.
    Up to 4 rules (recursion, groups, every quantifier), in xgrammar's print; the oracle is
    root's shortest text, found on the grammar as written. The smallest failure is shown."""
    for text, printed, shortest in random_grammars():
        got = impl.can_end(printed)
        if got != (shortest is not None):
            why = (
                f"root derives {shortest!r}" if shortest is not None
                else "no derivation from root ever stops recursing"
            )  # fmt: skip
            raise AssertionError(
                f"can_end of the grammar\n{text}\nwhich xgrammar prints as\n{printed}expected "
                f"{shortest is not None} ({why}), got {got}"
            )


CHECKS = [
    check_a_cleared_bit_forbids_its_token_and_the_sign_bit_counts,
    check_random_bitmasks_match_a_bit_by_bit_loop,
    check_the_dfa_is_the_trie_of_the_choices_bytes,
    check_every_state_s_mask_equals_xgrammar_s,
    check_smollm2_s_masks_equal_xgrammar_s,
    check_accept_refuses_what_the_mask_forbids_and_eos_terminates,
    check_a_fork_moves_on_alone,
    check_random_walks_agree_with_xgrammar,
    check_rollback_drops_the_last_states_in_place,
    check_rollback_undoes_eos_too,
    check_random_walks_with_rollbacks_agree_with_xgrammar,
    check_forced_text_on_hand_made_choices,
    check_forced_text_is_xgrammar_s_jump_forward_string,
    check_forced_tokens_walk_to_where_the_choices_part,
    check_productive_rules_is_a_fixpoint_over_the_rules,
    check_parse_alternatives_reads_items_groups_and_quantifiers,
    check_can_end_on_what_xgrammar_prints,
    check_random_grammars_end_as_their_shortest_derivation_says,
]

HINTS: dict[str, tuple[str, str, str]] = {
    "12.1": (
        "Each int32 word holds 32 tokens' yes/no: unpack every bit into one boolean per "
        "token, then put -inf wherever the boolean is False. Do it for all rows at once with "
        "tensor operations; a Python loop over 49k tokens is far too slow for every step.",
        "Shift each word right by 0..31 (a [32] tensor of shifts, broadcast against [rows, "
        "words, 1]) and keep the lowest bit; flatten the last two dimensions to get [rows, "
        "32 * words] and cut it to the vocabulary's length. masked_fill returns a new tensor.",
        "`(bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1` gives [rows, "
        "words, 32]; an arithmetic shift of a negative word still leaves bit 31 in the last "
        "place, so `& 1` reads the sign bit correctly.",
    ),
    "12.2": (
        "A trie of the choices is a DFA: one state per distinct prefix. A token may come "
        "next in a state if its bytes walk from that state without leaving the trie, so "
        "the allowed tokens are exactly those whose text is one of the strings you can "
        "spell by following edges from the state. EOS only where a whole choice ends.",
        "choice_dfa: a list of dicts, one per state; add a state whenever a byte has no "
        "edge yet. token_masks: for each state, enumerate the strings spelled from it (depth "
        "first, at most vocab.max_len bytes), look each up in vocab.by_text, add the stop "
        "tokens in accepting states, and pack a [states, vocab] boolean with pack_bitmask. "
        "The matcher keeps `self.states`, its current state last; DONE after EOS.",
        "accept: refuse when the state is DONE, when the token is a stop token outside an "
        "accepting state, or when `walk` falls off the DFA (tokens with empty text too); "
        "else append the new state. fill_bitmask copies `self.masks[state]` into the row "
        "(every bit set once DONE: what follows EOS is dropped). fork copies the list of "
        "states, not just a reference to it.",
    ),
    "12.3": (
        "A matcher that remembers every state it passed through rolls back by forgetting the "
        "last ones: the state before a token is still in the list. Termination is a state "
        "(DONE) too, so rolling back EOS makes the matcher live again.",
        "The list holds the start plus one state per accepted token, so at most len - 1 "
        "tokens can be undone. Check the range first, then delete the tail in place.",
        "Beware `del states[-n:]` with n = 0: `-0` is 0, so it deletes everything. Compute "
        "the index where the kept part ends from the list's length instead.",
    ),
    "12.4": (
        "Text is forced while the DFA has exactly one way on: a state with a single edge "
        "that is not accepting (an accepting state may also end there, so nothing is "
        "forced).",
        "Loop: while the state is not accepting and has one edge, take that edge, append "
        "its byte, move to its state. Return the bytes collected (b'' when none).",
        "A one-item dict's only (key, value) pair unpacks with `(pair,) = d.items()`; "
        "collect the bytes in a bytearray and return bytes(...) of it.",
    ),
    "12.5": (
        "A rule can end when one of its alternatives can, and an alternative (a sequence) "
        "when every item in it can: a string or a class always, an optional item (*, ?, "
        "{0, n}) by being absent, a rule when it is productive, a group when one of its "
        "alternatives can. Rules wait on each other, so start with no rule known to end and "
        "grow that set until a whole pass over the rules adds nothing.",
        "parse_alternatives is a recursive descent: a list of sequences, a new one at '|', "
        "return at ')' or at the end; at '(' recurse from the next token and expect to come "
        "back on its ')', then step past it; after any item, look at one more token for a "
        "quantifier ('{m, n}' may be absent when m is 0). can_end: split each line at "
        "'::=', `rule_tokens` its body, parse from 0, and answer True at once when the "
        "parse fails or stops before the last token.",
        "productive_rules: a set, and `while changed:` over `rules.items()`, adding a name "
        "not yet in it when `any(all(...) for seq in alternatives)` holds, the inner test "
        "being: True for an optional item or a terminal, `value in productive` for a rule, "
        "and the same any/all again for a group's alternatives (a helper that calls itself). "
        "A single pass is wrong: 'root ::= a' listed before 'a ::= \"x\"' needs two.",
    ),
}
