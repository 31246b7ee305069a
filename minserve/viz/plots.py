"""Chapter 00's pictures: next-token distributions, the sampler's filters, decode speed.

Figures are built with `matplotlib.figure.Figure` (no pyplot), so they work under any
backend, in a notebook, a test run or a script that saves them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from matplotlib.figure import Figure

from minserve.model.sampler import Sampler
from minserve.model.tokenizer import Tokenizer
from minserve.viz.naive import Generation

KEPT, DROPPED = "tab:blue", "lightgrey"


def token_labels(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[str]:
    """Each token as quoted text, so a leading space shows: "' Paris'"."""
    return [repr(tokenizer.decode([i])) for i in token_ids]


def plot_temperature(
    logits: torch.Tensor,
    tokenizer: Tokenizer,
    temperatures: Sequence[float] = (0.5, 1.0, 2.0),
    num_tokens: int = 8,
) -> Figure:
    """The most likely next tokens under softmax(logits / T) for a few temperatures T.

    Below 1 the distribution sharpens toward the argmax; above 1 it flattens.
    """
    top_ids = logits.topk(num_tokens).indices  # [num_tokens]
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(temperatures)
    for i, t in enumerate(temperatures):
        probs = (logits / t).softmax(-1)[top_ids]  # [num_tokens]
        xs = [x + (i - (len(temperatures) - 1) / 2) * width for x in range(num_tokens)]
        ax.bar(xs, probs.tolist(), width, label=f"T = {t:g}")
    ax.set_xticks(range(num_tokens), token_labels(tokenizer, top_ids.tolist()), rotation=30)
    ax.set_ylabel("probability")
    ax.set_title("Temperature reshapes the next-token distribution")
    ax.legend()
    return fig


def filter_masks(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float, sampler: Sampler | None = None
) -> dict[str, torch.Tensor]:
    """Which tokens each filter keeps on its own: {title: bool [vocab]}.

    Uses the sampler's own filters (pass `Sampler.from_module(your_module)` to see yours).
    """
    sampler = sampler or Sampler()
    row = logits.float().unsqueeze(0)  # [1, vocab]
    kept = {
        f"top-k, k = {top_k}": sampler.top_k_fn(row, torch.tensor([top_k])),
        f"top-p, p = {top_p:g}": sampler.top_p_fn(row, torch.tensor([top_p])),
        f"min-p, min_p = {min_p:g}": sampler.min_p_fn(row, torch.tensor([min_p])),
    }
    return {title: filtered[0].isfinite() for title, filtered in kept.items()}  # [vocab] each


def plot_sampling_filters(
    logits: torch.Tensor,
    tokenizer: Tokenizer,
    top_k: int = 5,
    top_p: float = 0.9,
    min_p: float = 0.1,
    sampler: Sampler | None = None,
    num_tokens: int = 15,
) -> Figure:
    """One panel per filter: the most likely tokens, kept ones in colour, dropped ones grey."""
    probs = logits.float().softmax(-1)  # [vocab]
    top_ids = probs.topk(num_tokens).indices  # [num_tokens]
    labels = token_labels(tokenizer, top_ids.tolist())
    masks = filter_masks(logits, top_k, top_p, min_p, sampler)
    fig = Figure(figsize=(12, 3.5), layout="constrained")
    for ax, (title, mask) in zip(fig.subplots(1, len(masks), sharey=True), masks.items()):
        colours = [KEPT if mask[i] else DROPPED for i in top_ids.tolist()]
        ax.bar(range(num_tokens), probs[top_ids].tolist(), color=colours)
        ax.set_xticks(range(num_tokens), labels, rotation=90)
        kept = int(mask.sum())
        ax.set_title(f"{title}: keeps {kept} token{'' if kept == 1 else 's'}")
    fig.axes[0].set_ylabel("probability")
    return fig


def plot_step_times(runs: Mapping[str, Generation]) -> Figure:
    """Step time against the number of tokens in context, one line per generation loop."""
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.subplots()
    for label, run in runs.items():
        ax.plot(run.context_lengths, [s * 1e3 for s in run.step_seconds], marker=".", label=label)
    ax.set_xlabel("tokens in context")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("One more token: recompute everything, or reuse the KV cache")
    ax.legend()
    return fig


def plot_decode_rates(
    rates: Mapping[str, float], floors: Mapping[str, float] | None = None
) -> Figure:
    """Measured decode tokens/s per setting as bars, each with its bandwidth floor dashed."""
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    names = list(rates)
    bars = ax.bar(names, [rates[n] for n in names], color=KEPT, label="measured")
    ax.bar_label(bars, fmt="%.1f")
    floored = [(i, name) for i, name in enumerate(names) if floors and name in floors]
    for j, (i, name) in enumerate(floored):
        label = "bandwidth floor" if j == 0 else None
        ax.hlines(floors[name], i - 0.4, i + 0.4, colors="black", linestyles="--", label=label)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode speed against the memory-bandwidth floor")
    ax.legend(loc="upper left")
    return fig
