"""Who does what in a disaggregated cluster: `<P>P<D>D`, e.g. 1P2D.

Rank 0 is the proxy (the server's process: tokenizes, routes, streams); ranks 1..P are
prefill instances and ranks P+1..P+D decode instances, each its own process with its own
engine and KV pool. KV moves point to point from a prefill rank to a decode rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROXY_RANK = 0
_SPELLING = re.compile(r"(\d+)P(\d+)D")


@dataclass(frozen=True)
class PDTopology:
    """P prefill instances and D decode instances behind one proxy."""

    num_prefill: int
    num_decode: int

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"disaggregation needs at least 1 prefill and 1 decode instance, got "
                f"{self.num_prefill}P{self.num_decode}D"
            )

    @classmethod
    def parse(cls, text: str) -> PDTopology:
        """'1P2D' -> PDTopology(1, 2); anything else raises a ValueError saying the format."""
        match = _SPELLING.fullmatch(text.strip().upper())
        if match is None:
            raise ValueError(
                f"--disaggregation takes <P>P<D>D (prefill and decode instances), e.g. 1P1D "
                f"or 1P2D; got {text!r}"
            )
        return cls(int(match[1]), int(match[2]))

    @property
    def label(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D"

    @property
    def world_size(self) -> int:
        return 1 + self.num_prefill + self.num_decode

    @property
    def prefill_ranks(self) -> tuple[int, ...]:
        return tuple(range(1, 1 + self.num_prefill))

    @property
    def decode_ranks(self) -> tuple[int, ...]:
        return tuple(range(1 + self.num_prefill, self.world_size))

    @property
    def worker_ranks(self) -> tuple[int, ...]:
        return self.prefill_ranks + self.decode_ranks

    def is_prefill(self, rank: int) -> bool:
        return rank in self.prefill_ranks
