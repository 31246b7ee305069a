"""Whose code a chapter's plug-in cells run, and a line that says so.

A chapter plugs the student's exercises into the live engine once they pass their checks,
and the solutions until then, so every cell runs and its stored outputs mean something.
Each such cell prints whose code it ran: "ran: solutions (yours: 3/17 checks pass)" while
the fallback is in use, "ran: yours (17/17 checks pass)" after; never "your" for code the
student did not write.

    code = plug_in("06")          # prints the check report, picks the module
    print(code.ran)               # in each cell that runs it
    LLM(..., plugins=CoursePlugins(...code.module...))
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from minserve.course.chapters import REPO_ROOT, get_chapter
from minserve.course.check import CheckResult, check_name, checked, load_implementation, run_chapter
from minserve.course.time_limit import DEFAULT_TIME_LIMIT


@dataclass(frozen=True)
class PluggedIn:
    """The module a chapter's cells run (the student's, or the solutions') and why."""

    module: ModuleType
    yours: bool  # the student's exercises: every check counted passes
    passed: int  # checks of the student's exercises that pass
    total: int  # checks counted

    @property
    def ran(self) -> str:
        """One line for a cell's output: whose code ran."""
        if self.yours:
            return f"ran: yours ({self.passed}/{self.total} checks pass)"
        return f"ran: solutions (yours: {self.passed}/{self.total} checks pass)"


def plug_in(
    chapter_number: str,
    exercises: tuple[str, ...] = (),
    root: Path = REPO_ROOT,
    report: bool = True,
    brief: bool = False,
) -> PluggedIn:
    """Check the student's `exercises/` module for a chapter (printing the report unless
    `report` is False), then import it if every check passes, else the solutions'.

    `exercises` narrows the count to some exercises' checks ("0.1", "0.2", ...), for a
    cell that needs only those (a chapter whose model pieces and sampler plug in apart)."""
    chapter = get_chapter(chapter_number)
    if report and not exercises:
        results = checked(chapter_number, root=root, brief=brief) or []
    else:
        results = _silent_results(chapter_number, exercises, root)
    passed = sum(r.outcome == "passed" for r in results)
    yours = bool(results) and passed == len(results)
    module = load_implementation(chapter, "exercises" if yours else "solutions", root).module
    sys.modules[module.__name__] = module  # as an import: pickling by name finds this module
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # and processes the engine spawns import it by name
    return PluggedIn(module, yours, passed, len(results))


def _silent_results(
    chapter_number: str, exercises: tuple[str, ...], root: Path
) -> list[CheckResult]:
    from minserve.course.exercise_map import check_exercises  # runs the stubs: only here

    chapter = get_chapter(chapter_number)
    owners = check_exercises(chapter)
    checks = [
        c for c in chapter.load_checks() if not exercises or owners[check_name(c)] in exercises
    ]
    implementation = load_implementation(chapter, "exercises", root)
    return run_chapter(chapter, implementation, DEFAULT_TIME_LIMIT, checks=checks)
