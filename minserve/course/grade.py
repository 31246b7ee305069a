"""`minserve check --all [--json]`: every chapter at once, for a student or for grading.

With `--json` the report is one JSON object on stdout: a row per check (chapter, exercise,
check, status, message), counts per status for each chapter and in all. Status is one of
"pass", "fail", "not implemented", "timeout", "skipped" (a later check that calls a
function which already ran past its time limit). Whatever the checks print goes to
stderr, so stdout stays valid JSON. A chapter whose file does not import fails every one
of its checks with the import error. The exit code is 0 when every check passes, else 1.

A check's exercise is the one it reaches first: the first stub it calls when it runs on
the untouched stubs (`minserve.course.exercise_map`).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from minserve.course.chapters import CHAPTERS, Chapter, get_chapter
from minserve.course.check import (
    CheckResult,
    CourseError,
    load_implementation,
    run_chapter,
    run_check,
)
from minserve.course.exercise_map import check_exercises
from minserve.course.time_limit import DEFAULT_TIME_LIMIT

STATUS = {
    "passed": "pass",
    "failed": "fail",
    "not implemented": "not implemented",
    "timed out": "timeout",
    "skipped": "skipped",
}


def grade_chapter(
    chapter: Chapter, impl: str, root: Path | None, seconds: float | None
) -> list[dict[str, str]]:
    """One row per check of `chapter`: chapter, exercise, check, status, message."""
    exercises = check_exercises(chapter)
    try:
        implementation = load_implementation(chapter, impl, root)
    except CourseError as error:
        why = error.args[0]
        return [_row(chapter, name, exercise, "fail", why) for name, exercise in exercises.items()]
    with contextlib.redirect_stdout(sys.stderr):
        results = run_chapter(chapter, implementation, seconds)
    return [_result_row(chapter, result, exercises) for result in results]


def _result_row(chapter: Chapter, result: CheckResult, exercises: dict[str, str]) -> dict[str, str]:
    exercise = result.exercise or exercises.get(result.name, "")
    message = "\n".join(part for part in (result.message, result.where) if part)
    if result.outcome == "passed":
        message = ""
    return _row(chapter, result.name, exercise, STATUS[result.outcome], message)


def _row(chapter: Chapter, check: str, exercise: str, status: str, message: str) -> dict[str, str]:
    return {
        "chapter": chapter.number,
        "exercise": exercise,
        "check": check,
        "status": status,
        "message": message,
    }


def _counts(rows: list[dict[str, str]]) -> dict[str, int]:
    counts = Counter(row["status"] for row in rows)
    return {status: counts[status] for status in STATUS.values()} | {"total": len(rows)}


def grade(
    chapters: tuple[Chapter, ...],
    impl: str = "exercises",
    root: Path | None = None,
    seconds: float | None = DEFAULT_TIME_LIMIT,
) -> dict[str, Any]:
    """The whole report as a JSON-ready dict: rows, counts per chapter, counts in all."""
    rows = [row for chapter in chapters for row in grade_chapter(chapter, impl, root, seconds)]
    per_chapter = {
        chapter.number: _counts([row for row in rows if row["chapter"] == chapter.number])
        for chapter in chapters
    }
    return {
        "root": str((root or Path.cwd()).resolve()),
        "impl": impl,
        "time_limit": seconds,
        "checks": rows,
        "chapters": per_chapter,
        "summary": _counts(rows),
    }


def grade_command(
    chapter: str | None,
    every: bool,
    impl: str,
    root: Path | None,
    seconds: float | None,
    as_json: bool,
    stream: TextIO | None = None,
) -> int:
    """`minserve check --all` / `--json`: reports for the chosen chapters; the exit code."""
    stream = stream or sys.stdout
    try:
        chapters = CHAPTERS if every else (get_chapter(chapter or ""),)
    except KeyError as error:
        print(f"minserve check: {error.args[0]} (or pass --all)", file=stream)
        return 1
    if as_json:
        report = grade(chapters, impl, root, seconds)
        print(json.dumps(report, indent=2, ensure_ascii=False), file=stream)
        return 0 if report["summary"]["pass"] == report["summary"]["total"] else 1
    codes = []
    for number, one in enumerate(chapters):
        print("\n" + "=" * 72 + "\n" if number else "", end="", file=stream)
        codes.append(run_check(one.number, impl, stream, root, seconds))
    failing = [c.number for c, code in zip(chapters, codes) if code]
    last = f"not passing yet: chapters {', '.join(failing)}." if failing else "every one passes."
    print(f"\nAll chapters: {last}", file=stream)
    return 1 if failing else 0
