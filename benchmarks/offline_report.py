"""The offline-throughput report: ratios between peers, then JSON, a markdown table and a plot.

Ratios compare engines in the same dtype: `vs vLLM` is a row's output tokens/s over vLLM's
in that dtype, and likewise for HF `generate` with static batches of 16 and of 64.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minserve.bench.offline import OfflineResult

PEER_LABELS = {
    "minserve": "minserve (paged engine)",
    "reference": "minserve (reference path)",
    "hf16": "HF generate, static batches of 16",
    "hf64": "HF generate, static batches of 64",
    "vllm": "vLLM CPU 0.32.0",
}
BASELINES = {"vllm": "vs vLLM", "hf16": "vs HF static 16", "hf64": "vs HF static 64"}
TARGETS = {"vllm": 1.0, "hf16": 3.0, "hf64": 3.0}  # minserve's paged engine, its goals


@dataclass(frozen=True)
class OfflineReport:
    """Everything one `python -m benchmarks.offline_throughput` run measured, and how."""

    command: str
    date: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    results: list[OfflineResult]

    def result(self, peer: str, dtype: str) -> OfflineResult | None:
        """The successful run of `peer` in `dtype`, if there is one."""
        found = [r for r in self.results if r.peer == peer and r.dtype == dtype and r.ok]
        return found[0] if found else None

    def ratios(self, row: OfflineResult) -> dict[str, float | None]:
        """`row`'s tokens/s over each baseline's in the same dtype (None: no such run)."""
        out: dict[str, float | None] = {}
        for baseline in BASELINES:
            base = self.result(baseline, row.dtype)
            out[baseline] = row.tokens_per_s / base.tokens_per_s if base and row.ok else None
        return out

    def to_dict(self) -> dict[str, Any]:
        results = [
            {**r.to_dict(), "ratios": _rounded(self.ratios(r))} for r in self.results
        ]  # fmt: skip
        return {
            "command": self.command,
            "date": self.date,
            "machine": self.machine,
            "settings": self.settings,
            "results": results,
        }


def label(peer: str) -> str:
    """The peer's name in the table and the plot."""
    return PEER_LABELS.get(peer, peer)


def _rounded(ratios: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 3) for k, v in ratios.items()}


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table_row(report: OfflineReport, r: OfflineResult) -> str:
    """One markdown table row: engine, dtype, throughput, tokens, time, ratios, notes."""
    if not r.ok:
        return f"| {label(r.peer)} | {r.dtype} | {r.status} | | | | | | | {r.note} |"
    ratios = report.ratios(r)
    cells = [
        label(r.peer),
        r.dtype,
        f"{r.tokens_per_s:.1f}",
        f"{r.output_tokens} / {r.generated_tokens}",
        f"{r.seconds:.1f}",
        *(_ratio_cell(ratios[b]) for b in BASELINES),
        str(r.details.get("load_average_start", "-")),
        r.note,
    ]
    return "| " + " | ".join(cells) + " |"


def headline(report: OfflineReport) -> list[str]:
    """minserve's paged engine against the targets, one line per dtype it ran in."""
    lines = []
    for r in report.results:
        if r.peer != "minserve" or not r.ok:
            continue
        ratios = report.ratios(r)
        parts = [
            f"{_ratio_cell(ratios[b])} {PEER_LABELS[b]} (target {TARGETS[b]:g}x)"
            for b in BASELINES
            if ratios[b] is not None
        ]
        lines.append(f"- minserve {r.dtype}: {r.tokens_per_s:.1f} tok/s; " + "; ".join(parts))
    return lines


def markdown(report: OfflineReport) -> str:
    """The report as a markdown page: settings, machine, the table, the headline."""
    s, m = report.settings, report.machine
    lines = [
        "# Offline throughput (nano-vllm's protocol, on a CPU)",
        "",
        f"- command: `{report.command}`",
        f"- date: {report.date}",
        f"- machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"{m.get('torch_threads', '?')} torch threads; 1-min load average "
        f"{m.get('load_average_start', '?')} at start, {m.get('load_average_end', '?')} at end",
        f"- model: {s.get('model', '?')}",
        f"- workload: {s['num_requests']} requests, prompt and output lengths uniform in "
        f"[{s['min_len']}, {s['max_len']}] (seed {s['seed']}), random token ids, ignore_eos, "
        f"temperature {s['temperature']} (nano-vllm's); {s['requested_tokens']} output tokens",
        "- throughput: requested output tokens / wall time of the generate call (loading and "
        "warm-up excluded); each engine ran in its own process, one after another",
        "",
        "| engine | dtype | output tok/s | useful / generated tokens | generate s | "
        + " | ".join(BASELINES.values())
        + " | load at start | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *(table_row(report, r) for r in report.results),
        "",
        *headline(report),
        "",
        "Ratios compare runs in the same dtype. Static batches decode every row to the",
        "batch's longest request, so HF generates more tokens than are useful; only the",
        "requested ones count. Per-run details (threads, load, steps, preemptions) are in",
        "the JSON file.",
        "",
    ]
    return "\n".join(lines)


def write_plot(report: OfflineReport, path: Path) -> Path | None:
    """A grouped bar chart of tokens/s per engine and dtype; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    peers = list(dict.fromkeys(r.peer for r in report.results))
    dtypes = list(dict.fromkeys(r.dtype for r in report.results))
    width = 0.8 / len(dtypes)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, dtype in enumerate(dtypes):
        values = [(report.result(p, dtype) or OfflineResult(p, dtype)).tokens_per_s for p in peers]
        xs = [x + (i - (len(dtypes) - 1) / 2) * width for x in range(len(peers))]
        bars = ax.bar(xs, values, width, label=dtype)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "n/a" for v in values], fontsize=8)
    ax.set_xticks(range(len(peers)), [label(p) for p in peers], fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Offline throughput, {report.settings['num_requests']} requests, CPU")
    ax.legend(title="dtype")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(report: OfflineReport, base: Path) -> list[Path]:
    """Write base.json, base.md and base.png (when matplotlib is there); the paths written."""
    base.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = base.with_suffix(".json"), base.with_suffix(".md")
    json_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    md_path.write_text(markdown(report))
    png = write_plot(report, base.with_suffix(".png"))
    return [json_path, md_path, *([png] if png else [])]
