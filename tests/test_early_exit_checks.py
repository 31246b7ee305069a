"""Exercise 6.6's checks: the solutions pass them, and the usual wrong early-exit drafts are
caught with a message that says what went wrong. (That the engine drafts with the class the
config names is tests/test_speculative.py's.)"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch

from minserve.attention.metadata import AttentionMetadata
from minserve.course import checks_ch06 as checks
from minserve.model.runner import ModelInputs, slot_of
from minserve.speculative.distributions import choose_drafts
from minserve.speculative.draft import Draft
from minserve.speculative.early_exit import EarlyExitProposer
from solutions import ch06_rejection_sampling as solutions

CHECKS = [
    checks.check_early_exit_drafts_what_the_first_layers_predict,
    checks.check_each_decode_in_a_batch_drafts_up_to_its_own_limit,
    checks.check_drafting_writes_only_the_reserved_slots_of_the_first_layers,
    checks.check_sampling_drafts_come_with_the_early_exits_processed_q,
    checks.check_a_row_that_cannot_be_sampled_stops_only_its_sequence,
]


def _student(cls: type) -> types.SimpleNamespace:
    return types.SimpleNamespace(EarlyExitProposer=cls)


def _newest_token_logits(proposer, chunks, drafts, shift: int, num_layers) -> torch.Tensor:
    """minserve's `_draft_logits`, with the position moved by `shift` and any `num_layers`."""
    block_size, device = proposer.runner.kv.block_size, proposer.runner.device
    last = [c.start + len(d) + shift for c, d in zip(chunks, drafts)]
    metadata = AttentionMetadata.build(
        query_lens=[1] * len(chunks),
        context_lens=[p + 1 for p in last],
        block_tables=[list(c.block_table) for c in chunks],
        slot_mapping=[slot_of(c.block_table, block_size, p) for c, p in zip(chunks, last)],
        device=device,
    )
    inputs = ModelInputs(
        input_ids=torch.tensor([(d or c.token_ids)[-1] for c, d in zip(chunks, drafts)]),
        positions=torch.tensor(last),
        metadata=metadata,
        sample_indices=torch.arange(len(chunks)),
    )
    return proposer.runner.forward(inputs, num_layers=num_layers)


class _PositionPastTheToken(EarlyExitProposer):
    """Runs the newest token one position too far (start + len(drafts) + 1)."""

    def _draft_logits(self, chunks, drafts) -> torch.Tensor:
        return _newest_token_logits(self, chunks, drafts, 1, self.num_layers)


class _EveryLayer(EarlyExitProposer):
    """Forgets the exit: runs the whole target (num_layers=None)."""

    def _draft_logits(self, chunks, drafts) -> torch.Tensor:
        return _newest_token_logits(self, chunks, drafts, 0, None)


class _SameRowEachRound(EarlyExitProposer):
    """Samples every round with the chunk's own row: the drafts before are not output."""

    def propose(self, chunks, limits) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor | None]] = [[] for _ in chunks]
        for step in range(max(limits, default=0)):
            active = [i for i, k in enumerate(limits) if k > step]
            logits = self._draft_logits([chunks[i] for i in active], [drafts[i] for i in active])
            rows = [chunks[i].samples[0] for i in active]  # should be row_after(row, drafts)
            tokens, qs = choose_drafts(self.sampler, logits, rows)
            for i, token, q in zip(active, tokens, qs):
                drafts[i].append(token)
                probs[i].append(q)
        return [Draft.from_choices(d, q) for d, q in zip(drafts, probs)]


class _StopsTheBatch(EarlyExitProposer):
    """Ends every sequence's drafting as soon as one row cannot be sampled."""

    def propose(self, chunks, limits) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in chunks]
        for step in range(max(limits, default=0)):
            active = [i for i, k in enumerate(limits) if k > step]
            logits = self._draft_logits([chunks[i] for i in active], [drafts[i] for i in active])
            tokens = logits.argmax(dim=-1).tolist()
            if logits.isnan().any():
                break
            for i, token in zip(active, tokens):
                drafts[i].append(token)
        return [Draft(d) for d in drafts]


class _MostDraftsForAll(EarlyExitProposer):
    """Gives every decode the batch's largest limit."""

    def propose(self, chunks, limits) -> list[Draft]:
        return super().propose(chunks, [max(limits)] * len(limits))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_solution_passes(check: Callable) -> None:
    check(solutions)


@pytest.mark.parametrize(
    ("cls", "check", "message"),
    [
        (
            _PositionPastTheToken,
            checks.check_drafting_writes_only_the_reserved_slots_of_the_first_layers,
            r"position start \+ j .* Slots written that should not be: \[\d",
        ),
        (
            _EveryLayer,
            checks.check_drafting_writes_only_the_reserved_slots_of_the_first_layers,
            "layers past the exit were written too",
        ),
        (
            _EveryLayer,
            checks.check_early_exit_drafts_what_the_first_layers_predict,
            r"expected drafts \[.*\] \(the argmax of the first 1 layers",
        ),
        (
            _SameRowEachRound,
            checks.check_sampling_drafts_come_with_the_early_exits_processed_q,
            r"q's row \d should be the early exit's processed distribution after drafts",
        ),
        (
            _StopsTheBatch,
            checks.check_a_row_that_cannot_be_sampled_stops_only_its_sequence,
            r"expected drafts \[\[\], \[\d+, \d+, \d+\]\] \(the first stops, the second goes on\)",
        ),
        (
            _MostDraftsForAll,
            checks.check_each_decode_in_a_batch_drafts_up_to_its_own_limit,
            r"limits \[3, 0, 1\].*each at most its own limit",
        ),
    ],
    ids=["position+1", "every-layer-slots", "every-layer-drafts", "same-row", "stop-all", "limits"],
)
def test_a_wrong_early_exit_is_caught(cls: type, check: Callable, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check(_student(cls))
