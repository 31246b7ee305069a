"""Chapter 06's picture: tokens per target forward, the formula against the engine.

With acceptance rate a and g drafts per step, a forward yields on average
(1 - a^(g+1)) / (1 - a) tokens (`draft_length.expected_tokens`). The engine measures its
own a and tokens per forward; each run is a point to set against the curve of its g.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure

from minserve.speculative.draft_length import expected_tokens


@dataclass(frozen=True)
class EnginePoint:
    """One engine run: its draft length and what its metrics measured."""

    draft_length: int
    acceptance_rate: float  # spec_decode_acceptance_rate
    tokens_per_forward: float  # spec_decode_tokens_per_forward


def plot_tokens_per_forward(
    points: Sequence[EnginePoint], acceptance_rate: float = 0.5, draft_length: int = 4
) -> Figure:
    """Curves of the formula over a for each measured g (and the chosen one), the engine's
    points in the same colours, and the chosen (a, g) marked with its expected value."""
    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.add_subplot()
    rates = [i / 100 for i in range(100)]  # [0, 0.99]
    colors = {}
    for g in sorted({p.draft_length for p in points} | {draft_length}):
        style = "-" if g == draft_length else ":"
        (line,) = ax.plot(rates, [expected_tokens(a, g) for a in rates], style, label=f"g = {g}")
        colors[g] = line.get_color()
    for p in points:
        ax.plot(p.acceptance_rate, p.tokens_per_forward, "o", color=colors[p.draft_length], ms=7)
    value = expected_tokens(acceptance_rate, draft_length)
    ax.plot(acceptance_rate, value, "*", color="black", ms=12)
    ax.annotate(f"  a = {acceptance_rate:.2f}, g = {draft_length}: {value:.2f}",
                (acceptance_rate, value), fontsize=8)  # fmt: skip
    ax.set(xlabel="acceptance rate a", ylabel="tokens per target forward", xlim=(0, 1))
    ax.set_title("(1 - a^(g+1)) / (1 - a); dots: the engine's runs", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def tokens_per_forward_widget(points: Sequence[EnginePoint]) -> Any:
    """Sliders for a and g over `plot_tokens_per_forward` (needs a live kernel)."""
    import ipywidgets as widgets  # only where a notebook asks for the widget
    from IPython.display import display

    rate = widgets.FloatSlider(0.5, min=0.0, max=0.99, step=0.01, description="a")
    length = widgets.IntSlider(4, min=1, max=8, description="g")
    view = widgets.Output()

    def redraw(_: object = None) -> None:
        view.clear_output(wait=True)
        with view:
            display(plot_tokens_per_forward(points, rate.value, length.value))

    rate.observe(redraw, "value")
    length.observe(redraw, "value")
    redraw()
    return widgets.VBox([widgets.HBox([rate, length]), view])
