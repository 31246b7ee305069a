"""The capacity simulator: hand-checkable cases where TTFT and TPOT equal the formula."""

import pytest

from minserve.disagg.costs import StepCosts, StepMeasurement, fit_step_costs
from minserve.disagg.planner import best_split, candidate_shapes, search_shapes
from minserve.disagg.simulator import SLO, ClusterShape, SimConfig, simulate
from minserve.disagg.workload import SimRequest, fixed_workload, poisson_workload

COSTS = StepCosts(base_s=0.010, per_prefill_token_s=0.001, per_decode_seq_s=0.002,
                  kv_bytes_per_token=1000)  # fmt: skip
CONFIG = SimConfig(max_num_batched_tokens=512, max_num_seqs=8, transfer_bandwidth_bytes_s=1e6)


def test_one_request_colocated_follows_the_formula():
    (r,) = simulate(
        [SimRequest(0.0, 100, 5)], ClusterShape(num_colocated=1), COSTS, CONFIG
    ).requests
    assert r.ttft_s == pytest.approx(0.010 + 100 * 0.001)  # one prefill step
    assert r.tpot_s == pytest.approx(0.010 + 0.002)  # then decode steps of batch 1
    assert r.finish_s == pytest.approx(0.110 + 4 * 0.012)


def test_one_request_disaggregated_pays_the_transfer_in_tpot():
    shape = ClusterShape(num_prefill=1, num_decode=1)
    (r,) = simulate([SimRequest(1.0, 100, 5)], shape, COSTS, CONFIG).requests
    transfer = 100 * 1000 / 1e6  # prompt tokens x bytes per token / bandwidth = 0.1 s
    assert r.ttft_s == pytest.approx(0.110)
    assert r.finish_s - r.arrival_s == pytest.approx(0.110 + transfer + 4 * 0.012)
    assert r.tpot_s == pytest.approx((transfer + 4 * 0.012) / 4)


def test_long_prompt_is_chunked_by_the_token_budget():
    (r,) = simulate(
        [SimRequest(0.0, 1000, 1)], ClusterShape(num_colocated=1), COSTS, CONFIG
    ).requests
    # 512 + 488 tokens: two steps, each paying the base cost
    assert r.ttft_s == pytest.approx(2 * 0.010 + 1000 * 0.001)
    assert r.tpot_s == 0.0


def test_well_spaced_requests_do_not_interfere():
    work = fixed_workload(interval_s=1.0, num_requests=3, prompt_len=50, output_len=3)
    result = simulate(work, ClusterShape(num_colocated=1), COSTS, CONFIG)
    for r in result.requests:
        assert r.ttft_s == pytest.approx(0.060) and r.tpot_s == pytest.approx(0.012)
    assert result.duration_s == pytest.approx(2.0 + 0.060 + 2 * 0.012)
    assert result.goodput(SLO(ttft_s=0.1, tpot_s=0.1)) == pytest.approx(3 / result.duration_s)
    assert result.goodput(SLO(ttft_s=0.05, tpot_s=0.1)) == 0.0


def test_colocated_prefill_slows_the_running_decode():
    # request B arrives while A decodes: the step that prefills B also decodes A
    work = [SimRequest(0.0, 10, 3), SimRequest(0.025, 200, 1)]
    a, b = simulate(work, ClusterShape(num_colocated=1), COSTS, CONFIG).requests
    # A: prefill [0, 0.020], decode [0.020, 0.032], then the mixed step of B's 200 tokens
    # plus A's decode starts at 0.032 and lasts 0.010 + 0.200 + 0.002
    assert a.finish_s == pytest.approx(0.032 + 0.212)
    assert b.first_token_s == pytest.approx(0.032 + 0.212)
    # disaggregated, A's decode never waits for B's prefill
    split = simulate(work, ClusterShape(num_prefill=1, num_decode=1), COSTS, CONFIG).requests
    assert split[0].tpot_s == pytest.approx((0.010 + 2 * 0.012) / 2)


def test_all_requests_finish_with_every_token_under_poisson_load():
    work = poisson_workload(rate=20, num_requests=60, prompt_len=(20, 300), output_len=(1, 20))
    for shape in candidate_shapes(4, [1, 2]):
        result = simulate(work, shape, COSTS.tensor_parallel(shape.tp, 0.001), CONFIG)
        assert len(result.requests) == 60
        for r, spec in zip(result.requests, work):
            assert spec.arrival_s < r.first_token_s <= r.finish_s
            # no step is shorter than a decode of one sequence
            assert r.finish_s - r.first_token_s >= (spec.output_len - 1) * 0.001


def test_search_ranks_shapes_by_goodput():
    work = poisson_workload(rate=30, num_requests=80, prompt_len=(200, 400), output_len=(10, 30))
    slo = SLO(ttft_s=0.5, tpot_s=0.03)
    points = search_shapes(4, work, {1: COSTS, 2: COSTS.tensor_parallel(2, 0.002)}, slo, CONFIG)
    assert len(points) == 4 + 2  # TP1: colocated + 3 splits; TP2: colocated + 1 split
    goodputs = [p.goodput for p in points]
    assert goodputs == sorted(goodputs, reverse=True)
    assert points[0].goodput == pytest.approx(points[0].result.goodput(slo))
    assert best_split(points).shape.num_prefill in (1, 2, 3)


def test_fit_recovers_the_step_cost_line():
    truth = StepCosts(0.004, 0.0002, 0.0007)
    shapes = [(64, 0), (256, 0), (0, 1), (0, 8), (32, 4)]
    measured = [StepMeasurement(t, b, truth.step_time(t, b)) for t, b in shapes]
    fitted = fit_step_costs(measured, kv_bytes_per_token=12)
    assert fitted.base_s == pytest.approx(0.004)
    assert fitted.per_prefill_token_s == pytest.approx(0.0002)
    assert fitted.per_decode_seq_s == pytest.approx(0.0007)
    assert fitted.kv_bytes_per_token == 12


def test_costs_round_trip_through_json(tmp_path):
    COSTS.save(tmp_path / "costs.json")
    assert StepCosts.load(tmp_path / "costs.json") == COSTS


def test_bad_shapes_and_inputs_are_rejected():
    with pytest.raises(ValueError, match="colocated instances or P > 0 prefill"):
        ClusterShape(num_prefill=2)
    with pytest.raises(ValueError, match="at least 3 different"):
        fit_step_costs([StepMeasurement(8, 0, 0.1)] * 5)
    with pytest.raises(ValueError, match="no TP degree"):
        candidate_shapes(3, [2])
    with pytest.raises(ValueError, match="at least 1 prompt"):
        SimRequest(0.0, 0, 4)


def test_calibration_measures_the_shapes_it_asked_for(tiny_model):
    from minserve import LLM
    from minserve.disagg.calibrate import calibrate, measure_steps

    llm = LLM(tiny_model("llama"), block_size=4, num_blocks=64)
    measured = measure_steps(llm.engine, prompt_lens=(4, 16), batch_sizes=(1, 3), repeats=2)
    shapes = [(m.prefill_tokens, m.decode_seqs) for m in measured]
    assert shapes == [(4, 0), (4, 0), (16, 0), (16, 0), (0, 1), (0, 1), (0, 3), (0, 3)]
    assert all(m.seconds > 0 for m in measured)
    assert not llm.engine.has_unfinished_requests()
    costs = calibrate(llm.engine, prompt_lens=(4, 16), batch_sizes=(1, 3))
    config = llm.loaded.config
    assert costs.kv_bytes_per_token == 2 * config.num_layers * config.kv_size * 4  # fp32


def test_replay_runs_a_workload_on_the_engine_at_its_arrival_times(tiny_model):
    from minserve import LLM
    from minserve.disagg.replay import replay

    llm = LLM(tiny_model("llama"), block_size=4, num_blocks=64)
    work = [SimRequest(0.0, 12, 3), SimRequest(0.05, 5, 1), SimRequest(0.1, 30, 4)]
    result = replay(llm.engine, work)
    for r, spec in zip(result.requests, work):
        assert r.output_len == spec.output_len
        assert r.arrival_s < r.first_token_s <= r.finish_s
    assert result.requests[1].tpot_s == 0.0  # one output token: no TPOT
    assert result.requests[2].arrival_s - result.requests[0].arrival_s == pytest.approx(0.1)
