"""The report `minserve check` prints: a line per check, a line per exercise, the first
failure of each exercise in full, the count, and what to do next:

      ✓ 4.1 a sequence's share of the token budget: 6/6 passed
      ✗ 4.2 recompute or swap a preempted sequence: 2/5 passed, 3 failed
      ○ 4.3 the host swap space's accounting: 0/6 passed, 6 not implemented yet

    4.2, first failure: A victim holding no block has nothing to swap: recompute, ...
      (the check's message, and the lines of yours to look at)

    8/17 checks passed.
    Next: fix the first failure of 4.2 above, then run `minserve check 04 4.2` again.
    Stuck? `minserve hint 04 4.2` gives a hint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minserve.course.check import CheckResult

MARKS = {"passed": "✓", "failed": "✗", "not implemented": "○", "timed out": "⧗", "skipped": "-"}
_WORST_FIRST = ("failed", "timed out", "skipped", "not implemented", "passed")
_FAILED = ("failed", "timed out")


@dataclass(frozen=True)
class Scope:
    """What one run checks: a chapter's file, or one exercise of it."""

    chapter: str  # "04"
    label: str  # the file checked: "exercises/ch04_chunked_prefill.py"
    impl: str = "exercises"
    exercise: str = ""  # "4.3" when one exercise is checked
    hints: frozenset[str] = frozenset()  # exercises with `minserve hint` hints

    def command(self, exercise: str = "") -> str:
        """The `minserve check` command line for the chapter, or for one exercise of it."""
        one = f" {exercise}" if exercise else ""
        impl = "" if self.impl == "exercises" else f" --impl {self.impl}"
        return f"minserve check {self.chapter}{one}{impl}"

    def hint(self, exercise: str) -> str:
        """The `minserve hint` command for your exercise, or "" where none would help."""
        if self.impl != "exercises" or exercise not in self.hints:
            return ""
        return f"minserve hint {self.chapter} {exercise}"


@dataclass(frozen=True)
class ExerciseResults:
    """The results of the checks one exercise owns ("" for checks that reach no exercise)."""

    id: str
    title: str
    results: tuple[CheckResult, ...]

    @property
    def outcome(self) -> str:
        """The worst outcome among its checks."""
        return next(o for o in _WORST_FIRST if any(r.outcome == o for r in self.results))

    @property
    def first_failure(self) -> CheckResult | None:
        """Its first check that failed or ran past the time limit, if any."""
        return next((r for r in self.results if r.outcome in _FAILED), None)

    def line(self) -> str:
        """`  ✗ 4.2 recompute or swap: 2/5 passed, 3 failed`."""
        passed = sum(r.outcome == "passed" for r in self.results)
        counts = [f"{passed}/{len(self.results)} passed"]
        for outcome, words in (
            ("failed", "failed"),
            ("timed out", "stopped at the time limit"),
            ("skipped", "skipped"),
            ("not implemented", "not implemented yet"),
        ):
            if n := sum(r.outcome == outcome for r in self.results):
                counts.append(f"{n} {words}")
        name = f"{self.id} {self.title}" if self.id else "other checks"
        return f"  {MARKS[self.outcome]} {name}: {', '.join(counts)}"


def by_exercise(
    results: list[CheckResult], owners: dict[str, str], titles: dict[str, str]
) -> list[ExerciseResults]:
    """The results grouped by the exercise each check belongs to, in exercise order; checks
    that reach no exercise last."""
    groups = []
    for id_ in [*titles, ""]:
        mine = tuple(r for r in results if owners.get(r.name, "") == id_)
        if mine:
            groups.append(ExerciseResults(id_, titles.get(id_, ""), mine))
    return groups


def result_line(result: CheckResult) -> str:
    """One check's line: its mark, its name, and why when it did not pass."""
    line = f"  {MARKS[result.outcome]} {result.name}"
    if result.outcome == "not implemented":
        line += f": not implemented yet (Exercise {result.exercise})"
    elif result.outcome == "timed out":
        line += ": stopped at the time limit"
    elif result.outcome == "skipped":
        line += f": {result.message.split(';')[0]}"
    return line


def summary(exercises: Sequence[ExerciseResults], scope: Scope) -> str:
    """A line per exercise, each exercise's first failure in full, the count, what next."""
    results = [r for exercise in exercises for r in exercise.results]
    parts = ["", *(exercise.line() for exercise in exercises)]
    for exercise in exercises:
        if first := exercise.first_failure:
            head = f"{exercise.id}, first failure" if exercise.id else "First failure"
            parts.append(f"\n{head}: {first.name}\n{indent(first.message, 2)}")
            if first.where:
                parts.append(indent(first.where, 2))
    passed = sum(r.outcome == "passed" for r in results)
    checks = f"checks of Exercise {scope.exercise}" if scope.exercise else "checks"
    parts.append(f"\n{passed}/{len(results)} {checks} passed.")
    parts.append(_next_step(exercises, results, scope))
    return "\n".join(parts)


def _next_step(
    exercises: Sequence[ExerciseResults], results: list[CheckResult], scope: Scope
) -> str:
    failing = next((e for e in exercises if e.first_failure), None)
    todo = next((r for r in results if r.outcome == "not implemented"), None)
    if failing is not None:
        which = f"the first failure of {failing.id}" if failing.id else "the first failure"
        step = f"Next: fix {which} above, then run `{scope.command(failing.id)}` again."
        return step + _stuck(scope, failing.id)
    if todo is not None:
        return (
            f"Next: {todo.message or 'the next exercise'}, in {scope.label}: replace its "
            f"`raise NotImplementedError(...)` with your code, then run "
            f"`{scope.command(todo.exercise)}`." + _stuck(scope, todo.exercise)
        )
    if scope.exercise:
        return f"Exercise {scope.exercise} passes. Check the whole chapter: `{scope.command()}`."
    return "All checks pass. Plug your code into the engine: see docs/course.md."


def _stuck(scope: Scope, exercise: str) -> str:
    hint = scope.hint(exercise)
    return f" Stuck? `{hint}` gives a hint." if hint else ""


def indent(text: str, spaces: int) -> str:
    """`text` with every non-empty line moved right by `spaces`."""
    return "\n".join(" " * spaces + line if line else line for line in text.splitlines())
