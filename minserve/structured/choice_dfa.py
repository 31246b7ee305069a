"""A `choice` constraint without a grammar library: a DFA over bytes, and each state's tokens.

The output must be exactly one of a few strings. Their trie is a deterministic finite
automaton (DFA) over bytes: state 0 is the empty prefix, each edge adds one byte, and a
state where a whole choice ends is accepting. A token may come next in a state when its
bytes (as the model decodes them) walk from that state without falling off the trie; EOS
only in an accepting state. Which tokens those are depends on the state alone, so they are
computed once per choice list, one bitmask row per state (the idea behind Outlines' index,
Willard and Louf 2023, and XGrammar's precomputed token masks, Dong et al. 2024), and a
step's mask is a copy of its state's row.

`ChoiceMatcher` follows the engine's matcher protocol (`token_matcher.py`): fill a mask,
accept a token, roll back (speculative decoding), fork, and the text the choices force next
(jump-forward). Plug it in with `LLM(plugins=CoursePlugins(choice_matcher_cls=ChoiceMatcher))`:
the engine then serves `StructuredOutputsParams(choice=[...])` with it instead of xgrammar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from minserve.model.token_mask import bitmask_words
from minserve.structured.token_matcher import MatcherAfter

DONE = -1  # the state after EOS: complete, nothing may follow


@dataclass(frozen=True)
class ChoiceDFA:
    """A DFA over bytes: state 0 is the start, `edges[s]` maps a byte to the state it leads
    to, and `accepting` holds the states where a whole choice ends."""

    edges: tuple[dict[int, int], ...]
    accepting: frozenset[int]

    @property
    def num_states(self) -> int:
        return len(self.edges)


class _TokenizerInfo(Protocol):  # xgrammar's TokenizerInfo, as far as it is read here
    decoded_vocab: list[bytes]
    stop_token_ids: list[int]


@dataclass(frozen=True)
class Vocabulary:
    """The model's tokens as the masks see them: `texts[i]` is the bytes token i decodes to
    (b"" for ids never allowed: special tokens, padding), `stop_token_ids` are EOS, and
    `encode` spells text in tokens (no special tokens added)."""

    texts: tuple[bytes, ...]
    stop_token_ids: tuple[int, ...]
    encode: Callable[[str], list[int]]
    by_text: dict[bytes, list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_text: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(self.texts):
            if text:
                by_text.setdefault(text, []).append(token_id)
        object.__setattr__(self, "by_text", by_text)  # derived once, in the constructor

    @property
    def size(self) -> int:
        return len(self.texts)

    @property
    def max_len(self) -> int:
        """Bytes in the longest token."""
        return max(map(len, self.by_text), default=0)

    @classmethod
    def from_tokenizer_info(
        cls, info: _TokenizerInfo, encode: Callable[[str], list[int]]
    ) -> Vocabulary:
        """The vocabulary as xgrammar decoded it (`compiler.tokenizer_info`): each entry's
        bytes, whatever its spelling (byte-level BPE's 'Ġ', byte fallback's '<0x0A>')."""
        return cls(tuple(info.decoded_vocab), tuple(info.stop_token_ids), encode)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab] -> int32 [rows, ceil(vocab / 32)], bit j of word w = token 32 w + j
    (the inverse of exercise 12.1's unpacking; bit 31 is the int32's sign bit)."""
    rows, vocab = allowed.shape
    bits = np.zeros((rows, bitmask_words(vocab) * 32), dtype=bool)
    bits[:, :vocab] = allowed.numpy()
    packed = np.packbits(bits, axis=-1, bitorder="little")  # uint8 [rows, 4 * words]
    return torch.from_numpy(packed.view("<i4").copy())  # 4 bytes, least significant first


def whole_characters(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters ("" if it starts inside
    one): a tokenizer encodes text, and a DFA over bytes may force half a character."""
    for end in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:end].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


# >>> exercise 12.2: the choices' DFA, each state's tokens, and the matcher
def choice_dfa(choices: Sequence[str]) -> ChoiceDFA:
    """The trie of the choices' UTF-8 bytes, as a DFA: state 0 is the empty prefix, a new
    state for each new prefix (numbered in the order they are first met), and the states
    where a choice ends are accepting."""
    # >>> solution
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
    # <<< solution


def walk(dfa: ChoiceDFA, state: int, text: bytes) -> int | None:
    """The state `text` leads to from `state`, or None if it falls off the DFA."""
    # >>> solution
    for byte in text:
        next_state = dfa.edges[state].get(byte)
        if next_state is None:
            return None
        state = next_state
    return state
    # <<< solution


def token_masks(dfa: ChoiceDFA, vocab: Vocabulary) -> torch.Tensor:
    """int32 [dfa.num_states, ceil(vocab.size / 32)]: row s has the bits of the tokens
    allowed in state s (their bytes walk from s without leaving the DFA; the stop tokens
    in accepting states only). Computed once per choice list: each step copies a row."""
    # >>> solution
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
    # <<< solution


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
        # >>> solution
        if self.state == DONE:
            bitmask[row] = -1
        else:
            bitmask[row] = self.masks[self.state]
        # <<< solution

    def accept(self, token_id: int) -> bool:
        """Move on by one token; False, and no change, if the current state forbids it."""
        # >>> solution
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
        # <<< solution

    @property
    def is_terminated(self) -> bool:
        """A whole choice was written and EOS accepted."""
        # >>> solution
        return self.state == DONE
        # <<< solution

    def fork(self) -> ChoiceMatcher:
        """An independent copy: its states move on without this matcher's."""
        # >>> solution
        copy = type(self)(self.dfa, self.masks, self.vocab)
        copy.states = list(self.states)
        return copy
        # <<< solution

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


# <<< exercise


# >>> exercise 12.3: roll back the last tokens
def rollback_states(states: list[int], num_tokens: int) -> None:
    """Undo the last `num_tokens` tokens of a matcher whose states are `states` (the start
    first, one more per accepted token): drop them in place. 0 changes nothing; a
    ValueError if `num_tokens` is negative or more than the tokens accepted."""
    # >>> solution
    accepted = len(states) - 1
    if not 0 <= num_tokens <= accepted:
        raise ValueError(f"cannot roll back {num_tokens} tokens: {accepted} were accepted")
    del states[len(states) - num_tokens :]
    # <<< solution


# <<< exercise


# >>> exercise 12.4: the text the choices force (jump-forward)
def forced_text(dfa: ChoiceDFA, state: int) -> bytes:
    """The longest text every continuation from `state` starts with: follow the states with
    exactly one edge that are not accepting (an accepting state may also stop there)."""
    # >>> solution
    text = bytearray()
    while state not in dfa.accepting and len(dfa.edges[state]) == 1:
        ((byte, state),) = dfa.edges[state].items()
        text.append(byte)
    return bytes(text)
    # <<< solution


# <<< exercise
