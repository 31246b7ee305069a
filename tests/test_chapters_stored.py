"""The course as stored: every chapter notebook committed executed, with a figure; no
notebook cell shows an exercise's solution; every exercise has its three hints; the course
guide's table of what a student writes is the stats'.

These read the committed files only (nothing is executed), so they are fast; nbval runs
the notebooks themselves.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from minserve.course.chapters import CHAPTERS, REPO_ROOT, Chapter
from minserve.course.generate import chapter_exercises
from minserve.course.hints import hints_for
from minserve.course.regions import solution_blocks
from minserve.course.stats import chapter_stats

NOTEBOOKS = sorted((REPO_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
APPENDICES = sorted((REPO_ROOT / "chapters").glob("appendix_*.ipynb"))  # no exercises
MIN_SOLUTION_LINE = 25  # shorter lines (`return out`, `i += 1`) are common to any code


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text(encoding="utf-8"))["cells"]


def _code_cells(notebook: Path) -> list[tuple[int, dict]]:
    """(number, cell) of every code cell with code in it; numbers count all cells from 1."""
    return [
        (number, cell)
        for number, cell in enumerate(_cells(notebook), start=1)
        if cell["cell_type"] == "code" and "".join(cell["source"]).strip()
    ]


def _text(value: str | list[str]) -> str:
    return value if isinstance(value, str) else "".join(value)


def _stored_text(cell: dict) -> str:
    """The cell's source and every text it stored: streams, plain text, errors."""
    parts = [_text(cell["source"])]
    for output in cell.get("outputs", []):
        parts.append(_text(output.get("text", "")))
        parts.append(_text(output.get("data", {}).get("text/plain", "")))
        parts.extend(output.get("traceback", []))
    return "\n".join(parts)


@cache
def solution_lines() -> tuple[tuple[str, str], ...]:
    """(exercise id, line) for every substantive line a student writes: stripped, long
    enough to be specific, not a comment or a docstring."""
    found = []
    for chapter in CHAPTERS:
        for exercise in chapter_exercises(chapter):
            for block in solution_blocks(exercise):
                in_docstring = False
                for raw in block:
                    line = raw.strip()
                    quotes = line.count('"""') + line.count("'''")
                    if in_docstring or quotes:
                        in_docstring = in_docstring != (quotes % 2 == 1)
                        continue
                    if len(line) > MIN_SOLUTION_LINE and not line.startswith("#"):
                        found.append((exercise.id, line))
    return tuple(found)


@pytest.mark.parametrize("notebook", NOTEBOOKS + APPENDICES, ids=lambda path: path.stem)
def test_every_code_cell_was_executed_and_stored(notebook: Path) -> None:
    missing = [number for number, cell in _code_cells(notebook) if cell["execution_count"] is None]
    assert not missing, (
        f"{notebook.name}: code cells {missing} (counting every cell from 1) have no "
        "execution_count; execute the notebook in place and commit its outputs"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS + APPENDICES, ids=lambda path: path.stem)
def test_every_chapter_stores_a_figure(notebook: Path) -> None:
    figures = [
        number
        for number, cell in _code_cells(notebook)
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert figures, f"{notebook.name}: no code cell stores a figure (an image/png output)"


@pytest.mark.parametrize("notebook", NOTEBOOKS + APPENDICES, ids=lambda path: path.stem)
def test_no_cell_shows_an_exercises_solution(notebook: Path) -> None:
    shown = [
        f"cell {number} shows exercise {exercise}'s line {line!r}"
        for number, cell in _code_cells(notebook)
        for exercise, line in solution_lines()
        if line in _stored_text(cell)
    ]
    more = f"; and {len(shown) - 3} more" if len(shown) > 3 else ""
    assert not shown, f"{notebook.name}: " + "; ".join(shown[:3]) + more


EXERCISES = [
    pytest.param(chapter, exercise.id, id=f"ch{chapter.number}-{exercise.id}")
    for chapter in CHAPTERS
    for exercise in chapter_exercises(chapter)
]


@pytest.mark.parametrize(("chapter", "exercise"), EXERCISES)
def test_every_exercise_has_three_hints(chapter: Chapter, exercise: str) -> None:
    hints = hints_for(chapter, exercise)  # what `minserve hint` shows; raises when missing
    assert len(hints) == 3 and all(isinstance(h, str) and h.strip() for h in hints), (
        f"exercise {exercise}: expected three non-empty hints (idea, structure, near code), "
        f"got {hints!r}"
    )
    verbatim = [line for ex, line in solution_lines() if ex == exercise and line in "".join(hints)]
    assert not verbatim, f"exercise {exercise}: a hint gives solution lines verbatim: {verbatim}"


def test_the_course_guides_table_of_what_you_write_is_the_stats() -> None:
    guide = (REPO_ROOT / "docs" / "course_guide.md").read_text(encoding="utf-8")
    for chapter in CHAPTERS:
        stats = chapter_stats(chapter)
        row = (
            f"| {chapter.number} | {chapter.title} | {len(stats)} | {sum(s.lines for s in stats)} |"
        )
        assert row in guide, f"docs/course_guide.md should have the row {row!r}"
