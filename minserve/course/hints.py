"""`minserve hint NN [exercise] [--level 1|2|3]`: graded hints, one step closer each time.

Each chapter's checks module holds `HINTS: dict[str, tuple[str, str, str]]`, mapping an
exercise id ("3.1") to three hints: the idea, the structure of the code, and something
close to code (but not the solution). Level 1 shows the idea; each level shows the ones
before it too, so a student can stop as soon as the picture is clear.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from typing import TextIO

from minserve.course.chapters import Chapter, get_chapter

Hints = tuple[str, str, str]
LEVEL_NAMES = ("the idea", "the structure", "near code")


class HintError(Exception):
    """An unknown chapter or exercise, or a chapter without hints; the message says which."""


def chapter_hints(chapter: Chapter) -> dict[str, Hints]:
    """The chapter's `HINTS` from its checks module (empty when it has none)."""
    return dict(getattr(importlib.import_module(chapter.checks), "HINTS", {}))


def hints_for(chapter: Chapter, exercise: str) -> Hints:
    """The three hints of one exercise ("3.1", or "1" for exercise 3.1 of chapter 03)."""
    hints = chapter_hints(chapter)
    if not hints:
        raise HintError(f"chapter {chapter.number} has no hints yet")
    wanted = exercise if "." in exercise else f"{int(chapter.number)}.{exercise}"
    if wanted not in hints:
        known = ", ".join(sorted(hints))
        raise HintError(
            f"no exercise {exercise!r} in chapter {chapter.number}; its exercises are {known}"
        )
    return hints[wanted]


def format_hints(exercise: str, hints: Hints, level: int) -> str:
    """Hints 1..level of one exercise, numbered, wrapped for a terminal."""
    if level not in (1, 2, 3):
        raise HintError(f"--level must be 1, 2 or 3, got {level}")
    parts = [f"Exercise {exercise}"]
    for number, (name, text) in enumerate(zip(LEVEL_NAMES[:level], hints[:level]), start=1):
        body = textwrap.fill(text, width=88, initial_indent="  ", subsequent_indent="  ")
        parts.append(f"\nHint {number} ({name}):\n{body}")
    if level < 3:
        parts.append(f"\nMore: --level {level + 1}")
    return "\n".join(parts)


def list_hints(chapter: Chapter) -> str:
    """The chapter's exercises, and the command that shows each one's hints."""
    from minserve.course.generate import chapter_exercises  # parses sources; only needed here

    hints = chapter_hints(chapter)
    if not hints:
        raise HintError(f"chapter {chapter.number} has no hints yet")
    lines = [f"Hints for chapter {chapter.number} ({chapter.title}):\n"]
    for exercise in chapter_exercises(chapter):
        command = f"minserve hint {chapter.number} {exercise.id}"
        if exercise.id not in hints:
            command = "(no hints yet)"
        lines.append(f"  {exercise.label}\n      {command}")
    lines.append("\nAdd --level 2 (the structure) or --level 3 (near code) for more.")
    return "\n".join(lines)


def show_hint(
    chapter_number: str,
    exercise: str | None = None,
    level: int = 1,
    stream: TextIO | None = None,
) -> int:
    """Print the hints (or, without an exercise, the list); 0 on success, 1 on an error."""
    stream = stream or sys.stdout
    try:
        chapter = get_chapter(chapter_number)
        if exercise is None:
            print(list_hints(chapter), file=stream)
            return 0
        hints = hints_for(chapter, exercise)
        wanted = exercise if "." in exercise else f"{int(chapter.number)}.{exercise}"
        print(format_hints(wanted, hints, level), file=stream)
    except (KeyError, HintError) as error:
        print(f"minserve hint: {error.args[0]}", file=stream)
        return 1
    return 0


def add_hint_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `hint` on the `minserve` command line."""
    parser = subparsers.add_parser(
        "hint", help="graded hints for an exercise", description=__doc__.split("\n")[0]
    )
    parser.add_argument("chapter", help="chapter number, e.g. 03")
    parser.add_argument("exercise", nargs="?", help="exercise id, e.g. 3.1; omit to list them")
    parser.add_argument(
        "--level",
        type=int,
        choices=(1, 2, 3),
        default=1,
        help="1: the idea (default); 2: also the structure; 3: also near code",
    )
    parser.set_defaults(run=lambda args: show_hint(args.chapter, args.exercise, args.level))
    return parser
