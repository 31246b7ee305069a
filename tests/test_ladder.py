"""Every chapter's exercises form a ladder whose labels match the work: each exercise has a
level and a time (minserve/course/ladder.py); a chapter starts with a warm-up and has a
core exercise and a stretch; a lower level is never longer (in solution lines) than a
higher one of the same chapter; the numbering follows the notebook; each chapter's first
cell lists every exercise with its level and time; a level written beside an exercise
agrees."""

from __future__ import annotations

import json
import re
from functools import cache

import pytest

from minserve.course import ladder
from minserve.course.chapters import CHAPTERS, REPO_ROOT, Chapter
from minserve.course.generate import chapter_exercises
from minserve.course.stats import chapter_stats

RANK = {level: i for i, level in enumerate(ladder.LEVELS)}
WARM_UP_MAX_LINES = 15  # a warm-up longer than this is not one
STRETCH_MIN_LINES = 15  # nor a stretch shorter
WARM_UP_MAX_MINUTES = 25


@cache
def _lines(chapter: Chapter) -> dict[str, int]:
    """Each exercise's solution lines, as `minserve check --stats` counts them."""
    return {row.id: row.lines for row in chapter_stats(chapter)}


def _markdown(chapter: Chapter) -> list[str]:
    cells = json.loads(ladder.notebook_path(chapter).read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def _mentions(text: str, ids: list[str]) -> list[str]:
    """The chapter's exercise ids in `text`, in order; "7.1-7.5" and "4.1 to 4.3" name the
    ids between too."""
    major = ids[0].split(".")[0]
    pattern = re.compile(
        rf"(?<![\d.]){major}\.(\d+)(?:(?:-|–| to ){major}\.(\d+))?(?![\d])"
    )  # fmt: skip
    found = []
    for match in pattern.finditer(text):
        first = int(match[1])
        last = int(match[2]) if match[2] else first
        found += [f"{major}.{n}" for n in range(first, last + 1) if f"{major}.{n}" in ids]
    return found


def test_every_exercise_has_a_level_and_a_time() -> None:
    ids = {e.id for chapter in CHAPTERS for e in chapter_exercises(chapter)}
    assert ids == set(ladder.LADDER), (
        f"missing from the ladder: {sorted(ids - set(ladder.LADDER))}; "
        f"in the ladder but no exercise: {sorted(set(ladder.LADDER) - ids)}"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_labels_follow_the_size_of_the_work(chapter: Chapter) -> None:
    lines = _lines(chapter)
    rungs = {e: ladder.rung(e) for e in lines}
    for a, low in rungs.items():
        for b, high in rungs.items():
            if RANK[low.level] < RANK[high.level]:
                assert lines[a] <= lines[b], (
                    f"{a} ({low.level}, {lines[a]} lines) is longer than {b} "
                    f"({high.level}, {lines[b]} lines)"
                )
    for exercise, r in rungs.items():
        if r.level == "warm-up":
            assert lines[exercise] <= WARM_UP_MAX_LINES and r.minutes <= WARM_UP_MAX_MINUTES, (
                f"{exercise}: a warm-up of {lines[exercise]} lines and {r.minutes} minutes"
            )
        if r.level == "stretch":
            assert lines[exercise] >= STRETCH_MIN_LINES, f"{exercise}: a stretch of 1-liners"
    levels = {r.level for r in rungs.values()}
    assert "core" in levels, f"chapter {chapter.number}: no core"
    assert "stretch" in levels, f"chapter {chapter.number}: no stretch"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_exercises_are_numbered_in_the_order_the_notebook_introduces_them(
    chapter: Chapter,
) -> None:
    ids = [e.id for e in chapter_exercises(chapter)]
    first: list[str] = []
    for text in _markdown(chapter)[1:]:  # the first cell lists them all
        for exercise in _mentions(text, ids):
            if exercise not in first:
                first.append(exercise)
    assert first == sorted(ids, key=lambda i: int(i.split(".")[1])), (
        f"chapter {chapter.number} first mentions its exercises in the order {first}"
    )
    assert ladder.rung(first[0]).level == "warm-up", (
        f"chapter {chapter.number} starts with {first[0]}, a {ladder.rung(first[0]).level}"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_the_first_cell_lists_every_exercise_with_its_level_and_time(chapter: Chapter) -> None:
    intro = _markdown(chapter)[0]
    assert ladder.intro_table(chapter) in intro, (
        f"chapter {chapter.number}'s first cell has no current exercise table: run "
        "`python -m minserve.course.ladder`"
    )
    for exercise in chapter_exercises(chapter):
        assert f"| {exercise.id} |" in intro


LABEL_BESIDE = re.compile(
    r"\*\*(?P<id>\d+\.\d+)[^*\n]*\*\*\s*\((?P<level>warm-up|core|stretch)"
    r"(?:, about (?P<minutes>\d+) minutes)?\)"
    r"|(?P<id2>\d+\.\d+)[^\n|]{0,60}\((?P<level2>warm-up|core|stretch)\)"
)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_a_level_written_beside_an_exercise_is_its_ladders(chapter: Chapter) -> None:
    ids = {e.id for e in chapter_exercises(chapter)}
    for text in _markdown(chapter)[1:]:
        for match in LABEL_BESIDE.finditer(text):
            exercise = match["id"] or match["id2"]
            level = match["level"] or match["level2"]
            if exercise in ids:
                assert ladder.rung(exercise).level == level, (
                    f"chapter {chapter.number} calls {exercise} a {level}; the ladder says "
                    f"{ladder.rung(exercise).level}"
                )
                if match["minutes"]:
                    assert int(match["minutes"]) == ladder.rung(exercise).minutes, (
                        f"chapter {chapter.number} gives {exercise} {match['minutes']} "
                        f"minutes; the ladder says {ladder.rung(exercise).minutes}"
                    )


def test_the_stale_check_finds_a_table_that_changed(tmp_path) -> None:
    chapter = CHAPTERS[0]
    intro = _markdown(chapter)[0]
    changed = ladder.with_table(intro, ladder.intro_table(chapter).replace("10 min", "11 min"))
    assert changed != intro and ladder.with_table(changed, ladder.intro_table(chapter)) == intro


def test_the_labels_beside_exercises_are_found() -> None:
    """The level check above reads the labels the notebooks write (not vacuously)."""
    texts = [t for chapter in CHAPTERS for t in _markdown(chapter)[1:]]
    assert sum(len(LABEL_BESIDE.findall(t)) for t in texts) >= 10


def test_the_weeks_hold_every_exercise_once_and_the_guide_says_their_hours() -> None:
    planned = [e for week in ladder.WEEKS.values() for e in week]
    assert sorted(planned) == sorted(ladder.LADDER) and len(planned) == len(set(planned))
    guide = (REPO_ROOT / "docs" / "course_guide.md").read_text(encoding="utf-8")
    for week in ladder.WEEKS:
        required, stretch = ladder.week_hours(week)
        row = next(line for line in guide.splitlines() if line.startswith(f"| {week} |"))
        assert f"| {required:.1f} h | {stretch:.1f} h |" in row, (week, row)
