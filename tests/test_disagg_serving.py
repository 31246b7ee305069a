"""Disaggregated serving: a proxy over 1 prefill + 2 decode processes streams what colocated
serving generates.

Oracle: `LLM.generate` on the same weights (colocated), token for token under greedy
decoding. Invariants: tokens arrive one step at a time (they stream), both decode instances
get work (least-loaded placement), and once nothing is in flight every instance's KV pool
is free again, aborted requests included.
"""

from __future__ import annotations

import httpx
import pytest
from disagg_cluster import cluster_fixtures
from openai import OpenAI
from test_server import wait_until_idle

from minserve import SamplingParams
from minserve.cli import main
from minserve.disagg.proxy_engine import DisaggregatedEngine
from minserve.disagg.topology import PDTopology
from minserve.outputs import OutputAccumulator
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

PROMPTS = ["The capital of France is", "One two three four five six seven eight nine ten", "Hi"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(block_size=4, num_blocks=64)
API = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


model_dir, oracle, cluster = cluster_fixtures("1P2D", "transfer", step_timeout_s=30, **OPTIONS)


def run_to_end(engine: DisaggregatedEngine) -> dict[str, list[int]]:
    """Step until idle; each request's token count so far at every step it appeared in."""
    seen: dict[str, list[int]] = {}
    whole = OutputAccumulator()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            output = whole.add(delta)
            seen.setdefault(output.request_id, []).append(len(output.outputs[0].token_ids))
    return seen


def assert_every_pool_free(engine: DisaggregatedEngine) -> None:
    free = {
        rank: (s["num_free_blocks"], s["num_blocks"]) for rank, s in engine.instance_stats.items()
    }
    assert sorted(free) == list(engine.topology.worker_ranks)
    assert all(f == total for f, total in free.values()), free


def test_topology_spelling():
    topology = PDTopology.parse("1p2d")
    assert (topology.prefill_ranks, topology.decode_ranks, topology.label) == ((1,), (2, 3), "1P2D")
    with pytest.raises(ValueError, match=r"takes <P>P<D>D .* got '2X1'"):
        PDTopology.parse("2X1")
    with pytest.raises(ValueError, match="at least 1 prefill and 1 decode instance, got 0P1D"):
        PDTopology.parse("0P1D")


def test_serve_flag_refuses_what_it_cannot_run(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--disaggregation", "1P"])
    assert "--disaggregation takes <P>P<D>D" in capsys.readouterr().err
    assert main(["serve", "--disaggregation", "1P1D", "--tensor-parallel-size", "2"]) == 2
    assert "drop --tensor-parallel-size" in capsys.readouterr().err


def test_tokens_stream_and_equal_colocated(cluster, oracle):
    tokenizer = cluster.get_tokenizer()
    for i, prompt in enumerate(PROMPTS):
        cluster.add_request(f"s{i}", prompt, tokenizer.encode(prompt), GREEDY)
    whole = OutputAccumulator()
    seen: dict[str, list[int]] = {}
    while cluster.has_unfinished_requests():
        for delta in cluster.step():
            seen.setdefault(delta.request_id, []).append(len(delta.outputs[0].token_ids))
            whole.add(delta)
    expected = oracle.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = [whole.outputs[f"s{i}"] for i in range(3)]
    assert all(out.finished for out in got)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert all(counts == [1] * 8 for counts in seen.values())  # one new token a step
    decisions = [cluster.decisions[f"s{i}"] for i in range(3)]
    assert {d["to_rank"] for d in decisions} == {2, 3}  # least-loaded: both decode instances
    assert all(d["transfer"] and d["accepted"] for d in decisions)  # the KV moved
    assert_every_pool_free(cluster)


def test_abort_frees_blocks_on_the_instance_holding_the_request(cluster):
    tokenizer = cluster.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for name in ("decoding", "prefilled", "queued"):
        cluster.add_request(name, None, tokenizer.encode(PROMPTS[1]), params)
        if name == "decoding":
            while cluster.requests["decoding"].location not in cluster.topology.decode_ranks:
                cluster.step()
            cluster.step()  # now it holds decode blocks
        elif name == "prefilled":
            cluster.step()  # prefilled: waits on the prefill rank for its hand-off
    assert cluster.requests["prefilled"].location == 1
    used = {r: s["num_blocks"] - s["num_free_blocks"] for r, s in cluster.instance_stats.items()}
    assert used[1] > 0 and used[cluster.requests["decoding"].location] > 0
    for name in ("decoding", "prefilled", "queued"):
        cluster.abort_request(name)
    run_to_end(cluster)  # the next round carries the aborts
    assert_every_pool_free(cluster)
    assert cluster.get_metrics()["num_requests_aborted"] == 3


def test_openai_api_through_the_cluster_equals_colocated_serving(cluster, oracle):
    with BackgroundServer(build_server(cluster, ServerConfig("tiny"))) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model="tiny", prompt=PROMPTS[0], **API)
        chunks = client.completions.create(model="tiny", prompt=PROMPTS[1], stream=True, **API)
        pieces = [chunk.choices[0].text for chunk in chunks]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], **API
        )
        expected = [o.outputs[0].text for o in oracle.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert whole.choices[0].text == expected[0] and whole.usage.completion_tokens == 8
        assert "".join(pieces) == expected[1] and len(pieces) >= 4  # a chunk per step
        messages = [{"role": "user", "content": "Hi"}]
        assert chat.choices[0].message.content == oracle.chat(messages, GREEDY)[0].outputs[0].text


def test_a_client_that_hangs_up_frees_blocks_on_every_instance(cluster):
    server = build_server(cluster, ServerConfig("tiny"))
    with BackgroundServer(server) as url:
        before = wait_until_idle(server)
        body = {"prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert [next(lines) for _ in range(4)][0].startswith("data: {")  # tokens came early
        stats = wait_until_idle(server)  # the abort reached the instance holding the request
        assert stats["num_requests_aborted"] == before["num_requests_aborted"] + 1
        assert stats["generation_tokens"] - before["generation_tokens"] < 200  # stopped early
    assert_every_pool_free(cluster)
