"""The instructors' answer key (docs/instructors/) keeps up with the course: a section for
every exercise, and the counts each page quotes are the course's own."""

from __future__ import annotations

import re

import pytest

from minserve.course.chapters import CHAPTERS, REPO_ROOT, Chapter
from minserve.course.generate import chapter_exercises
from minserve.course.stats import chapter_stats

PAGES = REPO_ROOT / "docs" / "instructors"
LINES_ROW = re.compile(r"^\| (\d+\.\d+) [^|\s][^|]*\| (\d+) \|", re.MULTILINE)
RUBRIC_ROW = re.compile(r"^\| (\d+\.\d+) \| (\d+) \| (\d+) \|", re.MULTILINE)


def page(chapter: Chapter) -> str:
    return (PAGES / f"ch{chapter.number}.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_every_exercise_has_a_section(chapter: Chapter) -> None:
    headings = set(re.findall(r"^### (\d+\.\d+) ", page(chapter), re.MULTILINE))
    assert headings == {exercise.id for exercise in chapter_exercises(chapter)}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_the_page_quotes_the_chapter_s_check_count(chapter: Chapter) -> None:
    quoted = re.search(r"runs\s+(\d+)\s+checks", page(chapter))
    assert quoted and int(quoted[1]) == len(chapter.load_checks())


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_lines_are_those_a_student_writes(chapter: Chapter) -> None:
    quoted = {exercise: int(lines) for exercise, lines in LINES_ROW.findall(page(chapter))}
    assert quoted == {s.id: s.lines for s in chapter_stats(chapter)}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_the_rubric_counts_every_check_once(chapter: Chapter) -> None:
    rows = RUBRIC_ROW.findall(page(chapter))
    assert [exercise for exercise, _, _ in rows] == [e.id for e in chapter_exercises(chapter)]
    assert sum(int(checks) for _, _, checks in rows) == len(chapter.load_checks())


def test_the_readme_links_every_chapter_s_page() -> None:
    readme = (PAGES / "README.md").read_text(encoding="utf-8")
    for chapter in CHAPTERS:
        assert f"(ch{chapter.number}.md)" in readme
