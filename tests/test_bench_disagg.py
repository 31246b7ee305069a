"""`minserve bench disagg` at tiny sizes: each part's code path against hand-computed values."""

import math
import sys

import numpy as np
import pytest

from benchmarks.disagg import markdown, plot
from minserve.bench.disagg_goodput import GoodputSpec, measure_setup, running, server_commands
from minserve.bench.disagg_goodput import wait_ready as wait_until_ready
from minserve.bench.disagg_plan import LLAMA_8B_H100, PlanSetting, gpu_roofline_costs, plan
from minserve.bench.disagg_workload import MixSpec, mixed_workload, to_sessions
from minserve.bench.serve_load import LoadSpec, arrival_times
from minserve.cli import main
from minserve.disagg.costs import StepCosts
from minserve.disagg.planner import candidate_shapes
from minserve.disagg.simulator import SLO, ClusterShape, SimConfig, simulate
from minserve.disagg.workload import poisson_workload

TINY_MIX = MixSpec((4, 12), (2, 4), rate_per_instance=2.0, slo=SLO(ttft_s=5.0, tpot_s=1.0))


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def pair_report(model_dir):
    """One pair: the transfer part at two lengths, then calibration and the 1P1D replay."""
    from minserve.bench.disagg_transfer import transfer_report
    from minserve.disagg.calibrate import calibrate
    from minserve.disagg.pd_pair import PrefillDecodePair
    from minserve.disagg.validate import validate_pair

    with PrefillDecodePair(model_dir, "transfer", block_size=4, num_blocks=128) as pair:
        transfer = transfer_report(pair, (8, 300), repeats=1)
        config = pair.llm.loaded.config
        costs = calibrate(pair.llm.engine, prompt_lens=(4, 8, 16), batch_sizes=(1, 2, 3), repeats=1)
        work = mixed_workload(4.0, 3, TINY_MIX, seed=1)
        validation = validate_pair(pair, work, costs)
    return transfer, config, costs, validation


def test_kv_bytes_are_layers_x_2_x_kv_heads_x_head_dim_x_dtype_bytes_x_tokens(pair_report):
    transfer, config, _, _ = pair_report
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4  # fp32
    for row in transfer["rows"]:
        assert row["kv_bytes_tokens"] == per_token * row["prompt_len"]
        assert row["kv_bytes"] == per_token * 4 * math.ceil(row["prompt_len"] / 4)  # whole blocks
        assert row["transfer_s"] > 0 and row["prefill_s"] > 0
        assert row["transfer_over_prefill"] == row["transfer_s"] / row["prefill_s"]
    assert [r["prompt_len"] for r in transfer["rows"]] == [8, 300]


def test_1p1d_replay_measures_every_metric_the_simulator_predicts(pair_report):
    _, _, costs, validation = pair_report
    assert set(validation) == {"lockstep", "free-running"}
    work = mixed_workload(4.0, 3, TINY_MIX, seed=1)
    for pairs in validation.values():
        assert set(pairs) == {"mean_ttft_s", "mean_tpot_s", "duration_s"}
        assert all(measured > 0 and simulated > 0 for measured, simulated in pairs.values())
        assert pairs["duration_s"][0] >= work[-1].arrival_s - work[0].arrival_s
    measured = [pairs[m][0] for pairs in validation.values() for m in sorted(pairs)]
    assert measured[:3] == measured[3:]  # one replay, two models
    assert costs.kv_bytes_per_token > 0


def test_fitted_link_recovers_latency_and_bandwidth():
    from minserve.bench.disagg_transfer import TransferRow, fit_link

    rows = [TransferRow(n, 1000 * n, 1000 * n, 0.002 + 1000 * n / 1e9, 0, 1.0, 1.0)
            for n in (64, 256, 1024)]  # fmt: skip
    latency, bandwidth = fit_link(rows)
    assert latency == pytest.approx(0.002) and bandwidth == pytest.approx(1e9)
    with pytest.raises(ValueError, match="at least 2 different sizes"):
        fit_link(rows[:1])


def test_lockstep_rounds_make_a_decode_wait_for_the_concurrent_prefill():
    from minserve.disagg.workload import SimRequest

    costs = StepCosts(1.0, 0.1, 0.5, kv_bytes_per_token=100)  # prefill 10 tokens: 2 s
    work = [SimRequest(0.0, 10, 3), SimRequest(2.0, 20, 3)]
    shape = ClusterShape(num_prefill=1, num_decode=1)
    free = simulate(work, shape, costs, SimConfig(transfer_bandwidth_bytes_s=1000))
    rounds = simulate(work, shape, costs, SimConfig(transfer_bandwidth_bytes_s=1000, lockstep=True))
    # free-running: A prefills 0-2, KV lands at 3 (1000 B / 1000 B/s), decodes 3-4.5-6;
    # B prefills 2-5, lands at 7, decodes 7-8.5-10
    assert [(r.ttft_s, r.tpot_s) for r in free.requests] == [(2.0, 2.0), (3.0, 2.5)]
    # rounds: [0, 2] A prefills; [2, 6] send A (1 s) + max(B's 3 s prefill, A's 1.5 s decode);
    # [6, 10] send B (2 s) + decode A and B (2 s); [10, 11.5] decode B
    assert [(r.ttft_s, r.tpot_s) for r in rounds.requests] == [(2.0, 4.0), (4.0, 2.75)]
    assert rounds.duration_s == 11.5


def test_the_mixed_workload_uses_bench_serve_arrivals_and_its_length_ranges():
    work = mixed_workload(2.0, 20, TINY_MIX, seed=3)
    assert [r.arrival_s for r in work] == arrival_times(20, LoadSpec(2.0, seed=3))
    assert all(4 <= r.prompt_len <= 12 and 2 <= r.output_len <= 4 for r in work)
    sessions = to_sessions(work, vocab_size=500)
    assert [len(s.prompts[0]) for s in sessions] == [r.prompt_len for r in work]
    assert [s.output_len for s in sessions] == [r.output_len for r in work]
    assert all(100 <= t < 500 for s in sessions for t in s.prompts[0])


def test_gpu_roofline_costs_follow_the_data_sheet_arithmetic():
    costs = gpu_roofline_costs(LLAMA_8B_H100, mean_context=1000)
    bytes_s, flops_s = 3.35e12 * 0.8, 989e12 * 0.5
    assert costs.base_s == pytest.approx(2 * 8.03e9 / bytes_s)  # weights read once per step
    assert costs.per_prefill_token_s == pytest.approx(2 * 8.03e9 / flops_s)
    kv_token = 32 * 2 * 8 * 128 * 2  # 128 KiB per token in bf16
    assert costs.kv_bytes_per_token == kv_token == 131072
    assert costs.per_decode_seq_s == pytest.approx(1000 * kv_token / bytes_s + 2 * 8.03e9 / flops_s)


def test_max_splits_keeps_both_ends_and_spaces_the_rest():
    shapes = candidate_shapes(128, [1], max_splits=5)
    assert [s.num_prefill for s in shapes if s.num_prefill] == [1, 33, 64, 95, 127]
    assert all(s.num_gpus == 128 for s in shapes)
    assert len(candidate_shapes(8, [1, 2], max_splits=24)) == 8 + 4  # all splits when few


def test_plan_simulates_every_shape_per_cluster_size_best_first():
    costs = StepCosts(0.01, 1e-4, 2e-4, kv_bytes_per_token=1000)
    setting = PlanSetting("tiny", costs, (16, 64), (4, 8), rate_per_gpu=5.0, requests_per_gpu=5,
                          slo=SLO(0.2, 0.02), config=SimConfig(), cluster_sizes=(2, 4),
                          tp_degrees=(1, 2))  # fmt: skip
    result = plan(setting)
    assert list(result["by_cluster_size"]) == ["2", "4"]
    four = result["by_cluster_size"]["4"]
    assert {p["label"] for p in four} == {"4 colocated TP1", "1P3D TP1", "2P2D TP1", "3P1D TP1",
                                          "2 colocated TP2", "1P1D TP2"}  # fmt: skip
    served = [p["served_per_gpu"] for p in four]
    assert served == sorted(served, reverse=True)
    assert all(p["served_per_gpu"] == pytest.approx(5.0 * p["attainment"]) for p in four)
    assert all(p["goodput_per_gpu"] == pytest.approx(p["goodput"] / 4) for p in four)
    work = poisson_workload(20.0, 20, (16, 64), (4, 8), seed=0)  # 4 GPUs x 5 req/s, x 5 each
    shape = ClusterShape(num_prefill=2, num_decode=2)
    direct = simulate(work, shape, costs, SimConfig())
    (row,) = [p for p in four if p["label"] == "2P2D TP1"]
    assert row["attainment"] == direct.attainment(SLO(0.2, 0.02))
    assert row["mean_tpot_s"] == direct.mean_tpot_s


def test_server_commands_put_two_replicas_behind_a_round_robin_router():
    (a, b, router), url = server_commands("colocated", GoodputSpec())
    ports = [cmd[cmd.index("--port") + 1] for cmd in (a, b, router)]
    assert url == f"http://127.0.0.1:{ports[2]}"
    assert router[router.index("--policy") + 1] == "round_robin"
    assert [router[i + 1] for i, x in enumerate(router) if x == "--replica"] == [
        f"http://127.0.0.1:{p}" for p in ports[:2]
    ]
    (disagg,), _ = server_commands("disaggregated", GoodputSpec())
    assert disagg[disagg.index("--disaggregation") + 1] == "1P1D"


def test_a_server_that_exits_is_reported_with_its_log():
    command = [sys.executable, "-c", "import sys; sys.stderr.write('no such flag'); sys.exit(2)"]
    with running(command) as server, pytest.raises(RuntimeError, match="no such flag"):
        wait_until_ready("http://127.0.0.1:9", [server], timeout_s=20)


def test_colocated_servers_serve_the_whole_workload(model_dir):
    spec = GoodputSpec(("colocated",), (4.0,), 4, TINY_MIX, str(model_dir))
    (row,) = measure_setup("colocated", spec, vocab_size=500)
    s = row["summary"]
    assert (s["completed"], s["failed"]) == (4, 0)
    work = mixed_workload(4.0, 4, TINY_MIX)
    assert s["total_output_tokens"] == sum(r.output_len for r in work)
    assert s["total_input_tokens"] == sum(r.prompt_len for r in work)


def test_report_has_every_part_and_says_what_did_not_run(pair_report, tmp_path):
    transfer, _, costs, validation = pair_report
    report = {
        "mix": {"prompt_len": [4, 12], "output_len": [2, 4], "slo": {"ttft_s": 5, "tpot_s": 1}},
        "transfer": transfer,
        "calibrated_costs": costs.__dict__,
        "validation": {"rate": 4.0, "num_requests": 3, "models": {
            name: {"metrics": {m: {"measured": a, "simulated": b} for m, (a, b) in pairs.items()}}
            for name, pairs in validation.items()}},
        "goodput": [{"setup": "disaggregated", "error": "minserve serve: unrecognized "
                     "arguments: --disaggregation 1P1D"}],
    }  # fmt: skip
    page = markdown(report)
    for heading in ("## 1. KV transfer", "## 2. Simulator vs measured 1P1D", "**lockstep**",
                    "**free-running**", "## 3. Colocated"):  # fmt: skip
        assert heading in page
    assert "not run: minserve serve: unrecognized arguments" in page
    assert plot(report, tmp_path / "d.png").stat().st_size > 0


def test_bad_parts_are_refused_with_the_choices(capsys):
    assert main(["bench", "disagg", "--parts", "bogus"]) == 2
    assert "choose from transfer, validate, plan, goodput" in capsys.readouterr().err
    assert main(["bench", "disagg", "--rates", "1,fast"]) == 2
    assert "expected comma-separated numbers, got '1,fast'" in capsys.readouterr().err


def test_fit_drops_a_negative_term_and_refits_the_others():
    from minserve.disagg.costs import StepMeasurement, fit_step_costs

    shapes = [(100, 0, 1.0), (200, 0, 2.1), (0, 1, 0.10), (0, 8, 0.06)]  # decode gets faster
    fitted = fit_step_costs([StepMeasurement(*s) for s in shapes])
    assert fitted.per_decode_seq_s == 0.0
    a = np.array([[1.0, t] for t, _, _ in shapes])  # the same fit without the dropped term
    y = np.array([s for _, _, s in shapes])
    (base, per_token), *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    assert (fitted.base_s, fitted.per_prefill_token_s) == pytest.approx((base, per_token))


def test_bench_disagg_prints_the_tables_of_the_parts_it_ran(capsys):
    assert main(["bench", "disagg", "--parts", "plan", "--plan-sizes", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## 4. Simulated capacity plans") and "## 1. KV transfer" not in out
    assert "| 2 | 1 | 1P1D TP1 |" in out  # 2 GPUs at TP 1: one prefill, one decode instance
