"""Chapter 02's pictures of its first kernels: which program read or wrote each element.

In the style of Triton-Puzzles: each tensor a launch touched is drawn as a grid (a vector as
one row, a matrix as itself), each element coloured by the program that loaded it (an
input) or stored it (an output), and each lane a mask turned off marked with a cross where
it pointed, past the end of the data or inside it. Recorded from the interpreter
(`kernel_access.accesses_recorded`), so it shows what the kernel did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from minserve.attention.triton_env import interpreting
from minserve.viz.kernel_access import Access, accesses_recorded


@dataclass(frozen=True)
class Touched:
    """What one launch did to one tensor, element by element."""

    name: str
    shape: tuple[int, int]  # drawn as [rows, cols]; a vector is one row
    by_program: np.ndarray  # [rows, cols + spill] program index that touched it, -1 if none
    masked: frozenset[int]  # flat element indices a masked-off lane pointed at
    kind: str  # "load" (an input) or "store" (an output)


@dataclass(frozen=True)
class ProgramMap:
    """Every tensor of a launch and the programs in the order they ran."""

    tensors: tuple[Touched, ...]
    programs: tuple[tuple[int, int, int], ...]


def record_programs(
    launch: Callable[[], object], tensors: Mapping[str, torch.Tensor]
) -> ProgramMap:
    """Run `launch()` in the interpreter and map each access onto `tensors` (name -> a
    contiguous 1-D or 2-D tensor: a view's base, to see which of its elements a view reads)."""
    if not interpreting():
        raise ValueError("recording a launch's accesses needs Triton's interpreter")
    with accesses_recorded() as seen:
        launch()
    programs = tuple(dict.fromkeys(access.program for access in seen))
    touched = [_touched(name, t, seen, programs) for name, t in tensors.items()]
    return ProgramMap(tuple(touched), programs)


def _touched(name: str, tensor: torch.Tensor, seen: list[Access], programs: tuple) -> Touched:
    if not tensor.is_contiguous() or tensor.dim() not in (1, 2):
        raise ValueError(f"{name}: draw a contiguous vector or matrix (a view's base)")
    rows, cols = (1, tensor.numel()) if tensor.dim() == 1 else tuple(tensor.shape)
    base, size = tensor.data_ptr(), tensor.element_size()
    index = {program: i for i, program in enumerate(programs)}
    mine = [a for a in seen if _targets(a, base, base + tensor.nbytes, size)]
    masked = {int(i) for a in mine for i in (a.masked - base) // size}
    spill = max((i + 1 - rows * cols for i in masked if rows == 1), default=0)
    by_program = np.full((rows, cols + max(spill, 0)), -1)
    for access in mine:
        for flat in (access.addresses - base) // size:
            r, c = divmod(int(flat), by_program.shape[1] if rows == 1 else cols)
            if 0 <= r < rows and by_program[r, c] < 0:
                by_program[r, c] = index[access.program]
    kind = "store" if {a.kind for a in mine} == {"store"} else "load"
    return Touched(name, (rows, cols), by_program, frozenset(masked), kind)


def _targets(access: Access, low: int, high: int, size: int) -> bool:
    """Whether an access is aimed at [low, high): a lane on inside it, or, with every lane
    off, a lane within a few elements of it (a block sticking out past the end)."""
    lanes = access.addresses if access.addresses.size else access.masked
    near = size * max(lanes.size, 1) if not access.addresses.size else 0
    return bool(((lanes >= low - near) & (lanes < high + near)).any())


def plot_programs(recorded: ProgramMap, title: str = "") -> Figure:
    """One panel per tensor: each element coloured by the program that read (or wrote) it,
    white if none did, a cross where a masked-off lane pointed."""
    count = max(len(recorded.programs), 1)
    cmap = ListedColormap([f"C{i % 10}" for i in range(count)])
    heights = [t.by_program.shape[0] + 1.2 for t in recorded.tensors]
    width = max(t.by_program.shape[1] for t in recorded.tensors)
    fig = Figure(figsize=(min(1.2 + 0.5 * width, 12), 0.8 + 0.42 * sum(heights)))
    axes = fig.subplots(len(recorded.tensors), 1, gridspec_kw={"height_ratios": heights})
    for ax, touched in zip(np.atleast_1d(axes), recorded.tensors, strict=True):
        _panel(ax, touched, cmap, count)
    two_d = any(p[1] for p in recorded.programs)
    names = ", ".join(
        f"{i}=({p[0]},{p[1]})" if two_d else f"{i}={p[0]}" for i, p in enumerate(recorded.programs)
    )
    fig.suptitle(f"{title}\nprograms, numbered in launch order (number=program id): {names}",
                 fontsize=8)  # fmt: skip
    fig.tight_layout()
    return fig


def _panel(ax, touched: Touched, cmap: ListedColormap, count: int) -> None:
    rows, cols = touched.by_program.shape
    shown = np.where(touched.by_program >= 0, touched.by_program, np.nan)
    ax.imshow(np.ones((rows, cols)), cmap=ListedColormap(["white"]), aspect="auto")
    ax.imshow(shown, cmap=cmap, vmin=-0.5, vmax=count - 0.5, aspect="auto", alpha=0.85)
    for r in range(rows):
        for c in range(cols):
            program = touched.by_program[r, c]
            if program >= 0:
                ax.text(c, r, str(program), ha="center", va="center", fontsize=8)
    data_cols = touched.shape[1]
    for flat in touched.masked:
        r, c = divmod(flat, cols) if rows > 1 else (0, flat)
        if 0 <= r < rows and 0 <= c < cols:  # in a corner where a program's number is
            dx, dy = (0.3, -0.22) if touched.by_program[r, c] >= 0 else (0.0, 0.0)
            ax.text(c + dx, r + dy, "x", ha="center", va="center", fontsize=9, color="dimgrey")
    if cols > data_cols:  # lanes past the end of a vector: outside the tensor
        ax.axvline(data_cols - 0.5, color="black", linewidth=2)
    ax.set_xticks(np.arange(cols + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(rows + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="lightgrey", linewidth=0.5)
    ax.tick_params(which="both", length=0, labelsize=7)
    ax.set_yticks(range(rows) if rows > 1 else [])
    verb = "wrote" if touched.kind == "store" else "read"
    ax.set_title(f"{touched.name}: the program that {verb} each element (x: a masked lane)",
                 fontsize=8, loc="left")  # fmt: skip
