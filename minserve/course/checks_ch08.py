"""Checks for chapter 08 (disaggregation), run against any module that defines
`TransferRule`, `admit`, the hand-off's two sides and the simulator's `simulate`:
minserve's own, the solutions, or a student's exercise file.

The link and the prefill speed are round numbers so every estimate can be worked out on
paper: latency 0.5 s, bandwidth 1000 B/s, so 500 KV bytes take 0.5 + 500 / 1000 = 1.0 s;
recomputing costs 0.25 s per prompt token.

The hand-off checks (8.3, 8.4) run one side on real SmolLM2 engines (a prefill engine
with 16 blocks, a decode engine with 4, blocks of 16 tokens) against a scripted peer that
can drop an acknowledgement, refuse an offer, or never send the blocks; after each, no
block is left held on either side, and a request that arrived decodes to the tokens the
engine gives it colocated.

The simulator checks (8.5) use round step costs (10 ms a step, 1 ms a prompt token, 2 ms
a decoding sequence, 1000 KV bytes a token over a 1 MB/s link), so every timeline can be
worked out on paper; a Poisson workload on several shapes then checks what must hold
whatever the order of events.
"""

from __future__ import annotations

import functools
import logging
import math
import traceback
from dataclasses import replace
from types import ModuleType
from typing import Any

import torch

from minserve.disagg.costs import StepCosts
from minserve.disagg.kv_transfer import KVAck, KVOffer
from minserve.disagg.sim_instance import SimState
from minserve.disagg.simulator import ClusterShape, SimConfig
from minserve.disagg.workload import SimRequest, poisson_workload
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
def _decode_llm() -> Any:
    from minserve.llm import LLM

    return LLM(num_blocks=4, block_size=16)  # the bundled SmolLM2


def _decode_engine() -> Any:
    return _decode_llm().engine


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


# --- exercises 8.3 and 8.4: the hand-off's two sides, each against a scripted peer ---

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = list(range(100, 120))  # 20 tokens: 2 blocks of 16


@functools.cache
def _prefill_engine() -> Any:
    from minserve.llm import LLM

    return LLM(_decode_llm().loaded, num_blocks=16, block_size=16).engine


@functools.cache
def _colocated() -> tuple[int, ...]:
    """PROMPT's greedy tokens, served by one engine start to finish: the oracle."""
    engine = _prefill_engine()
    engine.add_request("colocated", None, PROMPT, PARAMS)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.outputs[0].token_ids
    return tuple(tokens)


def _prefilled(request_id: str) -> Any:
    """A request prefilled on the prefill engine and detached, holding its 2 blocks."""
    from minserve.disagg.engine_hooks import detach_prefilled

    engine = _prefill_engine()
    engine.add_request(request_id, None, PROMPT, PARAMS)
    while not engine.step():
        pass
    return detach_prefilled(engine, request_id)


class _ScriptedDecode:
    """The decode side as the sender sees it: answers offers with `acks` (None: the ack
    never comes) and records the blocks sent."""

    def __init__(self, acks: list[KVAck] | None) -> None:
        self.acks, self.sent, self.offers = acks, [], []

    def offer(self, offers: list[KVOffer]) -> list[KVAck]:
        self.offers += offers
        if self.acks is None:
            raise RuntimeError("no acknowledgement within the step timeout")
        return self.acks

    def send_blocks(self, kv: torch.Tensor) -> None:
        self.sent.append(kv.clone())


def _send(impl: ModuleType, acks: list[KVAck] | None, with_kv: bool = True) -> tuple:
    """Run the student's `send_prefilled` on one prefilled request; (peer, error, blocks)."""
    engine = _prefill_engine()
    impl.send_prefilled(engine, _ScriptedDecode([]), [], [])  # a stub stops here, cheaply
    free = engine.kv.allocator.num_free
    seq = _prefilled("sent")
    blocks = list(seq.block_table.blocks)
    kv = engine.worker.read_blocks(blocks)
    peer, error = _ScriptedDecode(acks), None
    try:
        got = impl.send_prefilled(engine, peer, [seq], [KVOffer.of(seq, with_kv)])
    except NotImplementedError:
        engine.scheduler.free_detached(seq)  # a stub: free for it, and say so
        raise
    except RuntimeError as e:
        error, got = e, None
    left = free - engine.kv.allocator.num_free
    assert left == 0, (
        f"after the hand-off the prefill engine should hold none of the request's "
        f"{len(blocks)} blocks (free_detached every sequence, also when the link fails); "
        f"{left} are still held"
    )
    return peer, error, got, kv


def check_the_sender_sends_accepted_kv_and_frees_its_blocks(impl: ModuleType) -> None:
    """Accepted: the request's 2 blocks go out as one tensor, then its blocks are freed."""
    ack = KVAck("sent", True)
    peer, error, got, kv = _send(impl, [ack])
    assert error is None and got == [ack], f"expected the acks [{ack}] back, got {got!r}"
    assert len(peer.offers) == 1 and peer.offers[0].request_id == "sent", (
        f"expected one offer for 'sent', got {peer.offers}"
    )
    assert len(peer.sent) == 1 and torch.equal(peer.sent[0], kv), (
        f"expected one send of the request's blocks, a tensor of shape {tuple(kv.shape)} "
        f"(read_blocks of its block table); got {[tuple(t.shape) for t in peer.sent]}"
    )


def check_the_sender_sends_nothing_for_a_refused_offer(impl: ModuleType) -> None:
    """Refused (the decode pool is full): no bytes move, and the blocks are freed all the same."""
    ack = KVAck("sent", False, "no room for 20 transferred tokens")
    peer, error, got, _ = _send(impl, [ack])
    assert error is None and got == [ack], f"expected the acks [{ack}] back, got {got!r}"
    assert peer.sent == [], f"a refused offer sends no KV; {len(peer.sent)} tensors were sent"


def check_the_sender_frees_its_blocks_when_the_ack_never_comes(impl: ModuleType) -> None:
    """A dropped acknowledgement: the error reaches the caller, and no block stays held."""
    peer, error, _, _ = _send(impl, None)
    assert isinstance(error, RuntimeError), (
        "when transfer.offer raises (no ack), send_prefilled should let the error reach the "
        f"caller, who reports the request lost; it returned instead ({error!r})"
    )
    assert peer.sent == [], "no KV may move without an acknowledgement"


class _ScriptedPrefill:
    """The prefill side as the receiver sees it: `offers` (None: the link fails first), the
    blocks it sends (None: they never come), and whether acknowledging fails."""

    def __init__(self, offers: list[KVOffer] | None, kv: torch.Tensor | None,
                 ack_fails: bool = False) -> None:  # fmt: skip
        self.offers, self.kv, self.ack_fails, self.acks = offers, kv, ack_fails, []

    def receive_offers(self) -> list[KVOffer]:
        if self.offers is None:
            raise RuntimeError("the prefill rank closed its socket")
        return self.offers

    def acknowledge(self, acks: list[KVAck]) -> None:
        if self.ack_fails:
            raise RuntimeError("the acknowledgement could not be sent")
        self.acks += acks

    def receive_blocks(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.kv is None:
            raise RuntimeError("the blocks never came")
        assert tuple(self.kv.shape) == tuple(shape), (
            f"receive_blocks was asked for shape {tuple(shape)}; the request's blocks have "
            f"shape {tuple(self.kv.shape)}"
        )
        return self.kv


def _receive(impl: ModuleType, with_kv: bool, hold: int = 0, **script: Any) -> tuple:
    """The student's `receive_prefilled` on the decode engine, fed PROMPT's prefill (after
    another request took `hold` tokens' blocks); runs what it admitted to the end.
    (peer, error, [(seq, ack)], tokens decoded after the first)."""
    from minserve.disagg.engine_hooks import add_prefilled

    engine = _decode_engine()
    impl.receive_prefilled(engine, _ScriptedPrefill([], None), _solution_admit())  # a stub stops
    free = engine.kv.allocator.num_free
    seq = _prefilled("handed")
    prefill = _prefill_engine()
    kv = prefill.worker.read_blocks(seq.block_table.blocks)
    offer = KVOffer.of(seq, with_kv)
    prefill.scheduler.free_detached(seq)
    peer = _ScriptedPrefill(**{"offers": [offer], "kv": kv, **script})
    error, got, tokens = None, None, []
    try:
        if hold:
            add_prefilled(engine, "holder", list(range(hold)), PARAMS, 42, True)
        try:
            got = impl.receive_prefilled(engine, peer, _solution_admit())
        except NotImplementedError:
            raise
        except RuntimeError as e:
            error = e
        engine.abort_request("holder")
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens += output.outputs[0].token_ids
    finally:
        for request_id in ("handed", "holder"):
            engine.abort_request(request_id)
    assert engine.kv.allocator.num_free == free, (
        f"after the hand-off and the decode, the decode engine should hold no block; "
        f"{free - engine.kv.allocator.num_free} are still held (abort what was admitted "
        "when the blocks never come)"
    )
    return peer, error, got, [offer.first_token, *tokens]


def _solution_admit() -> Any:
    from minserve.disagg.hand_off import admit

    return admit  # 8.4 is checked on its own: exercise 8.2's admit is minserve's here


def check_the_receiver_acks_writes_the_kv_and_the_request_decodes(impl: ModuleType) -> None:
    """Accepted: one ack (accepted, no reason), the KV lands, greedy tokens as colocated."""
    peer, error, got, tokens = _receive(impl, with_kv=True)
    assert error is None, f"a hand-off that succeeds raises nothing; got {error!r}"
    assert peer.acks == [KVAck("handed", True, "")], (
        f"expected one ack KVAck('handed', True, ''), got {peer.acks}"
    )
    assert got is not None and [a for _, a in got] == peer.acks, (
        f"receive_prefilled should return (seq, ack) per offer; got {got!r}"
    )
    assert tuple(tokens) == _colocated(), (
        f"the request should decode to the colocated tokens {list(_colocated())}; got {tokens} "
        "(was the received KV written into the request's blocks?)"
    )


def check_the_receiver_refuses_a_full_pool_and_says_why(impl: ModuleType) -> None:
    """3 of 4 blocks held: the KV is refused with a reason, the prompt recomputed here."""
    peer, error, _, tokens = _receive(impl, with_kv=True, hold=48)
    assert error is None, f"a full pool is no error (recompute instead); got {error!r}"
    (ack,) = peer.acks
    assert not ack.accepted and "no room" in ack.reason, (
        f"expected a refusal whose reason says there was no room (refusal(engine, offer)); "
        f"got {ack}"
    )
    assert tuple(tokens) == _colocated(), (
        f"recomputed, the request should still decode to {list(_colocated())}; got {tokens}"
    )


def check_the_receiver_takes_a_recompute_offer_and_says_so(impl: ModuleType) -> None:
    """An offer without KV (the rule chose recompute): refused with that reason, decoded."""
    peer, error, _, tokens = _receive(impl, with_kv=False)
    assert error is None and [(a.accepted, a.reason) for a in peer.acks] == [
        (False, "the transfer rule chose recompute")
    ], f"expected one ack refusing with the rule's reason; got {peer.acks}, error {error!r}"
    assert tuple(tokens) == _colocated(), f"expected {list(_colocated())}, got {tokens}"


def check_the_receiver_drops_what_it_admitted_when_the_kv_never_comes(impl: ModuleType) -> None:
    """Acked, but the blocks never come: abort the request here and raise HandOffLostError."""
    from minserve.disagg.hand_off import HandOffLostError

    _, error, _, tokens = _receive(impl, with_kv=True, kv=None)
    assert isinstance(error, HandOffLostError) and error.request_ids == ["handed"], (
        f"expected HandOffLostError naming ['handed'], got {error!r}"
    )
    assert "never came" in str(error), (
        f"the error should carry the link's reason ('the blocks never came'), got {str(error)!r}"
    )
    assert tokens == [tokens[0]], f"the lost request must not decode; it made {tokens[1:]}"


def check_the_receiver_drops_what_it_admitted_when_the_ack_fails(impl: ModuleType) -> None:
    """The ack cannot be sent (the dropped ack, seen from this side): abort, raise."""
    from minserve.disagg.hand_off import HandOffLostError

    _, error, _, _ = _receive(impl, with_kv=True, ack_fails=True)
    assert isinstance(error, HandOffLostError) and error.request_ids == ["handed"], (
        f"expected HandOffLostError naming ['handed'], got {error!r}"
    )
    _, error, _, _ = _receive(impl, with_kv=True, offers=None)
    assert isinstance(error, HandOffLostError) and error.request_ids == [], (
        f"the link failing before any offer: HandOffLostError naming [], got {error!r}"
    )


# --- exercise 8.5: the simulator's event loop, on timelines worked out by hand ---

SIM_COSTS = StepCosts(base_s=0.010, per_prefill_token_s=0.001, per_decode_seq_s=0.002,
                      kv_bytes_per_token=1000)  # fmt: skip
SIM_CONFIG = SimConfig(max_num_batched_tokens=512, max_num_seqs=8, transfer_bandwidth_bytes_s=1e6)
DECODE_STEP = 0.012  # one step decoding one sequence: 10 ms + 2 ms


def _simulated(impl: ModuleType, work: list[SimRequest], shape: ClusterShape, config=SIM_CONFIG):
    """The student's `simulate`; its requests, which must be the workload's, in order."""
    try:
        requests = impl.simulate(work, shape, SIM_COSTS, config).requests
    except ValueError as error:
        if traceback.extract_tb(error.__traceback__)[-1].name != "finish_step":
            raise
        raise AssertionError(
            f"simulate({len(work)} requests, {shape.label}): an instance finished a step that "
            f"decoded a request it no longer runs ({error}): two steps of one instance "
            "overlapped. An instance is busy from the start of its step to its step_done "
            "event, and starts nothing in between."
        ) from error
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == [w.arrival_s for w in work], (
        f"simulate({len(work)} requests, {shape.label}): expected one RequestTimes per request "
        f"in the workload's order (arrivals {[w.arrival_s for w in work]}), got arrivals "
        f"{arrivals}"
    )
    return requests


def _expect_times(what: str, got: list[tuple[float, ...]], expected: list[tuple[float, ...]]):
    close = len(got) == len(expected) and all(
        math.isclose(g, e, rel_tol=1e-9, abs_tol=1e-12)
        for gs, es in zip(got, expected)
        for g, e in zip(gs, es)
    )
    rounded = [tuple(round(t, 6) for t in times) for times in got]
    assert close, f"{what}: expected {expected}, got {rounded}"


def check_one_colocated_request_is_one_prefill_step_then_decode_steps(impl: ModuleType) -> None:
    """1 colocated instance, 100 prompt tokens, 5 output: first token 0.110 s, last 0.158 s"""
    (r,) = _simulated(impl, [SimRequest(0.0, 100, 5)], ClusterShape(num_colocated=1))
    _expect_times(
        "one request (arrival 0 s, 100 prompt tokens, 5 output) on 1 colocated instance, "
        "(first token, finish) in s: one prefill step of 0.010 + 100 x 0.001, then 4 decode "
        "steps of 0.010 + 0.002",
        [(r.first_token_s, r.finish_s)],
        [(0.110, 0.110 + 4 * DECODE_STEP)],
    )


def check_a_hand_off_costs_latency_plus_bytes_over_bandwidth(impl: ModuleType) -> None:
    """1P1D, 50 ms latency: 100 tokens' KV takes 0.05 + 100 x 1000 / 1e6 = 0.15 s to land"""
    config = replace(SIM_CONFIG, transfer_latency_s=0.05)
    shape = ClusterShape(num_prefill=1, num_decode=1)
    spec = SimRequest(1.0, 100, 5)
    seconds = impl.ClusterRun(shape, SIM_COSTS, config).transfer_s(SimState(spec, 100))
    assert math.isclose(seconds, 0.15), (
        "transfer_s of a 100-token prompt (1000 KV bytes a token, 1e6 B/s, 0.05 s latency): "
        f"expected 0.05 + 100000 / 1e6 = 0.15 s, got {seconds}"
    )
    (r,) = _simulated(impl, [spec], shape, config)
    _expect_times(
        "one request (arrival 1 s, 100 prompt tokens, 5 output) on 1P1D, (first token, "
        "finish) in s: the first token when the prefill step ends, then 0.15 s of KV "
        "transfer before the decode instance's 4 steps",
        [(r.first_token_s, r.finish_s)],
        [(1.110, 1.110 + 0.15 + 4 * DECODE_STEP)],
    )


def check_the_kv_goes_to_the_least_loaded_decode_instance(impl: ModuleType) -> None:
    """1P2D: A decodes on one instance, so B's KV goes to the other and B decodes alone"""
    work = [SimRequest(0.0, 10, 10), SimRequest(0.025, 10, 10)]
    a, b = _simulated(impl, work, ClusterShape(num_prefill=1, num_decode=2))
    # A: prefill [0, 0.020], KV lands at 0.030, 9 decode steps alone
    # B: prefill [0.025, 0.045], KV lands at 0.055 on the idle instance, 9 steps alone
    _expect_times(
        "1P2D, A (arrival 0 s) and B (0.025 s), 10 prompt and 10 output tokens each, "
        "(first token, finish) of A and B in s: B's KV must go to the decode instance "
        "that is not decoding A, so each decodes alone in steps of 0.012 s",
        [(a.first_token_s, a.finish_s), (b.first_token_s, b.finish_s)],
        [(0.020, 0.030 + 9 * DECODE_STEP), (0.045, 0.055 + 9 * DECODE_STEP)],
    )


def check_arrivals_join_the_least_loaded_front_instance(impl: ModuleType) -> None:
    """2 colocated instances, 2 requests at t = 0: one each, both first tokens at 0.110 s"""
    work = [SimRequest(0.0, 100, 2), SimRequest(0.0, 100, 2)]
    got = [(r.first_token_s, r.finish_s) for r in
           _simulated(impl, work, ClusterShape(num_colocated=2))]  # fmt: skip
    _expect_times(
        "2 colocated instances, 2 requests arriving at 0 s (100 prompt tokens, 2 output "
        "each), (first token, finish) in s: the second must join the idle instance",
        got,
        [(0.110, 0.110 + DECODE_STEP)] * 2,
    )


def check_a_busy_instance_finishes_its_step_before_starting_another(impl: ModuleType) -> None:
    """B arrives while A's decode step runs: B's prefill starts when that step ends"""
    work = [SimRequest(0.0, 10, 3), SimRequest(0.025, 200, 1)]
    a, b = _simulated(impl, work, ClusterShape(num_colocated=1))
    # A: prefill [0, 0.020], decode [0.020, 0.032]; B arrives at 0.025 and waits; the
    # next step prefills B's 200 tokens and decodes A: [0.032, 0.032 + 0.212]
    _expect_times(
        "1 colocated instance, A (arrival 0 s, 10 prompt tokens, 3 output) and B (0.025 s, "
        "200 prompt tokens, 1 output), (first token, finish) of A and B in s: B arrives "
        "during A's decode step [0.020, 0.032] and waits for its end",
        [(a.first_token_s, a.finish_s), (b.first_token_s, b.finish_s)],
        [(0.020, 0.244), (0.244, 0.244)],
    )


def check_a_poisson_workload_keeps_every_request_s_bounds(impl: ModuleType) -> None:
    """60 Poisson arrivals on 2 colocated, 1P1D and 2P1D: no request beats its own work"""
    work = poisson_workload(rate=20, num_requests=60, prompt_len=(20, 300), output_len=(1, 20))
    for shape in (ClusterShape(num_colocated=2), ClusterShape(num_prefill=1, num_decode=1),
                  ClusterShape(num_prefill=2, num_decode=1)):  # fmt: skip
        disaggregated = shape.num_decode > 0
        for i, (r, spec) in enumerate(zip(_simulated(impl, work, shape), work)):
            prefill = SIM_COSTS.base_s + spec.prompt_len * SIM_COSTS.per_prefill_token_s
            transfer = spec.prompt_len * 1000 / 1e6 if disaggregated else 0.0
            decodes = (spec.output_len - 1) * DECODE_STEP
            least = (prefill, transfer + decodes if spec.output_len > 1 else 0.0)
            got = (r.first_token_s - r.arrival_s, r.finish_s - r.first_token_s)
            assert spec.output_len > 1 or got[1] == 0.0, (
                f"{shape.label}, request {i} of a Poisson workload (arrival "
                f"{spec.arrival_s:.4f} s, {spec.prompt_len} prompt tokens, 1 output): its only "
                f"token is its first, so it finishes there; got {got[1]:.4f} s later (a "
                "finished request handed off or decoded again?)"
            )
            assert got[0] >= least[0] - 1e-9 and got[1] >= least[1] - 1e-9, (
                f"{shape.label}, request {i} of a Poisson workload (arrival {spec.arrival_s:.4f} "
                f"s, {spec.prompt_len} prompt tokens, {spec.output_len} output): its time to "
                f"first token must be at least one prefill of its prompt ({least[0]:.4f} s) "
                f"and first token to finish at least its KV transfer plus its decode steps "
                f"({least[1]:.4f} s); got {got[0]:.4f} s and {got[1]:.4f} s (events out of "
                "time order, or steps that overlap?)"
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
    check_the_sender_sends_accepted_kv_and_frees_its_blocks,
    check_the_sender_sends_nothing_for_a_refused_offer,
    check_the_sender_frees_its_blocks_when_the_ack_never_comes,
    check_the_receiver_acks_writes_the_kv_and_the_request_decodes,
    check_the_receiver_refuses_a_full_pool_and_says_why,
    check_the_receiver_takes_a_recompute_offer_and_says_so,
    check_the_receiver_drops_what_it_admitted_when_the_kv_never_comes,
    check_the_receiver_drops_what_it_admitted_when_the_ack_fails,
    check_one_colocated_request_is_one_prefill_step_then_decode_steps,
    check_a_hand_off_costs_latency_plus_bytes_over_bandwidth,
    check_the_kv_goes_to_the_least_loaded_decode_instance,
    check_arrivals_join_the_least_loaded_front_instance,
    check_a_busy_instance_finishes_its_step_before_starting_another,
    check_a_poisson_workload_keeps_every_request_s_bounds,
]


HINTS: dict[str, tuple[str, str, str]] = {
    "8.1": (
        "Two ways to give the decode side a prompt's KV: move the bytes over the link, or "
        "compute them again. Estimate the seconds each takes and take the cheaper.",
        "Compute both estimates first (transfer from the link's latency and bandwidth, "
        "recompute from the measured seconds per prefill token, infinite before any was "
        "measured), then let the policy decide (forced, or the cheaper with ties to "
        "transfer), then log one line and return a TransferDecision.",
        "transfer seconds: the link's latency plus the bytes over its bandwidth; when "
        "self.recompute_s_per_token is None use float('inf'); the choice is policy "
        "'transfer', or policy 'auto' with transfer_s <= recompute_s; log.info(...) names "
        "the request id and 'transfer' or 'recompute'.",
    ),
    "8.2": (
        "Blocks come before bytes: the decode side reserves room for the whole prompt "
        "before the sender moves anything, and a pool without room is no error: the "
        "request is taken anyway and its prompt computed here.",
        "If the offer carries KV, try add_prefilled with with_kv=True and answer True; "
        "catch MemoryError (no room). In every other case, add_prefilled with "
        "with_kv=False and answer False.",
        "add_prefilled takes the offer's request id, prompt ids (a list), params and first "
        "token; inside `if offer.with_kv:` a try/except MemoryError around "
        "the with_kv=True call; fall through to the with_kv=False call.",
    ),
    "8.3": (
        "The sender holds the only copy of the KV until the receiver has acknowledged it and "
        "the bytes are out; after that, and also when the link fails, its blocks must go "
        "back to the pool, or every failure leaks memory.",
        "Wrap the whole exchange in try/finally: inside, offer (this waits for the acks) "
        "and send the blocks of each accepted request; in the finally, free every "
        "sequence's detached blocks. Do not catch the link's error: the caller reports "
        "the request lost.",
        "transfer.offer returns one ack per offer, in order; for each accepted one, "
        "read its blocks through engine.worker.read_blocks and hand them to "
        "transfer.send_blocks; in the finally, engine.scheduler.free_detached each "
        "sequence.",
    ),
    "8.4": (
        "The receiver admits before it acknowledges, so an accepted offer always has blocks "
        "to land in; it answers every offer, saying why when it refuses; and if the link "
        "fails after admitting, it drops what it admitted so no block stays held.",
        "Three phases. Receive the offers (a failure here lost nothing: HandOffLostError "
        "with no ids). Admit each and build one KVAck per offer. Acknowledge and receive "
        "the accepted requests' blocks inside a try: on RuntimeError abort every offered "
        "request, then raise HandOffLostError with their ids and the error's text.",
        "admitted = [admit(engine, o) for o in offers]; KVAck(o.request_id, accepted, '' "
        "if accepted else refusal(engine, o)); acknowledge them all through the transfer, "
        "then receive_into_blocks for each accepted sequence; return "
        "(seq, ack) pairs.",
    ),
}

HINTS["8.5"] = (
    "A discrete-event simulation never ticks a clock: it jumps from one event to the next "
    "earliest one (an arrival, the end of an instance's step, a prompt's KV landing on a "
    "decode instance), and handling an event may schedule later ones. An instance runs one "
    "step at a time; whenever it becomes idle, or gets work while idle, it plans its next.",
    "replay: a SimState per request, an arrive event for each, then pop the heap until it "
    "is empty, dispatching on the kind (arrivals to the least-loaded front instance, landed "
    "KV to its decode instance, both through _enqueue; step ends to _step_done). _start: "
    "nothing if busy or if plan() gives None; else mark it busy and push its step_done at "
    "now + the step's cost. _step_done: idle again, hand off each completed prefill that "
    "still has tokens to produce (prefill instances only), then _start. _hand_off: the "
    "least-loaded decoder now, a kv_landed event transfer_s later.",
    "heapq.heappop(self.events) gives (now, tie-break, kind, what); min(instances, "
    "key=lambda i: i.load) picks the least loaded; the step's cost is "
    "self.costs.step_time(step.prefill_tokens, len(step.decodes)); a completed prefill is "
    "handed off only when instance.role is 'prefill' and the state is not done; the KV's "
    "bytes are the prompt length times costs.kv_bytes_per_token.",
)
