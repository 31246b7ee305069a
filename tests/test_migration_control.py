"""The proxy's bookkeeping of live migration, without processes: orders refused with the
reason, and each round settled from what the two decode ranks reported (the source's word
while it lives, the destination's commit once it is dead)."""

from __future__ import annotations

import pytest

from minserve.disagg.migration import PRE_COPY, MigrationOrder
from minserve.disagg.migration_control import (
    MigrationConflictError,
    MigrationControl,
    UnknownInstanceError,
    UnknownRequestError,
)
from minserve.disagg.token_deltas import RemoteRequest

DECODE = (2, 3)  # a 1P2D cluster's decode ranks
ALIVE = {1, 2, 3}


def requests(**where: int) -> dict[str, RemoteRequest]:
    return {r: RemoteRequest(r, None, [1, 2, 3], rank) for r, rank in where.items()}


def migrating(*request_ids: str) -> MigrationControl:
    """A control with `request_ids` migrating from rank 2 to rank 3, started."""
    control = MigrationControl(DECODE)
    held = requests(**dict.fromkeys(request_ids, 2))
    for request_id in request_ids:
        control.order(held, ALIVE, request_id, 3, PRE_COPY)
    control.start_round(held, ALIVE, least_loaded=min)
    return control


def said(request_id: str, outcome: str, blocks: int = 0, reason: str = "", pause_s=0.0):
    return {"id": request_id, "outcome": outcome, "blocks": blocks, "reason": reason,
            "pause_s": pause_s}  # fmt: skip


def report(*outcomes: dict) -> dict:
    return {"migrations": list(outcomes)}


def test_orders_are_refused_with_the_reason():
    control = MigrationControl(DECODE)
    held = requests(decoding=2, prefilling=1)
    with pytest.raises(UnknownRequestError, match="no request 'x' is in flight"):
        control.order(held, ALIVE, "x", 3, PRE_COPY)
    with pytest.raises(UnknownInstanceError, match=r"rank 1 is not a decode instance"):
        control.order(held, ALIVE, "decoding", 1, PRE_COPY)
    with pytest.raises(MigrationConflictError, match="decode rank 3 is dead"):
        control.order(held, {1, 2}, "decoding", 3, PRE_COPY)
    with pytest.raises(MigrationConflictError, match="not decoding yet .* prefill rank 1"):
        control.order(held, ALIVE, "prefilling", 3, PRE_COPY)
    with pytest.raises(MigrationConflictError, match="'decoding' is on rank 2 already"):
        control.order(held, ALIVE, "decoding", 2, PRE_COPY)
    assert control.order(held, ALIVE, "decoding", 3, PRE_COPY) == 2
    with pytest.raises(MigrationConflictError, match="'decoding' is migrating already"):
        control.order(held, ALIVE, "decoding", 3, PRE_COPY)
    with pytest.raises(MigrationConflictError, match="no other live decode instance"):
        control.drain(held, {1, 2}, 2)


def test_an_order_that_no_longer_holds_is_dropped_when_its_round_comes():
    control = MigrationControl(DECODE)
    held = requests(gone=2, resumed=2)
    for request_id in held:
        control.order(held, ALIVE, request_id, 3, PRE_COPY)
    del held["gone"]  # finished meanwhile
    held["resumed"].location = 3  # its instance died; it resumed on rank 3
    control.start_round(held, ALIVE, least_loaded=min)
    assert control.active == {} and control.stats.started == 0
    assert control.outcomes == {
        "gone": "aborted: the request finished or was aborted before it moved",
        "resumed": "aborted: the request left rank 2 before it moved",
    }


def test_the_commands_list_each_migration_for_both_ranks_in_one_order():
    control = migrating("b", "a")
    assert control.commands(2) == control.commands(3)
    assert [c["request_id"] for c in control.commands(2)] == ["a", "b"]
    assert control.commands(1) == []


def test_a_round_settles_by_the_source_while_it_lives():
    control = migrating("staged", "moved", "refused", "doubled")
    moved, drop = control.settle({
        2: report(said("staged", "stage", 5), said("moved", "committed", 2, pause_s=0.25),
                  said("refused", "aborted", reason="no room on rank 3"),
                  said("doubled", "aborted", reason="the link to rank 3 failed")),
        3: report(said("staged", "stage", 5), said("moved", "committed", 2),
                  said("refused", "aborted", reason="no room on rank 3"),
                  said("doubled", "committed", 1)),
    })  # fmt: skip
    assert moved == {"moved": 3}
    assert drop == [(3, "doubled")]  # the source kept it: the destination drops its copy
    assert list(control.active) == ["staged"]
    assert control.outcomes == {"moved": "committed", "refused": "aborted: no room on rank 3",
                                "doubled": "aborted: the link to rank 3 failed"}  # fmt: skip
    stats = control.stats
    assert (stats.started, stats.committed, stats.aborted) == (4, 1, 2)
    assert (stats.blocks_precopied, stats.blocks_final, stats.pause_s_total) == (5, 2, 0.25)


def test_with_a_peer_dead_the_survivor_decides():
    control = migrating("committed_then_lost", "mid_stage", "orphaned")
    moved, drop = control.settle({3: report(said("committed_then_lost", "committed", 3),
                                            said("mid_stage", "stage", 4))})  # fmt: skip
    assert moved == {"committed_then_lost": 3} and drop == []  # the source died: rank 3 has it
    assert control.outcomes["mid_stage"] == "aborted: the source, decode rank 2, died"
    assert control.outcomes["orphaned"] == "aborted: the source, decode rank 2, died"
    control = migrating("mid_stage")
    moved, _ = control.settle({2: report(said("mid_stage", "stage", 4))})
    assert moved == {} and control.active == {}
    assert control.outcomes["mid_stage"] == "aborted: the destination, decode rank 3, died"
    assert control.stats.blocks_precopied == 0  # they went nowhere


def test_a_drain_starts_a_migration_for_each_request_on_the_instance():
    control = MigrationControl((2, 3, 4))
    held = requests(a=2, b=2, c=3)
    assert sorted(control.drain(held, {1, 2, 3, 4}, 2)) == ["a", "b"]
    control.start_round(held, {1, 2, 3, 4}, least_loaded=max)
    assert control.active == {r: MigrationOrder(r, 2, 4) for r in ("a", "b")}
    with pytest.raises(MigrationConflictError, match="rank 3 cannot be drained"):
        control.drain(held, {1, 2, 3}, 3)  # rank 4 dead, rank 2 draining: nowhere to go
