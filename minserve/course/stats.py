"""How much the course asks a student to write: exercises and lines, chapter by chapter.

A student line is a line strictly inside a `# >>> solution` ... `# <<< solution` block of
a region: what the stub takes out and the student puts back. `python -m
minserve.course.stats` (or `minserve check --stats`) prints the table the docs quote.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from minserve.course.chapters import CHAPTERS, Chapter
from minserve.course.generate import chapter_exercises
from minserve.course.regions import Exercise, solution_blocks


@dataclass(frozen=True)
class ExerciseStats:
    """One exercise's id, title and the number of lines a student writes for it."""

    id: str
    title: str
    lines: int


def exercise_stats(exercise: Exercise) -> ExerciseStats:
    """Count the lines inside the exercise's solution blocks."""
    lines = sum(len(block) for block in solution_blocks(exercise))
    return ExerciseStats(exercise.id, exercise.title, lines)


def chapter_stats(chapter: Chapter) -> list[ExerciseStats]:
    """Every exercise of one chapter, in source order."""
    return [exercise_stats(exercise) for exercise in chapter_exercises(chapter)]


def print_stats(stream: TextIO | None = None) -> int:
    """Print exercises and student lines per chapter, then the course's total; returns it."""
    stream = stream or sys.stdout
    total_exercises = total_lines = 0
    print(f"{'chapter':<44} {'exercises':>9} {'lines':>6}", file=stream)
    for chapter in CHAPTERS:
        stats = chapter_stats(chapter)
        lines = sum(s.lines for s in stats)
        total_exercises, total_lines = total_exercises + len(stats), total_lines + lines
        print(f"{chapter.number} {chapter.title:<41} {len(stats):>9} {lines:>6}", file=stream)
        for s in stats:
            print(f"     {s.id:<5} {s.title[:46]:<46} {s.lines:>6}", file=stream)
    print(f"{'the course':<44} {total_exercises:>9} {total_lines:>6}", file=stream)
    return total_lines


if __name__ == "__main__":
    print_stats()
    sys.exit(0)
