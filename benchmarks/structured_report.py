"""The structured-output benchmark's page: correctness, overhead, speculation."""

from __future__ import annotations

from typing import Any

from benchmarks.run_env import RunRecord
from benchmarks.structured_serve import BATCH

TARGET_OVERHEAD = 0.10  # constrained decoding at most 10% slower than free

BASE_PHASES = ("schedule", "propose", "prepare", "forward", "sample", "update")


def markdown(report: dict[str, Any], record: RunRecord) -> str:
    s = report["settings"]
    lines = [*record.header_lines("Structured output: correctness, overhead, speculation"),
             f"- SmolLM2-135M-Instruct; {s['num_schemas']} JSON schemas, {s['num_regex']} "
             f"regexes, {s['num_choice']} choice lists (seed {s['seed']}); max_tokens "
             f"{s['max_tokens']}; batch {BATCH}", "",
             "## 1. Correctness through `minserve serve` (16 in flight)", "",
             "| kind | sampling | requests | valid | cut at max_tokens | invalid | HTTP error |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["correctness"]["summary"]:
        lines.append(f"| {r['kind']} | {r['sampling']} | {r['requests']} | {r['valid']} | "
                     f"{r['length']} | {r['invalid']} | {r['http_error']} |")  # fmt: skip
    total = sum(r["requests"] for r in report["correctness"]["summary"])
    valid = sum(r["valid"] for r in report["correctness"]["summary"])
    off = report["offline_greedy_valid"]
    lines += ["", f"{valid} / {total} valid ({100 * valid / max(total, 1):.1f}%); offline, "
              f"greedy: {off['valid']} / {off['requests']}. Failures in full: the JSON's "
              "`correctness.failures`.", ""]  # fmt: skip
    lines += overhead_lines(report["overhead"], report["compile_ms"])
    lines += speculation_lines(report["speculative"], report["jump_forward"])
    return "\n".join(lines) + "\n"


def overhead_lines(o: dict[str, Any], compile_ms: dict[str, dict]) -> list[str]:
    c, f = o["constrained"], o["free"]
    extra = [p for p in c["phase_ms_per_step"] if p not in BASE_PHASES]
    lines = [f"## 2. Overhead, offline, batch {BATCH}: {o['requests']} JSON requests, "
             f"{o['output_tokens']} output tokens either way", "",
             "| run | tokens/s | step ms per token | steps | "
             + " | ".join(f"{p} ms/step" for p in (*BASE_PHASES, *extra)) + " |",
             "|---|---:|---:|---:|" + "---:|" * (len(BASE_PHASES) + len(extra))]  # fmt: skip
    for name, side in (("free", f), ("constrained", c)):
        phases = " | ".join(f"{side['phase_ms_per_step'].get(p, 0.0):.2f}"
                            for p in (*BASE_PHASES, *extra))  # fmt: skip
        lines.append(f"| {name} | {side['tokens_per_s']:.1f} | {side['step_ms_per_token']:.2f} "
                     f"| {side['steps']:g} | {phases} |")  # fmt: skip
    met = max(o["throughput_overhead"], o["step_time_overhead"]) <= TARGET_OVERHEAD
    lines += ["", f"Overhead: {100 * o['throughput_overhead']:+.1f}% tokens/s, "
              f"{100 * o['step_time_overhead']:+.1f}% step time per token (target <= "
              f"{100 * TARGET_OVERHEAD:g}%: {'met' if met else 'not met'}). "
              f"{mask_sentence(c['phase_ms_per_step'], extra)}", "",
              "Compile time per grammar (ms): " + "; ".join(
                  f"{k}: median {v['median']}, p90 {v['p90']}, max {v['max']} "
                  f"({v['grammars']} grammars)" for k, v in compile_ms.items()), ""]  # fmt: skip
    return lines


def mask_sentence(phases: dict[str, float], extra: list[str]) -> str:
    """The engine's mask phases (names outside BASE_PHASES): filling the masks, which may
    overlap the forward, against the sampler's wait for them."""
    if not extra:
        return "The engine reports no mask phase."
    fill = sum(phases[p] for p in extra if "fill" in p)
    wait = sum(phases[p] for p in extra if "wait" in p)
    hidden = f"; {100 * (1 - wait / fill):.0f}% of the filling hidden" if fill else ""
    return (f"Mask phases ({', '.join(extra)}), constrained: filling {fill:.2f} ms per step, "
            f"the sampler waiting {wait:.2f} ms per step{hidden}.")  # fmt: skip


def speculation_lines(spec: dict[str, Any], jump: dict[str, Any]) -> list[str]:
    lines = ["## 3. Speculation exactness (greedy, n-gram k = 4)", ""]
    if spec["supported"]:
        lines.append(f"{spec['equal']} / {spec['total']} outputs equal the non-speculative "
                     f"constrained ones token for token; acceptance rate "
                     f"{spec['spec'].get('spec_decode_acceptance_rate', 0):.2f}.")  # fmt: skip
    else:
        lines.append(spec["error"])
    lines += ["", "## 4. Jump-forward (long fixed keys, one line of JSON, each request alone)", "",
              f"Without: {jump['off']['tokens_per_step']:.2f} output tokens per engine step "
              f"({jump['off']['tokens_per_s']:.1f} tokens/s)."]  # fmt: skip
    if jump["supported"]:
        lines.append(f"With {jump['config']}: {jump['on']['tokens_per_step']:.2f} tokens per "
                     f"step ({jump['on']['tokens_per_s']:.1f} tokens/s); outputs equal: "
                     f"{jump['equal']} / {jump['requests']}.")  # fmt: skip
    else:
        lines.append(f"With jump-forward: {jump['error']}")
    return lines
