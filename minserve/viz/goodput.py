"""Chapter 09's goodput picture: each request's TTFT against its TPOT, and the SLO boxes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle


def plot_slo_boxes(
    ttft_ms: Sequence[float], tpot_ms: Sequence[float], slos_ms: Mapping[str, tuple[float, float]]
) -> Figure:
    """One dot per request (TTFT, TPOT in ms); one box per SLO {label: (ttft ms, tpot ms)}.

    A request counts towards an SLO's goodput when its dot lies inside that box.
    """
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    ax.scatter(ttft_ms, tpot_ms, color="black", zorder=3, label="requests")
    for (label, (ttft, tpot)), color in zip(slos_ms.items(), ["tab:red", "tab:green", "tab:blue"]):
        ax.add_patch(Rectangle((0, 0), ttft, tpot, fill=False, ec=color, lw=2, label=label))
    most_ttft = max([*ttft_ms, *(t for t, _ in slos_ms.values())])
    most_tpot = max([*tpot_ms, *(p for _, p in slos_ms.values())])
    ax.set(xlim=(0, 1.1 * most_ttft), ylim=(0, 1.1 * most_tpot), xlabel="TTFT (ms)",
           ylabel="TPOT (ms)", title="a request is good inside the box of its SLO")  # fmt: skip
    ax.legend(fontsize=8)
    return fig
