"""Chapter 02's timing picture: attention backends side by side, per batch size."""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure


def plot_backend_times(
    times: Mapping[str, Mapping[int, float]],
    title: str,
    unit: str = "microseconds per layer",
    group: str = "batch",
) -> Figure:
    """Grouped bars: times {backend: {batch size: time in `unit`}}, one group per batch."""
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.subplots()
    names = list(times)
    batches = list(next(iter(times.values())))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [b + (i - (len(names) - 1) / 2) * width for b in range(len(batches))]
        bars = ax.bar(xs, [times[name][b] for b in batches], width, label=name)
        ax.bar_label(bars, fmt="%.0f")
    ax.set_xticks(range(len(batches)), [f"{group} {b}" for b in batches])
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.margins(y=0.12)  # room for the bars' labels
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # beside: hides no bar
    return fig
