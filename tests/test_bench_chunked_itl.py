"""The chunked-prefill ITL benchmark measures what it says, on a tiny model and tiny sizes."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import numpy as np
import pytest

from minserve import LLM
from minserve.bench.chunked_itl import ItlConfig, ItlWorkload, itl_summary, summarize
from minserve.bench.chunked_itl_command import add_arguments, measure
from minserve.cli import main
from minserve.viz.step_trace import trace_engine

WORKLOAD = ItlWorkload(
    num_streams=3,
    stream_prompt_len=8,
    stream_output_len=20,
    num_long=2,
    long_prompt_len=96,
    long_output_len=3,
    first_arrival=3,
    arrival_every=8,
)
CHUNKED, UNCHUNKED = ItlConfig(True, 32), ItlConfig(False, 128)


@pytest.fixture(scope="module")
def model(tiny_model):
    return LLM(tiny_model("llama"))


def engine(model: LLM, config: ItlConfig):
    return LLM(model.loaded, num_blocks=WORKLOAD.kv_blocks(), **asdict(config)).engine


@pytest.fixture(scope="module")
def traces(model):
    arrivals = WORKLOAD.arrivals(model.loaded.config.vocab_size)
    return {
        config: trace_engine(engine(model, config), arrivals) for config in (CHUNKED, UNCHUNKED)
    }


ARGS = ["--num-streams", "3", "--stream-output-len", "20", "--num-long", "2",
        "--long-prompt-len", "96", "--arrival-every", "8", "--budgets", "16,32",
        "--unchunked-budget", "128", "--clock", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def measured(tiny_model) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return measure(parser.parse_args(["--model", str(tiny_model("llama")), *ARGS]))


def test_report_ratios_follow_from_its_results(measured) -> None:
    base, chunked = measured["results"][0], measured["results"][2]
    c = measured["comparison"]["chunked-32"]
    # the JSON rounds ratios to 3 decimals and tokens/s to 2
    assert c["p99_itl_reduction"] == pytest.approx(
        base["itl_ms"]["p99"] / chunked["itl_ms"]["p99"], abs=1e-3
    )
    assert c["throughput_ratio"] == pytest.approx(
        chunked["total_tokens_per_s"] / base["total_tokens_per_s"], abs=2e-3
    )


def test_example_stream_itls_are_the_gaps_between_its_token_times(measured) -> None:
    for r in measured["results"]:
        times, itl = r["example_stream"]["token_times_s"], r["example_stream"]["itl_ms"]
        assert len(times) == 20
        assert np.allclose(np.diff(times) * 1000, itl)
        assert max(itl) <= r["itl_ms"]["max"] + 1e-9


def test_greedy_tokens_are_the_same_with_and_without_chunking(measured) -> None:
    assert measured["same_greedy_tokens_as_unchunked"] == {
        "unchunked-128": True, "chunked-16": True, "chunked-32": True
    }  # fmt: skip


def test_chunked_run_splits_long_prompts_into_steps_shared_with_decodes(measured, traces) -> None:
    chunked, unchunked = measured["results"][2], measured["results"][0]
    assert chunked["max_step_tokens"] <= 32 < unchunked["max_step_tokens"]
    assert chunked["mixed_steps"] >= 2 * 96 // 32
    trace = traces[CHUNKED]
    chunks = [
        (w.num_tokens, step)
        for step in trace.steps
        for w in step.scheduled
        if w.request_id == "long0" and not w.is_decode
    ]
    assert len(chunks) >= 96 // 32 + 1 and sum(n for n, _ in chunks) == 96
    for _, step in chunks:
        assert step.num_tokens <= 32
        decoding = {w.request_id for w in step.scheduled if w.is_decode}
        assert decoding >= {"stream0", "stream1", "stream2"}


def test_unchunked_run_prefills_each_long_prompt_in_one_step(traces) -> None:
    steps = [s for s in traces[UNCHUNKED].steps if any(w.num_tokens == 96 for w in s.scheduled)]
    assert len(steps) == 2


def test_summary_itls_are_percentiles_of_the_streams_token_gaps(traces) -> None:
    trace = traces[CHUNKED]
    result = summarize(CHUNKED, trace, WORKLOAD)
    gaps = []
    for r in WORKLOAD.stream_ids:
        times = trace.token_times(r)  # the ends of the steps that sampled r's tokens
        gaps += [1000 * (b - a) for a, b in zip(times, times[1:])]
    assert result.num_itl_samples == len(gaps) == 3 * 19
    assert result.itl_ms["p99"] == pytest.approx(np.percentile(gaps, 99))
    assert result.itl_ms["max"] == pytest.approx(max(gaps))
    assert result.seconds == pytest.approx(sum(s.duration for s in trace.steps))


def test_both_runs_match_the_reference_path(model, traces) -> None:
    reference = LLM(model.loaded, engine="reference")
    for arrival in WORKLOAD.arrivals(model.loaded.config.vocab_size):
        prompt = [list(arrival.prompt_token_ids)]
        expected = reference.generate(prompt, arrival.params, use_tqdm=False)[0].outputs[0]
        for trace in traces.values():
            assert trace.token_ids(arrival.request_id) == [expected.token_ids]


def test_itl_summary_needs_gaps() -> None:
    with pytest.raises(ValueError, match="no inter-token gaps"):
        itl_summary([])


def test_workload_rejects_long_prompts_arriving_after_the_streams_end() -> None:
    with pytest.raises(ValueError, match="arrives at step 40"):
        ItlWorkload(stream_output_len=30, num_long=2, first_arrival=10, arrival_every=30)


def test_cli_rejects_an_unchunked_budget_too_small_for_the_long_prompt(capsys) -> None:
    assert main(["bench", "chunked-itl", "--unchunked-budget", "2048"]) == 2
    assert "use at least 2063" in capsys.readouterr().err


def test_bench_chunked_itl_prints_a_row_per_configuration(tiny_model, capsys) -> None:
    argv = ["bench", "chunked-itl", "--model", str(tiny_model("llama")), "--num-streams", "2",
            "--stream-output-len", "12", "--num-long", "1", "--long-prompt-len", "24",
            "--arrival-every", "2", "--budgets", "8", "--unchunked-budget", "128"]  # fmt: skip
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| configuration | token budget | ITL p50 ms |")
    assert [row.split(" | ")[:2] for row in rows[1:]] == [
        ["| no chunking", "128"], ["| chunked prefill", "8"]
    ]  # fmt: skip
