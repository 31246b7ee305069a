"""Chapter 11's checks catch the usual wrong answers (and pass the solutions)."""

from __future__ import annotations

import dataclasses
from types import ModuleType, SimpleNamespace

import pytest

import solutions.ch11_state_plane as solution
from minserve.course import checks_ch11 as checks
from minserve.disagg.stage_planner import FINAL


def variant(**changes) -> ModuleType:
    """The solutions with some names replaced."""
    return SimpleNamespace(**{**vars(solution), **changes})


def fails(check, impl, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        check(impl)


def test_the_solutions_pass_every_check() -> None:
    for check in checks.CHECKS:
        check(solution)


def test_keys_from_hash_or_unchained_are_caught() -> None:
    def unchained(root, token_ids, block_size):
        return [solution.next_key(root, token_ids[i : i + block_size])
                for i in range(0, len(token_ids) - block_size + 1, block_size)]  # fmt: skip

    fails(checks.check_block_keys_chain_and_skip_a_partial_block, variant(block_keys=unchained),
          "chained from block 0")  # fmt: skip
    fails(checks.check_prompts_share_exactly_their_common_blocks, variant(block_keys=unchained),
          "share")  # fmt: skip


def test_a_greedy_load_rule_is_caught() -> None:
    def greedy(num_blocks, holders, block_nbytes, block_size, prefill, speeds):
        by = {s.name: s for s in (solution.DEVICE, *speeds)}
        k = 0
        while k < len(holders) and by[holders[k]].load_s(block_nbytes) < block_size / prefill:
            k += 1
        rest = (num_blocks - k) * block_size / prefill
        return solution.LoadPlan(k, sum(by[t].load_s(block_nbytes) for t in holders[:k]) + rest)

    fails(checks.check_one_disk_block_is_recomputed_and_eight_are_loaded, variant(plan_load=greedy),
          "never sees the eight")  # fmt: skip


def test_an_index_that_ignores_gaps_is_caught() -> None:
    class Blind(solution.ExactIndex):
        def apply(self, batch):
            replica = self.replicas[batch.instance]
            for event in batch.events:
                solution.apply_event(replica.held, event)
            replica.next_seq = batch.seq + 1
            return True

    fails(checks.check_a_gap_is_remembered_until_a_replay_fills_it, variant(ExactIndex=Blind),
          "must not apply")  # fmt: skip
    fails(checks.check_a_batch_applied_twice_changes_nothing, variant(ExactIndex=Blind),
          "must be skipped")  # fmt: skip


def test_a_journal_that_keeps_the_second_identity_or_role_is_caught() -> None:
    @dataclasses.dataclass
    class NoIdentity(solution.Journal):
        def take(self, chunk):
            out = super().take(chunk)
            if out is not None:
                out.update({k: chunk[k] for k in ("id", "created") if k in chunk})
            return out

    @dataclasses.dataclass
    class TwoRoles(solution.Journal):
        def _take_choice(self, choice):
            self.role_sent = False  # every role goes out again
            return super()._take_choice(choice)

    fails(checks.check_a_continued_stream_reads_as_the_uninterrupted_one,
          variant(Journal=NoIdentity), "uninterrupted stream")  # fmt: skip
    fails(checks.check_a_continued_chat_stream_has_one_role, variant(Journal=TwoRoles),
          "must vanish")  # fmt: skip


def test_a_planner_that_chases_the_source_is_caught() -> None:
    def chasing(filled_blocks, sent_blocks, block_bytes, bandwidth_bytes_s, latency_s, step_s,
                tokens_per_block, stages_done, max_stages):  # fmt: skip
        final = latency_s + (filled_blocks - sent_blocks + 1) * block_bytes / bandwidth_bytes_s
        if final <= step_s or stages_done >= max_stages:
            return FINAL
        return range(sent_blocks, filled_blocks)  # every dirty block, never asking if it pays

    chase = variant(next_stage=chasing)
    fails(checks.check_the_stage_cap_and_a_pre_copy_that_cannot_catch_up, chase, "not less")
    fails(checks.check_a_long_context_is_pre_copied_then_the_rest_goes_final, chase, "hides")
