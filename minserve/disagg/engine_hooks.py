"""The engine's two hooks for prefill/decode disaggregation (DistServe, Mooncake).

A prefill instance runs a request until its first token, then `detach_prefilled` takes it
out of the engine while keeping its KV blocks, for `KVTransfer` to send. The decode
instance continues it with `add_prefilled`: either into blocks allocated for the incoming
KV (the next step decodes), or by recomputing the prompt when that is cheaper.
"""

from __future__ import annotations

from minserve.engine import LLMEngine
from minserve.sampling_params import SamplingParams
from minserve.scheduler.sequence import SeqStatus, Sequence


def detach_prefilled(engine: LLMEngine, request_id: str) -> Sequence:
    """Take out a request whose prefill just gave its first token, keeping its KV blocks.

    The caller sends the blocks to a decode instance, then frees them with
    `engine.kv.free(seq.block_table)`. Call it right after the step that prefilled it.
    """
    tracked = engine.requests.get(request_id)
    seq = tracked.seqs[0] if tracked and len(tracked.seqs) == 1 else None
    prompt_len = len(seq.sample.prompt_token_ids) if seq else -1
    if seq is None or seq.sample.finished or len(seq.sample.token_ids) != 1:
        raise ValueError(f"request {request_id!r} is not an n=1 request that just prefilled")
    if seq.num_computed_tokens != prompt_len or seq not in engine.scheduler.running:
        raise ValueError(f"request {request_id!r} is not a running, fully prefilled request")
    engine.scheduler.running.remove(seq)
    seq.status = SeqStatus.FINISHED
    del engine.requests[request_id]
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

    with_kv: blocks for the prompt are allocated now (the caller writes the transferred
    KV into them) and the next step decodes; else the prompt is recomputed here.
    """
    kv = engine.kv
    if with_kv and not kv.can_append(kv.new_table(), len(prompt_token_ids)):
        raise MemoryError(
            f"no room for {len(prompt_token_ids)} transferred tokens: "
            f"{kv.allocator.num_free} free blocks of {kv.block_size} tokens"
        )
    request = engine.add_request(request_id, None, prompt_token_ids, params)
    seq = engine.requests[request_id].seqs[0]
    seq.sample.append(first_token, None, engine.rules)
    request.record_token_time()
    if seq.sample.finished:
        engine.abort_request(request_id)
        raise ValueError(f"request {request_id!r} already finished with its first token")
    if with_kv:
        request.num_cached_tokens = 0
        engine.scheduler.waiting.remove(seq)
        kv.append(seq.block_table, len(prompt_token_ids))
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.status = SeqStatus.RUNNING
        engine.scheduler.running.append(seq)
    return seq
