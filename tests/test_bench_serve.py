"""`bench serve` computes vLLM's serving metrics; checked on synthetic timestamps, then live."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from minserve import LLM
from minserve.bench.serve_client import Endpoint, send
from minserve.bench.serve_load import LoadSpec, arrival_times
from minserve.bench.serve_metrics import RequestRecord, parse_goodput, summarize
from minserve.bench.serve_workloads import WorkloadSpec, build_workload
from minserve.cli import main
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig


def synthetic_records() -> list[RequestRecord]:
    return [
        RequestRecord(prompt_tokens=10, output_tokens=5, ttft=0.1, itl=[0.1] * 4, latency=0.5,
                      success=True),  # tpot (0.5 - 0.1) / 4 = 0.1
        RequestRecord(prompt_tokens=20, output_tokens=3, ttft=0.3, itl=[0.4, 0.6], latency=1.3,
                      success=True),  # tpot (1.3 - 0.3) / 2 = 0.5
        RequestRecord(prompt_tokens=30, output_tokens=1, ttft=0.2, latency=0.2, success=True),
        RequestRecord(prompt_tokens=40, error="HTTP 503"),
    ]  # fmt: skip


def test_summary_follows_vllm_definitions() -> None:
    s = summarize(synthetic_records(), duration_s=2.0, slos={}, percentiles=[50, 99])
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    # TPOT leaves out the first token, and one-token requests have none
    assert s["tpot_ms"]["mean"] == pytest.approx(300.0) and s["tpot_ms"]["p50"] == pytest.approx(
        300
    )
    assert s["itl_ms"]["mean"] == pytest.approx(np.mean([0.1] * 4 + [0.4, 0.6]) * 1000)
    assert s["e2el_ms"]["p99"] == pytest.approx(np.percentile([500, 1300, 200], 99))
    assert s["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slos = parse_goodput(["ttft:250", "tpot:200"])
    assert slos == {"ttft": 0.25, "tpot": 0.2}
    s = summarize(synthetic_records(), duration_s=2.0, slos=slos)
    # first: both met; second: TTFT 300 ms misses; third: one token, TPOT counts as 0
    assert s["request_goodput"] == pytest.approx(2 / 2.0)
    assert (
        summarize(synthetic_records(), 2.0, parse_goodput(["e2el:400"]))["request_goodput"] == 0.5
    )


@pytest.mark.parametrize("bad", ["ttft", "itl:100", "ttft:fast", "tpot:-5"])
def test_goodput_rejects_bad_slos(bad: str) -> None:
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_spread() -> None:
    poisson = np.diff(arrival_times(4001, LoadSpec(request_rate=4.0, seed=1)))
    bursty = np.diff(arrival_times(4001, LoadSpec(request_rate=4.0, burstiness=0.25, seed=1)))
    assert poisson.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.mean() == pytest.approx(0.25, rel=0.1)
    # gamma(k) gaps: coefficient of variation 1/sqrt(k): 1 for Poisson, 2 at burstiness 0.25
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.07)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.12)
    assert arrival_times(5, LoadSpec(request_rate=math.inf)) == [0.0] * 5
    assert arrival_times(5, LoadSpec(2.0, seed=3)) == arrival_times(5, LoadSpec(2.0, seed=3))


def test_workloads_have_the_asked_shapes() -> None:
    shared = build_workload(WorkloadSpec("shared-prefix", 4, input_len=8, prefix_len=32))
    assert all(len(s.prompts[0]) == 40 for s in shared)
    assert len({tuple(s.prompts[0][:32]) for s in shared}) == 1
    assert len({tuple(s.prompts[0][32:]) for s in shared}) == 4
    chat = build_workload(WorkloadSpec("multi-turn", 2, input_len=5, num_turns=3))
    assert [s.num_turns for s in chat] == [3, 3] and all(s.is_chat for s in chat)
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec("zipf")


def test_bench_serve_against_a_live_server(tiny_model, tmp_path, capsys) -> None:
    llm = LLM(tiny_model("llama"), num_blocks=128, block_size=4)
    with BackgroundServer(build_server(llm.engine, ServerConfig("tiny"))) as url:
        args = ["bench", "serve", "--base-url", url, "--num-prompts", "6", "--input-len", "16",
                "--output-len", "8", "--request-rate", "50", "--goodput", "ttft:60000",
                "--no-progress", "--output", str(tmp_path / "run")]  # fmt: skip
        assert main(args) == 0
        chat = ["--workload", "multi-turn", "--num-prompts", "2", "--num-turns", "2"]
        assert main([*args[:-1], str(tmp_path / "chat"), *chat, "--input-len", "4"]) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    s = report["summary"]
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["total_input_tokens"] == 6 * 16 and s["total_output_tokens"] == 6 * 8
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert all(0 < r["ttft"] <= r["latency"] and len(r["itl"]) == 7 for r in report["records"])
    assert (tmp_path / "run.png").stat().st_size > 0 and "| tiny |" in capsys.readouterr().out
    chat = json.loads((tmp_path / "chat.json").read_text())["records"]
    assert len(chat) == 4 and all(r["success"] for r in chat)
    assert chat[1]["prompt_tokens"] > chat[0]["prompt_tokens"] + 8  # turn 2 carries turn 1


def sse_client(*events: dict | str) -> httpx.AsyncClient:
    """An httpx client whose every POST streams these server-sent events."""
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    transport = httpx.MockTransport(lambda _: httpx.Response(200, text=body))
    return httpx.AsyncClient(transport=transport)


def test_every_chunk_with_a_choice_is_a_token_event_even_with_empty_text() -> None:
    """vLLM's client: TTFT at the first chunk with a choice (a held-back token has empty
    text), an ITL for each later one; the usage chunk (no choices) is not a token."""
    usage = {"prompt_tokens": 4, "completion_tokens": 3}
    events = [{"choices": [{"text": ""}]}, {"choices": [{"text": "é"}]},
              {"choices": [{"text": "!", "finish_reason": "length"}]},
              {"choices": [], "usage": usage}, "[DONE]"]  # fmt: skip
    client = sse_client(*events)
    record, text = asyncio.run(send(client, Endpoint("http://t", "m"), {"prompt": [1, 2]}))
    assert (text, record.success, record.output_tokens, record.prompt_tokens) == ("é!", True, 3, 4)
    assert len(record.itl) == 2 and 0 < record.ttft <= record.latency


def test_a_stream_without_a_choice_fails_the_request() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 0}}
    record, _ = asyncio.run(send(sse_client(usage, "[DONE]"), Endpoint("http://t", "m"), {}))
    assert not record.success and "no first token" in record.error
