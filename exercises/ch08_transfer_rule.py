# Your workspace for chapter 08 (Disaggregating prefill and decode): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 08` from the repository root.
# Generated from minserve/disagg/transfer_rule.py, minserve/disagg/hand_off.py by `python -m minserve.course.generate`.
# stub fingerprint: ce110f5cb116 (lets the generator tell your edits from a stale stub)
"""Chapter 08, Disaggregating prefill and decode: transfer or recompute, and the
KV hand-off, both sides.

After a prefill, a request's KV cache either travels to the decode instance
(latency + bytes / bandwidth) or the decode instance computes the prompt again
(prompt tokens x seconds per prefill token). You write `TransferRule.decide`,
then `admit` (the decode instance takes an offered request, blocks first), then
the hand-off's two sides: `send_prefilled` (offer, acks, blocks, free) and
`receive_prefilled` (offers, admit, ack or refuse with a reason, blocks in).
Plug them into the pair with `PrefillDecodePair(model, admit=admit,
send=send_prefilled, receive=receive_prefilled)`.
"""

from dataclasses import dataclass

from minserve.disagg.engine_hooks import add_prefilled  # noqa: F401
from minserve.disagg.hand_off import (  # noqa: F401  (your code will want them)
    Admit,
    HandOffLostError,
    receive_into_blocks,
    refusal,
)
from minserve.disagg.kv_transfer import KVAck, KVOffer, KVTransfer
from minserve.disagg.transfer_rule import (
    POLICIES,
    TransferDecision,
    log,  # noqa: F401  (to log each decision)
)
from minserve.engine import LLMEngine
from minserve.scheduler.sequence import Sequence


# Exercise 8.1: transfer or recompute
@dataclass
class TransferRule:
    """Measured link and prefill speed; `decide` picks the cheaper way per request."""

    latency_s: float
    bandwidth_bytes_s: float
    policy: str = "auto"
    recompute_s_per_token: float | None = None  # None until a prefill step was seen

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"transfer policy must be one of {POLICIES}, got {self.policy!r}")

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Update the prefill speed from a step (a running mean, weight 1/4 on the new one)."""
        if num_tokens > 0:
            rate = seconds / num_tokens
            old = self.recompute_s_per_token
            self.recompute_s_per_token = rate if old is None else 0.75 * old + 0.25 * rate

    def decide(self, request_id: str, num_tokens: int, kv_bytes: int) -> TransferDecision:
        """Estimate both ways for one request and pick the cheaper (ties: transfer).

        transfer_s = latency_s + kv_bytes / bandwidth_bytes_s; recompute_s = num_tokens x
        recompute_s_per_token (infinite while no prefill was observed). Policy "transfer" or
        "recompute" forces the choice but still reports both estimates. Log the decision.
        """
        raise NotImplementedError("Exercise 8.1: transfer or recompute")


# Exercise 8.2: the decode side of the KV hand-off
def admit(engine: LLMEngine, offer: KVOffer) -> tuple[Sequence, bool]:
    """Take an offered request into this decode engine; (its sequence, KV accepted).

    Blocks come first: with `offer.with_kv`, allocate blocks for the whole prompt before
    any byte moves, with `add_prefilled(engine, request_id, prompt ids (a list), params,
    first_token, with_kv=True)`; the caller then acknowledges and writes the received KV
    into `seq.block_table`. It raises MemoryError when the pool has no room: then refuse
    the KV and take the request anyway, to recompute its prompt here (`with_kv=False`).
    An offer without KV (the rule chose recompute) is always taken that way.
    """
    raise NotImplementedError("Exercise 8.2: the decode side of the KV hand-off")


# Exercise 8.3: the sender's side of the KV hand-off
def send_prefilled(
    engine: LLMEngine, transfer: KVTransfer, seqs: list[Sequence], offers: list[KVOffer]
) -> list[KVAck]:
    """Hand `seqs` (detached, prefilled, described by `offers`) to the decode side.

    Offer them all (`transfer.offer` waits for the acks), then send each accepted request's
    blocks (`engine.worker.read_blocks(seq.block_table.blocks)` to `transfer.send_blocks`).
    Free this engine's copies (`engine.scheduler.free_detached(seq)`) in every case: once
    the blocks went out, and also when the link fails (the error goes on to the caller).
    Returns the acks.
    """
    raise NotImplementedError("Exercise 8.3: the sender's side of the KV hand-off")


# Exercise 8.4: the receiver's side of the KV hand-off
def receive_prefilled(
    engine: LLMEngine, transfer: KVTransfer, admit: Admit = admit
) -> list[tuple[Sequence, KVAck]]:
    """Take the sender's offers into `engine`; each admitted sequence with its ack.

    `transfer.receive_offers()`, then `admit(engine, offer)` each (blocks first), then one
    `transfer.acknowledge(acks)`: a `KVAck(request_id, accepted, reason)` per offer, in
    order, the reason of a refusal from `refusal(engine, offer)`. Then the KV of each
    accepted request, `receive_into_blocks(engine, transfer, seq)`. When the link fails
    (RuntimeError) before any offer arrived, raise `HandOffLostError([], cause)`; after
    admitting, first abort every offered request here (`engine.abort_request`: frees its
    blocks), then raise `HandOffLostError(their ids, cause)`.
    """
    raise NotImplementedError("Exercise 8.4: the receiver's side of the KV hand-off")
