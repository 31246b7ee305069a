"""The course's ladder: each exercise's level (warm-up, core, stretch) and estimated time.

A warm-up is a few lines that use one idea of the chapter; a core exercise is the
chapter's main work, the piece the engine cannot run without; a stretch is the longest or
most intricate part, worth doing once the rest passes. The levels follow the size of the
work: within a chapter, a warm-up is never longer than a core exercise, nor a core
exercise longer than a stretch (tests/test_ladder.py counts the solution lines). Times are
estimates for a student who meets the prerequisites (docs/course_guide.md), reading the
docstring and the checks' reports included.

Each chapter's notebook lists its exercises in its first cell, between the markers
`<!-- exercises -->` and `<!-- /exercises -->`: `python -m minserve.course.ladder` writes
those tables, and `--check` says which are stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from minserve.course.chapters import CHAPTERS, REPO_ROOT, Chapter
from minserve.course.generate import chapter_exercises

Level = Literal["warm-up", "core", "stretch"]
LEVELS: tuple[Level, ...] = ("warm-up", "core", "stretch")
START, END = "<!-- exercises -->", "<!-- /exercises -->"


@dataclass(frozen=True)
class Rung:
    """One exercise's place on its chapter's ladder."""

    level: Level
    minutes: int  # estimated time for a student who meets the prerequisites


LADDER: dict[str, Rung] = {
    # 00 The model we serve
    "0.1": Rung("warm-up", 10),
    "0.2": Rung("warm-up", 15),
    "0.3": Rung("warm-up", 5),
    "0.4": Rung("core", 30),
    "0.5": Rung("warm-up", 15),
    "0.6": Rung("core", 20),
    "0.7": Rung("warm-up", 10),
    "0.8": Rung("stretch", 45),
    "0.9": Rung("stretch", 40),
    # 01 KV cache and the block allocator
    "1.1": Rung("warm-up", 20),
    "1.2": Rung("core", 45),
    "1.3": Rung("stretch", 50),
    # 02 Paged attention
    "2.1": Rung("warm-up", 10),
    "2.2": Rung("warm-up", 10),
    "2.3": Rung("warm-up", 15),
    "2.4": Rung("core", 20),
    "2.5": Rung("core", 25),
    "2.6": Rung("core", 60),
    "2.7": Rung("core", 30),
    "2.8": Rung("core", 20),
    "2.9": Rung("stretch", 75),
    # 03 Continuous batching
    "3.1": Rung("warm-up", 20),
    "3.2": Rung("core", 60),
    "3.3": Rung("core", 45),
    "3.4": Rung("stretch", 60),
    # 04 Chunked prefill and preemption
    "4.1": Rung("warm-up", 10),
    "4.2": Rung("warm-up", 10),
    "4.3": Rung("core", 45),
    "4.4": Rung("stretch", 60),
    # 05 Sharing prefixes
    "5.1": Rung("warm-up", 20),
    "5.2": Rung("core", 90),
    "5.3": Rung("stretch", 75),
    # 06 Sampling and speculative decoding
    "6.1": Rung("warm-up", 10),
    "6.2": Rung("core", 30),
    "6.3": Rung("warm-up", 15),
    "6.4": Rung("warm-up", 15),
    "6.5": Rung("core", 30),
    "6.6": Rung("stretch", 45),
    # 07 Tensor parallelism
    "7.1": Rung("warm-up", 15),
    "7.2": Rung("core", 20),
    "7.3": Rung("core", 25),
    "7.4": Rung("core", 30),
    "7.5": Rung("stretch", 60),
    # 08 Disaggregating prefill and decode
    "8.1": Rung("warm-up", 20),
    "8.2": Rung("warm-up", 15),
    "8.3": Rung("warm-up", 20),
    "8.4": Rung("core", 40),
    "8.5": Rung("stretch", 60),
    # 09 Assembling the server
    "9.1": Rung("warm-up", 15),
    "9.2": Rung("warm-up", 10),
    "9.3": Rung("core", 20),
    "9.4": Rung("core", 45),
    "9.5": Rung("stretch", 45),
    "9.6": Rung("stretch", 45),
    # 10 Fewer bytes
    "10.1": Rung("warm-up", 20),
    "10.2": Rung("stretch", 45),
    "10.3": Rung("warm-up", 20),
    "10.4": Rung("core", 40),
    "10.5": Rung("warm-up", 15),
    # 11 The state plane
    "11.1": Rung("warm-up", 15),
    "11.2": Rung("core", 30),
    "11.3": Rung("core", 45),
    "11.4": Rung("stretch", 75),
    "11.5": Rung("core", 30),
    # 12 Structured output
    "12.1": Rung("warm-up", 20),
    "12.2": Rung("core", 60),
    "12.3": Rung("warm-up", 15),
    "12.4": Rung("warm-up", 20),
    "12.5": Rung("stretch", 75),
}


# The four-week plan of docs/course_guide.md (a fifth week optional): which exercises each
# week holds. Chapter 02 is split: its Triton first steps (2.1-2.3) close week 1.
WEEKS: dict[str, tuple[str, ...]] = {
    "1": ("0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1.1", "1.2", "1.3")
    + ("2.1", "2.2", "2.3"),
    "2": ("2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "3.1", "3.2", "3.3", "3.4"),
    "3": ("4.1", "4.2", "4.3", "4.4", "5.1", "5.2", "5.3")
    + ("6.1", "6.2", "6.3", "6.4", "6.5", "6.6"),
    "4": ("7.1", "7.2", "7.3", "7.4", "7.5", "8.1", "8.2", "8.3", "8.4", "8.5")
    + ("9.1", "9.2", "9.3", "9.4", "9.5", "9.6"),
    "5 (optional)": ("10.1", "10.2", "10.3", "10.4", "10.5")
    + ("12.1", "12.2", "12.3", "12.4", "12.5"),
    "6 (optional)": ("11.1", "11.2", "11.3", "11.4", "11.5"),
}


def week_hours(week: str) -> tuple[float, float]:
    """(hours of warm-up and core exercises, hours of stretch ones) of one week."""
    rungs = [rung(e) for e in WEEKS[week]]
    required = sum(r.minutes for r in rungs if r.level != "stretch")
    stretch = sum(r.minutes for r in rungs if r.level == "stretch")
    return round(required / 60, 1), round(stretch / 60, 1)


def rung(exercise: str) -> Rung:
    """The ladder entry of one exercise ("3.1"); a KeyError names the missing id."""
    if exercise not in LADDER:
        raise KeyError(f"exercise {exercise} has no level and time in minserve/course/ladder.py")
    return LADDER[exercise]


def chapter_minutes(chapter: Chapter) -> int:
    """The estimated time of all of a chapter's exercises."""
    return sum(rung(e.id).minutes for e in chapter_exercises(chapter))


def intro_table(chapter: Chapter) -> str:
    """The markdown table a chapter's first cell lists its exercises in, with the markers."""
    rows = [
        f"| {e.id} | {e.title} | {rung(e.id).level} | {rung(e.id).minutes} min |"
        for e in chapter_exercises(chapter)
    ]
    total = chapter_minutes(chapter)
    return "\n".join(
        [
            START,
            f"**Exercises** (`minserve check {chapter.number} N.M` checks one; about "
            f"{_hours(total)} in all):",
            "",
            "| exercise | what you write | level | time |",
            "|---|---|---|---|",
            *rows,
            END,
        ]
    )


def _hours(minutes: int) -> str:
    return f"{minutes} minutes" if minutes < 90 else f"{minutes / 60:.1f} hours"


def notebook_path(chapter: Chapter, root: Path = REPO_ROOT) -> Path:
    """The chapter's notebook, `chapters/NN_*.ipynb`."""
    (path,) = (root / "chapters").glob(f"{chapter.number}_*.ipynb")
    return path


def with_table(intro: str, table: str) -> str:
    """`intro` (a first cell's markdown) with its exercise table replaced, or appended."""
    if START in intro and END in intro:
        head, rest = intro.split(START, 1)
        return head + table + rest.split(END, 1)[1]
    return intro.rstrip("\n") + "\n\n" + table


def stale(root: Path = REPO_ROOT) -> list[str]:
    """The chapters whose first cell's table is not what the ladder says."""
    return [
        chapter.number
        for chapter in CHAPTERS
        if intro_table(chapter) not in "".join(_cells(notebook_path(chapter, root))[0]["source"])
    ]


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def write_tables(root: Path = REPO_ROOT) -> list[str]:
    """Rewrite every chapter's table in place; the chapters changed."""
    changed = []
    for chapter in CHAPTERS:
        path = notebook_path(chapter, root)
        notebook = json.loads(path.read_text(encoding="utf-8"))
        intro = "".join(notebook["cells"][0]["source"])
        updated = with_table(intro, intro_table(chapter))
        if updated != intro:
            notebook["cells"][0]["source"] = updated.splitlines(keepends=True)
            text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
            path.write_text(text, encoding="utf-8")
            changed.append(chapter.number)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which tables are stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        print("stale: " + ", ".join(old) if old else "every chapter's exercise table is current")
        return 1 if old else 0
    changed = write_tables()
    print("written: " + ", ".join(changed) if changed else "unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
