"""The tables `minserve bench disagg` prints, a section per part the run has.

`benchmarks/disagg.py` writes the same sections under its run record (benchmarks/disagg.md).
"""

from __future__ import annotations

METRIC_NAMES = {
    "mean_ttft_s": "mean TTFT (s)",
    "mean_tpot_s": "mean TPOT (s)",
    "duration_s": "duration (s)",
}


def section_lines(report: dict) -> list[str]:
    """Every part the run has, each a short table with what it measured (a blank line first)."""
    lines = []
    for key, section in (
        ("transfer", _transfer),
        ("validation", _validation),
        ("goodput", _goodput),
        ("plans", _plans),
    ):
        if key in report:
            lines += ["", *section(report)]
    return lines


def _transfer(report: dict) -> list[str]:
    t = report["transfer"]
    ping, fit = t["link_pingpong"], t["link_fitted"]
    fitted = (
        ""
        if fit is None
        else (
            f"; fitted to the rows below: latency {fit['latency_s'] * 1e3:.2f} ms, bandwidth "
            f"{fit['bandwidth_bytes_s'] / 1e9:.2f} GB/s (the simulator uses this one)"
        )
    )
    rows = [
        "## 1. KV transfer per request vs its prefill (SmolLM2, fp32, gloo, 1 thread each)",
        "",
        f"Link by the pair's ping-pong at start-up: latency {ping['latency_s'] * 1e3:.2f} ms, "
        f"bandwidth {ping['bandwidth_bytes_s'] / 1e9:.2f} GB/s{fitted}. Median of "
        f"{t['repeats']} requests per length; transfer: the prefill side's time in `dist.send`; "
        "prefill: the prefill engine's step over the whole prompt.",
        "",
        "| prompt tokens | KV bytes sent | formula bytes | transfer (ms) | GB/s | rule's estimate "
        "(ms) | prefill (s) | transfer / prefill |",
        "|" + "---|" * 8,
    ]
    for r in t["rows"]:
        rows.append(
            f"| {r['prompt_len']} | {r['kv_bytes']:,} | {r['kv_bytes_tokens']:,} | "
            f"{r['transfer_s'] * 1e3:.2f} | {r['kv_bytes'] / r['transfer_s'] / 1e9:.2f} | "
            f"{r['estimated_transfer_s'] * 1e3:.2f} | {r['prefill_s']:.3f} | "
            f"{r['transfer_over_prefill']:.2%} |"
        )
    return rows


def _errors_table(pairs: dict[str, tuple[float, float]]) -> list[str]:
    rows = ["| metric | measured | simulated | error |", "|---|---|---|---|"]
    for m, (real, sim) in pairs.items():
        flag = "" if abs(sim - real) <= 0.2 * real else " (outside 20%)"
        rows.append(
            f"| {METRIC_NAMES[m]} | {real:.3f} | {sim:.3f} | {(sim - real) / real:+.1%}{flag} |"
        )
    return rows


def _validation(report: dict) -> list[str]:
    v = report["validation"]
    c = report["calibrated_costs"]
    rows = [
        "## 2. Simulator vs measured 1P1D (`PrefillDecodePair` replaying the workload)",
        "",
        f"{v['num_requests']} requests at {v['rate']} req/s (the mixed workload of part 3); "
        f"costs calibrated on the pair's prefill engine: base {c['base_s'] * 1e3:.1f} ms, "
        f"{c['per_prefill_token_s'] * 1e3:.2f} ms per prefill token, "
        f"{c['per_decode_seq_s'] * 1e3:.2f} ms per decoding sequence. Lockstep: the simulator "
        "steps both instances in rounds as the pair does (a decode step waits for the "
        "concurrent prefill step); free-running: each instance steps on its own.",
    ]
    for name, model in v["models"].items():
        pairs = {m: (x["measured"], x["simulated"]) for m, x in model["metrics"].items()}
        rows += ["", f"**{name}**", "", *_errors_table(pairs)]
    return rows


def _goodput(report: dict) -> list[str]:
    mix, slo = report["mix"], report["mix"]["slo"]
    rows = [
        "## 3. Colocated (2 replicas + round-robin router) vs disaggregated (1P1D)",
        "",
        f"Mixed workload: prompts {mix['prompt_len'][0]}-{mix['prompt_len'][1]} tokens, "
        f"outputs {mix['output_len'][0]}-{mix['output_len'][1]}, Poisson arrivals; SLOs "
        f"TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s'] * 1e3:.0f} ms. Simulated: the "
        "calibrated simulator on the same workload and shape.",
        "",
        "| setup | rate (req/s) | done | goodput (req/s) | simulated goodput | mean TTFT (s) "
        "| sim | mean TPOT (ms) | sim | duration (s) | sim |",
        "|" + "---|" * 11,
    ]
    for r in report["goodput"]:
        if "error" in r:
            first_line = r["error"].strip().splitlines()[0] if r["error"].strip() else "?"
            rows.append(f"| {r['setup']} | - | not run: {first_line[:150]} |" + " |" * 8)
            continue
        s, sim = r["summary"], r.get("simulated", {})
        m = sim.get("metrics", {})
        rows.append(
            f"| {r['setup']} | {r['rate']} | {s['completed']}/{s['completed'] + s['failed']} | "
            f"{s['request_goodput']:.3f} | {sim.get('goodput', float('nan')):.3f} | "
            f"{s['ttft_ms']['mean'] / 1e3:.2f} | {m.get('mean_ttft_s', float('nan')):.2f} | "
            f"{s['tpot_ms']['mean']:.0f} | {m.get('mean_tpot_s', float('nan')) * 1e3:.0f} | "
            f"{s['duration_s']:.1f} | {m.get('duration_s', float('nan')):.1f} |"
        )
    return rows


def _plans(report: dict) -> list[str]:
    rows = ["## 4. Simulated capacity plans (predictions, not measurements)"]
    for p in report["plans"]:
        s = p["setting"]
        rows += [
            "",
            f"**{s['name']}**: prompts {s['prompt_len']}, outputs {s['output_len']}, "
            f"{s['rate_per_gpu']} req/s per GPU offered, {s['requests_per_gpu']} requests per "
            f"GPU, SLOs TTFT <= {s['slo']['ttft_s']} s, TPOT <= {s['slo']['tpot_s'] * 1e3:.0f} ms. "
            "Per cluster size and TP degree: the best P:D split and the colocated shape. "
            "SLO-met req/s / GPU: the offered rate x attainment (in brackets), what shapes are "
            "ranked by; goodput: SLO-met requests / (first arrival to last finish), which with "
            "a few seconds of arrivals mostly measures the final drain. **bold**: the best.",
            "",
            "| GPUs | TP | best split | SLO-met req/s / GPU | goodput / GPU | mean TTFT (s) | "
            "mean TPOT (ms) | colocated | SLO-met req/s / GPU | goodput / GPU | mean TTFT (s) | "
            "mean TPOT (ms) |",
            "|" + "---|" * 12,
        ]
        for gpus, points in p["by_cluster_size"].items():
            for tp in s["tp_degrees"]:
                split = [q for q in points if q["tp"] == tp and q["num_prefill"]]
                colo = [q for q in points if q["tp"] == tp and q["num_colocated"]]
                if split and colo:
                    best = max(split, key=lambda q: (q["served_per_gpu"], q["goodput"]))
                    cells = [_plan_cells(q, q is points[0]) for q in (best, colo[0])]
                    rows.append(f"| {gpus} | {tp} | " + " | ".join(cells) + " |")
    return rows


def _plan_cells(q: dict, best: bool) -> str:
    label = f"**{q['label']}**" if best else q["label"]
    return (
        f"{label} | {q['served_per_gpu']:.2f} ({q['attainment']:.0%}) | "
        f"{q['goodput_per_gpu']:.2f} | {q['mean_ttft_s']:.3f} | {q['mean_tpot_s'] * 1e3:.1f}"
    )
