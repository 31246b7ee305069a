"""Chapter 05's pictures: the radix tree of the prefix cache, as text and as a drawing.

Drawn from a real `RadixCache`: each node is an edge of the tree with its tokens (decoded
when a tokenizer is given), its KV blocks and how many running requests lock it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from matplotlib.figure import Figure

from minserve.kvcache.radix_cache import RadixCache, RadixNode

Decode = Callable[[Sequence[int]], str]


def _label(node: RadixNode, decode: Decode | None, width: int) -> str:
    text = decode(node.key) if decode else " ".join(map(str, node.key))
    text = text.replace("\n", "⏎")
    return text if len(text) <= width else text[: width - 1] + "…"


def _children(node: RadixNode) -> list[RadixNode]:
    return sorted(node.children.values(), key=lambda c: c.key)


def tree_lines(cache: RadixCache, decode: Decode | None = None, width: int = 40) -> list[str]:
    """The tree as indented lines: edge text, blocks, lock count."""
    lines = [
        f"root ({cache.num_cached_blocks} blocks cached, {cache.num_evictable_blocks} evictable)"
    ]

    def visit(node: RadixNode, depth: int) -> None:
        for child in _children(node):
            lock = f", locked x{child.lock_ref}" if child.lock_ref else ""
            label = _label(child, decode, width)
            lines.append(f"{'    ' * depth}└─ {label!r}  blocks {child.blocks}{lock}")
            visit(child, depth + 1)

    visit(cache.root, 1)
    return lines


def _layout(root: RadixNode) -> dict[RadixNode, tuple[float, int]]:
    """(x, depth) per node: leaves side by side, a parent centred over its children."""
    places: dict[RadixNode, tuple[float, int]] = {}
    next_leaf = [0.0]

    def place(node: RadixNode, depth: int) -> float:
        kids = _children(node)
        if kids:
            x = sum(place(child, depth + 1) for child in kids) / len(kids)
        else:
            x, next_leaf[0] = next_leaf[0], next_leaf[0] + 1
        places[node] = (x, depth)
        return x

    place(root, 0)
    return places


def draw_tree(
    cache: RadixCache,
    decode: Decode | None = None,
    title: str = "",
    highlight: Mapping[RadixNode, str] | None = None,
    width: int = 22,
) -> Figure:
    """The radix tree: boxes are edges (text, blocks), grey when no request locks them."""
    places = _layout(cache.root)
    leaves = max(1, sum(1 for n in places if not n.children))
    depth = max(d for _, d in places.values())
    fig = Figure(figsize=(min(2.6 * leaves + 1, 14), 1.3 * depth + 1.4))
    ax = fig.add_subplot()
    for node, (x, d) in places.items():
        if node.parent is not None:
            px, pd = places[node.parent]
            ax.plot([px, x], [-pd, -d], color="0.6", zorder=1)
        label = "root" if node is cache.root else (
            f"{_label(node, decode, width)}\nblocks {node.blocks}"
            + (f"\nlocked x{node.lock_ref}" if node.lock_ref else "")
        )  # fmt: skip
        colour = (highlight or {}).get(node) or ("#cfe3f7" if node.lock_ref else "#eeeeee")
        ax.text(x, -d, label, ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round", facecolor=colour, edgecolor="0.4"))  # fmt: skip
    ax.set_xlim(-0.7, leaves - 0.3)
    ax.set_ylim(-depth - 0.6, 0.6)
    ax.axis("off")
    ax.set_title(title or f"{cache.num_cached_blocks} blocks cached", fontsize=10)
    return fig


def bar_chart(
    values: Mapping[str, float],
    ylabel: str,
    title: str = "",
    fmt: str = "{:.2f}",
    colors: Sequence[str] | None = None,
) -> Figure:
    """A labelled bar per entry (hit rates, TTFTs): the chapter's comparisons."""
    fig = Figure(figsize=(5.5, 3))
    ax = fig.add_subplot()
    colors = colors or [f"C{i}" for i in range(len(values))]
    bars = ax.bar(list(values), list(values.values()), color=colors)
    for bar, value in zip(bars, values.values()):
        ax.annotate(fmt.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
