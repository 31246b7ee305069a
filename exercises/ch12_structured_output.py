# Your workspace for chapter 12 (Structured output): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 12` from the repository root.
# Generated from minserve/model/token_mask.py, minserve/structured/choice_dfa.py, minserve/structured/grammar_ends.py by `python -m minserve.course.generate`.
# stub fingerprint: dd0aedb7b199 (lets the generator tell your edits from a stale stub)
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
    raise NotImplementedError("Exercise 12.1: apply a token bitmask to the logits")


# Exercise 12.2: the choices' DFA, each state's tokens, and the matcher
def choice_dfa(choices: Sequence[str]) -> ChoiceDFA:
    """The trie of the choices' UTF-8 bytes, as a DFA: state 0 is the empty prefix, a new
    state for each new prefix (numbered in the order they are first met), and the states
    where a choice ends are accepting."""
    raise NotImplementedError("Exercise 12.2: the choices' DFA, each state's tokens, and the matcher")


def walk(dfa: ChoiceDFA, state: int, text: bytes) -> int | None:
    """The state `text` leads to from `state`, or None if it falls off the DFA."""
    raise NotImplementedError("Exercise 12.2: the choices' DFA, each state's tokens, and the matcher")


def token_masks(dfa: ChoiceDFA, vocab: Vocabulary) -> torch.Tensor:
    """int32 [dfa.num_states, ceil(vocab.size / 32)]: row s has the bits of the tokens
    allowed in state s (their bytes walk from s without leaving the DFA; the stop tokens
    in accepting states only). Computed once per choice list: each step copies a row."""
    raise NotImplementedError("Exercise 12.2: the choices' DFA, each state's tokens, and the matcher")


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
        raise NotImplementedError("Exercise 12.2: the choices' DFA, each state's tokens, and the matcher")

    def accept(self, token_id: int) -> bool:
        """Move on by one token; False, and no change, if the current state forbids it."""
        raise NotImplementedError("Exercise 12.2: the choices' DFA, each state's tokens, and the matcher")

    @property
    def is_terminated(self) -> bool:
        """A whole choice was written and EOS accepted."""
        raise NotImplementedError("Exercise 12.2: the choices' DFA, each state's tokens, and the matcher")

    def fork(self) -> ChoiceMatcher:
        """An independent copy: its states move on without this matcher's."""
        raise NotImplementedError("Exercise 12.2: the choices' DFA, each state's tokens, and the matcher")

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
    raise NotImplementedError("Exercise 12.3: roll back the last tokens")


# Exercise 12.4: the text the choices force (jump-forward)
def forced_text(dfa: ChoiceDFA, state: int) -> bytes:
    """The longest text every continuation from `state` starts with: follow the states with
    exactly one edge that are not accepting (an accepting state may also stop there)."""
    raise NotImplementedError("Exercise 12.4: the text the choices force (jump-forward)")


# Exercise 12.5: whether a grammar can end (its productive rules)
def can_end(grammar_text: str, root: str = "root") -> bool:
    """Whether `root` derives a finite text. Read each `name ::= body` line (lines without
    "::=" are skipped) into its alternatives: `rule_tokens`, then `parse_alternatives` from
    token 0, which must consume every token; then look for `root` among the
    `productive_rules`. True when the text cannot be read here (a body whose tokens or
    structure make no sense, or no rule named `root`): a grammar is refused only on proof
    that it never ends."""
    raise NotImplementedError("Exercise 12.5: whether a grammar can end (its productive rules)")


def parse_alternatives(tokens: list[Token], i: int) -> tuple[Alternatives | None, int]:
    """Parse `seq | seq | ...` from `tokens[i]` up to a ")" that closes it or the end:
    (its alternatives, the index of that ")" or len(tokens)); (None, i) where a token makes
    no sense (an op where an item should be, a "(" never closed). Each alternative is a
    list of (item, may be absent) pairs. An item is a string or a character class
    ("terminal", None), a rule's name ("rule", name), or a group "(" ... ")" ("group", its
    alternatives, parsed by recursion), then at most one quantifier: after `*`, `?` or a
    repeat "{0, n}" the item may be absent; after `+` or "{m, n}" with m > 0 it may not."""
    raise NotImplementedError("Exercise 12.5: whether a grammar can end (its productive rules)")


def productive_rules(rules: dict[str, Alternatives]) -> set[str]:
    """The names of the rules that derive a finite text, by a fixpoint: a rule becomes
    productive once one of its alternatives is a sequence whose every item may be absent
    or ends (a terminal, a rule already productive, a group with such an alternative); go
    over all the rules again until a pass adds none. A rule named but not defined is not
    productive."""
    raise NotImplementedError("Exercise 12.5: whether a grammar can end (its productive rules)")
