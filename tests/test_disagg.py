"""Prefill/decode disaggregation: the KV hand-off gives the same greedy tokens as colocated."""

import os
import signal
import time

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.disagg.engine_hooks import add_prefilled, detach_prefilled
from minserve.disagg.kv_wire import MIXED_BACKEND, KVWire, choose_kv_wire, instance_gpu
from minserve.disagg.pd_pair import DecodeWorkerError, PrefillDecodePair
from minserve.disagg.transfer_rule import TransferRule

PROMPTS = ["The capital of France is", "One two three four five six seven eight nine ten", "Hi"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def colocated(model_dir):
    llm = LLM(model_dir, block_size=4, num_blocks=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _hand_off(
    prefill: LLM, decode: LLM, prompt: str, with_kv: bool, write_kv: bool = True
) -> list[int]:
    """The engine hooks in one process: prefill in one engine, decode in another."""
    text, ids = prefill._tokenize(prompt)
    prefill.engine.add_request("r", text, ids, GREEDY)
    while not prefill.engine.step():
        pass
    seq = detach_prefilled(prefill.engine, "r")
    moved = add_prefilled(decode.engine, "r", ids, GREEDY, seq.sample.token_ids[0], with_kv)
    if with_kv and write_kv:
        kv = prefill.engine.worker.read_blocks(seq.block_table.blocks)
        decode.engine.worker.write_blocks(moved.block_table.blocks, kv)
    prefill.engine.scheduler.free_detached(seq)
    while decode.engine.has_unfinished_requests():
        decode.engine.step()
    assert prefill.engine.kv.allocator.num_free == prefill.engine.kv.allocator.num_blocks
    assert decode.engine.kv.allocator.num_free == decode.engine.kv.allocator.num_blocks
    return moved.sample.token_ids


@pytest.mark.parametrize("with_kv", [True, False], ids=["transfer", "recompute"])
def test_engine_hooks_continue_a_prefill_in_another_engine(model_dir, colocated, with_kv):
    prefill = LLM(model_dir, block_size=4, num_blocks=64)
    decode = LLM(prefill.loaded, block_size=4, num_blocks=64)
    for prompt, expected in zip(PROMPTS, colocated):
        assert _hand_off(prefill, decode, prompt, with_kv) == expected


def test_the_transferred_kv_is_what_decode_reads(model_dir, colocated):
    prefill = LLM(model_dir, block_size=4, num_blocks=64)
    decode = LLM(prefill.loaded, block_size=4, num_blocks=64)
    tokens = _hand_off(prefill, decode, PROMPTS[0], with_kv=True, write_kv=False)
    assert tokens[0] == colocated[0][0]  # the first token comes from the prefill side
    assert tokens != colocated[0]  # without the KV, decode attends to empty blocks


def test_add_prefilled_without_room_says_so(model_dir):
    decode = LLM(model_dir, block_size=4, num_blocks=2, max_model_len=8)
    with pytest.raises(MemoryError, match="no room for 9 transferred tokens: 2 free blocks"):
        add_prefilled(decode.engine, "r", list(range(9)), GREEDY, 5, with_kv=True)
    assert not decode.engine.has_unfinished_requests()


def test_detach_refuses_a_request_still_prefilling(model_dir):
    llm = LLM(model_dir, block_size=4, num_blocks=64)
    llm.engine.add_request("r", None, list(range(1, 20)), GREEDY)
    with pytest.raises(ValueError, match="not an n=1 request that just prefilled"):
        detach_prefilled(llm.engine, "r")


def test_rule_transfers_when_the_link_beats_recompute():
    rule = TransferRule(latency_s=1e-3, bandwidth_bytes_s=1e9)
    rule.observe_prefill(100, 0.1)  # 1 ms per token
    assert rule.decide("a", 100, 10**6).transfer  # 2 ms to move vs 100 ms to recompute
    assert not rule.decide("b", 1, 10**7).transfer  # 11 ms to move vs 1 ms to recompute
    assert TransferRule(1e-3, 1e9, policy="recompute").decide("c", 100, 1).transfer is False


def test_kv_travels_over_nccl_only_when_every_instance_has_its_own_gpu():
    gpus = dict(nccl_available=True)
    assert choose_kv_wire("cuda", 2, num_gpus=2, **gpus) == KVWire(MIXED_BACKEND, "cuda")
    assert choose_kv_wire("auto", 4, num_gpus=8, **gpus).backend == MIXED_BACKEND
    assert choose_kv_wire("cuda", 2, num_gpus=1, **gpus) == KVWire("gloo", "cpu")  # shared GPU
    assert choose_kv_wire("cpu", 2, num_gpus=8, **gpus).backend == "gloo"
    assert choose_kv_wire("auto", 2, num_gpus=0, **gpus).backend == "gloo"
    assert choose_kv_wire("cuda", 2, num_gpus=2, nccl_available=False).backend == "gloo"
    assert KVWire(MIXED_BACKEND, "cuda").device(1) == torch.device("cuda", 1)
    assert KVWire("gloo", "cpu").device(1) == torch.device("cpu")
    assert [instance_gpu(i, 2) for i in range(4)] == [0, 1, 0, 1]


def test_gathered_blocks_are_a_copy_the_pool_can_reuse(model_dir):
    # NCCL sends are asynchronous: the prefill side frees its blocks right after `send`,
    # so what it sends must not alias the pool.
    llm = LLM(model_dir, block_size=4, num_blocks=8)
    pool = llm.engine.worker.pool
    pool.kv.normal_()
    sent = pool.gather_blocks([5, 2])  # [layers, 2, 2, bs, Hkv, D]
    expected = pool.kv[:, :, [5, 2]].clone()
    pool.kv.zero_()  # the blocks are reused by the next prefill
    assert torch.equal(sent, expected)
    assert sent.device == pool.kv.device


def test_two_processes_match_colocated_greedy(model_dir, colocated):
    with PrefillDecodePair(model_dir, block_size=4, num_blocks=64) as pair:
        # the start-up ping-pong saw a local link: memory-copy speed, not 1e15 B/s of noise
        assert 1e7 < pair.rule.bandwidth_bytes_s < 1e12 and pair.rule.latency_s < 0.1
        for policy in ("transfer", "recompute"):
            pair.rule.policy = policy
            outputs = pair.generate(PROMPTS, GREEDY)
            assert [o.outputs[0].token_ids for o in outputs] == colocated
            assert all(o.finished for o in outputs)
        one = pair.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))
        assert one[0].outputs[0].token_ids == colocated[0][:1]  # never left the prefill side
        block_bytes = pair.llm.engine.worker.pool.block_nbytes
        lengths = [len(o.prompt_token_ids) for o in outputs]
        assert pair.transfer.stats.kv_bytes == sum(-(-n // 4) for n in lengths) * block_bytes
        assert pair.transfer.stats.num_transfers == len(PROMPTS)  # only the transfer round
        kv = pair.llm.engine.kv
        assert kv.allocator.num_free == kv.allocator.num_blocks  # freed after the acks


def test_a_dead_decode_worker_is_a_clear_error(model_dir):
    pair = PrefillDecodePair(model_dir, step_timeout_s=20, block_size=4, num_blocks=64)
    pair.generate(PROMPTS[:1], GREEDY)
    os.kill(pair.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(DecodeWorkerError, match=r"decode instance \(pid \d+, exit code -9\)"):
        pair.generate(PROMPTS, GREEDY)
    assert time.monotonic() - start < 25
    kv = pair.llm.engine.kv
    assert kv.allocator.num_free == kv.allocator.num_blocks
    with pytest.raises(DecodeWorkerError, match="shut down"):
        pair.generate(PROMPTS, GREEDY)
