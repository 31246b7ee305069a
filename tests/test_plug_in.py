"""Plug-in cells say whose code ran: the solutions until every check of the student's
exercises passes, the student's after, with the count of checks that pass."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from minserve.course.chapters import REPO_ROOT, get_chapter
from minserve.course.plug_in import plug_in

CHAPTER = get_chapter("08")  # a chapter whose checks take well under a second


@pytest.fixture(autouse=True)
def _imports_restored() -> Iterator[None]:
    """plug_in registers its module and root like an import: undo that for other tests."""
    path = list(sys.path)
    ours = ("exercises", "solutions")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ours}
    yield
    sys.path[:] = path
    for name in [k for k in sys.modules if k.split(".")[0] in ours]:
        del sys.modules[name]
    sys.modules.update(saved)


def _checkout(tmp_path: Path, exercises_from: str) -> Path:
    """A folder with exercises/ (copied from `exercises_from`) and solutions/."""
    for kind in ("exercises", "solutions"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "__init__.py").write_text("")
    module = f"{CHAPTER.module}.py"
    shutil.copy(REPO_ROOT / exercises_from / module, tmp_path / "exercises" / module)
    shutil.copy(REPO_ROOT / "solutions" / module, tmp_path / "solutions" / module)
    return tmp_path


def test_untouched_exercises_run_the_solutions_and_say_so(tmp_path: Path, capsys) -> None:
    code = plug_in("08", root=_checkout(tmp_path, "exercises"))
    assert not code.yours and code.passed == 0 and code.total > 0
    assert Path(code.module.__file__) == tmp_path / "solutions" / f"{CHAPTER.module}.py"
    assert code.ran == f"ran: solutions (yours: 0/{code.total} checks pass)"
    assert "checks passed" in capsys.readouterr().out  # the report was printed


def test_exercises_that_pass_every_check_run_and_are_called_yours(tmp_path: Path) -> None:
    code = plug_in("08", root=_checkout(tmp_path, "solutions"), report=False)
    assert code.yours and code.passed == code.total > 0
    assert Path(code.module.__file__) == tmp_path / "exercises" / f"{CHAPTER.module}.py"
    assert code.ran == f"ran: yours ({code.total}/{code.total} checks pass)"
    assert sys.modules[code.module.__name__] is code.module  # pickled by name, as imported


def test_a_subset_of_exercises_counts_only_their_checks(tmp_path: Path) -> None:
    root = _checkout(tmp_path, "exercises")
    whole = plug_in("08", root=root, report=False)
    first = plug_in("08", exercises=("8.1",), root=root, report=False)
    assert 0 < first.total < whole.total
