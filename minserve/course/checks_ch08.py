"""Checks for chapter 08 (disaggregation), run against any module that defines
`TransferRule` and `admit`: minserve's own, the solutions, or a student's exercise file.

The link and the prefill speed are round numbers so every estimate can be worked out on
paper: latency 0.5 s, bandwidth 1000 B/s, so 500 KV bytes take 0.5 + 500 / 1000 = 1.0 s;
recomputing costs 0.25 s per prompt token.
"""

from __future__ import annotations

import functools
import logging
import math
from types import ModuleType
from typing import Any

from minserve.disagg.kv_transfer import KVOffer
from minserve.sampling_params import SamplingParams

LATENCY_S, BANDWIDTH, KV_BYTES, S_PER_TOKEN = 0.5, 1000.0, 500, 0.25


def _rule(impl: ModuleType, policy: str = "auto", observed: bool = True) -> Any:
    rule = impl.TransferRule(LATENCY_S, BANDWIDTH, policy=policy)
    if observed:
        rule.observe_prefill(8, 8 * S_PER_TOKEN)  # the first step sets the speed: 0.25 s/token
    return rule


def _expect(decision: Any, transfer_s: float, recompute_s: float, transfer: bool) -> None:
    got = (decision.transfer_s, decision.recompute_s, decision.transfer)
    assert math.isclose(got[0], transfer_s) and (
        math.isclose(got[1], recompute_s) or got[1] == recompute_s
    ), f"expected transfer_s={transfer_s}, recompute_s={recompute_s}; got {got[0]}, {got[1]}"
    assert got[2] is transfer, (
        f"transfer {transfer_s} s vs recompute {recompute_s} s: expected transfer={transfer}, "
        f"got {got[2]!r}"
    )


def check_a_long_prompt_is_transferred(impl: ModuleType) -> None:
    """8 prompt tokens: transfer 0.5 + 500/1000 = 1.0 s beats recompute 8 x 0.25 = 2.0 s."""
    decision = _rule(impl).decide("long", 8, KV_BYTES)
    assert (decision.request_id, decision.kv_bytes) == ("long", KV_BYTES), (
        f"the decision should name request 'long' and {KV_BYTES} bytes, got "
        f"{decision.request_id!r} and {decision.kv_bytes}"
    )
    _expect(decision, 1.0, 2.0, True)


def check_a_short_prompt_is_recomputed(impl: ModuleType) -> None:
    """2 prompt tokens: recompute 2 x 0.25 = 0.5 s beats transfer 1.0 s (the latency alone)."""
    _expect(_rule(impl).decide("short", 2, KV_BYTES), 1.0, 0.5, False)


def check_a_tie_goes_to_transfer(impl: ModuleType) -> None:
    """4 prompt tokens: both cost 1.0 s; a tie transfers (the decode side skips the work)."""
    _expect(_rule(impl).decide("tie", 4, KV_BYTES), 1.0, 1.0, True)


def check_without_a_measured_prefill_recompute_costs_infinity(impl: ModuleType) -> None:
    """Before any prefill step was observed, recompute_s is inf and the KV is transferred."""
    _expect(_rule(impl, observed=False).decide("first", 2, KV_BYTES), 1.0, math.inf, True)


def check_policy_recompute_forces_recompute_and_keeps_the_estimates(impl: ModuleType) -> None:
    """policy="recompute" never transfers, even when transfer is cheaper; estimates stay."""
    _expect(_rule(impl, policy="recompute").decide("r", 8, KV_BYTES), 1.0, 2.0, False)


def check_policy_transfer_forces_transfer_and_keeps_the_estimates(impl: ModuleType) -> None:
    """policy="transfer" always transfers, even when recompute is cheaper; estimates stay."""
    _expect(_rule(impl, policy="transfer").decide("t", 2, KV_BYTES), 1.0, 0.5, True)


def check_each_decision_is_logged(impl: ModuleType) -> None:
    """decide logs one line on the "minserve.disagg" logger naming the request and the choice."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("minserve.disagg")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _rule(impl).decide("logged-request", 2, KV_BYTES)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1, f"expected one log line for one decision, got {lines}"
    assert "logged-request" in lines[0] and "recompute" in lines[0], (
        f"the log line should name the request and its choice (recompute), got {lines[0]!r}"
    )


# --- exercise 8.2: admit, on a decode engine with room for 4 blocks of 16 tokens ---


@functools.cache
def _decode_engine() -> Any:
    from minserve.llm import LLM

    return LLM(num_blocks=4, block_size=16).engine  # the bundled SmolLM2


def _offer(name: str, num_tokens: int, with_kv: bool) -> KVOffer:
    prompt = tuple(range(100, 100 + num_tokens))
    return KVOffer(name, prompt, 42, SamplingParams(max_tokens=8, temperature=0), with_kv)


def _admit(impl: ModuleType, offer: KVOffer, hold: int = 0) -> tuple[Any, bool]:
    """Run the student's `admit` (after another request took `hold` tokens' blocks), then
    abort both, so every check starts from an empty pool."""
    from minserve.disagg.engine_hooks import add_prefilled

    engine = _decode_engine()
    free = engine.kv.allocator.num_free
    try:
        if hold:
            holder = _offer("holder", hold, True)
            add_prefilled(engine, "holder", list(holder.prompt_token_ids), holder.params, 42, True)
        seq, accepted = impl.admit(engine, offer)
        state = (seq.num_computed_tokens, len(seq.block_table.blocks), list(seq.sample.token_ids))
        waiting = seq in engine.scheduler.waiting
    finally:
        for request_id in (offer.request_id, "holder"):
            engine.abort_request(request_id)  # a request the engine does not hold: a no-op
    assert engine.kv.allocator.num_free == free, "aborting the request should free its blocks"
    return (state, waiting), accepted


def check_an_offer_with_kv_gets_blocks_before_any_byte_moves(impl: ModuleType) -> None:
    """20 prompt tokens with KV: accepted, 2 blocks allocated, the prompt counts as computed."""
    ((computed, blocks, tokens), waiting), accepted = _admit(impl, _offer("kv", 20, True))
    assert accepted is True, f"an offer that fits should be accepted, got {accepted!r}"
    assert (computed, blocks) == (20, 2), (
        f"expected the 20 prompt tokens computed in 2 blocks (16 tokens each) for the KV to "
        f"land in, got {computed} computed tokens and {blocks} blocks"
    )
    assert tokens == [42] and not waiting, "the request should decode next, with token 42"


def check_no_room_means_recompute_not_an_error(impl: ModuleType) -> None:
    """20 prompt tokens with KV, 3 of 4 blocks held by another request: refused, recomputed.

    No MemoryError escapes: the request is taken anyway, to recompute its prompt here."""
    ((computed, blocks, _), waiting), accepted = _admit(impl, _offer("big", 20, True), hold=48)
    assert accepted is False, f"KV that does not fit must be refused, got {accepted!r}"
    assert (computed, blocks, waiting) == (0, 0, True), (
        "a refused request should wait to recompute its prompt (0 computed tokens, no "
        f"blocks yet), got {computed} computed, {blocks} blocks, waiting={waiting}"
    )


def check_an_offer_without_kv_is_recomputed(impl: ModuleType) -> None:
    """The rule chose recompute (with_kv False): taken, not accepted, its prompt waits."""
    ((computed, _, _), waiting), accepted = _admit(impl, _offer("rc", 20, False))
    assert accepted is False and computed == 0 and waiting, (
        f"expected (accepted False, 0 computed, waiting); got ({accepted!r}, {computed}, {waiting})"
    )


CHECKS = [
    check_a_long_prompt_is_transferred,
    check_a_short_prompt_is_recomputed,
    check_a_tie_goes_to_transfer,
    check_without_a_measured_prefill_recompute_costs_infinity,
    check_policy_recompute_forces_recompute_and_keeps_the_estimates,
    check_policy_transfer_forces_transfer_and_keeps_the_estimates,
    check_each_decision_is_logged,
    check_an_offer_with_kv_gets_blocks_before_any_byte_moves,
    check_no_room_means_recompute_not_an_error,
    check_an_offer_without_kv_is_recomputed,
]
