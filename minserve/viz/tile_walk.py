"""Chapter 02's picture of a kernel's tile walk: which slots of the paged K cache it read,
load by load, recorded while Triton's interpreter runs it.

`record_tile_walk` records one launch's loads (`kernel_access.accesses_recorded`) and keeps those
that fall inside the K cache, as (block, offset) slots; `plot_tile_walk` draws the pool,
each slot coloured by the load (or the split) that read it, and `tile_walk_widget` steps
through the loads with a slider. So the picture shows what the kernel did, not what it
should do: a kernel that reads past a context shows the extra slots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minserve.attention.triton_env import interpreting
from minserve.viz.kernel_access import accesses_recorded


@dataclass(frozen=True)
class TileLoad:
    """One `tl.load` of one program: the K-cache slots it read."""

    program: tuple[int, int, int]  # the program's ids on the grid's three axes
    slots: tuple[tuple[int, int], ...]  # (physical block, offset), in the order read


@dataclass(frozen=True)
class TileWalk:
    """Every load of the K cache one kernel launch made, in the order the programs ran."""

    num_blocks: int
    block_size: int
    loads: tuple[TileLoad, ...]

    def slots_read(self) -> set[tuple[int, int]]:
        return {slot for load in self.loads for slot in load.slots}


def record_tile_walk(launch: Callable[[], object], k_cache: torch.Tensor) -> TileWalk:
    """Run `launch()` (a kernel launch, in the interpreter) and record its reads of `k_cache`
    [num_blocks, block_size, Hkv, D] (contiguous)."""
    if not interpreting() or not k_cache.is_contiguous():
        raise ValueError("recording reads needs the interpreter and a contiguous K cache")
    num_blocks, block_size = k_cache.shape[:2]
    base, row = k_cache.data_ptr(), k_cache[0, 0].nbytes  # bytes per (block, offset) slot
    with accesses_recorded() as seen:
        launch()
    loads = []
    for access in (a for a in seen if a.kind == "load"):
        addresses = access.addresses
        inside = addresses[(addresses >= base) & (addresses < base + k_cache.nbytes)]
        slot_index = (inside - base) // row  # [reads]: block * block_size + offset
        ordered = dict.fromkeys(divmod(int(s), block_size) for s in slot_index)
        if ordered:
            loads.append(TileLoad(access.program, tuple(ordered)))
    return TileWalk(num_blocks, block_size, tuple(loads))


def slot_labels(
    tables: Mapping[str, Sequence[int]], lengths: Mapping[str, int], block_size: int
) -> dict[tuple[int, int], str]:
    """Each stored token's slot -> "a7" (sequence a, position 7): what a cell holds."""
    labels = {}
    for name, table in tables.items():
        for pos in range(lengths[name]):
            labels[(table[pos // block_size], pos % block_size)] = f"{name}{pos}"
    return labels


def plot_tile_walk(
    walk: TileWalk,
    labels: Mapping[tuple[int, int], str] | None = None,
    upto: int | None = None,
    colour_by: Literal["load", "split"] = "load",
    title: str = "",
) -> Figure:
    """The pool as a grid (a row per physical block, a column per offset); each slot read
    by the first `upto` loads coloured by the load that read it first (or by its split,
    the program's third id), the last load outlined. Grey: holds a token, never read."""
    loads = walk.loads[: len(walk.loads) if upto is None else upto]
    colour = np.full((walk.num_blocks, walk.block_size), np.nan)  # NaN: not read
    for i, load in enumerate(loads):
        for block, offset in load.slots:
            if np.isnan(colour[block, offset]):
                colour[block, offset] = i if colour_by == "load" else load.program[2]
    keys = max(len(walk.loads), 1) if colour_by == "load" else 1 + max(
        (load.program[2] for load in walk.loads), default=0
    )  # fmt: skip
    fig = Figure(figsize=(1.2 + 0.9 * walk.block_size, 0.9 + 0.42 * walk.num_blocks))
    ax = fig.add_subplot()
    ax.imshow(np.ones_like(colour), cmap=ListedColormap(["whitesmoke"]), aspect="auto")
    cmap = ListedColormap([f"C{i % 10}" for i in range(keys)])
    ax.imshow(colour, cmap=cmap, vmin=-0.5, vmax=keys - 0.5, aspect="auto", alpha=0.85)
    for (block, offset), text in (labels or {}).items():
        read = not np.isnan(colour[block, offset])
        ax.text(offset, block, text, ha="center", va="center", fontsize=8,
                color="black" if read else "grey")  # fmt: skip
    if loads:
        for block, offset in loads[-1].slots:
            ax.add_patch(_outline(offset, block))
    ax.set_xticks(range(walk.block_size), [f"offset {o}" for o in range(walk.block_size)])
    ax.set_yticks(range(walk.num_blocks), [f"block {b}" for b in range(walk.num_blocks)])
    ax.tick_params(length=0, labelsize=8)
    key = "colour: the load that read it" if colour_by == "load" else "colour: the split"
    ax.set_title(f"{title}\n{len(loads)}/{len(walk.loads)} loads; {key}", fontsize=9)
    fig.tight_layout()
    return fig


def _outline(x: int, y: int) -> Rectangle:
    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2)


def tile_walk_widget(
    walk: TileWalk,
    labels: Mapping[tuple[int, int], str] | None = None,
    colour_by: Literal["load", "split"] = "load",
    title: str = "",
):
    """A slider over the walk's loads, redrawing `plot_tile_walk` up to the chosen one."""
    import ipywidgets as widgets
    from IPython.display import display

    slider = widgets.IntSlider(value=1, min=1, max=max(len(walk.loads), 1), description="loads")
    out = widgets.Output()

    def draw(change: dict | None = None) -> None:
        with out:
            out.clear_output(wait=True)
            display(plot_tile_walk(walk, labels, slider.value, colour_by, title))

    slider.observe(draw, names="value")
    draw()
    return widgets.VBox([slider, out])
