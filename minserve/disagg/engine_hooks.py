"""The engine's hooks for prefill/decode disaggregation (DistServe, Mooncake) and live
migration between decode instances (Llumnix).

A prefill instance runs a request until its first token, then `detach_prefilled` takes it
out of the engine while keeping its KV blocks, for `KVTransfer` to send. The decode
instance continues it with `add_prefilled`: either into blocks allocated for the incoming
KV (the next step decodes), or by recomputing the prompt when that is cheaper. Both go
through the scheduler's methods (`detach`, `resume`): it stays the one writer of its state.
A migrating request leaves its source with `release_migrated` and continues on the
destination with `adopt_migrated`: its generated tokens given, its KV already received.
"""

from __future__ import annotations

from typing import Any

from minserve.engine import LLMEngine
from minserve.kvcache.block_table import BlockTable
from minserve.messages import SchedulerUpdate
from minserve.sampling_params import SamplingParams
from minserve.scheduler.scheduler import adopt_computed
from minserve.scheduler.sequence import Sequence


def detach_prefilled(engine: LLMEngine, request_id: str) -> Sequence:
    """Take out a request whose prefill just gave its first token, keeping its KV blocks.

    The caller sends the blocks (`engine.worker.read_blocks(seq.block_table.blocks)`) to a
    decode instance, then frees them with `engine.scheduler.free_detached(seq)`. Call it
    right after the step that prefilled it.
    """
    seqs = engine.scheduler.sequences_of(request_id)
    seq = seqs[0] if len(seqs) == 1 else None
    if seq is None or seq.sample.finished or len(seq.sample.token_ids) != 1:
        raise ValueError(f"request {request_id!r} is not an n=1 request that just prefilled")
    engine.scheduler.detach(seq)
    engine.forget_request(request_id)
    return seq


def add_prefilled(
    engine: LLMEngine,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    first_token: int,
    with_kv: bool,
) -> Sequence:
    """Continue a request another instance prefilled (its first token given).

    The first token is not shown again: the engine's deltas start with the token after it.
    with_kv: blocks for the prompt are allocated now (the caller writes the transferred KV
    into `seq.block_table.blocks` with `engine.worker.write_blocks`) and the next step
    decodes; else the prompt is recomputed here.
    """
    kv = engine.kv
    if with_kv and not kv.can_append(kv.new_table(), len(prompt_token_ids)):
        raise MemoryError(
            f"no room for {len(prompt_token_ids)} transferred tokens: "
            f"{kv.allocator.num_free} free blocks of {kv.block_size} tokens"
        )
    engine.add_request(request_id, None, prompt_token_ids, params)
    (seq,) = engine.scheduler.sequences_of(request_id)
    first = engine.scheduler.resume(seq, first_token, len(prompt_token_ids) if with_kv else 0)
    if seq.sample.finished:
        engine.abort_request(request_id)
        raise ValueError(f"request {request_id!r} already finished with its first token")
    # its text state; the prefill side showed it
    engine.output_processor.process(SchedulerUpdate(new_tokens=(first,)))
    return seq


def release_migrated(engine: LLMEngine, request_id: str) -> None:
    """A request that now lives on another instance leaves this engine: its blocks are
    freed, its text state dropped (nothing is finished or counted as aborted)."""
    engine.forget_request(request_id)
    engine.scheduler.abort_request(request_id)


def resume_request(
    engine: LLMEngine,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    token_ids: list[int],
    priority: int = 0,
) -> Sequence | None:
    """Continue a request after the tokens it generated elsewhere (its instance died, or it
    migrates here): queued to compute prompt + `token_ids`, then sample what follows them,
    as it would have there (penalties, stop rules, seeded draws, text so far). None when
    `token_ids` finished it already (the next step reports that)."""
    engine.add_request(
        request_id, None, prompt_token_ids, params, priority, resume_token_ids=token_ids
    )
    seqs = engine.scheduler.sequences_of(request_id)
    return seqs[0] if seqs else None


def resume_from_json(engine: LLMEngine, commands: list[dict[str, Any]]) -> dict[str, str]:
    """`resume_request` for each of the proxy's commands (`RemoteRequest.resume_json`);
    the ones this engine refused, {request id: why} (the proxy fails those)."""
    refused = {}
    for resumed in commands:
        params = SamplingParams(**resumed["params"])
        try:
            resume_request(
                engine, resumed["id"], resumed["prompt_token_ids"], params,
                resumed["token_ids"], resumed["priority"],
            )  # fmt: skip
        except ValueError as error:  # bad resume tokens: this request alone fails
            refused[resumed["id"]] = f"could not resume {resumed['id']!r}: {error}"
    return refused


def adopt_migrated(
    engine: LLMEngine,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    token_ids: list[int],
    table: BlockTable,
    num_computed: int,
) -> Sequence | None:
    """Continue a request another instance decoded: `token_ids` generated there, the KV of
    its first `num_computed` tokens received into `table` (0: none; then it is recomputed
    here, and `table` is freed). The engine's deltas start after `token_ids`."""
    seq = resume_request(engine, request_id, prompt_token_ids, params, token_ids)
    if seq is None or num_computed == 0:
        engine.kv.free(table)
    else:
        adopt_computed(engine.scheduler, seq, table, num_computed)
    return seq
