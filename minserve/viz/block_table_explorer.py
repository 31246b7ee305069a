"""An interactive explorer of block tables: allocate, fork, write and free, and watch the
pool's blocks and reference counts change (PagedAttention's sharing and copy-on-write).

`BlockTableExplorer` holds one allocator and named block tables of any classes shaped like
minserve's (a student's work from chapter 01 included); `widget()` drives it with buttons,
`figure()` draws its state with `kvcache.plot_block_tables`, so a stored notebook shows
the picture even where widgets do not render.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from minserve.kvcache.block_allocator import BlockAllocator, NoFreeBlocksError
from minserve.kvcache.block_table import BlockTable
from minserve.viz.kvcache import plot_block_tables


class BlockTableExplorer:
    """A small pool and its sequences, changed one operation at a time; every operation
    is logged as a line such as `fork A -> B: blocks [0, 1] now counted 2`."""

    def __init__(
        self,
        num_blocks: int = 8,
        block_size: int = 4,
        table_cls: type = BlockTable,
        allocator_cls: type = BlockAllocator,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.table_cls = table_cls
        self.allocator = allocator_cls(num_blocks)
        self.tables: dict[str, Any] = {}
        self.log: list[str] = []

    def _name(self) -> str:
        return next(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in self.tables)

    def new(self, num_tokens: int) -> str:
        """A new sequence whose prompt takes `num_tokens` slots; returns its name."""
        name = self._name()
        table = self.table_cls(self.block_size)
        slots, _ = table.append(self.allocator, num_tokens)
        self.tables[name] = table
        self.log.append(f"new {name} ({num_tokens} tokens): blocks {table.blocks}, slots {slots}")
        return name

    def write(self, name: str, num_tokens: int = 1) -> None:
        """Append `num_tokens` tokens to sequence `name` (a decode step writes one)."""
        slots, copies = self.tables[name].append(self.allocator, num_tokens)
        copied = f"; copy-on-write {copies} (src, dst)" if copies else ""
        self.log.append(f"write {num_tokens} to {name}: slots {slots}{copied}")

    def fork(self, name: str) -> str:
        """A child of sequence `name` sharing all its blocks; returns the child's name."""
        child = self._name()
        self.tables[child] = self.tables[name].fork(self.allocator)
        counts = [self.allocator.refcount(b) for b in self.tables[child].blocks]
        self.log.append(f"fork {name} -> {child}: blocks {self.tables[child].blocks}, "
                        f"reference counts {counts}")  # fmt: skip
        return child

    def free(self, name: str) -> None:
        """Release sequence `name`'s blocks (a shared block survives its other users)."""
        self.tables.pop(name).free(self.allocator)
        self.log.append(f"free {name}: {self.allocator.num_free} of {self.num_blocks} blocks free")

    def figure(self) -> Figure:
        """The tables and the pool now, with each block's reference count."""
        return plot_block_tables(self.tables, self.num_blocks, self.allocator)

    def widget(self) -> Any:
        """Buttons (new, write, fork, free), a sequence picker and a token count; the
        figure and the log redraw after every operation."""
        import ipywidgets as w
        from IPython.display import display

        picker = w.Dropdown(options=list(self.tables), description="sequence")
        tokens = w.BoundedIntText(value=1, min=1, max=64, description="tokens")
        out = w.Output()

        def redraw() -> None:
            picker.options = list(self.tables)
            with out:
                out.clear_output(wait=True)
                display(self.figure())
                print("\n".join(self.log[-6:]))

        def act(operation: str) -> None:
            try:
                if operation == "new":
                    self.new(tokens.value)
                elif picker.value is not None:
                    {"write": lambda: self.write(picker.value, tokens.value),
                     "fork": lambda: self.fork(picker.value),
                     "free": lambda: self.free(picker.value)}[operation]()  # fmt: skip
            except NoFreeBlocksError as error:
                self.log.append(f"{operation}: {error}")
            redraw()

        buttons = []
        for operation in ("new", "write", "fork", "free"):
            button = w.Button(description=operation)
            button.on_click(lambda _, op=operation: act(op))
            buttons.append(button)
        redraw()
        return w.VBox([w.HBox([picker, tokens]), w.HBox(buttons), out])
