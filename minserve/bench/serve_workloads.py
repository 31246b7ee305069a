"""Workloads for `bench serve`: what each simulated user sends, seeded.

A workload is a list of sessions; a session is one or more turns sent one after another
(the next turn waits for the previous reply). Arrivals are drawn per session.

    random         one turn: `input_len` random token ids (vLLM's random dataset)
    shared-prefix  one turn: a `prefix_len` prefix shared by every request + a random tail
    multi-turn     `num_turns` chat turns; each turn re-sends the conversation so far
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORKLOADS = ("random", "shared-prefix", "multi-turn")
WORDS = ("cache", "block", "token", "batch", "prefill", "decode", "kernel", "tensor",
         "queue", "server", "model", "layer", "memory", "stream", "request", "latency")  # fmt: skip
FIRST_TOKEN_ID = 100  # skip the special tokens at the start of the vocabulary


@dataclass(frozen=True)
class WorkloadSpec:
    """How to build a workload; lengths are in tokens (words for multi-turn messages)."""

    name: str = "random"
    num_sessions: int = 100
    input_len: int = 128
    output_len: int = 64
    prefix_len: int = 256
    num_turns: int = 3
    vocab_size: int = 49152
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose {', '.join(WORKLOADS)}")
        for name in ("num_sessions", "input_len", "output_len", "num_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")


@dataclass
class Session:
    """One user's turns. Completions turns carry token ids; chat turns carry messages."""

    prompts: list[list[int]] = field(default_factory=list)  # completions: one per turn
    user_messages: list[str] = field(default_factory=list)  # chat: one per turn
    output_len: int = 64

    @property
    def is_chat(self) -> bool:
        return bool(self.user_messages)

    @property
    def num_turns(self) -> int:
        return len(self.user_messages) if self.is_chat else len(self.prompts)


def build_workload(spec: WorkloadSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    if spec.name == "multi-turn":
        return [
            Session(
                user_messages=[_words(rng, spec.input_len) for _ in range(spec.num_turns)],
                output_len=spec.output_len,
            )  # fmt: skip
            for _ in range(spec.num_sessions)
        ]
    prefix = (
        _token_ids(rng, spec.prefix_len, spec.vocab_size) if spec.name == "shared-prefix" else []
    )
    return [
        Session(
            prompts=[prefix + _token_ids(rng, spec.input_len, spec.vocab_size)],
            output_len=spec.output_len,
        )  # fmt: skip
        for _ in range(spec.num_sessions)
    ]


def _token_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count)]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))
