"""Chapter 04's budget explorer: what the token budget does to TTFT and ITL.

A step's time is modelled as a line in the tokens it computes, `StepCost`, fitted to
steps measured on the real engine (`StepTrace`s from `minserve.viz.step_trace`). Then
`simulate_chunked` replays chapter 04's scenario for any budget (streams decoding, a long
prompt arriving) with the scheduler's own rule for sharing the budget
(`minserve.scheduler.budget.prefill_chunk`, or yours), and reads the long prompt's time
to first token (TTFT) and the streams' inter-token latency (ITL) off the simulated trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from minserve.scheduler.budget import prefill_chunk
from minserve.viz.step_trace import ScheduledWork, StepTrace, TracedStep

ChunkRule = Callable[[int, int, bool], int]


@dataclass(frozen=True)
class StepCost:
    """A step's seconds as `fixed_s + per_token_s * tokens` (reading the weights, then the
    work that grows with the batch)."""

    fixed_s: float
    per_token_s: float

    @classmethod
    def fit(cls, steps: Sequence[TracedStep]) -> StepCost:
        """Least squares over measured steps (their tokens against their durations)."""
        tokens = np.array([step.num_tokens for step in steps], dtype=float)
        seconds = np.array([step.duration for step in steps])
        per_token, fixed = np.polyfit(tokens, seconds, 1)
        return cls(max(float(fixed), 0.0), max(float(per_token), 0.0))

    def seconds(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens


@dataclass(frozen=True)
class Scenario:
    """Streams already decoding; a long prompt ("doc") arrives before step `arrival_step`."""

    num_streams: int = 4
    stream_tokens: int = 20  # tokens each stream still generates
    prompt_len: int = 256
    doc_tokens: int = 4  # tokens the long prompt generates
    arrival_step: int = 4


def simulate_chunked(
    scenario: Scenario,
    budget: int | None,
    cost: StepCost,
    rule: ChunkRule = prefill_chunk,
) -> StepTrace:
    """The scenario under a token budget (None: no chunking, the prompt in one step).

    Each step the decodes ask `rule` for their token first, then the long prompt for what
    it still needs; the step lasts `cost.seconds(tokens)`.
    """
    chunked = budget is not None
    limit = budget if budget is not None else scenario.prompt_len + scenario.num_streams + 1
    left_to_decode = {f"s{i}": scenario.stream_tokens for i in range(scenario.num_streams)}
    prompt_left, trace = scenario.prompt_len, StepTrace()
    while any(left_to_decode.values()) or prompt_left or left_to_decode.get("doc"):
        step = len(trace.steps)
        added = tuple(left_to_decode) if step == 0 else ()
        if step == scenario.arrival_step:
            added = ("doc",)
        work, left = [], limit
        for request_id, to_go in left_to_decode.items():
            if to_go and rule(1, left, chunked) == 1:
                work.append(ScheduledWork(request_id, 1, is_decode=True))
                left -= 1
        chunk = 0
        if step >= scenario.arrival_step and prompt_left:
            chunk = rule(prompt_left, left, chunked)
            if chunk:
                work.append(ScheduledWork("doc", chunk, is_decode=False))
        if not work:
            raise ValueError(
                f"step {step} computed nothing: the rule gave no tokens (budget {limit})"
            )
        sampled = tuple(w.request_id for w in work if w.is_decode)
        for request_id in sampled:
            left_to_decode[request_id] -= 1
        if chunk and chunk == prompt_left:  # the prompt's last chunk samples its first token
            sampled += ("doc",)
            left_to_decode["doc"] = scenario.doc_tokens - 1
        prompt_left -= chunk
        duration = cost.seconds(sum(w.num_tokens for w in work))
        trace.steps.append(TracedStep(duration, tuple(work), sampled=sampled, added=added))
    return trace


@dataclass(frozen=True)
class Latencies:
    """What one budget gives: the long prompt's TTFT and the streams' ITL (seconds)."""

    ttft: float
    itl_median: float
    itl_max: float

    @classmethod
    def of(cls, trace: StepTrace, stream_ids: Sequence[str], doc: str = "doc") -> Latencies:
        gaps = sorted(g for r in stream_ids for g in trace.inter_token_latencies(r))
        return cls(trace.time_to_first_token(doc), gaps[len(gaps) // 2], gaps[-1])


def sweep(
    scenario: Scenario, budgets: Sequence[int], cost: StepCost, rule: ChunkRule = prefill_chunk
) -> list[Latencies]:
    streams = [f"s{i}" for i in range(scenario.num_streams)]
    return [Latencies.of(simulate_chunked(scenario, b, cost, rule), streams) for b in budgets]


def plot_budget(
    scenario: Scenario,
    budget: int,
    cost: StepCost,
    budgets: Sequence[int] = tuple(range(8, 257, 8)),
    rule: ChunkRule = prefill_chunk,
) -> Figure:
    """Left: the streams' ITL over time at `budget` and without chunking. Right: the long
    prompt's TTFT and the streams' worst ITL for every budget, `budget` marked."""
    streams = [f"s{i}" for i in range(scenario.num_streams)]
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    runs = [(f"budget {budget}", budget, "tab:green"), ("no chunking", None, "tab:red")]
    for label, b, color in runs:
        trace = simulate_chunked(scenario, b, cost, rule)
        for i, request_id in enumerate(streams):
            times = trace.token_times(request_id)[1:]
            gaps = [1000 * g for g in trace.inter_token_latencies(request_id)]
            left.plot(times, gaps, ".-", color=color, alpha=0.7, label=label if i == 0 else None)
    left.set(xlabel="seconds (simulated)", ylabel="streams' ITL (ms)", ylim=(0, None))
    left.set_title("Streams' inter-token latency", loc="left")
    left.legend()
    points = sweep(scenario, budgets, cost, rule)
    right.plot(
        budgets, [p.ttft for p in points], "-", color="tab:orange", label="long prompt's TTFT"
    )
    right.plot(
        budgets, [p.itl_max for p in points], "-", color="tab:blue", label="streams' worst ITL"
    )
    mark = Latencies.of(simulate_chunked(scenario, budget, cost, rule), streams)
    right.plot([budget, budget], [mark.ttft, mark.itl_max], "o", color="black")
    right.axvline(budget, color="black", linewidth=0.8, linestyle="--")
    right.set(xlabel="token budget (max_num_batched_tokens)", ylabel="seconds", ylim=(0, None))
    right.set_title(
        f"budget {budget}: TTFT {mark.ttft:.2f} s, worst ITL {1000 * mark.itl_max:.0f} ms",
        loc="left",
    )
    right.legend()
    return fig


def budget_explorer(
    scenario: Scenario, cost: StepCost, start: int = 32, rule: ChunkRule = prefill_chunk
) -> object:
    """A slider over the token budget redrawing `plot_budget` (needs a live kernel)."""
    import ipywidgets as widgets
    from IPython.display import display

    slider = widgets.IntSlider(value=start, min=8, max=256, step=4, description="budget")
    view = widgets.Output()

    def draw(budget: int) -> None:
        view.clear_output(wait=True)
        with view:
            display(plot_budget(scenario, budget, cost, rule=rule))

    slider.observe(lambda change: draw(change["new"]), names="value")
    draw(start)
    return widgets.VBox([slider, view])
