"""Chapter 01's pictures: contiguous against paged KV layouts, block tables, utilization.

The layouts are drawn from real `BlockTable`s and the numbers from
`minserve.viz.kv_utilization`, so a picture shows exactly what the engine does.
Figures are built with `matplotlib.figure.Figure` (no pyplot).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_table import BlockTable
from minserve.viz.kv_utilization import EngineRun, Utilization

FREE = to_rgba("whitesmoke")
EMPTY_ALPHA = 0.22  # reserved but holding no token


def _colour(i: int, filled: bool = True) -> tuple[float, float, float, float]:
    return to_rgba(f"C{i % 10}", 1.0 if filled else EMPTY_ALPHA)


def _filled(table: BlockTable, logical: int) -> int:
    """Tokens in logical block `logical` of `table`."""
    return min(table.block_size, table.num_tokens - logical * table.block_size)


def _grid(ax: Axes, width: int, height: int, every: int = 1) -> None:
    """White lines between cells, thicker every `every` columns (block boundaries)."""
    ax.set_xticks([])
    ax.set_yticks([])
    for x in range(width + 1):
        ax.axvline(x - 0.5, color="white", linewidth=2.0 if x % every == 0 else 0.5)
    for y in range(height + 1):
        ax.axhline(y - 0.5, color="white", linewidth=2.0)


def plot_fragmentation(
    tables: Mapping[str, BlockTable], num_blocks: int, reserve: int, blocks_per_row: int = 4
) -> Figure:
    """The same sequences in contiguous buffers of `reserve` slots (left) and in a paged pool
    of `num_blocks` blocks (right). Solid: slots holding a token; pale: reserved, empty."""
    names, block_size = list(tables), next(iter(tables.values())).block_size
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[reserve, blocks_per_row * block_size])

    contiguous = np.tile(np.array(FREE), (len(names), reserve, 1))  # [seqs, reserve, RGBA]
    for i, table in enumerate(tables.values()):
        contiguous[i, :] = _colour(i, filled=False)
        contiguous[i, : table.num_tokens] = _colour(i)
    stored = sum(t.num_tokens for t in tables.values())
    left.imshow(contiguous, aspect="auto")
    _grid(left, reserve, len(names))
    left.set_yticks(range(len(names)), names)
    left.set_title(
        f"contiguous: {reserve} slots per sequence, {stored}/{len(names) * reserve} used "
        f"({stored / (len(names) * reserve):.0%})"
    )

    rows = -(-num_blocks // blocks_per_row)
    pool = np.tile(np.array(FREE), (rows, blocks_per_row * block_size, 1))  # [rows, slots, RGBA]
    for i, table in enumerate(tables.values()):
        for logical, block in enumerate(table.blocks):
            row, x0 = divmod(block, blocks_per_row)
            x0 *= block_size
            pool[row, x0 : x0 + block_size] = _colour(i, filled=False)
            pool[row, x0 : x0 + _filled(table, logical)] = _colour(i)
    right.imshow(pool, aspect="auto")
    _grid(right, blocks_per_row * block_size, rows, every=block_size)
    for block in range(num_blocks):
        row, col = divmod(block, blocks_per_row)
        right.text(col * block_size - 0.3, row - 0.3, str(block), fontsize=7, va="top")
    used = sum(len(t.blocks) for t in tables.values())
    right.set_title(
        f"paged: {used} of {num_blocks} blocks of {block_size}, {stored}/{used * block_size} "
        f"used ({stored / (used * block_size):.0%})"
    )
    legend = [Patch(color=_colour(i), label=name) for i, name in enumerate(names)]
    legend.append(Patch(color=_colour(0, filled=False), label="reserved, empty"))
    fig.legend(handles=legend, loc="outside lower center", ncols=len(legend))
    return fig


def plot_block_tables(
    tables: Mapping[str, BlockTable], num_blocks: int, allocator: BlockAllocator | None = None
) -> Figure:
    """Each sequence's logical blocks (top row, side by side) and the physical blocks of the
    pool they map to (bottom row). A block shared by several sequences (after a fork) has an
    arrow from each; with `allocator`, each physical block shows its reference count."""
    starts, x = [], 0
    for table in tables.values():
        starts.append(x)
        x += len(table.blocks) + 1  # a gap between sequences
    width = max(num_blocks, x - 1)
    fig = Figure(figsize=(max(6.0, 0.75 * width), 2.6), layout="constrained")
    ax = fig.subplots()
    owners: dict[int, list[int]] = {}
    for i, ((name, table), x0) in enumerate(zip(tables.items(), starts)):
        ax.text(x0, 2.75, name, va="bottom")
        for logical, block in enumerate(table.blocks):
            owners.setdefault(block, []).append(i)
            ax.add_patch(Rectangle((x0 + logical, 2), 0.9, 0.7, color=_colour(i, filled=False)))
            label = f"L{logical}\n{_filled(table, logical)}/{table.block_size}"
            ax.text(x0 + logical + 0.45, 2.35, label, ha="center", va="center", fontsize=8)
            ax.annotate(
                "", xy=(block + 0.45, 0.75), xytext=(x0 + logical + 0.45, 1.98),
                arrowprops={"arrowstyle": "->", "color": _colour(i)},
            )  # fmt: skip
    for block in range(num_blocks):
        held = owners.get(block, [])
        colour = _colour(held[0]) if len(held) == 1 else ("grey" if held else FREE)
        ax.add_patch(Rectangle((block, 0), 0.9, 0.7, color=colour))
        ax.text(block + 0.45, 0.35, str(block), ha="center", va="center", fontsize=9)
        if allocator is not None:
            ax.text(block + 0.45, -0.2, f"ref {allocator.refcount(block)}", ha="center",
                    va="center", fontsize=7)  # fmt: skip
    ax.text(-0.2, 0.35, "pool", ha="right", va="center")
    ax.set_xlim(-1.2, width + 0.2)
    ax.set_ylim(-0.45, 3.1)
    ax.set_axis_off()
    ax.set_title("block tables: logical block -> physical block (grey: shared)")
    return fig


def plot_utilization(results: Sequence[Utilization]) -> Figure:
    """Per layout: tokens stored / slots reserved, and how many requests the budget holds."""
    fig = Figure(figsize=(11, 0.6 + 0.55 * len(results)), layout="constrained")
    left, right = fig.subplots(1, 2, sharey=True)
    labels = [r.label for r in results]
    colours = [_colour(i) for i in range(len(results))]
    bars = left.barh(labels, [100 * r.utilization for r in results], color=colours)
    left.bar_label(bars, fmt="%.1f%%", padding=3)
    left.set_xlim(0, 115)
    left.set_xlabel("tokens stored / slots reserved (%)")
    left.invert_yaxis()
    bars = right.barh(labels, [r.requests_fit for r in results], color=colours)
    right.bar_label(bars, padding=3)
    right.set_xlabel(f"requests that fit {results[0].budget_tokens} KV slots at once")
    right.set_xlim(0, 1.15 * max(r.requests_fit for r in results))
    return fig


def plot_engine_run(run: EngineRun) -> Figure:
    """A real engine run, step by step: the pool's tokens and allocated slots (left), and its
    utilization against contiguous buffers for the same sequences (right)."""
    steps = range(1, len(run.snapshots) + 1)
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(steps, [s.slots_reserved for s in run.snapshots], label="slots in allocated blocks")
    left.plot(steps, [s.tokens_stored for s in run.snapshots], label="tokens stored")
    left.axhline(run.pool_slots, color="black", linestyle="--", label="pool size")
    left.set_xlabel("engine step")
    left.set_ylabel("KV slots")
    left.legend()
    right.plot(steps, [100 * s.utilization for s in run.snapshots], label="paged (measured)")
    by_layout: dict[str, list[float]] = {}
    for snapshot in run.snapshots:
        for label, value in run.contiguous_utilization(snapshot).items():
            by_layout.setdefault(label, []).append(100 * value)
    for label, values in by_layout.items():
        right.plot(steps, values, label=f"{label} (same sequences)")
    right.set_ylim(0, 105)
    right.set_xlabel("engine step")
    right.set_ylabel("tokens stored / slots reserved (%)")
    right.legend(loc="best", fontsize="small")
    return fig
