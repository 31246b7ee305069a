"""A prefill instance: a process that prefills, then hands each request's KV to a decode rank.

One round, as the proxy (rank 0) commands it:

    abort what the proxy says (queued, mid-prefill, or prefilled and waiting to leave)
    add the new requests to its engine, and those it resumes: requests whose decode
        instance died when no other is left, continued here after their tokens so far
        (they stay and decode here)
    hand off last round's prefills: for each destination decode rank, in rank order,
        offer (JSON) -> acks -> KV blocks (send) -> free its own copies
    one prefill step; requests that got their first token are detached, kept for the next
    report to the proxy: new tokens, who leaves, transfer decisions, lost hand-offs, stats

Per destination, `TransferRule` (link measured at start-up, prefill speed measured here)
chooses whether the KV moves or the decode instance recomputes the prompt.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from minserve.disagg.engine_hooks import detach_prefilled, resume_from_json
from minserve.disagg.hand_off import send_prefilled
from minserve.disagg.kv_transfer import KVOffer, TorchKVTransfer
from minserve.disagg.kv_wire import HOST
from minserve.disagg.token_deltas import delta_json
from minserve.disagg.topology import PROXY_RANK
from minserve.disagg.transfer_rule import TransferRule
from minserve.disagg.wire import recv_command, send_json
from minserve.engine import LLMEngine, observe_steps
from minserve.sampling_params import SamplingParams
from minserve.scheduler.sequence import Sequence


def serve_prefill_rounds(
    engine: LLMEngine,
    control: dist.ProcessGroup,
    links: dict[int, tuple[float, float]],
    policy: str,
    kv_device: torch.device,
) -> None:
    """Rounds until the proxy says stop or is gone (commands on the control group)."""
    instance = PrefillInstance(engine, links, policy, kv_device)
    while (command := recv_command(PROXY_RANK, control)) is not None:
        send_json(instance.round(command), PROXY_RANK)


class PrefillInstance:
    """One prefill engine, its prefilled requests waiting to leave, and one link per decode rank."""

    def __init__(
        self,
        engine: LLMEngine,
        links: dict[int, tuple[float, float]],
        policy: str,
        kv_device: torch.device = HOST,
    ) -> None:
        self.engine = engine
        self.rules = {d: TransferRule(*link, policy=policy) for d, link in links.items()}
        self.transfers = {d: TorchKVTransfer(d, device=kv_device) for d in links}
        self.leaving: dict[str, Sequence] = {}
        self.staying: set[str] = set()  # resumed here: they decode here, they never leave

    def round(self, command: dict[str, Any]) -> dict[str, Any]:
        for request_id in command["abort"]:
            self.abort(request_id)
        for add in command["add"]:
            params = SamplingParams(**add["params"])
            self.engine.add_request(
                add["id"], None, add["prompt_token_ids"], params, add["priority"]
            )
        failed = resume_from_json(self.engine, command["resume"])
        self.staying |= {r["id"] for r in command["resume"] if r["id"] not in failed}
        decisions, lost = self.hand_off(command["send"])
        outputs, leaving = self.step()
        stats = self.engine.get_metrics()
        return {"outputs": outputs, "leaving": leaving, "decisions": decisions, "lost": lost,
                "failed": failed, "stats": stats}  # fmt: skip

    def abort(self, request_id: str) -> None:
        self.staying.discard(request_id)
        seq = self.leaving.pop(request_id, None)
        if seq is not None:
            self.engine.scheduler.free_detached(seq)
        else:
            self.engine.abort_request(request_id)

    def hand_off(self, sends: list[list]) -> tuple[list[dict], list[str]]:
        """Each destination in rank order (every rank walks the pairs in one global order)."""
        by_rank: dict[int, list[Sequence]] = defaultdict(list)
        for request_id, rank in sends:
            by_rank[rank].append(self.leaving.pop(request_id))
        decisions, lost = [], []
        for rank in sorted(by_rank):
            seqs = by_rank[rank]
            try:
                decisions += self.send_to(rank, seqs)  # frees rank's copies, sent or lost
            except RuntimeError:  # the decode instance died mid-hand-off
                lost += [seq.request.request_id for seq in seqs]
        return decisions, lost

    def send_to(self, rank: int, seqs: list[Sequence]) -> list[dict]:
        """Offer, get acks, send the accepted requests' blocks; the decisions as JSON."""
        worker, rule = self.engine.worker, self.rules[rank]
        decisions = [
            rule.decide(
                seq.request.request_id, len(seq.request.prompt_token_ids),
                len(seq.block_table.blocks) * worker.pool.block_nbytes,
            )
            for seq in seqs
        ]  # fmt: skip
        offers = [KVOffer.of(seq, d.transfer) for seq, d in zip(seqs, decisions)]
        acks = send_prefilled(self.engine, self.transfers[rank], seqs, offers)
        return [
            {**asdict(d), "to_rank": rank, "accepted": a.accepted, "refused_because": a.reason}
            for d, a in zip(decisions, acks)
        ]

    def step(self) -> tuple[list[dict], list[str]]:
        """One prefill step: every request's new tokens, and the ids of those now leaving."""
        if not self.engine.has_unfinished_requests():
            return [], []
        with observe_steps(self.engine) as records:
            outputs = self.engine.step()
        for record, rule in itertools.product(records, self.rules.values()):
            rule.observe_prefill(record.scheduler_output.num_batched_tokens, record.timings.forward)
        self.staying -= {o.request_id for o in outputs if o.finished}
        leaving = [o.request_id for o in outputs if not o.finished]
        leaving = [request_id for request_id in leaving if request_id not in self.staying]
        for request_id in leaving:  # its decode instance reports the tokens after this one
            self.leaving[request_id] = detach_prefilled(self.engine, request_id)
        return [delta_json(o) for o in outputs], leaving
