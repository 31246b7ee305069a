# Generated from minserve/model/token_mask.py, minserve/structured/choice_dfa.py, minserve/structured/grammar_ends.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 12, Structured output: token masks, and a `choice` constraint as a DFA
over the model's tokens.

12.1 applies a token bitmask to the logits (bit j of word w is token 32 w + j);
plug it into the sampler with
`LLM(plugins=CoursePlugins(sampler=Sampler(bitmask_fn=apply_token_bitmask)))`.
12.2 builds the trie of the choices' bytes as a DFA, each state's allowed tokens
as one bitmask row (computed once), and `ChoiceMatcher`, the engine's matcher
over them; 12.3 rolls a matcher back (speculative decoding); 12.4 finds the text
the choices force next (jump-forward). Plug your matcher into the engine with
`LLM(plugins=CoursePlugins(choice_matcher_cls=ChoiceMatcher))`: it then serves
`StructuredOutputsParams(choice=[...])` instead of xgrammar.
12.5 decides whether a grammar can end (its productive rules, by a fixpoint), on
xgrammar's print of the compiled grammar; plug it in with
`LLM(plugins=CoursePlugins(grammar_can_end=can_end))`: every grammar compiled
is then refused, or not, by your test.
"""

from __future__ import annotations  # ChoiceMatcher's methods name their class

from collections.abc import Iterator, Sequence  # noqa: F401

import torch

from minserve.structured.choice_dfa import (  # noqa: F401  (your code wants them)
    DONE,
    ChoiceDFA,
    Vocabulary,
    pack_bitmask,
    whole_characters,
)
from minserve.structured.grammar_ends import (  # noqa: F401
    Alternatives,
    Item,
    Token,
    rule_tokens,
)
from minserve.structured.token_matcher import MatcherAfter


# Exercise 12.1: apply a token bitmask to the logits
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set every token a row's bitmask forbids to -inf.

    `logits` is float [rows, vocab]; `bitmask` is int32 [rows, ceil(vocab / 32)], where bit
    j of word w (counting from the least significant bit, the sign bit being bit 31) says
    whether token 32 w + j is allowed. Bits past `vocab` in the last word are ignored.
    Returns a new tensor on the logits' device; `logits` is left unchanged.
    """
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()  # [rows, vocab]
    return logits.masked_fill(~allowed, float("-inf"))


# Exercise 12.2: the choices' DFA, each state's tokens, and the matcher
def choice_dfa(choices: Sequence[str]) -> ChoiceDFA:
    """The trie of the choices' UTF-8 bytes, as a DFA: state 0 is the empty prefix, a new
    state for each new prefix (numbered in the order they are first met), and the states
    where a choice ends are accepting."""
    edges: list[dict[int, int]] = [{}]
    accepting = set()
    for choice in choices:
        state = 0
        for byte in choice.encode("utf-8"):
            if byte not in edges[state]:
                edges[state][byte] = len(edges)
                edges.append({})
            state = edges[state][byte]
        accepting.add(state)
    return ChoiceDFA(tuple(edges), frozenset(accepting))


def walk(dfa: ChoiceDFA, state: int, text: bytes) -> int | None:
    """The state `text` leads to from `state`, or None if it falls off the DFA."""
    for byte in text:
        next_state = dfa.edges[state].get(byte)
        if next_state is None:
            return None
        state = next_state
    return state


def token_masks(dfa: ChoiceDFA, vocab: Vocabulary) -> torch.Tensor:
    """int32 [dfa.num_states, ceil(vocab.size / 32)]: row s has the bits of the tokens
    allowed in state s (their bytes walk from s without leaving the DFA; the stop tokens
    in accepting states only). Computed once per choice list: each step copies a row."""
    allowed = torch.zeros(dfa.num_states, vocab.size, dtype=torch.bool)  # [states, vocab]
    for state in range(dfa.num_states):
        texts = _spelled_from(dfa, state, b"", vocab.max_len)
        ids = [token_id for text in texts for token_id in vocab.by_text.get(text, ())]
        if state in dfa.accepting:
            ids += vocab.stop_token_ids
        allowed[state, ids] = True
    return pack_bitmask(allowed)


def _spelled_from(dfa: ChoiceDFA, state: int, prefix: bytes, max_len: int) -> Iterator[bytes]:
    """Every non-empty text of at most `max_len` bytes that walks from `state` (after
    `prefix`): the only texts a token allowed there can have."""
    for byte, next_state in dfa.edges[state].items():
        text = prefix + bytes([byte])
        yield text
        if len(text) < max_len:
            yield from _spelled_from(dfa, next_state, text, max_len)


class ChoiceMatcher:
    """One sample's place in a `choice` constraint (the engine's matcher protocol). `states`
    is every state it passed through, the current one last (DONE once EOS is accepted);
    the DFA and its masks are built once, by `build`, and shared by forks."""

    def __init__(self, dfa: ChoiceDFA, masks: torch.Tensor, vocab: Vocabulary) -> None:
        self.dfa, self.masks, self.vocab = dfa, masks, vocab
        self.states = [0]

    @classmethod
    def build(cls, choices: Sequence[str], vocab: Vocabulary) -> ChoiceMatcher:
        """A matcher at the start of a fresh DFA for `choices`, its masks computed now."""
        dfa = choice_dfa(choices)
        return cls(dfa, token_masks(dfa, vocab), vocab)

    @property
    def state(self) -> int:
        return self.states[-1]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`. Once terminated, every token:
        the sample has ended, and a position after its EOS (a verified draft's bonus
        position, say) is drawn and dropped, so it must not be left with nothing to draw."""
        if self.state == DONE:
            bitmask[row] = -1
        else:
            bitmask[row] = self.masks[self.state]

    def accept(self, token_id: int) -> bool:
        """Move on by one token; False, and no change, if the current state forbids it."""
        state = self.state
        if state == DONE or not 0 <= token_id < self.vocab.size:
            return False
        if token_id in self.vocab.stop_token_ids:
            next_state = DONE if state in self.dfa.accepting else None
        else:
            text = self.vocab.texts[token_id]
            next_state = walk(self.dfa, state, text) if text else None
        if next_state is None:
            return False
        self.states.append(next_state)
        return True

    @property
    def is_terminated(self) -> bool:
        """A whole choice was written and EOS accepted."""
        return self.state == DONE

    def fork(self) -> ChoiceMatcher:
        """An independent copy: its states move on without this matcher's."""
        copy = type(self)(self.dfa, self.masks, self.vocab)
        copy.states = list(self.states)
        return copy

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (exercise 12.3)."""
        rollback_states(self.states, num_tokens)

    def forced_tokens(self) -> list[int]:
        """The tokens of the text every choice left forces next (exercise 12.4); []."""
        if self.state == DONE:
            return []
        text = whole_characters(forced_text(self.dfa, self.state))
        return self.vocab.encode(text) if text else []

    def after(self, token_ids: Sequence[int]) -> MatcherAfter:
        """The state after `token_ids`, read-only (this matcher is unchanged)."""
        return MatcherAfter(self, token_ids)


# Exercise 12.3: roll back the last tokens
def rollback_states(states: list[int], num_tokens: int) -> None:
    """Undo the last `num_tokens` tokens of a matcher whose states are `states` (the start
    first, one more per accepted token): drop them in place. 0 changes nothing; a
    ValueError if `num_tokens` is negative or more than the tokens accepted."""
    accepted = len(states) - 1
    if not 0 <= num_tokens <= accepted:
        raise ValueError(f"cannot roll back {num_tokens} tokens: {accepted} were accepted")
    del states[len(states) - num_tokens :]


# Exercise 12.4: the text the choices force (jump-forward)
def forced_text(dfa: ChoiceDFA, state: int) -> bytes:
    """The longest text every continuation from `state` starts with: follow the states with
    exactly one edge that are not accepting (an accepting state may also stop there)."""
    text = bytearray()
    while state not in dfa.accepting and len(dfa.edges[state]) == 1:
        ((byte, state),) = dfa.edges[state].items()
        text.append(byte)
    return bytes(text)


# Exercise 12.5: whether a grammar can end (its productive rules)
def can_end(grammar_text: str, root: str = "root") -> bool:
    """Whether `root` derives a finite text. Read each `name ::= body` line (lines without
    "::=" are skipped) into its alternatives: `rule_tokens`, then `parse_alternatives` from
    token 0, which must consume every token; then look for `root` among the
    `productive_rules`. True when the text cannot be read here (a body whose tokens or
    structure make no sense, or no rule named `root`): a grammar is refused only on proof
    that it never ends."""
    rules: dict[str, Alternatives] = {}
    for line in grammar_text.splitlines():
        name, sep, body = line.partition("::=")
        if not sep:
            continue
        tokens = rule_tokens(body)
        if tokens is None:
            return True
        alternatives, end = parse_alternatives(tokens, 0)
        if alternatives is None or end != len(tokens):
            return True
        rules[name.strip()] = alternatives
    return root not in rules or root in productive_rules(rules)


def parse_alternatives(tokens: list[Token], i: int) -> tuple[Alternatives | None, int]:
    """Parse `seq | seq | ...` from `tokens[i]` up to a ")" that closes it or the end:
    (its alternatives, the index of that ")" or len(tokens)); (None, i) where a token makes
    no sense (an op where an item should be, a "(" never closed). Each alternative is a
    list of (item, may be absent) pairs. An item is a string or a character class
    ("terminal", None), a rule's name ("rule", name), or a group "(" ... ")" ("group", its
    alternatives, parsed by recursion), then at most one quantifier: after `*`, `?` or a
    repeat "{0, n}" the item may be absent; after `+` or "{m, n}" with m > 0 it may not."""
    alternatives: Alternatives = [[]]
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "op" and text == ")":
            return alternatives, i
        if kind == "op" and text == "|":
            alternatives.append([])
            i += 1
            continue
        if kind == "op" and text == "(":
            inner, i = parse_alternatives(tokens, i + 1)
            if inner is None or i >= len(tokens):
                return None, i
            item: Item = ("group", inner)
        elif kind in ("string", "cls"):
            item = ("terminal", None)
        elif kind == "name":
            item = ("rule", text)
        else:
            return None, i
        i += 1
        optional = False
        if i < len(tokens) and (tokens[i][0] == "repeat" or tokens[i][1] in ("*", "+", "?")):
            quantifier = tokens[i][1]
            optional = quantifier in ("*", "?") or (
                quantifier.startswith("{") and int(quantifier[1:].split(",")[0]) == 0
            )
            i += 1
        alternatives[-1].append((item, optional))
    return alternatives, i


def productive_rules(rules: dict[str, Alternatives]) -> set[str]:
    """The names of the rules that derive a finite text, by a fixpoint: a rule becomes
    productive once one of its alternatives is a sequence whose every item may be absent
    or ends (a terminal, a rule already productive, a group with such an alternative); go
    over all the rules again until a pass adds none. A rule named but not defined is not
    productive."""
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in productive and _any_ends(alternatives, productive):
                productive.add(name)
                changed = True
    return productive


def _any_ends(alternatives: Alternatives, productive: set[str]) -> bool:
    return any(all(_ends(item, opt, productive) for item, opt in seq) for seq in alternatives)


def _ends(item: Item, optional: bool, productive: set[str]) -> bool:
    kind, value = item
    if optional or kind == "terminal":
        return True
    if kind == "rule":
        return value in productive
    return _any_ends(value, productive)  # type: ignore[arg-type]
