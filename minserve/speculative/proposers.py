"""Proposers chosen by name (`speculative_config["method"]`).

A proposer's one method: `propose(seqs, limits) -> drafts`, at most `limits[i]` tokens for
`seqs[i]`, whose block table already has slots for that many drafts after its newest token.
"""

from __future__ import annotations

from typing import Protocol

from minserve.model.runner import ModelRunner
from minserve.scheduler.sequence import Sequence
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.draft_model import DraftModelProposer
from minserve.speculative.early_exit import EarlyExitProposer
from minserve.speculative.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]: ...


def make_proposer(config: SpeculativeConfig, runner: ModelRunner) -> Proposer:
    """The proposer `config.method` names (the config has rejected unknown methods)."""
    if config.method == "early_exit":
        return EarlyExitProposer(config, runner)
    if config.method == "draft_model":
        return DraftModelProposer(config, runner)
    return NgramProposer(config)
