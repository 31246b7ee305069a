"""Speculative decoding (n-gram and early-exit proposers): greedy output is exactly the
non-speculative output.

Oracles: the same engine without speculation, and `LLM(engine="reference")`. Invariants:
every block is free when work is done (also after aborts); the acceptance counters add up.
Prompts repeat a pattern so the tiny random model's greedy loops give the proposer hits.
"""

from __future__ import annotations

import random

import pytest
from test_engine import assert_all_blocks_free, token_ids

from minserve import LLM, SamplingParams
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_table import BlockTable
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.ngram import NgramProposer
from minserve.speculative.proposers import make_proposer
from minserve.speculative.verify import accepted_length

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3}
EARLY_EXIT = {"method": "early_exit", "num_speculative_tokens": 3, "num_draft_layers": 1}


def repetitive_workload(count: int, seed: int):
    """Prompts that repeat a short random pattern (plus a random tail), greedy params."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        pattern = [rng.randrange(3, 49152) for _ in range(rng.randint(2, 6))]
        tail = [rng.randrange(3, 49152) for _ in range(rng.randint(0, 3))]
        prompts.append(pattern * rng.randint(1, 5) + tail)
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        for _ in range(count)
    ]
    return prompts, params


def assert_tables_hold_only_computed_tokens(engine) -> None:
    for seq in engine.scheduler.running:
        table = seq.block_table
        assert table.num_tokens == seq.num_computed_tokens
        assert len(table.blocks) == -(-table.num_tokens // table.block_size)


@pytest.fixture(scope="module")
def model(tiny_model):
    return LLM(tiny_model("llama"), engine="reference").loaded


@pytest.fixture(scope="module")
def workload():
    return repetitive_workload(24, seed=1)


@pytest.fixture(scope="module")
def expected(model, workload) -> list[list[int]]:
    return token_ids(LLM(model).generate(*workload, use_tqdm=False))


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=2))
    assert proposer.lookup([1, 2, 9, 1, 2, 7, 8, 1, 2], 3) == [7, 8, 1]
    assert proposer.lookup([5, 6, 7, 5], 2) == [6, 7]  # n = 2 fails, n = 1 matches
    assert proposer.lookup([1, 2, 3], 4) == []


def test_accepted_length_stops_at_first_disagreement() -> None:
    assert accepted_length([7, 8, 9], [7, 8]) == 2
    assert accepted_length([7, 5, 9], [7, 8]) == 1
    assert accepted_length([1], []) == 0


def test_truncate_frees_blocks_past_the_kept_tokens() -> None:
    allocator, table = BlockAllocator(8), BlockTable(4)
    table.append(allocator, 11)  # 3 blocks
    table.truncate(allocator, 5)
    assert (len(table.blocks), table.num_tokens, allocator.num_free) == (2, 5, 6)
    with pytest.raises(ValueError, match="cannot truncate"):
        table.truncate(allocator, 6)


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=16, num_blocks=512),
        dict(block_size=1, num_blocks=4096),
        dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=5),  # chunked, tight budget
        dict(block_size=2, num_blocks=40),  # preemption pressure
        dict(block_size=4, enable_prefix_caching=True),
    ],
    ids=["ample", "block1", "chunked", "preempt", "prefix"],
)
@pytest.mark.parametrize("method", [NGRAM, EARLY_EXIT], ids=["ngram", "early_exit"])
def test_greedy_identity(model, workload, expected, options, method) -> None:
    llm = LLM(model, speculative_config=method, **options)
    assert token_ids(llm.generate(*workload, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    assert metrics["spec_decode_num_accepted_tokens"] > 0  # speculation really happened
    if llm.engine.kv.prefix_cache is None:
        assert_all_blocks_free(llm.engine)
    else:
        assert metrics["num_free_blocks"] + metrics["prefix_cache_blocks"] == metrics["num_blocks"]


def test_the_solutions_draft_lengths_give_minserves_adaptive_run(
    model, workload, expected, monkeypatch
):
    """Exercise 6.5 plugged in: the same tokens, drafts and acceptances as minserve's own.
    The draft cost ratio is held at n-gram lookup's nominal 0: measured, it is wall-clock
    time, and two runs' near-zero ratios can tip a borderline length either way."""
    from minserve.speculative.counters import SpecCounters
    from solutions.ch06_rejection_sampling import DraftLengths

    monkeypatch.setattr(SpecCounters, "cost_ratio", property(lambda self: 0.0))

    adaptive = {**NGRAM, "draft_length": "adaptive"}
    default = LLM(model, speculative_config=adaptive)
    plugged = LLM(model, speculative_config={**adaptive, "draft_lengths_cls": DraftLengths})
    assert isinstance(plugged.engine.scheduler.drafts.lengths, DraftLengths)
    assert token_ids(plugged.generate(*workload, use_tqdm=False)) == expected
    default.generate(*workload, use_tqdm=False)
    keys = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    metrics, default_metrics = plugged.get_metrics(), default.get_metrics()
    assert [metrics[k] for k in keys] == [default_metrics[k] for k in keys]
    assert metrics["spec_decode_num_draft_tokens"] > 0


def test_greedy_identity_against_the_reference_path(model, workload, expected) -> None:
    reference = LLM(model, engine="reference")
    assert token_ids(reference.generate(*workload, use_tqdm=False)) == expected


def test_acceptance_counters_add_up(model, workload) -> None:
    llm = LLM(model, speculative_config=NGRAM)
    outputs = llm.generate(*workload, use_tqdm=False)
    m = llm.get_metrics()
    proposed, accepted = m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]
    assert 0 < accepted <= proposed <= 4 * m["spec_decode_num_drafts"]
    assert m["spec_decode_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert m["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + accepted / m["spec_decode_num_drafts"]
    )
    generated = sum(len(t) for t in token_ids(outputs))
    assert m["generation_tokens"] == generated
    assert m["spec_decode_tokens_per_forward"] > 1.0


def test_fewer_steps_than_plain_decoding(model, workload) -> None:
    plain, spec = LLM(model, max_num_seqs=1), LLM(model, max_num_seqs=1, speculative_config=NGRAM)
    prompts, params = workload
    plain.generate(prompts[:6], params[:6], use_tqdm=False)
    spec.generate(prompts[:6], params[:6], use_tqdm=False)
    assert spec.get_metrics()["num_steps"] < plain.get_metrics()["num_steps"]


def test_mixed_batch_with_sampling_n_and_stops(model, workload, expected) -> None:
    """Beside sampling rows and n = 2 requests, greedy rows keep their tokens; stop tokens and
    logprobs inside accepted drafts behave as in plain decoding."""
    prompts, _ = workload
    stop_at = [ids[len(ids) // 2] if ids else 0 for ids in expected]
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(n=1 + i % 2, stop_token_ids=[stop_at[i]], **greedy)
        for i in range(len(prompts))
    ]
    plain = LLM(model).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(model, block_size=4, speculative_config=NGRAM)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    kept = [i for i in range(len(prompts)) if i % 3]
    assert [token_ids([spec[i]]) for i in kept] == [token_ids([plain[i]]) for i in kept]
    assert all(len(c.token_ids) == 12 for i in range(0, len(prompts), 3) for c in spec[i].outputs)
    for a, b in zip(spec, plain):
        if a.outputs[0].logprobs:
            got = [lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
            want = [lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
            assert got == pytest.approx(want, abs=1e-4)
    assert_all_blocks_free(spec_llm.engine)


@pytest.mark.parametrize("method", [NGRAM, EARLY_EXIT], ids=["ngram", "early_exit"])
def test_aborts_leave_every_block_free(model, workload, method) -> None:
    llm = LLM(model, block_size=2, num_blocks=200, speculative_config=method)
    engine, (prompts, params) = llm.engine, workload
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), None, p, sp)
    rng, step = random.Random(0), 0
    while engine.has_unfinished_requests():
        engine.step()
        assert_tables_hold_only_computed_tokens(engine)  # rejected drafts' slots rolled back
        step += 1
        if step % 3 == 0:
            engine.abort_request(str(rng.randrange(len(prompts))))
    assert llm.get_metrics()["num_requests_aborted"] > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "unknown speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "at least 1"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown speculative_config"),
        ({**NGRAM, "num_draft_layers": 1}, "applies to method 'early_exit'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "lookup_min"),
        ({**NGRAM, "proposer_cls": 3}, "proposer_cls must be a class"),
        ({**NGRAM, "draft_lengths_cls": 3}, "draft_lengths_cls must be a class"),
        (
            {"method": "jump_forward", "num_speculative_tokens": 2, "proposer_cls": NgramProposer},
            "proposer_cls applies to methods 'ngram' and 'early_exit'",
        ),
    ],
)
def test_bad_speculative_config_is_rejected(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(options)


@pytest.mark.parametrize(
    "options", [dict(), dict(block_size=2, num_blocks=40)], ids=["ample", "preempt"]
)
def test_draft_model_identical_to_target_is_always_accepted(model, workload, expected, options):
    llm = LLM(model, speculative_config={**DRAFT, "model": model}, **options)
    assert token_ids(llm.generate(*workload, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    assert metrics["spec_decode_num_draft_tokens"] > 0
    assert metrics["spec_decode_acceptance_rate"] == 1.0
    assert_all_blocks_free(llm.engine)
    draft = llm.engine.worker.speculator.proposer
    # the draft KV of the last sequences to finish goes when a step names them finished
    # (SchedulerOutput.finished_seq_ids): an idle step here
    assert llm.engine.step() == []
    assert draft.allocator.num_free == draft.allocator.num_blocks and not draft.states


def test_draft_model_that_disagrees_changes_nothing(tiny_model, model, workload, expected):
    llm = LLM(model, block_size=2, num_blocks=40, speculative_config={
        **DRAFT, "model": tiny_model("qwen2")})  # fmt: skip
    assert token_ids(llm.generate(*workload, use_tqdm=False)) == expected
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
    assert_all_blocks_free(llm.engine)


def test_early_exit_needs_fewer_layers_than_the_target(model) -> None:
    with pytest.raises(ValueError, match=r"num_draft_layers must be in \[1, 1\]"):
        LLM(model, speculative_config={**EARLY_EXIT, "num_draft_layers": 2})


def test_reference_engine_rejects_speculation(model) -> None:
    with pytest.raises(ValueError, match="engine='paged'"):
        LLM(model, engine="reference", speculative_config=NGRAM)


def test_the_ngram_proposer_class_comes_from_the_config() -> None:
    class Echo(NgramProposer):
        def lookup(self, token_ids: list[int], k: int) -> list[int]:
            return token_ids[-1:] * k

    config = SpeculativeConfig("ngram", 2, proposer_cls=Echo)
    proposer = make_proposer(config, runner=None)  # type: ignore[arg-type]
    assert isinstance(proposer, Echo) and proposer.lookup([4, 5], 2) == [5, 5]


def test_the_early_exit_proposer_class_comes_from_the_config(model, workload, expected) -> None:
    """Exercise 6.6 plugged in: the solution's class drafts, and greedy output is unchanged."""
    from solutions.ch06_rejection_sampling import EarlyExitProposer

    class Counting(EarlyExitProposer):
        calls = 0

        def propose(self, chunks, limits):
            Counting.calls += 1
            return super().propose(chunks, limits)

    prompts, params = workload
    llm = LLM(model, speculative_config={**EARLY_EXIT, "proposer_cls": Counting})
    assert token_ids(llm.generate(prompts[:2], params[:2], use_tqdm=False)) == expected[:2]
    assert isinstance(llm.engine.worker.speculator.proposer, Counting) and Counting.calls > 0
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
