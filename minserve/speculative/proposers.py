"""Proposers chosen by name (`speculative_config["method"]`).

A proposer's one method: `propose(chunks, limits) -> drafts`, at most `limits[i]` tokens
for the decode `chunks[i]`, whose block table already has slots for that many drafts after
its token. Its sampling row (`chunks[i].samples[0]`) says how: greedy rows get
deterministic drafts; a model proposer draws a sampling row's drafts from its own processed
distribution q and returns q's rows with them, for rejection sampling.
"""

from __future__ import annotations

from typing import Protocol

from minserve.messages import ScheduledChunk
from minserve.model.runner import ModelRunner
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.draft import Draft
from minserve.speculative.draft_model import DraftModelProposer
from minserve.speculative.early_exit import EarlyExitProposer
from minserve.speculative.jump_forward import JumpForwardProposer
from minserve.speculative.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, chunks: list[ScheduledChunk], limits: list[int]) -> list[Draft]: ...


def make_proposer(config: SpeculativeConfig, runner: ModelRunner) -> Proposer:
    """The proposer `config.method` names (the config has rejected unknown methods)."""
    if config.method == "early_exit":
        return (config.proposer_cls or EarlyExitProposer)(config, runner)
    if config.method == "draft_model":
        return DraftModelProposer(config, runner)
    if config.method == "jump_forward":
        return JumpForwardProposer(config)
    return (config.proposer_cls or NgramProposer)(config)
