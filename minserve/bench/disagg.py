"""`minserve bench disagg`: prefill/decode disaggregation, measured here and simulated beyond.

    minserve bench disagg [--parts transfer,validate,plan,goodput]   # about 8-10 min

Four parts, run in this order, each printed as a table (`disagg_tables.py`):
- transfer: KV bytes and hand-off time per request against its prefill time, prompt lengths
  64..2048, through a real `PrefillDecodePair` (`disagg_transfer.py`);
- validate: the same pair calibrates the simulator (`calibrate.py`), then replays the mixed
  workload in real time (1P1D); the simulator predicts the same workload on 1P1D, in
  lockstep rounds as the pair runs and free-running;
- plan: the planner's best P:D split and TP degree at 8, 32 and 128 GPUs, with a GPU
  roofline's costs and with the costs calibrated in `validate` (`disagg_plan.py`);
- goodput: colocated (2 replicas behind a round-robin router) vs `minserve serve
  --disaggregation 1P1D`, same workload and rates through `bench serve`'s load generator
  (`disagg_goodput.py`), the calibrated simulator's prediction beside each run.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from tqdm.auto import tqdm

from minserve.bench.disagg_goodput import SETUPS, GoodputSpec, measure_setup
from minserve.bench.disagg_plan import cpu_setting, gpu_setting, plan
from minserve.bench.disagg_tables import section_lines
from minserve.bench.disagg_workload import CPU_MIX, mixed_workload
from minserve.bench.options import numbers, set_threads
from minserve.disagg.costs import StepCosts
from minserve.disagg.simulator import ClusterShape, SimConfig, simulate
from minserve.disagg.validate import METRICS, relative_errors

PARTS = ("transfer", "validate", "plan", "goodput")
# prefills and decode contexts across the mixed workload's prompt lengths (32-256)
CALIBRATION = {
    "prompt_lens": (32, 128, 256),
    "batch_sizes": (1, 2, 3, 4, 6, 8),
    "decode_contexts": (32, 64, 96, 128, 160, 192, 224, 256),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    p.add_argument("--prompt-lens", default="64,128,256,512,1024,2048", help="transfer part")
    p.add_argument("--transfer-repeats", type=int, default=2)
    p.add_argument("--rates", default="0.8,1.2", help="total req/s for the goodput runs")
    p.add_argument("--num-requests", type=int, default=24, help="per goodput run and replay")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--plan-sizes", default="8,32,128", help="cluster sizes (GPUs) to plan")
    p.add_argument("--seed", type=int, default=0)


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `disagg` subcommand of `minserve bench`."""
    p = kinds.add_parser("disagg", help="KV transfer cost, 1P1D vs colocated, simulator plans")
    add_arguments(p)
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    set_threads(1)  # one torch thread here; every server and instance has its own
    print("\n".join(section_lines(measure(args))).strip())
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Check the options, then run the chosen parts in order, under one progress bar."""
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"--parts: choose from {', '.join(PARTS)}, got {args.parts!r}")
    spec = GoodputSpec(
        tuple(s.strip() for s in args.setups.split(",") if s.strip()),
        numbers(args.rates, float),
        args.num_requests,
        CPU_MIX,
        args.model,
        seed=args.seed,
    )
    prompt_lens = numbers(args.prompt_lens, int)
    sizes = numbers(args.plan_sizes, int)
    total = (
        len(prompt_lens) * ("transfer" in parts)
        + ("validate" in parts)
        + (1 + ("validate" in parts)) * len(sizes) * ("plan" in parts)
        + len(spec.setups) * len(spec.rates) * ("goodput" in parts)
    )
    report: dict = {"parts": list(parts), "mix": asdict(CPU_MIX), "goodput_spec": asdict(spec)}
    with tqdm(total=total, desc="bench disagg") as bar:
        if {"transfer", "validate"} & set(parts):
            report.update(_pair_parts(args, parts, prompt_lens, spec, bar))
        if "plan" in parts:
            report["plans"] = [plan(gpu_setting(sizes), bar)]
            if "calibrated_costs" in report:  # the CPU plan needs part 2's calibration
                costs = StepCosts(**report["calibrated_costs"])
                bandwidth = report["link"]["bandwidth_bytes_s"]
                report["plans"].append(plan(cpu_setting(costs, bandwidth, sizes), bar))
        if "goodput" in parts:
            report["goodput"] = _goodput_part(spec, report, bar)
    return report


def _pair_parts(args, parts, prompt_lens, spec: GoodputSpec, bar) -> dict:
    """Parts 1 and 2 on one prefill/decode pair (transfer forced, one thread per process)."""
    from minserve.bench.disagg_transfer import transfer_report
    from minserve.disagg.calibrate import calibrate
    from minserve.disagg.pd_pair import PrefillDecodePair
    from minserve.disagg.validate import validate_pair
    from minserve.model.default_model import default_model_path

    model = args.model or str(default_model_path())
    out: dict = {}
    budget = max(spec.max_num_batched_tokens, *prompt_lens)
    with PrefillDecodePair(model, "transfer", max_num_batched_tokens=budget) as pair:
        link = {"latency_s": pair.rule.latency_s, "bandwidth_bytes_s": pair.rule.bandwidth_bytes_s}
        out["link"] = {**link, "source": "the pair's ping-pong at start-up"}
        if "transfer" in parts:
            out["transfer"] = transfer_report(pair, prompt_lens, args.transfer_repeats, bar)
            if out["transfer"]["link_fitted"] is not None:
                link = out["transfer"]["link_fitted"]
                out["link"] = {**link, "source": "fitted to the measured transfers"}
        if "validate" in parts:
            costs = calibrate(pair.llm.engine, **CALIBRATION)
            work = mixed_workload(spec.rates[0], spec.num_requests, spec.mix, spec.seed)
            models = validate_pair(
                pair, work, costs, (link["latency_s"], link["bandwidth_bytes_s"])
            )
            out["calibrated_costs"] = asdict(costs)
            out["validation"] = {
                "rate": spec.rates[0],
                "num_requests": spec.num_requests,
                "calibration": CALIBRATION,
                "models": {name: _pairs_row(pairs) for name, pairs in models.items()},
            }
            bar.update(1)
    return out


def _pairs_row(pairs: dict[str, tuple[float, float]]) -> dict:
    return {
        "metrics": {m: {"measured": a, "simulated": b} for m, (a, b) in pairs.items()},
        "errors": relative_errors(pairs),
    }


def _goodput_part(spec: GoodputSpec, report: dict, bar) -> list[dict]:
    """Each setup's measured rows (or the error that stopped it), with simulated predictions."""
    from minserve.llm import LLM

    vocab = LLM(spec.model, engine="reference").loaded.config.vocab_size
    rows = []
    for setup in spec.setups:
        try:
            rows += measure_setup(setup, spec, vocab, bar)
        except RuntimeError as error:  # e.g. a server flag not there yet: say so, go on
            rows.append({"setup": setup, "error": str(error)})
    if "calibrated_costs" in report:
        costs = StepCosts(**report["calibrated_costs"])
        for row in rows:
            if "summary" in row:
                row["simulated"] = predict(row, spec, costs, report["link"])
    return rows


def predict(row: dict, spec: GoodputSpec, costs: StepCosts, link: dict) -> dict:
    """The simulator's mean TTFT, mean TPOT and duration for one measured goodput run."""
    shape = (
        ClusterShape(num_colocated=2)
        if row["setup"] == "colocated"
        else ClusterShape(num_prefill=1, num_decode=1)
    )
    work = mixed_workload(row["rate"], spec.num_requests, spec.mix, spec.seed)
    config = SimConfig(
        spec.max_num_batched_tokens,
        transfer_bandwidth_bytes_s=link["bandwidth_bytes_s"],
        transfer_latency_s=link["latency_s"],
        lockstep=row["setup"] == "disaggregated",  # the server's instances step in rounds
    )
    result = simulate(work, shape, costs, config)
    s = row["summary"]
    measured = {
        "mean_ttft_s": s["ttft_ms"]["mean"] / 1e3,
        "mean_tpot_s": s["tpot_ms"]["mean"] / 1e3,
        "duration_s": s["duration_s"],
    }
    pairs = {m: (measured[m], getattr(result, m)) for m in METRICS}
    return {
        "metrics": {m: getattr(result, m) for m in METRICS},
        "goodput": result.goodput(spec.mix.slo),
        "errors": relative_errors(pairs),
    }
