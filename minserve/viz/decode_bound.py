"""One decode step's time against its two floors: reading the weights, doing the math.

The step's arithmetic is one multiply-add per weight (batch 1); its memory traffic is
every weight once. Whichever floor is higher bounds the step: for decoding, memory.
"""

from __future__ import annotations

from matplotlib.figure import Figure


def plot_decode_bound(step_s: float, read_s: float, math_s: float) -> Figure:
    """Horizontal bars, in milliseconds: the measured step, the memory floor, the compute floor."""
    labels = ["measured decode step", "read every weight once", "every multiply-add"]
    values = [step_s * 1e3, read_s * 1e3, math_s * 1e3]
    fig = Figure(figsize=(7, 2.2), layout="constrained")  # shown once, as the cell's value
    ax = fig.subplots()
    ax.barh(labels[::-1], values[::-1], color=["tab:green", "tab:blue", "tab:grey"])
    for y, value in enumerate(values[::-1]):
        ax.text(value, y, f" {value:.2f} ms", va="center", fontsize=8)
    ax.set_xlabel("milliseconds per decode step (batch 1)")
    ax.set_xlim(0, max(values) * 1.25)
    ax.set_title("Decoding is memory-bound: reading the weights, not the arithmetic, sets the pace")
    return fig
