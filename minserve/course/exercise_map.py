"""Which exercise each check belongs to: the one it reaches first.

Each check of a chapter runs once against the chapter's untouched stubs and is stopped at
the first stub it calls; that stub's exercise owns the check. `minserve check NN N.M` runs
the checks of one exercise this way, the report groups its results by exercise, and
`minserve check --json` labels each row with it.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from functools import cache
from pathlib import Path
from types import CodeType, FrameType

from minserve.course.chapters import Chapter, Check
from minserve.course.check import _EXERCISE_ID, _load_file, check_name
from minserve.course.generate import render_chapter
from minserve.course.time_limit import DEFAULT_TIME_LIMIT, CheckTimeout, time_limit


class _Reached(BaseException):
    """Raised on entering a stub. A BaseException, so neither the checks nor hypothesis nor
    Triton's interpreter take it for a failure to retry, shrink or wrap."""

    def __init__(self, exercise: str) -> None:
        super().__init__(exercise)
        self.exercise = exercise


@cache
def check_exercises(chapter: Chapter) -> dict[str, str]:
    """Each check's name -> the exercise id its untouched stub reaches first ("" if none)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{chapter.module}.py"
        path.write_text(render_chapter(chapter, "exercise"), encoding="utf-8")
        stubs = _load_file(f"stubs.{chapter.module}", path)
        return {
            check_name(check): _first_exercise(check, stubs, str(path))
            for check in chapter.load_checks()
        }


def _first_exercise(check: Check, stubs: object, path: str) -> str:
    """Run `check` on the stubs until it enters one; that stub's exercise id."""

    def on_call(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename == path:
            if exercise := _stub_exercise(frame.f_code):
                raise _Reached(exercise)

    previous = sys.getprofile()
    sys.setprofile(on_call)
    try:
        with time_limit(DEFAULT_TIME_LIMIT, {path}), contextlib.redirect_stdout(None):
            check(stubs)  # type: ignore[arg-type]
    except _Reached as reached:
        return reached.exercise
    except NotImplementedError as error:  # a stub entered off this thread, say
        if found := _EXERCISE_ID.search(str(error)):
            return found[1]
    except (Exception, CheckTimeout):
        pass
    finally:
        sys.setprofile(previous)
    return ""


def _stub_exercise(code: CodeType) -> str:
    """The exercise id ("3.1") when `code` is a stub's body, which raises
    `NotImplementedError("Exercise 3.1: ...")`; "" for the given functions around stubs."""
    if "NotImplementedError" not in code.co_names:
        return ""
    for constant in code.co_consts:
        if isinstance(constant, str) and constant.startswith("Exercise "):
            return constant.removeprefix("Exercise ").split(":", 1)[0]
    return ""
