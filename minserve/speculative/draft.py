"""`Draft`: what a proposer returns for one sequence and step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Draft:
    """One sequence's guesses for a step and the distribution each was drawn from."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] q; None: deterministic (one-hot)

    @classmethod
    def from_choices(cls, token_ids: list[int], probs: list[torch.Tensor | None]) -> Draft:
        """Drafts chosen one position at a time; q's rows are kept when every one was drawn."""
        if not token_ids or any(q is None for q in probs):
            return cls(token_ids)
        return cls(token_ids, torch.stack(probs))  # type: ignore[arg-type]
