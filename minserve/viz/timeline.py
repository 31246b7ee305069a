"""Chapters 03 and 04's pictures: who ran in which step, and how long streams waited.

Both read a `StepTrace` (`minserve.viz.step_trace`), recorded on the real engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from minserve.viz.step_trace import StepTrace

PREFILL, DECODE, PREEMPTED = "tab:orange", "tab:blue", "tab:red"
Axis = Literal["step", "time"]


def plot_timelines(traces: Mapping[str, StepTrace], x: Axis = "step") -> Figure:
    """One timeline per trace, stacked on a shared x axis (steps, or seconds of engine time).

    A row per request; a cell per step it ran in: orange for prefill (the cell shows
    how many tokens), blue for decode; a red cross where it was preempted.
    """
    rows = max(len(trace.request_ids) for trace in traces.values())
    fig = Figure(figsize=(10, 0.9 + 0.32 * rows * len(traces)), layout="constrained")
    axes = fig.subplots(len(traces), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, trace) in zip(axes, traces.items()):
        draw_timeline(ax, trace, x)
        ax.set_title(f"{title}: {len(trace.steps)} steps, {trace.wall_time:.1f} s", loc="left")
    axes[-1].set_xlabel("engine step" if x == "step" else "seconds (engine time)")
    axes[0].legend(handles=_legend(), loc="upper right", fontsize="small")
    return fig


def draw_timeline(ax: Axes, trace: StepTrace, x: Axis = "step") -> None:
    """Draw one trace's timeline on `ax` (rows: requests in the order they were added)."""
    row = {request_id: i for i, request_id in enumerate(trace.request_ids)}
    starts = trace.starts if x == "time" else list(range(len(trace.steps)))
    widths = [s.duration for s in trace.steps] if x == "time" else [1.0] * len(trace.steps)
    for start, width, step in zip(starts, widths, trace.steps):
        for work in step.scheduled:
            color = DECODE if work.is_decode else PREFILL
            ax.broken_barh([(start, width)], (row[work.request_id] - 0.4, 0.8), color=color)
            if not work.is_decode and x == "step":
                center = (start + width / 2, row[work.request_id])
                ax.text(*center, str(work.num_tokens), ha="center", va="center", fontsize=7)
        for request_id in step.preempted:
            ax.plot(start + width / 2, row[request_id], "x", color=PREEMPTED, markersize=8)
    ax.set_yticks(range(len(row)), list(row))
    ax.set_ylim(len(row) - 0.5, -0.5)  # first request on top
    ax.set_ylabel("request")


def _legend() -> list[Patch | Line2D]:
    return [
        Patch(color=PREFILL, label="prefill (tokens)"),
        Patch(color=DECODE, label="decode"),
        Line2D([], [], marker="x", color=PREEMPTED, linestyle="", label="preempted"),
    ]


def plot_inter_token_latency(
    traces: Mapping[str, StepTrace], request_ids: Sequence[str], mark: str | None = None
) -> Figure:
    """Inter-token latency of `request_ids` against time, one colour per trace.

    A point is a token: when it came out, and how long after the request's previous one.
    The line steps: a gap is the wait that ends at its token, so a stall is a wall, not a
    ramp from the token before. `mark` names a request whose arrival is drawn as a dashed
    line.
    """
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax = fig.subplots()
    for (label, trace), color in zip(traces.items(), ["tab:red", "tab:green", "tab:purple"]):
        for i, request_id in enumerate(request_ids):
            times = trace.token_times(request_id)[1:]
            gaps = [1000 * g for g in trace.inter_token_latencies(request_id)]
            ax.step(
                times,
                gaps,
                ".-",
                where="pre",
                color=color,
                alpha=0.7,
                label=label if i == 0 else None,
            )
        if mark is not None:
            ax.axvline(trace.arrival_time(mark), color=color, linestyle="--", linewidth=1)
    ax.set_xlabel("seconds (engine time)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("Decode streams while a long prompt arrives" if mark else "Inter-token latency")
    return fig
