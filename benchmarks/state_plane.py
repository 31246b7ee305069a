"""The state plane's record: the disk tier, the load-or-recompute rule, KV events, spilling.

    python -m benchmarks.state_plane --threads 2 --max-load 1.5

Runs `minserve.bench.state_plane`'s measurements under a run record and writes
state_plane.{json,md,png}: a returning session's time to first token from disk against
recomputing it (after a restart on the same directory, page cache dropped), the rule's
choice against both paths measured over throttled disks, the router's index kept from KV
events against the engines' own block sets, output tokens/s under memory pressure with
and without the disk tier, streams that survive a killed replica (`minserve.bench.recovery`)
and the gaps a client sees during live migration. `--parts` picks some of them.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchmarks.run_env import (
    RunRecord,
    measure_recorded,
    record_parser,
    save_figure,
    write_results,
)
from minserve.bench import recovery, state_plane
from minserve.bench.options import choices, numbers

PARTS = ("disk", "rule", "events", "spill", "recovery", "migration")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=3, help="disk tier: runs per length (median)")
    p.add_argument("--directory", default="/var/tmp", help="where the disk tiers' files go")
    p.add_argument("--parts", default=",".join(PARTS), help=f"from {', '.join(PARTS)}")
    p.add_argument("--streams", type=int, default=8, help="recovery: streams at once")
    p.add_argument("--prompt-len", type=int, default=600, help="recovery: tokens per prompt")
    p.add_argument("--output-len", type=int, default=200, help="recovery: tokens per stream")
    p.add_argument("--kill-at", type=int, default=50, help="recovery: tokens before the kill")
    p.add_argument("--policy", default="kv_aware", help="recovery: kv_aware or cache_aware")
    p.add_argument("--migration-lengths", default="256,1024,2048", help="migration: contexts")


def measure(args: argparse.Namespace) -> dict:
    from minserve.llm import LLM

    parts = set(choices(args.parts, PARTS, "part"))
    lengths = numbers(args.migration_lengths, int)
    settings = state_plane.Settings(repeats=args.repeats, directory=args.directory,
                                    migration_lengths=lengths)  # fmt: skip
    spec = recovery.RecoverySpec(args.streams, args.prompt_len, args.output_len, args.kill_at,
                                 policy=args.policy, directory=args.directory)  # fmt: skip
    base = LLM(num_blocks=32)  # the bundled model, loaded once; each part builds its engines
    report: dict = {"settings": {"lengths": settings.lengths, "caps_mb_s": settings.caps_mb_s,
                                 "rule_lengths": settings.rule_lengths,
                                 "repeats": settings.repeats, "parts": sorted(parts)}}  # fmt: skip
    if "disk" in parts:
        report["disk_tier"] = state_plane.disk_tier(base, settings)
    if "rule" in parts:
        report["rule"] = state_plane.rule(base, settings)
    if "events" in parts:
        report["events"] = state_plane.events(base, settings)
    if "spill" in parts:
        report["spill"] = state_plane.spill(base, settings)
    if "recovery" in parts:
        report["recovery"] = recovery.recovery(spec)
    if "migration" in parts:
        report["migration"] = state_plane.migration(base, settings)
    return report


def main(argv: list[str] | None = None) -> int:
    args = record_parser(__spec__.name, __doc__, add_arguments).parse_args(argv)
    record, measured = measure_recorded(__spec__.name, argv, args, measure, args.threads)
    report = {"command": record.command, "date": record.date, "machine": record.machine,
              **measured}  # fmt: skip
    plot = write_plot if "disk_tier" in report else None  # the plot is the disk tier's
    write_results(report, args.output, markdown(report), plot)
    return 0


def markdown(report: dict) -> str:
    record = RunRecord(report["command"], report["date"], report["machine"])
    rows = ["# The state plane: disk tier, load-or-recompute, KV events, spilling, recovery, "
            "migration", "",
            f"- command: `{report['command']}`", f"- date: {report['date']}",
            record.load_line(), ""]  # fmt: skip
    if "disk_tier" in report:
        rows += ["## A returning session's first token, by where its KV comes from", "",
                 "Recompute: a fresh engine. Disk: an engine restarted on the same directory, "
                 "the files' pages dropped from the OS cache. Device: a hit in the pool. "
                 f"Medians of {report['settings']['repeats']} runs; tokens: 16 greedy tokens "
                 "after a disk load vs computed.", "",
                 "| history | recompute | disk | device | disk / recompute | blocks from disk "
                 "| same tokens |",
                 "|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in report["disk_tier"]:
            rows.append(f"| {r['history']} | {r['recompute_s'] * 1e3:.0f} ms | "
                        f"{r['disk_s'] * 1e3:.0f} ms | {r['device_s'] * 1e3:.0f} ms | "
                        f"{r['disk_over_recompute']:.3f} | {r['blocks_loaded']} | "
                        f"{r['same_tokens']} |")  # fmt: skip
        rows.append("")
    if "rule" in report:
        right = [r["right"] for r in report["rule"]]
        rows += ["## The load-or-recompute rule over throttled disks", "",
                 f"The rule chose the faster path in {sum(right)} of {len(right)} cases "
                 f"({sum(right) / len(right):.0%}). Both paths measured with the page cache "
                 "dropped; the cap (`BandwidthCap`) sleeps to honour its bandwidth.", "",
                 "| history | disk cap | load | recompute | faster | rule chose |",
                 "|---:|---:|---:|---:|---|---|"]  # fmt: skip
        for r in report["rule"]:
            cap = "none" if not math.isfinite(r["cap_mb_s"]) else f"{r['cap_mb_s']:g} MB/s"
            mark = "" if r["right"] else " (wrong)"
            rows.append(f"| {r['history']} | {cap} | {r['load_s'] * 1e3:.0f} ms | "
                        f"{r['recompute_s'] * 1e3:.0f} ms | {r['faster']} | "
                        f"{r['chose']}{mark} |")  # fmt: skip
        rows.append("")
    if "events" in report:
        e = report["events"]
        rows += ["## KV events: the index against the engines", "",
                 f"Two engines (device, host and disk tiers) publishing; a mixed workload; "
                 f"one restarted on its directory. Index equal to every engine's block sets, "
                 f"every medium: **{e['exact']}**.", "",
                 "| when | engine | device | host | disk | replays | exact |",
                 "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for when in ("before_restart", "after_restart"):
            for i, c in enumerate(e[when]):
                b = c["blocks"]
                rows.append(f"| {when.replace('_', ' ')} | {i} | {b['device']} | {b['host']} | "
                            f"{b['disk']} | {c['replays']} | {c['exact']} |")  # fmt: skip
        rows.append("")
    if "spill" in report:
        rows += spill_section(report["spill"], report["settings"]["repeats"])
    if "recovery" in report:
        rows += recovery_section(report["recovery"])
    if "migration" in report:
        rows += migration_section(report["migration"])
    return "\n".join(rows) + "\n"


def spill_section(s: dict, repeats: int) -> list[str]:
    rows = ["## Spilling under memory pressure", "",
            "Eight distinct prompts admitted together, decoding greedily (ignore_eos) in a pool "
            "too small for all of them at full length: the scheduler preempts while they "
            "decode. Prefix caching in both modes, so a preempted request takes back what is "
            "still cached on the device; recompute computes what was evicted, disk reads it "
            f"back when the rule says loading wins. Medians of {repeats} runs each, order "
            "alternating.", "",
            "| prompts x tokens | output | blocks | recompute tok/s | disk tok/s | disk / "
            "recompute | preemptions | blocks read from disk | same tokens |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in s["rows"]:
        rec, disk = r["recompute"], r["disk"]
        rows.append(f"| {r['num_requests']} x {r['prompt_len']} | {r['output_len']} | "
                    f"{r['num_blocks']} | {rec['output_tok_s']:.1f} | {disk['output_tok_s']:.1f} "
                    f"| {r['disk_over_recompute']:.2f} | {rec['preemptions']:g} / "
                    f"{disk['preemptions']:g} | {disk['disk_blocks_loaded']:g} | "
                    f"{r['same_tokens']} |")  # fmt: skip
    verdict = "met" if s["met"] else "not met"
    rows += ["", f"Disk at least recompute-only's output tokens/s at every pressure: **{verdict}**",
             ""]  # fmt: skip
    return rows


def _verdicts(targets: dict[str, str], met: dict[str, bool]) -> list[str]:
    return [f"- {text}: **{'met' if met[name] else 'not met'}**" for name, text in targets.items()]


def recovery_section(r: dict) -> list[str]:
    spec, sums = r["spec"], r["recompute"]
    rows = ["## A replica killed mid-stream: its streams go on from the shared disk tier", "",
            f"Two `minserve serve` replicas (bundled model, one torch thread each, prefix "
            f"caching, one `--kv-disk-path` directory, KV events) behind the router "
            f"({spec['policy']}, in this process). {spec['num_streams']} streams at once "
            f"(half greedy, half seeded at temperature {spec['temperature']:g}), distinct "
            f"prompts of {spec['prompt_len']} token ids, {spec['output_len']} tokens each "
            f"(ignore_eos). When every stream had {spec['kill_at']} tokens, the replica serving "
            f"most of them was SIGKILLed; the router continued its streams on the other "
            "(`resume_token_ids`). Oracle: the same requests on two fresh replicas nobody "
            "killed. A stream's stall: the longest gap between its chunks at the client from "
            "the kill on (gaps before it are the prompts' admission, in the oracle too); "
            "longest gap: over the whole stream.", "",
            "| stream | sampling | resumed | identical | stall | longest gap | gap at the resume "
            "| tokens at resume | usable blocks on disk | not written through | recomputed |",
            "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for s in r["streams"]:
        sampling = "greedy" if s["seed"] is None else f"seed {s['seed']}"
        extra = "| | | |"
        if s["resumed"]:
            low, high = s["recomputed"]
            extra = (f"{s['resume_gap_s'] * 1e3:.0f} ms | {s['tokens_at_resume']} | "
                     f"{s['usable_blocks']} | {s['not_written']} | "
                     f"{low if low == high else f'{low}-{high}'}")  # fmt: skip
        rows.append(f"| {s['stream']} | {sampling} | {s['resumed']} | {s['identical']} | "
                    f"{s['stall_s'] * 1e3:.0f} ms | {s['longest_gap_s'] * 1e3:.0f} ms | "
                    f"{extra} |")  # fmt: skip
    rows += ["", "Recompute, from the survivor's counters across the resumes (vLLM's "
             "`prefix_cache_queries` and `prefix_cache_hits`, in prompt tokens: a resumed "
             "request's prompt is its prompt + the tokens generated so far): queries - hits "
             "is what it computed. The blocks each resumed stream could read are those the "
             "shared directory held just after the kill (listed then; the survivor writes "
             "only what it computed, a step later), up to the block of its last token, which "
             "is always computed; everything else was not written through. Hits can only fall "
             "short of those blocks, so the blocks on disk the survivor computed anyway, summed "
             "over the streams, bound each stream's excess. Tokens at resume: counted by the "
             "client (tokens arrived by the kill + 20 ms); their sum should equal the queries "
             "and the router's count. Recomputed, per stream: its tokens not written through, "
             "plus at most the excess summed over the streams (a range when that is not 0).", "",
             f"- resumed streams: {sums['resumed_streams']}; queries {sums['queries']} "
             f"(client: {sums['client_tokens_at_resume']}, router: "
             f"{sums['router_tokens_at_resume']}); hits {sums['hits']} "
             f"({sums['disk_blocks_loaded']} blocks read from disk)",
             f"- recomputed {sums['recomputed']} tokens, of which not written through "
             f"{sums['not_written']}; beyond that: **{sums['beyond_not_written']}** tokens "
             f"(all resumed streams together)",
             f"- longest stall: {r['stall_s'] * 1e3:.0f} ms at a client (longest gap over whole "
             f"streams {r['longest_gap_s'] * 1e3:.0f} ms), "
             f"{r['router_longest_stall_s'] * 1e3:.0f} ms at the router (failure to next "
             f"chunk); the oracle's: stall {r['oracle_stall_s'] * 1e3:.0f} ms, median gap "
             f"{r['oracle_median_gap_s'] * 1e3:.0f} ms", "",
             "Targets:", ""]  # fmt: skip
    return rows + _verdicts(recovery.TARGETS, r["targets"]) + [""]


def migration_section(m: dict) -> list[str]:
    rows = ["## Live migration: what the client sees", "",
            "One request decodes on a 1P2D cluster (bundled model), moves to the other decode "
            "instance by multi-stage pre-copy, then back by stop-and-copy "
            "(`minserve.bench.migration.measure_migration_gaps`). Longest gap: from the order "
            "to the destination's first token; step: the median gap while nothing migrates. "
            "Identical: its tokens against the same prompt on one engine, uninterrupted. "
            "Pools: every instance's free blocks = its blocks afterwards (the counts each "
            "instance reports every round).", "",
            "| context | median step | pre-copy gap | / step | stop-and-copy gap | / step "
            "| pause | blocks pre-copied + final | identical | pools free |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    for r in m["rows"]:
        step, pre, stop = r["median_step_s"], r["pre_copy"], r["stop_and_copy"]
        rows.append(f"| {r['context_len']} | {step * 1e3:.1f} ms | {pre['max_gap_s'] * 1e3:.1f} ms"
                    f" | {pre['max_gap_s'] / step:.2f}x | {stop['max_gap_s'] * 1e3:.1f} ms | "
                    f"{stop['max_gap_s'] / step:.2f}x | {pre['pause_s'] * 1e3:.1f} ms | "
                    f"{pre['blocks_precopied']} + {pre['blocks_final']} | {r['identical']} | "
                    f"{r['pools_free']} |")  # fmt: skip
    rows += ["", f"Pre-copy's longest gaps, max / min over the lengths: {m['spread']:.2f}x.", "",
             "Targets:", ""]  # fmt: skip
    return rows + _verdicts(state_plane.MIGRATION_TARGETS, m["targets"]) + [""]


def write_plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minserve.viz.tiers import plot_first_token_by_tier

    fig, ax = plt.subplots(figsize=(7, 3.5))
    rows = report.get("disk_tier", [])
    lengths = [r["history"] for r in rows]
    seconds = {tier: [r[f"{tier}_s"] for r in rows] for tier in ("recompute", "disk", "device")}
    plot_first_token_by_tier(lengths, seconds, ax)
    return save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
