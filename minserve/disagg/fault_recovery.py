"""Fault recovery on the proxy: requests whose instance died, or whose hand-off was lost.

A dead instance (its socket closes, or a report takes longer than the step timeout) is left
out of the next rounds, and the requests it held carry on elsewhere: one that streamed no
token yet is prefilled again on a live prefill instance; the others resume on a live decode
instance (with none left, on a prefill instance) from prompt + the tokens streamed so far,
so their streams go on as if nothing happened. Only a request with nowhere to go fails:
`step()` raises `RequestsFailedError` naming it, with the step's other outputs.

`FaultRecovery` gathers a round's evidence (deaths, hand-offs lost, resumes refused) and
names the requests to place again; `where_again` says where they may go. The proxy
(`DisaggregatedEngine`) owns the requests and the command queues and does the placing.
"""

from __future__ import annotations

from collections.abc import Container
from multiprocessing.process import BaseProcess
from typing import Any

from minserve.disagg.token_deltas import RemoteRequest

Sends = dict[int, list[list]]  # prefill rank -> [request id, decode rank] it hands off


class FaultRecovery:
    """One round's faults: dead ranks and why, hand-offs lost, resumes refused.

    The proxy's state comes in as arguments (`requests`, `alive`, `sends`): read, never
    written; what to do about each request goes back to the proxy."""

    def __init__(self) -> None:
        self.deaths: dict[int, str] = {}  # dead rank -> what happened to it
        self._orphans: set[str] = set()  # hand-offs lost this round: resume them
        self._admitted: set[str] = set()  # ids decode ranks took in this round
        self._refused: dict[str, str] = {}  # request id -> why an instance refused to resume it

    def instance_died(self, rank: int, proc: BaseProcess, kind: str, error: BaseException) -> None:
        """Reap the `kind` ("prefill" or "decode") instance's process; record why it failed."""
        proc.join(2.0)  # a dead process's exit may lag its closed socket
        if proc.is_alive():
            proc.terminate()  # stuck past the step timeout: it cannot rejoin the rounds
        self.deaths[rank] = (
            f"the {kind} instance (rank {rank}, pid {proc.pid}, exit code {proc.exitcode}) "
            f"failed: {error}"
        )

    def note_report(self, report: dict[str, Any]) -> None:
        """What one instance's report says: hand-offs it took, lost, and resumes it refused."""
        self._admitted.update(request_id for request_id, _ in report.get("admitted", []))
        self._orphans.update(report["lost"])  # a hand-off cut by an instance's death
        self._refused.update(report.get("failed", {}))

    def refused(self) -> dict[str, str]:
        """The resumes the instances refused this round (request id -> why): these fail."""
        refused, self._refused = self._refused, {}
        return refused

    def orphans(
        self, requests: dict[str, RemoteRequest], alive: set[int], sends: Sends,
        failed: Container[str],
    ) -> list[RemoteRequest]:  # fmt: skip
        """The requests to place again after this round, those in `failed` aside: on a dead
        instance, or their hand-off lost (by the instances, or with a sender that died)."""
        self._lost_in_transit(sends, alive)
        orphaned = [
            request for request_id, request in requests.items()
            if (request_id in self._orphans or request.location not in alive)
            and request_id not in failed
        ]  # fmt: skip
        self._orphans.clear()
        return orphaned

    def _lost_in_transit(self, sends: Sends, alive: set[int]) -> None:
        """A prefill rank that died mid-round: what it was handing off and no decode rank got."""
        for rank, items in sends.items():
            if rank not in alive:
                self._orphans.update(r for r, _ in items if r not in self._admitted)
        self._admitted.clear()

    def why_lost(self, rank: int, request_id: str) -> str:
        """Why a request with nowhere to go fails: its instance's death, or its lost hand-off."""
        return self.deaths.get(rank, f"the KV hand-off of {request_id} failed")


def where_again(
    request: RemoteRequest, prefill: list[int], decode: list[int]
) -> tuple[list[int], bool]:
    """Where a request may be placed again, and whether it starts over. No token streamed
    yet: a live prefill instance, from the start. Else a live decode instance (with none
    left, a prefill instance), to continue after the tokens it streamed."""
    if not request.token_ids:
        return prefill, True
    return decode or prefill, False
