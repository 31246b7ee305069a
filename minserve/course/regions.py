"""Exercise regions: the marked parts of minserve's sources that become the course.

One source of truth: a region is written once, inside minserve, and rendered two ways.

    # >>> exercise 0.5: top-k filtering
    def apply_top_k(logits, top_k):
        \"\"\"Docstring the student keeps.\"\"\"
        # >>> solution
        ...the reference body...
        # <<< solution
    # <<< exercise

The *solution* drops the four marker lines; the *stub* replaces each solution block with
`raise NotImplementedError("Exercise 0.5: top-k filtering")` at the solution markers'
indentation, so signatures and docstrings survive.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["exercise", "solution"]

_OPEN_EXERCISE = re.compile(r"^\s*# >>> exercise (?P<id>\d+(?:\.\d+)+): (?P<title>\S.*?)\s*$")
_CLOSE_EXERCISE = re.compile(r"^\s*# <<< exercise\s*$")
_OPEN_SOLUTION = re.compile(r"^(?P<indent>\s*)# >>> solution\s*$")
_CLOSE_SOLUTION = re.compile(r"^\s*# <<< solution\s*$")
_ANY_MARKER = re.compile(r"^\s*# (>>>|<<<)")


class MarkerError(ValueError):
    """Badly placed exercise markers; the message starts with `path:line`."""


@dataclass(frozen=True)
class Exercise:
    """One marked region: its id ("0.1"), title, and raw lines (solution markers kept)."""

    id: str
    title: str
    path: str
    start: int  # 1-based line of `# >>> exercise`
    end: int  # 1-based line of `# <<< exercise`
    lines: tuple[str, ...]  # the lines strictly between the two exercise markers

    @property
    def label(self) -> str:
        """What the stub raises and the report prints: "Exercise 0.5: top-k filtering"."""
        return f"Exercise {self.id}: {self.title}"

    def stub(self, note: str = "") -> str:
        """The statement a solution block becomes: `raise NotImplementedError("Exercise
        0.5: top-k filtering")`, with `note` after the label."""
        message = (self.label + note).replace("\\", "\\\\").replace('"', '\\"')
        return f'raise NotImplementedError("{message}")'

    def render(self, kind: Kind, keep_markers: bool = False, note: str = "") -> list[str]:
        """The region's lines as a stub ("exercise") or as the reference ("solution").

        `keep_markers` keeps the solution markers around what each block became, so the
        result is still a marked region (a student checkout's minserve sources); `note`
        follows the label in the stub's message.
        """
        out: list[str] = []
        in_solution = False
        for line in self.lines:
            if opening := _OPEN_SOLUTION.match(line):
                in_solution = True
                out += [line] if keep_markers else []
                if kind == "exercise":
                    out.append(f"{opening['indent']}{self.stub(note)}\n")
            elif _CLOSE_SOLUTION.match(line):
                in_solution = False
                out += [line] if keep_markers else []
            elif kind == "solution" or not in_solution:
                out.append(line)
        return out


@dataclass
class _OpenRegion:
    """Parser state for the exercise currently open."""

    start: int
    id: str
    title: str
    body: list[str] = field(default_factory=list)
    solution_start: int | None = None  # line of the open `# >>> solution`, if any
    solutions: int = 0

    def close(self, path: str, end: int) -> Exercise:
        where = f"{path}:{end}"
        if self.solution_start is not None:
            raise MarkerError(
                f"{where}: `# <<< exercise` while the solution block opened at line "
                f"{self.solution_start} is still open; close it with `# <<< solution` first"
            )
        if self.solutions == 0:
            raise MarkerError(
                f"{path}:{self.start}: exercise {self.id} has no `# >>> solution` block, "
                "so its stub would equal its solution"
            )
        return Exercise(self.id, self.title, path, self.start, end, tuple(self.body))


def parse_exercises(text: str, path: str) -> list[Exercise]:
    """All exercise regions of one source file, checked for balance, nesting and unique ids."""
    exercises: list[Exercise] = []
    region: _OpenRegion | None = None
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        where = f"{path}:{number}"
        if match := _OPEN_EXERCISE.match(line):
            if region is not None:
                raise MarkerError(
                    f"{where}: `# >>> exercise` inside exercise {region.id} opened at "
                    f"line {region.start}; exercises cannot nest"
                )
            region = _OpenRegion(number, match["id"], match["title"])
        elif _CLOSE_EXERCISE.match(line):
            if region is None:
                raise MarkerError(f"{where}: `# <<< exercise` without a matching `# >>> exercise`")
            exercises.append(region.close(path, number))
            region = None
        else:
            _track_solution_marker(region, line, path, number)
            if region is not None:
                region.body.append(line)
    if region is not None:
        raise MarkerError(
            f"{path}:{region.start}: exercise {region.id} is never closed; "
            "add `# <<< exercise` after it"
        )
    check_unique_ids(exercises)
    return exercises


def _track_solution_marker(region: _OpenRegion | None, line: str, path: str, number: int) -> None:
    """Update `region` for a solution marker on `line`; reject stray or unknown markers."""
    where = f"{path}:{number}"
    if _OPEN_SOLUTION.match(line):
        if region is None:
            raise MarkerError(f"{where}: `# >>> solution` outside any exercise region")
        if region.solution_start is not None:
            raise MarkerError(
                f"{where}: `# >>> solution` inside the solution block opened at line "
                f"{region.solution_start}; solution blocks cannot nest"
            )
        region.solution_start = number
        region.solutions += 1
    elif _CLOSE_SOLUTION.match(line):
        if region is None or region.solution_start is None:
            raise MarkerError(f"{where}: `# <<< solution` without a matching `# >>> solution`")
        region.solution_start = None
    elif _ANY_MARKER.match(line):
        raise MarkerError(
            f"{where}: unrecognised marker {line.strip()!r}; expected "
            "`# >>> exercise N.M: title`, `# <<< exercise`, `# >>> solution` or `# <<< solution`"
        )


def solution_blocks(exercise: Exercise) -> list[list[str]]:
    """The lines strictly inside each `# >>> solution` ... `# <<< solution` block: what a
    student writes."""
    blocks: list[list[str]] = []
    inside = False
    for line in exercise.lines:
        if _OPEN_SOLUTION.match(line):
            inside = True
            blocks.append([])
        elif _CLOSE_SOLUTION.match(line):
            inside = False
        elif inside:
            blocks[-1].append(line)
    return blocks


def check_unique_ids(exercises: Iterable[Exercise]) -> None:
    """Raise `MarkerError` if two regions share an id (in one file or across a chapter)."""
    seen: dict[str, Exercise] = {}
    for exercise in exercises:
        if first := seen.get(exercise.id):
            raise MarkerError(
                f"{exercise.path}:{exercise.start}: duplicate exercise id {exercise.id}; "
                f"already used at {first.path}:{first.start}"
            )
        seen[exercise.id] = exercise


def render_source(
    text: str, path: str, kind: Kind, keep_markers: bool = False, note: str = ""
) -> str:
    """The whole file with every region rendered as a stub or a solution, markers gone
    (or kept, with `keep_markers`: each solution block then holds only its stub, whose
    message ends with `note`)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    next_line = 1
    for exercise in parse_exercises(text, path):
        opening, closing = lines[exercise.start - 1], lines[exercise.end - 1]
        out += lines[next_line - 1 : exercise.start - 1]
        out += [opening] if keep_markers else []
        out += exercise.render(kind, keep_markers, note)
        out += [closing] if keep_markers else []
        next_line = exercise.end + 1
    out += lines[next_line - 1 :]
    return "".join(out)
