"""The course's chapters: which minserve sources hold each chapter's exercises.

A chapter is one notebook (`chapters/NN_slug.ipynb`), one generated module in
`exercises/` and `solutions/`, and one list of checks run by `minserve check NN`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from minserve.course.regions import Kind

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # minserve/
REPO_ROOT = PACKAGE_DIR.parent  # holds exercises/ and solutions/ in a source checkout

Check = Callable[[ModuleType], None]


@dataclass(frozen=True)
class Chapter:
    """One chapter of the course and where its exercises come from."""

    number: str  # "00"
    slug: str  # "sampling": the notebook is chapters/00_sampling.ipynb
    title: str
    module: str  # "ch00_sampling": exercises/ch00_sampling.py, solutions/ch00_sampling.py
    sources: tuple[str, ...]  # relative to the minserve package: "model/sampler.py"
    header: str  # module docstring + imports of the generated file
    checks: str  # dotted path of a module with `CHECKS: list[Check]`

    def generated_path(self, kind: Kind) -> str:
        """Where the generated module lives, relative to the repo root."""
        return f"{kind}s/{self.module}.py"

    def source_modules(self) -> tuple[str, ...]:
        """The minserve modules holding the reference code: ("minserve.model.sampler",)."""
        return tuple("minserve." + s.removesuffix(".py").replace("/", ".") for s in self.sources)

    def load_checks(self) -> list[Check]:
        """The chapter's checks, in the order the report shows them."""
        return list(importlib.import_module(self.checks).CHECKS)


CHAPTERS: tuple[Chapter, ...] = (
    Chapter(
        number="00",
        slug="sampling",
        title="The model we serve",
        module="ch00_sampling",
        sources=("model/sampler.py",),
        header=(
            '"""Chapter 00, The model we serve: the sampler\'s filters (top-k, top-p, min-p).\n\n'
            "Each function takes logits [rows, vocab] and one setting per row, and returns new\n"
            "logits in which the tokens the filter rejects are -inf.\n"
            '"""\n\n'
            "import torch\n"
        ),
        checks="minserve.course.checks_ch00",
    ),
    Chapter(
        number="01",
        slug="block_allocator",
        title="KV cache and the block allocator",
        module="ch01_block_allocator",
        sources=("kvcache/block_allocator.py",),
        header=(
            '"""Chapter 01, KV cache and the block allocator: free list and reference counts.\n\n'
            "The paged KV pool is cut into blocks; `BlockAllocator` hands out block ids and\n"
            "counts who holds each one. Plug your class into the engine with\n"
            "`LLM(block_allocator_cls=BlockAllocator)`.\n"
            '"""\n\n'
            "from collections import deque\n\n"
            "from minserve.kvcache import NoFreeBlocksError\n"
        ),
        checks="minserve.course.checks_ch01",
    ),
    Chapter(
        number="03",
        slug="continuous_batching",
        title="Continuous batching",
        module="ch03_scheduler",
        sources=("scheduler/scheduler.py",),
        header=(
            '"""Chapter 03, Continuous batching: the scheduler that builds every step\'s batch.\n\n'
            "Each step, running sequences go first (decodes, then prefill chunks), preempting\n"
            "when the KV cache runs out of blocks; then waiting ones are admitted in policy\n"
            "order while the token budget, the seats and the blocks last. Plug your class\n"
            "into the engine with `LLM(scheduler_cls=Scheduler)`.\n"
            '"""\n\n'
            "from minserve.config import SchedulerConfig\n"
            "from minserve.kvcache.manager import KVCacheManager\n"
            "from minserve.scheduler.policy import get_policy\n"
            "from minserve.scheduler.scheduler import (\n"
            "    ScheduledSeq,\n"
            "    SchedulerOutput,\n"
            "    SchedulerStats,\n"
            ")\n"
            "from minserve.scheduler.sequence import SeqStatus, Sequence\n"
        ),
        checks="minserve.course.checks_ch03",
    ),
)


def get_chapter(number: str) -> Chapter:
    """The chapter numbered `number` ("00", "0" or "ch00"); KeyError names the known ones."""
    wanted = number.removeprefix("ch")
    for chapter in CHAPTERS:
        if wanted.isdigit() and int(wanted) == int(chapter.number):
            return chapter
    known = ", ".join(chapter.number for chapter in CHAPTERS)
    raise KeyError(f"no chapter {number!r}; the course has chapters {known}")
