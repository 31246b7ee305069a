"""Proposers chosen by name (`speculative_config["method"]`).

A proposer's one method: `propose(seqs, limits, rows) -> drafts`, at most `limits[i]` tokens
for `seqs[i]`, whose block table already has slots for that many drafts after its newest
token. `rows[i]` is the sequence's sampling row: greedy rows get deterministic drafts; a
model proposer draws a sampling row's drafts from its own processed distribution q and
returns q's rows with them, for rejection sampling.
"""

from __future__ import annotations

from typing import Protocol

from minserve.model.runner import ModelRunner
from minserve.model.sampler import SamplingRow
from minserve.scheduler.sequence import Sequence
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.draft import Draft
from minserve.speculative.draft_model import DraftModelProposer
from minserve.speculative.early_exit import EarlyExitProposer
from minserve.speculative.ngram import NgramProposer


class Proposer(Protocol):
    def propose(
        self, seqs: list[Sequence], limits: list[int], rows: list[SamplingRow]
    ) -> list[Draft]: ...


def make_proposer(config: SpeculativeConfig, runner: ModelRunner) -> Proposer:
    """The proposer `config.method` names (the config has rejected unknown methods)."""
    if config.method == "early_exit":
        return EarlyExitProposer(config, runner)
    if config.method == "draft_model":
        return DraftModelProposer(config, runner)
    return NgramProposer(config)
