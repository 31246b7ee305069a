"""Chapter 03's step explorer: one step of a schedule, and where it sits in the run.

Left, the run's timeline (`minserve.viz.timeline`) with the chosen step highlighted.
Right, that step's batch as a bar of the token budget: which request runs how many
tokens (decodes blue, prefill chunks orange), the budget line, and the seats it fills.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from minserve.viz.step_trace import StepTrace
from minserve.viz.timeline import DECODE, PREFILL, draw_timeline


def plot_step(trace: StepTrace, index: int, budget: int, seats: int) -> Figure:
    """The timeline of `trace` with step `index` highlighted, and that step's batch."""
    if not 0 <= index < len(trace.steps):
        raise IndexError(f"step {index} is not in this trace of {len(trace.steps)} steps")
    step = trace.steps[index]
    fig = Figure(figsize=(11, 0.9 + 0.4 * len(trace.request_ids)), layout="constrained")
    timeline, batch = fig.subplots(1, 2, width_ratios=(3, 2))
    draw_timeline(timeline, trace)
    timeline.axvspan(index, index + 1, color="gold", alpha=0.35, zorder=0)
    for edge in (index, index + 1):
        timeline.axvline(edge, color="black", linewidth=1.2)
    timeline.set_xlabel("engine step")
    timeline.set_title(f"step {index} of {len(trace.steps)}", loc="left")
    rows = {request_id: i for i, request_id in enumerate(trace.request_ids)}
    for work in step.scheduled:
        color = DECODE if work.is_decode else PREFILL
        batch.barh(rows[work.request_id], work.num_tokens, color=color)
        kind = "decode" if work.is_decode else "prefill"
        batch.text(
            work.num_tokens, rows[work.request_id], f" {kind} {work.num_tokens}", va="center"
        )
    for request_id in step.preempted:
        batch.text(0, rows[request_id], " preempted", va="center", color="tab:red")
    batch.axvline(budget, color="tab:red", linestyle="--", linewidth=1)
    batch.set_xlim(0, budget * 1.35)
    batch.set_yticks(range(len(rows)), list(rows))
    batch.set_ylim(len(rows) - 0.5, -0.5)
    batch.set_xlabel(f"tokens this step (dashed: the budget, {budget})")
    batch.set_title(
        f"{step.num_tokens} of {budget} tokens, {len(step.scheduled)} of {seats} seats",
        loc="left",
    )
    return fig


def step_explorer(trace: StepTrace, budget: int, seats: int, start: int = 0) -> object:
    """A slider over the steps of `trace`, redrawing `plot_step` (needs a live kernel)."""
    import ipywidgets as widgets
    from IPython.display import display

    slider = widgets.IntSlider(value=start, min=0, max=len(trace.steps) - 1, description="step")
    view = widgets.Output()

    def draw(index: int) -> None:
        view.clear_output(wait=True)
        with view:
            print("\n".join(trace.schedule_lines()[index : index + 1]))
            display(plot_step(trace, index, budget, seats))

    slider.observe(lambda change: draw(change["new"]), names="value")
    draw(start)
    return widgets.VBox([slider, view])
