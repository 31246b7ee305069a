"""Live migration between decode instances (Llumnix): a request moved while it decodes
streams the text it would have streamed had it stayed.

Oracle: `LLM.generate` (colocated) on the same weights, greedy and seeded (seeded draws are
keyed by position, so the destination draws what the source would have). Invariants: every
pool is free once nothing is in flight (allocator free counts, as the instances report
them), the metrics count what moved, refusals say why. One 1P2D cluster for the module;
the faults (a destination killed mid-migration) are in test_disagg_faults.py.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import httpx
import pytest
import torch
from disagg_cluster import cluster_fixtures

from minserve import LLM, SamplingParams
from minserve.bench.migration import measure_migration_gaps
from minserve.disagg.engine_hooks import adopt_migrated, release_migrated
from minserve.disagg.migration import (
    STOP_AND_COPY,
    MigrationOrder,
    Migrations,
    StagePolicy,
    _Outgoing,
)
from minserve.disagg.migration_control import (
    MigrationConflictError,
    UnknownInstanceError,
    UnknownRequestError,
)
from minserve.disagg.proxy_engine import DisaggregatedEngine
from minserve.disagg.stage_planner import next_stage
from minserve.outputs import OutputAccumulator, RequestOutput
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

OPTIONS = dict(block_size=4, num_blocks=96)
PRE_COPY_3 = StagePolicy(min_stages=3, max_stages=4)  # three stages at least, whatever the link
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)


model_dir, oracle, cluster = cluster_fixtures("1P2D", "transfer", step_timeout_s=30, **OPTIONS)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [100 + (37 * i + salt) % 1000 for i in range(length)]


def expected(oracle: LLM, prompt: list[int], params: SamplingParams) -> RequestOutput:
    return oracle.generate([prompt], params, use_tqdm=False)[0]


def other_decode_rank(cluster: DisaggregatedEngine, rank: int) -> int:
    (other,) = [r for r in cluster.topology.decode_ranks if r != rank]
    return other


def step_until(cluster: DisaggregatedEngine, whole: OutputAccumulator, done) -> None:
    for _ in range(500):
        if done():
            return
        for delta in cluster.step():
            whole.add(delta)
    raise AssertionError("the cluster did not get there in 500 rounds")


def decoding(cluster: DisaggregatedEngine, whole: OutputAccumulator, request_id: str, n: int):
    """Once `request_id` streamed n tokens and lives on a decode instance."""
    request = cluster.requests.get(request_id)
    streamed = whole.outputs.get(request_id)
    tokens = len(streamed.outputs[0].token_ids) if streamed else 0
    return request is not None and request.location in cluster.topology.decode_ranks and tokens >= n


def assert_every_pool_free(cluster: DisaggregatedEngine) -> None:
    free = {r: (s["num_free_blocks"], s["num_blocks"]) for r, s in cluster.instance_stats.items()}
    assert sorted(free) == sorted(cluster.alive)
    assert all(f == total for f, total in free.values()), free


def test_the_engine_hooks_move_a_decoding_request(oracle):
    """In one process: decode a few tokens in one engine, copy the blocks, continue in the
    other; the text is one engine's, and both pools end free."""
    source, target = LLM(oracle.loaded, **OPTIONS), LLM(oracle.loaded, **OPTIONS)
    prompt = prompt_of(64)
    for params in (replace(GREEDY, max_tokens=12), replace(SEEDED, max_tokens=12)):
        source.engine.add_request("r", None, prompt, params)
        text = "".join(o.outputs[0].text for _ in range(6) for o in source.engine.step())
        (seq,) = source.engine.scheduler.sequences_of("r")
        table, kv = target.engine.kv.new_table(), target.engine.kv
        kv.append(table, seq.num_computed_tokens)
        target.engine.worker.write_blocks(
            table.blocks, source.engine.worker.read_blocks(seq.block_table.blocks)
        )
        tokens = list(seq.sample.token_ids)
        adopt_migrated(target.engine, "r", prompt, params, tokens, table, seq.num_computed_tokens)
        release_migrated(source.engine, "r")
        assert not source.engine.has_unfinished_requests()
        while target.engine.has_unfinished_requests():
            text += "".join(o.outputs[0].text for o in target.engine.step())
        assert text == expected(oracle, prompt, params).outputs[0].text
        for engine in (source.engine, target.engine):
            assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


@pytest.mark.parametrize(
    ("context", "params", "policy"),
    [(64, GREEDY, PRE_COPY_3), (64, SEEDED, STOP_AND_COPY), (256, GREEDY, STOP_AND_COPY),
     (256, SEEDED, PRE_COPY_3)],
    ids=["64-greedy-precopy", "64-seeded-stopcopy", "256-greedy-stopcopy", "256-seeded-precopy"],
)  # fmt: skip
def test_a_migrated_request_streams_the_text_it_would_have(
    cluster, oracle, context, params, policy
):
    request_id = f"m{context}-{params.seed}"
    prompt = prompt_of(context, salt=context)
    stats = cluster.migrations.stats
    before = (stats.committed, stats.blocks_precopied, stats.blocks_final)
    cluster.add_request(request_id, None, prompt, params)
    whole = OutputAccumulator()
    step_until(cluster, whole, lambda: decoding(cluster, whole, request_id, 4))
    source = cluster.requests[request_id].location
    target = other_decode_rank(cluster, source)
    assert cluster.migrate(request_id, target, policy) == source
    step_until(cluster, whole, lambda: cluster.requests[request_id].location == target)
    context_blocks = math.ceil((context + 4) / 4)  # the prompt and the tokens before the move
    if policy is STOP_AND_COPY:  # every block in the final stage, while the request waits
        assert stats.blocks_precopied == before[1]
        assert stats.blocks_final - before[2] >= context_blocks
    else:  # the full blocks went while it decoded; the final stage carried the rest
        assert stats.blocks_precopied - before[1] >= context // 4
        assert stats.blocks_final - before[2] <= 3
    step_until(cluster, whole, lambda: not cluster.has_unfinished_requests())
    want = expected(oracle, prompt, params).outputs[0]
    got = whole.outputs[request_id].outputs[0]
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert cluster.migrations.outcomes[request_id] == "committed"
    assert stats.committed == before[0] + 1
    assert_every_pool_free(cluster)


def test_drain_moves_every_request_off_an_instance(cluster, oracle):
    prompts = {f"d{i}": prompt_of(48, salt=i) for i in range(4)}
    first = ("d0", "d1", "d2")  # least-loaded placement: two on one instance, one on the other
    whole = OutputAccumulator()
    for request_id in first:
        cluster.add_request(request_id, None, prompts[request_id], GREEDY)
    step_until(cluster, whole, lambda: all(decoding(cluster, whole, r, 2) for r in first))
    where = Counter(cluster.requests[r].location for r in first)
    (drained, _), (survivor, _) = where.most_common()
    held = cluster.drain(drained)
    assert sorted(held) == sorted(r for r in first if cluster.requests[r].location == drained)
    assert len(held) == 2  # two migrations between the same two ranks in the same rounds
    cluster.add_request("d3", None, prompts["d3"], GREEDY)  # placed on the survivor only
    step_until(cluster, whole, lambda: decoding(cluster, whole, "d3", 2))
    step_until(cluster, whole, lambda: all(r in cluster.migrations.outcomes for r in held))
    assert {r: q.location for r, q in cluster.requests.items()} == dict.fromkeys(prompts, survivor)
    cluster.undrain(drained)
    step_until(cluster, whole, lambda: not cluster.has_unfinished_requests())
    for request_id, prompt in prompts.items():
        want = expected(oracle, prompt, GREEDY).outputs[0]
        assert whole.outputs[request_id].outputs[0].text == want.text
    assert all(cluster.migrations.outcomes[r] == "committed" for r in held)
    assert_every_pool_free(cluster)


def test_a_destination_without_room_refuses_and_the_source_serves_on(cluster, oracle):
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = {"filler": prompt_of(200, salt=3), "mover": prompt_of(256, salt=4)}
    whole = OutputAccumulator()
    for request_id, prompt in prompts.items():
        cluster.add_request(request_id, None, prompt, long)
    step_until(cluster, whole, lambda: all(decoding(cluster, whole, r, 2) for r in prompts))
    full = cluster.requests["filler"].location  # 51 of its 96 blocks are the filler's
    assert cluster.requests["mover"].location == other_decode_rank(cluster, full)
    aborted = cluster.migrations.stats.aborted
    cluster.migrate("mover", full, PRE_COPY_3)
    step_until(cluster, whole, lambda: "mover" in cluster.migrations.outcomes)
    assert cluster.migrations.outcomes["mover"].startswith(
        f"aborted: no room on rank {full} for 256 migrated tokens"
    )
    assert cluster.migrations.stats.aborted == aborted + 1
    assert cluster.requests["mover"].location != full  # the source kept it
    step_until(cluster, whole, lambda: not cluster.has_unfinished_requests())
    for request_id, prompt in prompts.items():
        assert (
            whole.outputs[request_id].outputs[0].text
            == expected(oracle, prompt, long).outputs[0].text
        )
    assert_every_pool_free(cluster)  # the destination freed what it reserved


def test_migrate_and_drain_refuse_what_they_cannot_do(cluster):
    prefill, first = cluster.topology.prefill_ranks[0], cluster.topology.decode_ranks[0]
    with pytest.raises(UnknownRequestError, match="no request 'nope' is in flight"):
        cluster.migrate("nope", first)
    cluster.add_request("r", None, prompt_of(16), GREEDY)
    with pytest.raises(
        UnknownInstanceError, match=r"rank 1 is not a decode instance; decode ranks: \[2, 3\]"
    ):
        cluster.migrate("r", prefill)
    with pytest.raises(MigrationConflictError, match="'r' is not decoding yet"):
        cluster.migrate("r", first)
    whole = OutputAccumulator()
    step_until(cluster, whole, lambda: decoding(cluster, whole, "r", 2))
    here = cluster.requests["r"].location
    with pytest.raises(MigrationConflictError, match=f"'r' is on rank {here} already"):
        cluster.migrate("r", here)
    cluster.migrate("r", other_decode_rank(cluster, here))
    with pytest.raises(MigrationConflictError, match="'r' is migrating already"):
        cluster.migrate("r", other_decode_rank(cluster, here))
    with pytest.raises(UnknownInstanceError, match="rank 1 is not a decode instance"):
        cluster.drain(prefill)
    cluster.abort_request("r")  # mid-migration: the source says it is gone; nothing leaks
    step_until(cluster, whole, lambda: not cluster.has_unfinished_requests())
    assert cluster.migrations.outcomes["r"].startswith("aborted: the request finished or was")
    assert_every_pool_free(cluster)


def test_a_request_added_with_resume_tokens_continues_on_a_decode_instance(cluster, oracle):
    prompt = prompt_of(32, salt=5)
    want = expected(oracle, prompt, SEEDED).outputs[0]
    cluster.add_request("resumed", None, prompt, SEEDED, resume_token_ids=want.token_ids[:5])
    assert cluster.requests["resumed"].location in cluster.topology.decode_ranks
    whole = OutputAccumulator()
    step_until(cluster, whole, lambda: not cluster.has_unfinished_requests())
    got = whole.outputs["resumed"].outputs[0]
    assert got.token_ids == want.token_ids[5:]  # what follows the tokens it was given
    assert got.text and want.text.endswith(got.text)
    assert "resumed" not in cluster.decisions  # no prefill instance saw it
    assert_every_pool_free(cluster)


def test_the_admin_routes_migrate_a_stream_over_http(cluster, oracle):
    body = {"prompt": prompt_of(40, salt=9), "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text = ""
    with BackgroundServer(build_server(cluster, ServerConfig("tiny"))) as url:
        admin = httpx.Client(base_url=url, timeout=30)

        def migrate(request_id: str, to: int) -> httpx.Response:
            return admin.post("/v1/admin/migrate", json={"request_id": request_id, "to": to})

        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for number, line in enumerate(response.iter_lines()):
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                if number == 4:  # a few tokens in: it decodes on a decode instance
                    (placed,) = admin.get("/v1/admin/requests").json()["data"]
                    request_id, source = placed["request_id"], placed["instance"]
                    target = other_decode_rank(cluster, source)
                    refusals = [migrate("x", target), migrate(request_id, 1),
                                migrate(request_id, source),
                                admin.post("/v1/admin/drain", json={"instance": 7})]  # fmt: skip
                    moved = migrate(request_id, target)
        metrics = admin.get("/metrics").text
    assert [r.status_code for r in refusals] == [404, 400, 409, 400]
    assert refusals[0].json()["error"]["message"] == "no request 'x' is in flight"
    assert moved.status_code == 202 and moved.json()["from"] == source
    assert text == expected(oracle, body["prompt"], GREEDY).outputs[0].text
    assert cluster.migrations.outcomes[request_id] == "committed"
    committed = cluster.migrations.stats.committed
    assert f"minserve:migrations_committed_total {committed:.1f}" in metrics


def test_the_benchmark_measures_both_kinds_of_migration(cluster):
    row = measure_migration_gaps(cluster, 64, settle_tokens=2, max_tokens=40,
                                 pre_copy=PRE_COPY_3)  # fmt: skip
    assert row.context_len == 64 and row.median_step_s > 0
    assert row.pre_copy.blocks_precopied >= 16 and row.pre_copy.blocks_final <= 3
    assert row.stop_and_copy.blocks_precopied == 0 and row.stop_and_copy.blocks_final >= 17
    assert row.pre_copy.max_gap_s > 0 and row.stop_and_copy.max_gap_s > 0
    assert row.stop_and_copy.pause_s > 0
    assert_every_pool_free(cluster)


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_stages_are_planned_within_the_share_of_a_step(model_dir, share):
    """Where copies share the cores with decoding, a stage adds its time to the step: the
    planner is given `step_share` of the measured step to fill."""
    llm = LLM(model_dir, **OPTIONS)
    llm.engine.add_request("r", None, prompt_of(200), GREEDY)
    llm.engine.step()  # prefilled: 50 full blocks of 4 tokens
    seq = llm.engine.scheduler.sequences_of("r")[0]
    nbytes = llm.engine.worker.pool.block_nbytes
    migrations = Migrations(llm.engine, 0, {1: (5e-4, nbytes / 1e-3)}, {}, torch.device("cpu"))
    migrations.step_s = 0.02  # 20 ms a step, 1 ms a block
    order = MigrationOrder("r", 0, 1, StagePolicy(step_share=share))
    filled = seq.num_computed_tokens // 4
    expected = next_stage(filled, 0, nbytes, nbytes / 1e-3, 5e-4, 0.02 * share, 4, 0, 32)
    assert migrations._plan(seq, _Outgoing(), order) == expected == range(0, int(19.5 * share))
    with pytest.raises(ValueError, match="step_share"):
        StagePolicy(step_share=0)
