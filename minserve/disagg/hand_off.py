"""The KV hand-off protocol, both sides, over any `KVTransfer` (DistServe, Mooncake).

    sender (prefill)                               receiver (decode)
    offer(offers)          ── offers ──►           receive_offers()
                                                   admit each: blocks first, or refuse
                           ◄── acks ───            acknowledge(acks: accepted, or why not)
    send_blocks per accepted                       receive_blocks into its blocks
    free its own copies: after sending, or when the link fails

Neither side leaks a block: the sender frees its copies whatever happens, the receiver
aborts what it admitted when the blocks never come (`HandOffLostError` names them).
"""

from __future__ import annotations

from collections.abc import Callable

from minserve.disagg.engine_hooks import add_prefilled
from minserve.disagg.kv_transfer import KVAck, KVOffer, KVTransfer
from minserve.engine import LLMEngine
from minserve.scheduler.sequence import Sequence

Admit = Callable[[LLMEngine, KVOffer], tuple[Sequence, bool]]
Send = Callable[[LLMEngine, KVTransfer, list[Sequence], list[KVOffer]], list[KVAck]]
Receive = Callable[[LLMEngine, KVTransfer, Admit], list[tuple[Sequence, KVAck]]]
RECOMPUTE = "the transfer rule chose recompute"


class HandOffLostError(RuntimeError):
    """The link failed mid-hand-off; `request_ids` were dropped here (their blocks freed)."""

    def __init__(self, request_ids: list[str], cause: str = "") -> None:
        super().__init__(f"hand-off of {request_ids} failed" + (f": {cause}" if cause else ""))
        self.request_ids = request_ids


# >>> exercise 8.2: the decode side of the KV hand-off
def admit(engine: LLMEngine, offer: KVOffer) -> tuple[Sequence, bool]:
    """Take an offered request into this decode engine; (its sequence, KV accepted).

    Blocks come first: with `offer.with_kv`, allocate blocks for the whole prompt before
    any byte moves, with `add_prefilled(engine, request_id, prompt ids (a list), params,
    first_token, with_kv=True)`; the caller then acknowledges and writes the received KV
    into `seq.block_table`. It raises MemoryError when the pool has no room: then refuse
    the KV and take the request anyway, to recompute its prompt here (`with_kv=False`).
    An offer without KV (the rule chose recompute) is always taken that way.
    """
    # >>> solution
    args = (offer.request_id, list(offer.prompt_token_ids), offer.params, offer.first_token)
    if offer.with_kv:
        try:
            return add_prefilled(engine, *args, with_kv=True), True
        except MemoryError:
            pass  # refused: the prompt is recomputed here instead
    return add_prefilled(engine, *args, with_kv=False), False
    # <<< solution


# <<< exercise


# >>> exercise 8.3: the sender's side of the KV hand-off
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
    # >>> solution
    try:
        acks = transfer.offer(offers)
        for seq, ack in zip(seqs, acks):
            if ack.accepted:
                transfer.send_blocks(engine.worker.read_blocks(seq.block_table.blocks))
        return acks
    finally:
        for seq in seqs:
            engine.scheduler.free_detached(seq)  # only now: sent, refused, or lost
    # <<< solution


# <<< exercise


def refusal(engine: LLMEngine, offer: KVOffer) -> str:
    """Why `admit` took `offer` without its KV."""
    if not offer.with_kv:
        return RECOMPUTE
    kv = engine.kv
    return (
        f"no room for {len(offer.prompt_token_ids)} transferred tokens: "
        f"{kv.allocator.num_free} free blocks of {kv.block_size} tokens; recomputing here"
    )


def receive_into_blocks(engine: LLMEngine, transfer: KVTransfer, seq: Sequence) -> None:
    """Receive one accepted request's KV and write it into the blocks `admit` allocated."""
    pool = engine.worker.pool
    blocks = seq.block_table.blocks
    layers, kv, _, *tail = pool.kv.shape  # [layers, 2, num_blocks, block_size, Hkv, D]
    data = transfer.receive_blocks((layers, kv, len(blocks), *tail), pool.dtype)
    engine.worker.write_blocks(blocks, data)


# >>> exercise 8.4: the receiver's side of the KV hand-off
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
    # >>> solution
    try:
        offers = transfer.receive_offers()
    except RuntimeError as error:
        raise HandOffLostError([], str(error)) from error  # nothing was admitted yet
    admitted = [admit(engine, offer) for offer in offers]
    acks = [
        KVAck(offer.request_id, accepted, "" if accepted else refusal(engine, offer))
        for offer, (_, accepted) in zip(offers, admitted)
    ]
    try:
        transfer.acknowledge(acks)
        for seq, accepted in admitted:
            if accepted:
                receive_into_blocks(engine, transfer, seq)
    except RuntimeError as error:
        for offer in offers:
            engine.abort_request(offer.request_id)  # frees what was allocated
        raise HandOffLostError([o.request_id for o in offers], str(error)) from error
    return [(seq, ack) for (seq, _), ack in zip(admitted, acks)]
    # <<< solution


# <<< exercise
