# Generated from minserve/disagg/transfer_rule.py, minserve/disagg/hand_off.py, minserve/disagg/simulator.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 08, Disaggregating prefill and decode: transfer or recompute, the KV
hand-off, both sides, and the capacity simulator's event loop.

After a prefill, a request's KV cache either travels to the decode instance
(latency + bytes / bandwidth) or the decode instance computes the prompt again
(prompt tokens x seconds per prefill token). You write `TransferRule.decide`,
then `admit` (the decode instance takes an offered request, blocks first), then
the hand-off's two sides: `send_prefilled` (offer, acks, blocks, free) and
`receive_prefilled` (offers, admit, ack or refuse with a reason, blocks in).
Plug them into the pair with `PrefillDecodePair(model, admit=admit,
send=send_prefilled, receive=receive_prefilled)`. Last, the capacity
simulator's event loop (`ClusterRun`: arrivals, steps, KV hand-offs); plug
`simulate` into the planner with `search_shapes(..., simulator=simulate)`.
"""

import heapq
import itertools
from dataclasses import dataclass

from minserve.disagg.costs import StepCosts
from minserve.disagg.engine_hooks import add_prefilled  # noqa: F401
from minserve.disagg.hand_off import (  # noqa: F401  (your code will want them)
    Admit,
    HandOffLostError,
    receive_into_blocks,
    refusal,
)
from minserve.disagg.kv_transfer import KVAck, KVOffer, KVTransfer
from minserve.disagg.sim_instance import PlannedStep, SimInstance, SimState
from minserve.disagg.simulator import (
    ClusterShape,
    RequestTimes,
    SimConfig,
    SimResult,
)
from minserve.disagg.transfer_rule import (
    POLICIES,
    TransferDecision,
    log,  # noqa: F401  (to log each decision)
)
from minserve.disagg.workload import SimRequest
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
        transfer_s = self.latency_s + kv_bytes / self.bandwidth_bytes_s
        recompute_s = num_tokens * (self.recompute_s_per_token or float("inf"))
        transfer = self.policy == "transfer" or (
            self.policy == "auto" and transfer_s <= recompute_s
        )
        decision = TransferDecision(request_id, kv_bytes, transfer_s, recompute_s, transfer)
        log.info(
            "%s: %d tokens, %d KV bytes: transfer %.2e s vs recompute %.2e s -> %s",
            request_id, num_tokens, kv_bytes, transfer_s, recompute_s,
            "transfer" if transfer else "recompute",
        )  # fmt: skip
        return decision


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
    args = (offer.request_id, list(offer.prompt_token_ids), offer.params, offer.first_token)
    if offer.with_kv:
        try:
            return add_prefilled(engine, *args, with_kv=True), True
        except MemoryError:
            pass  # refused: the prompt is recomputed here instead
    return add_prefilled(engine, *args, with_kv=False), False


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
    try:
        acks = transfer.offer(offers)
        for seq, ack in zip(seqs, acks):
            if ack.accepted:
                transfer.send_blocks(engine.worker.read_blocks(seq.block_table.blocks))
        return acks
    finally:
        for seq in seqs:
            engine.scheduler.free_detached(seq)  # only now: sent, refused, or lost


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


# Exercise 8.5: the cluster simulator's event loop
def simulate(
    workload: list[SimRequest], shape: ClusterShape, costs: StepCosts, config: SimConfig
) -> SimResult:
    """Replay `workload` on `shape`; `costs` are one instance's step times (at shape.tp)."""
    if not workload:
        raise ValueError("the workload has no requests")
    run = ClusterRun(shape, costs, config)
    if config.lockstep:
        from minserve.disagg.sim_rounds import simulate_rounds

        states = simulate_rounds(workload, run.front, run.decoders, costs, run.transfer_s)
        return SimResult(tuple(_times(s) for s in states))
    return run.replay(workload)


class ClusterRun:
    """One simulation's clock, event queue and instances (a discrete-event simulation).

    `events` is a heap of (time, tie-break, kind, what): the next event is always the
    earliest, and events at the same time come out in the order they were pushed (`_push`
    numbers them). Three kinds: "arrive" (what: a `SimState`), "step_done" (what:
    (instance, the `PlannedStep` it ran)) and "kv_landed" (what: (decode instance, state)).
    `front` are the instances requests arrive at (colocated, or prefill); `decoders` the
    decode instances (none when colocated). Each `SimInstance` plans its next step
    (`plan()`: None when it has nothing to run), is told when a step ends
    (`finish_step(step, now)`: the requests whose prefill completed in it), says how
    loaded it is (`load`), and is `busy` while a step runs.
    """

    def __init__(self, shape: ClusterShape, costs: StepCosts, config: SimConfig) -> None:
        self.costs, self.config = costs, config
        self.events: list[tuple[float, int, str, object]] = []  # (time, tie-break, kind, what)
        self.order = itertools.count()

        def make(role: str, n: int) -> list[SimInstance]:
            limits = (config.max_num_batched_tokens, config.max_num_seqs)
            return [SimInstance(role, *limits) for _ in range(n)]

        self.front = make("colocated", shape.num_colocated) or make("prefill", shape.num_prefill)
        self.decoders = make("decode", shape.num_decode)

    def replay(self, workload: list[SimRequest]) -> SimResult:
        """Every request's times, in the order of `workload`.

        One `SimState(spec, spec.prompt_len)` per request and an "arrive" event at its
        arrival time; then pop events in time order until none is left. An arrival joins
        the least-loaded front instance, landed KV its decode instance (both through
        `_enqueue`, which starts the instance if it is idle); a finished step goes to
        `_step_done`. The result: `SimResult` of `_times(state)` for each request."""
        states = [SimState(spec, spec.prompt_len) for spec in workload]
        for state in states:
            self._push(state.spec.arrival_s, "arrive", state)
        while self.events:
            now, _, kind, what = heapq.heappop(self.events)
            if kind == "arrive":
                self._enqueue(min(self.front, key=lambda i: i.load), what, now)
            elif kind == "kv_landed":
                instance, state = what
                self._enqueue(instance, state, now)
            else:
                self._step_done(*what, now)
        return SimResult(tuple(_times(s) for s in states))

    def _push(self, time: float, kind: str, what: object) -> None:
        heapq.heappush(self.events, (time, next(self.order), kind, what))

    def _enqueue(self, instance: SimInstance, state: SimState, now: float) -> None:
        instance.waiting.append(state)
        self._start(instance, now)

    def _start(self, instance: SimInstance, now: float) -> None:
        """An idle instance with work starts its next step: it is busy until a "step_done"
        event, `costs.step_time(prefill tokens, decodes)` seconds from `now`. A busy
        instance, or one whose `plan()` is None, does nothing."""
        if instance.busy:
            return
        step = instance.plan()
        if step is None:
            return
        instance.busy = True
        seconds = self.costs.step_time(step.prefill_tokens, len(step.decodes))
        self._push(now + seconds, "step_done", (instance, step))

    def _step_done(self, instance: SimInstance, step: PlannedStep, now: float) -> None:
        """The instance's step ended at `now`: it is idle again; on a prefill instance each
        request whose prefill completed and still has tokens to produce is handed off;
        then the instance starts its next step, if it has one."""
        instance.busy = False
        for state in instance.finish_step(step, now):
            if instance.role == "prefill" and not state.done:
                self._hand_off(state, now)
        self._start(instance, now)

    def _hand_off(self, state: SimState, now: float) -> None:
        """Send a finished prefill's KV to the decode instance least loaded now: it lands
        there (a "kv_landed" event) `transfer_s(state)` seconds later."""
        target = min(self.decoders, key=lambda i: i.load)
        self._push(now + self.transfer_s(state), "kv_landed", (target, state))

    def transfer_s(self, state: SimState) -> float:
        """Seconds to move one prompt's KV: `config.transfer_latency_s` + its bytes
        (prompt tokens x `costs.kv_bytes_per_token`) / `config.transfer_bandwidth_bytes_s`."""
        nbytes = state.spec.prompt_len * self.costs.kv_bytes_per_token
        return self.config.transfer_latency_s + nbytes / self.config.transfer_bandwidth_bytes_s


def _times(state: SimState) -> RequestTimes:
    """A finished request's times; an error names a request the simulation left unfinished."""
    if state.first_token_s is None or state.finish_s is None:
        raise RuntimeError(
            f"the simulation ended with a request unfinished ({state.spec}: "
            f"{state.prefill_left} prompt tokens left to prefill, {state.num_generated} of "
            f"{state.spec.output_len} tokens produced): no event was left to run it"
        )
    return RequestTimes(
        state.spec.arrival_s, state.first_token_s, state.finish_s, state.spec.output_len
    )
