"""Where an error in your file points: at the lines you wrote, not the given ones.

An exercise file mixes given lines (the signature, the setup, and in Triton kernels the
`tl.store` after your code) with the lines you wrote in place of the stub's `raise`. An
error often surfaces in a given line: a `tl.store` of an `out` your lines built with the
wrong shape, a name your lines never set. The report then shows your frames, innermost
first, labels a given line as given, and names the lines of yours that last set what it
uses.
"""

from __future__ import annotations

import ast
import difflib
import linecache
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from minserve.course.chapters import REPO_ROOT

MAX_CALLERS = 2  # your frames shown above the one that raised
MAX_NAMES = 3  # names of a given line traced back to your lines
Position = tuple[str, int | None, str]  # a frame: filename, line, function


def written_lines(text: str, stub: str) -> frozenset[int]:
    """The 1-based numbers of the lines of `text` that are not the untouched `stub`'s: the
    lines you wrote."""
    lines, given = text.splitlines(), stub.splitlines()
    matcher = difflib.SequenceMatcher(None, given, lines, autojunk=False)
    kept = {b + i + 1 for _, b, size in matcher.get_matching_blocks() for i in range(size)}
    return frozenset(range(1, len(lines) + 1)) - kept


def describe_frames(frames: Sequence[Position], stub: str = "", lead: str = "{}") -> str:
    """Your frames of a traceback, innermost last: the line that raised, then up to
    MAX_CALLERS callers of yours. With `stub` (the untouched file), a line you did not write
    is labelled given and followed by your lines that set the names it uses. `lead` frames
    the first line's "your code" or "given code": "the value came from {}"."""
    filename, line, function = frames[-1]
    mine = _written(filename, stub) if stub else None
    if mine is None or line in mine or not mine:
        parts = [frame_text(lead.format("your code") + " at", filename, line, function)]
    else:
        whose = lead.format("given code (not yours)") + " at"
        parts = [frame_text(whose, filename, line, function), *_setters(filename, line or 0, mine)]
    for caller in reversed(frames[-1 - MAX_CALLERS : -1]):
        parts.append(frame_text("called from your code at", *caller))
    return "\n".join(parts)


def frame_text(prefix: str, filename: str, line: int | None, function: str) -> str:
    """`prefix path:line, in function:` and the line's source, indented."""
    text = f"{prefix} {display(Path(filename))}:{line}{f', in {function}' if function else ''}"
    source = linecache.getline(filename, line or 0).strip()
    return f"{text}:\n    {source}" if source else text


def display(path: Path) -> str:
    """A path relative to the working directory or the repo root when it lies inside one."""
    for base in (Path.cwd(), REPO_ROOT):
        if path.resolve().is_relative_to(base.resolve()):
            return str(path.resolve().relative_to(base.resolve()))
    return str(path)


def _written(filename: str, stub: str) -> frozenset[int] | None:
    try:
        return _written_in(Path(filename).read_text(encoding="utf-8"), stub)
    except OSError:
        return None


@lru_cache(maxsize=8)
def _written_in(text: str, stub: str) -> frozenset[int]:
    return written_lines(text, stub)


def _setters(filename: str, line: int, mine: frozenset[int]) -> list[str]:
    """For each name the statement at `line` reads, the last line of yours before it that
    assigned it; else the span of your lines in that function."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except SyntaxError:
        return []
    function = _innermost(tree, line, (ast.FunctionDef, ast.AsyncFunctionDef))
    statement = _innermost(function, line, (ast.stmt,), skip=function) if function else None
    if function is None or statement is None:
        return []
    found = []
    for name in _names_read(statement):
        lines = [n for n in _assignments(function, name) if n < line and n in mine]
        if lines and len(found) < MAX_NAMES:
            whose = f"`{name}` there was last set by your code at"
            found.append(frame_text(whose, filename, max(lines), ""))
    yours = sorted(n for n in mine if function.lineno <= n < line)
    if found or not yours:
        return found
    return [f"your lines above it in {function.name}: {display(Path(filename))}:"
            f"{yours[0]}-{yours[-1]}"]  # fmt: skip


def _innermost(
    root: ast.AST, line: int, kinds: tuple[type, ...], skip: ast.AST | None = None
) -> Any:
    """The innermost node of one of `kinds` under `root` (`skip` aside) spanning `line`."""
    best = None
    for node in ast.walk(root):
        if isinstance(node, kinds) and node is not skip and _spans(node, line):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best


def _spans(node: Any, line: int) -> bool:
    return node.lineno <= line <= (node.end_lineno or node.lineno)


def _names_read(statement: ast.stmt) -> list[str]:
    """The names the statement loads, in order, once each; for a compound statement (`for`,
    `if`, `with`), those of its header only."""
    names: list[str] = []
    for field, value in ast.iter_fields(statement):
        if field in ("body", "orelse", "finalbody", "handlers"):
            continue
        for part in value if isinstance(value, list) else [value]:
            for node in ast.walk(part) if isinstance(part, ast.AST) else ():
                loads = isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                if loads and node.id not in names:
                    names.append(node.id)
    return names


def _assignments(function: ast.AST, name: str) -> Iterator[int]:
    """The lines in `function` that bind `name`."""
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            yield node.lineno
