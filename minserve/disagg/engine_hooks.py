"""The engine's two hooks for prefill/decode disaggregation (DistServe, Mooncake).

A prefill instance runs a request until its first token, then `detach_prefilled` takes it
out of the engine while keeping its KV blocks, for `KVTransfer` to send. The decode
instance continues it with `add_prefilled`: either into blocks allocated for the incoming
KV (the next step decodes), or by recomputing the prompt when that is cheaper. Both go
through the scheduler's methods (`detach`, `resume`): it stays the one writer of its state.
"""

from __future__ import annotations

from minserve.engine import LLMEngine
from minserve.messages import SchedulerUpdate
from minserve.sampling_params import SamplingParams
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
