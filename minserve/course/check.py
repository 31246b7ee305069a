"""`minserve check NN [N.M]`: check your code for a chapter, or one exercise, plainly.

The implementation under test is one of
- `exercises`: your workspace, `exercises/chNN_*.py` under the current directory;
- `solutions`: the reference copies in `solutions/`;
- `minserve`: the chapter's source modules inside minserve itself.

Each check is a function taking that module; it passes, fails (an assertion or any other
error), meets a stub's `NotImplementedError`, or runs past its time limit (10 s unless
`--time-limit` says otherwise): then the report names the exercise, what each pass of its
loop must change, and the line it was stopped at. After a time-out, later checks that call
the function which hung are skipped, so the whole run stays bounded. A check belongs to
the exercise it reaches first (`minserve.course.exercise_map`). The report shows one line
per check, one per exercise, then each exercise's first failure in full: its message and
the lines of your code where it broke (`minserve.course.your_lines`). The closing line
says what to do next, and which `minserve hint` to ask when something failed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import linecache
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import CodeType, FrameType, ModuleType
from typing import Literal, TextIO

from minserve.course.chapters import CHAPTERS, Chapter, Check, get_chapter
from minserve.course.report import Scope, by_exercise, indent, result_line, summary
from minserve.course.time_limit import DEFAULT_TIME_LIMIT, CheckTimeout, time_limit
from minserve.course.your_lines import describe_frames, frame_text

IMPLS = ("exercises", "solutions", "minserve")
Outcome = Literal["passed", "failed", "not implemented", "timed out", "skipped"]
_EXERCISE_ID = re.compile(r"Exercise (\d+(?:\.\d+)+)")
# where a region starts: `# >>> exercise 3.1: ...` in minserve, `# Exercise 3.1: ...` generated
_REGION_START = re.compile(r"^\s*# (?:>>> exercise|Exercise) (\d+(?:\.\d+)+):")
_DEFINITION = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)")
_REGION_END = re.compile(r"^\s*# <<< exercise\s*$")


class CourseError(Exception):
    """Something to fix before any check can run: wrong folder, a file that won't import."""


@dataclass(frozen=True)
class Implementation:
    """The module under test and the files its code lives in (to spot your frames)."""

    module: ModuleType
    files: tuple[Path, ...]
    label: str  # what the report calls it: "exercises/ch00_model.py"
    chapter: Chapter | None = None  # a generated file's chapter: its stub tells your lines

    def stub(self) -> str:
        """The untouched stub of a generated file ("" for minserve's own sources): the lines
        it shares with yours are given, the others you wrote."""
        return _stub(self.chapter) if self.chapter is not None else ""


@dataclass(frozen=True)
class CheckResult:
    """What one check found."""

    name: str
    outcome: Outcome
    message: str = ""  # the exercise label, or the failure's message
    where: str = ""  # the failing line, yours when the traceback reaches your file
    exercise: str = ""  # "3.1" when known: the stub met, or where a time-out stopped


class _Skipped(BaseException):
    """Raised on entering a function of yours that already ran past a time limit."""

    def __init__(self, code: CodeType) -> None:
        super().__init__(code.co_name)
        self.code = code


@dataclass
class Session:
    """What one run of a chapter's checks carries from check to check."""

    seconds: float | None = DEFAULT_TIME_LIMIT  # per check; None: no limit
    progress: dict[str, str] | None = None  # exercise id -> what each pass must change
    hung: dict[CodeType, str] | None = None  # your functions that timed out -> that check
    functions: dict[str, str] | None = None  # function or class name -> its exercise id

    def exercise_of(self, code: CodeType, line: int | None = None) -> str:
        """The exercise a function of yours belongs to: by its region in the file, else by
        its name."""
        return _exercise_at(code, line) or (self.functions or {}).get(code.co_name, "")


def load_implementation(chapter: Chapter, impl: str, root: Path | None = None) -> Implementation:
    """Import the chapter's module from `exercises/`, `solutions/` (under `root`) or minserve."""
    if impl == "minserve":
        modules = [importlib.import_module(name) for name in chapter.source_modules()]
        files = tuple(Path(m.__file__).resolve() for m in modules if m.__file__)
        label = ", ".join(f"minserve/{source}" for source in chapter.sources)
        return Implementation(_merge(modules, chapter), files, label)
    if impl not in IMPLS:
        raise CourseError(f"unknown implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    root = (root or Path.cwd()).resolve()
    if not (root / impl).is_dir():
        raise CourseError(
            f"no {impl}/ folder in {root}. Run `minserve check` from the root of the "
            f"minserve repository, the folder that holds {impl}/."
        )
    relative = chapter.generated_path(impl.removesuffix("s"))  # "exercises/ch00_model.py"
    path = root / relative
    if not path.exists():
        raise CourseError(
            f"{relative} is missing; restore it with `python -m minserve.course.generate`"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # so your module can import its neighbours
    module = _load_file(f"{impl}.{chapter.module}", path)
    return Implementation(module, (path,), relative, chapter)


@cache
def _stub(chapter: Chapter) -> str:
    from minserve.course.generate import render_chapter  # parses sources; only needed here

    return render_chapter(chapter, "exercise")


def _load_file(name: str, path: Path) -> ModuleType:
    """Execute `path` afresh as module `name` (edits since the last run are picked up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module  # dataclasses and typing look their module up while it runs
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise CourseError(
            f"could not import {path.name}:\n{indent(_describe(error, (path,)), 2)}"
        ) from error
    finally:
        if previous is None:
            del sys.modules[name]
        else:
            sys.modules[name] = previous
    return module


def _merge(modules: list[ModuleType], chapter: Chapter) -> ModuleType:
    """A chapter drawn from one source module is that module; several are merged into one."""
    if len(modules) == 1:
        return modules[0]
    merged = ModuleType(f"minserve_{chapter.module}")
    for module in modules:
        merged.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    return merged


def passes(impl: ModuleType, checks: list[Check]) -> bool:
    """Whether `impl` passes every one of `checks`: a notebook's switch from the solution to
    the student's code once it is right."""
    try:
        for check in checks:
            check(impl)
    except Exception:  # a failed check, a stub, or a bug: not ready for the engine
        return False
    return True


def run_one(check: Check, impl: Implementation, session: Session | None = None) -> CheckResult:
    """Run one check under the session's time limit and classify what happened."""
    session = session or Session()
    name = check_name(check)
    tracer = _ReturnTracer(impl.files, session.hung or {})
    seconds = session.seconds and session.seconds * getattr(check, "time_limit_factor", 1)
    try:
        with time_limit(seconds, {str(f) for f in impl.files}), tracer:
            check(impl.module)
    except NotImplementedError as error:
        if found := _EXERCISE_ID.search(str(error)):  # a stub; torch raises it too, elsewhere
            return CheckResult(name, "not implemented", str(error), exercise=found[1])
        return CheckResult(name, "failed", _message(error), _where(error, impl, tracer))
    except CheckTimeout as error:
        return _timed_out(name, error, impl, session)
    except _Skipped as skipped:
        where = (session.hung or {}).get(skipped.code, "an earlier check")
        message = (
            f"skipped: it calls {skipped.code.co_name}, stopped at the time limit in "
            f"'{where}'; fix that loop first"
        )
        return CheckResult(name, "skipped", message, exercise=session.exercise_of(skipped.code))
    except Exception as error:
        where = _where(error, impl, tracer)
        return CheckResult(name, "failed", _message(_unwrapped(error)), where)
    return CheckResult(name, "passed")


def _timed_out(
    name: str, error: CheckTimeout, impl: Implementation, session: Session
) -> CheckResult:
    """Name the exercise that hung, what must make progress, and where it was stopped."""
    frames = [
        (frame, line)
        for frame, line in traceback.walk_tb(error.__traceback__)
        if _resolve(frame.f_code.co_filename) in impl.files
    ]
    seconds = f"{error.seconds:g} s"
    if not frames:
        message = (
            f"no result in {seconds}, and the time went outside your code (the check itself, "
            "or minserve); on a slow machine, raise the limit: --time-limit SECONDS"
        )
        return CheckResult(name, "timed out", message)
    frame, line = frames[-1]
    exercise = session.exercise_of(frame.f_code, line)
    progress = (session.progress or {}).get(exercise, "")
    head = f"Exercise {exercise}: " if exercise else ""
    if progress:
        message = f"{head}your loop made no progress in {seconds}: {progress}"
    else:
        message = (
            f"{head}your code ran {seconds} without finishing: look for a loop whose "
            "condition never changes"
        )
    message += " (a slow machine? raise the limit: --time-limit SECONDS; in run_check, time_limit=)"
    if session.hung is not None:
        session.hung[frame.f_code] = name
    where = frame_text(
        "stopped in your code at", frame.f_code.co_filename, line, frame.f_code.co_name
    )
    return CheckResult(name, "timed out", message, where, exercise)


def _exercise_at(code: CodeType, line: int | None = None) -> str:
    """The exercise whose region holds `line` (default: the function's first line) of
    `code`'s file, or "" outside every region."""
    filename, line = code.co_filename, line or code.co_firstlineno
    found = ""
    for text in linecache.getlines(filename)[:line]:
        if start := _REGION_START.match(text):
            found = start[1]
        elif _REGION_END.match(text):
            found = ""
    return found


class _ReturnTracer:
    """Remembers the last line of your code that returned, to show where a wrong value came
    from when the assertion that caught it lives in the check, not in your file."""

    def __init__(self, files: tuple[Path, ...], hung: dict[CodeType, str]) -> None:
        self._files = {str(f) for f in files}
        self._is_yours: dict[str, bool] = {}
        self._hung = hung  # entering one of these raises _Skipped
        self.last: tuple[str, int, str] | None = None  # filename, line, function

    def __enter__(self) -> None:
        self._previous = sys.getprofile()
        sys.setprofile(self._on_event)

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)

    def _on_event(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in self._hung:
            raise _Skipped(frame.f_code)
        if event != "return":
            return
        filename = frame.f_code.co_filename
        if filename not in self._is_yours:
            self._is_yours[filename] = str(_resolve(filename)) in self._files
        if self._is_yours[filename]:
            self.last = (filename, frame.f_lineno, frame.f_code.co_name)


def check_name(check: Check) -> str:
    """The first docstring line, or the function name made readable."""
    doc = (check.__doc__ or "").strip()
    if doc:
        return doc.splitlines()[0].rstrip(".")
    return check.__name__.removeprefix("check_").replace("_", " ")


def _message(error: BaseException) -> str:
    """The error's text; its type too, unless it is a check's own assertion."""
    text = str(error).strip()
    if isinstance(error, AssertionError) and _raised_in_a_check(error):
        return text or "assertion failed"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _raised_in_a_check(error: BaseException) -> bool:
    """Whether a check's module raised it (not Triton, minserve or your own `assert`)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = _resolve(frames[-1].filename) if frames else None
    return where is None or where.parent == Path(__file__).resolve().parent


def _describe(error: BaseException, files: tuple[Path, ...]) -> str:
    """Message plus location, for errors raised while importing your file."""
    if isinstance(error, SyntaxError):
        return "".join(traceback.format_exception_only(error)).rstrip()
    return f"{_message(error)}\n{_describe_frame(error, files)}".rstrip()


def _wrapped(error: BaseException) -> BaseException | None:
    """What Triton's interpreter wrapped in `error`, when it is its InterpreterError: each call
    of a @triton.jit function (a kernel, or a helper a kernel calls) wraps what it raised."""
    return error.__cause__ if type(error).__name__ == "InterpreterError" else None


def _unwrapped(error: BaseException) -> BaseException:
    while (inner := _wrapped(error)) is not None:
        error = inner
    return error


def _frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The traceback of `error` and of each error it wraps, outermost first: the whole path
    from the check into a kernel and the helpers it called."""
    frames = traceback.extract_tb(error.__traceback__)
    while (inner := _wrapped(error)) is not None:
        error = inner
        frames += traceback.extract_tb(error.__traceback__)
    return frames


def _describe_frame(error: BaseException, files: tuple[Path, ...], stub: str = "") -> str:
    """The traceback's frames in your files (the one that raised, and its callers of yours),
    else the deepest frame of all."""
    frames = _frames(error)
    yours = [f for f in frames if _resolve(f.filename) in files]
    if yours:
        return describe_frames([(f.filename, f.lineno, f.name) for f in yours], stub)
    if frames:
        return frame_text("checked at", frames[-1].filename, frames[-1].lineno, frames[-1].name)
    return ""


def _where(error: BaseException, impl: Implementation, tracer: _ReturnTracer) -> str:
    """Where to look: the line of your code that raised, or else the one that returned the
    value the check rejected."""
    frames = _frames(error)
    if tracer.last and not any(_resolve(f.filename) in impl.files for f in frames):
        return describe_frames([tracer.last], impl.stub(), "the value came from {}")
    return _describe_frame(error, impl.files, impl.stub())


def _resolve(filename: str) -> Path | None:
    try:
        return Path(filename).resolve()
    except OSError:
        return None


def run_chapter(
    chapter: Chapter,
    implementation: Implementation,
    seconds: float | None = DEFAULT_TIME_LIMIT,
    on_result: Callable[[CheckResult], None] | None = None,
    checks: list[Check] | None = None,
) -> list[CheckResult]:
    """Every check of `chapter` (or those of `checks`) on `implementation`, each under
    `seconds`, in order."""
    checks_module = importlib.import_module(chapter.checks)
    progress = getattr(checks_module, "PROGRESS", {})
    session = Session(seconds, progress, {}, _exercise_names(chapter))
    results = []
    for check in chapter.load_checks() if checks is None else checks:
        results.append(result := run_one(check, implementation, session))
        if on_result is not None:
            on_result(result)
    return results


def _exercise_names(chapter: Chapter) -> dict[str, str]:
    """Each function and class defined in the chapter's regions -> its exercise id."""
    from minserve.course.generate import chapter_exercises  # parses sources

    names: dict[str, str] = {}
    for exercise in chapter_exercises(chapter):
        for line in exercise.lines:
            if found := _DEFINITION.match(line):
                names.setdefault(found[1], exercise.id)
    return names


def run_check(
    chapter_number: str,
    impl: str = "exercises",
    stream: TextIO | None = None,
    root: Path | None = None,
    time_limit: float | None = DEFAULT_TIME_LIMIT,
    brief: bool = False,
    exercise: str | None = None,
) -> int:
    """Check one chapter, or one `exercise` of it ("4.3", or "3"), and print the report to
    `stream`; 0 if every check run passes, else 1.

    `stream` defaults to stdout; `root` is the folder holding `exercises/` and `solutions/`
    (default: the current directory); `time_limit` is in seconds per check (None: none);
    `brief` leaves out the line per check (a notebook's second check of a chapter prints
    the line per exercise, the failures and what to do next, not the whole list again).
    """
    results = checked(chapter_number, impl, stream, root, time_limit, brief, exercise)
    return 0 if results is not None and all(r.outcome == "passed" for r in results) else 1


def checked(
    chapter_number: str,
    impl: str = "exercises",
    stream: TextIO | None = None,
    root: Path | None = None,
    time_limit: float | None = DEFAULT_TIME_LIMIT,
    brief: bool = False,
    exercise: str | None = None,
) -> list[CheckResult] | None:
    """`run_check`'s work: the report printed, each check's result returned (None: the
    implementation could not be loaded, which the report says)."""
    from minserve.course.exercise_map import check_exercises  # runs the stubs: only here

    stream = stream or sys.stdout
    try:
        chapter = get_chapter(chapter_number)
        titles = _exercise_titles(chapter)
        wanted = _exercise_id(chapter, exercise, titles) if exercise else ""
        implementation = load_implementation(chapter, impl, root)
    except (KeyError, CourseError) as error:
        print(f"minserve check: {error.args[0]}", file=stream)
        return None
    owners = check_exercises(chapter)  # check name -> the exercise it belongs to
    checks = [c for c in chapter.load_checks() if not wanted or owners[check_name(c)] == wanted]
    only = f": Exercise {wanted}, {titles[wanted]}" if wanted else ""
    print(f"Chapter {chapter.number}: {chapter.title}", file=stream)
    print(f"checking {implementation.label}{only}" + ("" if brief else "\n"), file=stream)

    def report(result: CheckResult) -> None:
        if not brief:
            print(result_line(result), file=stream, flush=True)

    results = run_chapter(chapter, implementation, time_limit, report, checks)
    scope = Scope(chapter.number, implementation.label, impl, wanted, _hinted(chapter))
    print(summary(by_exercise(results, owners, titles), scope), file=stream)
    return results


def _exercise_titles(chapter: Chapter) -> dict[str, str]:
    """The chapter's exercise ids -> titles, in order."""
    from minserve.course.generate import chapter_exercises  # parses sources; only needed here

    return {e.id: e.title for e in chapter_exercises(chapter)}


def _exercise_id(chapter: Chapter, exercise: str, titles: dict[str, str]) -> str:
    """The exercise id for "4.3" or "3" in chapter 04; CourseError lists the chapter's."""
    wanted = exercise if "." in exercise else f"{int(chapter.number)}.{exercise}"
    if wanted not in titles:
        known = "\n".join(f"  {id_} {title}" for id_, title in titles.items())
        raise CourseError(
            f"no exercise {exercise!r} in chapter {chapter.number}; its exercises are:\n{known}"
        )
    return wanted


def _hinted(chapter: Chapter) -> frozenset[str]:
    from minserve.course.hints import chapter_hints

    return frozenset(chapter_hints(chapter))


def list_chapters(stream: TextIO | None = None) -> None:
    """Print the chapters and how to check one (to stdout by default)."""
    stream = stream or sys.stdout
    from minserve.course.generate import chapter_exercises  # parses sources; only needed here

    print("The course's chapters:\n", file=stream)
    for chapter in CHAPTERS:
        ids = ", ".join(e.id for e in chapter_exercises(chapter))
        print(f"  {chapter.number}  {chapter.title}  (exercises {ids})", file=stream)
    print(
        "\nRun `minserve check NN` from the repository root to check your exercises/chNN_*.py,"
        "\nor `minserve check NN N.M` (e.g. `minserve check 04 4.3`) to check one exercise.",
        file=stream,
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("chapter", nargs="?", help="chapter number, e.g. 00; omit to list them")
    parser.add_argument(
        "exercise", nargs="?", help="one exercise to check, e.g. 4.3; omit to check them all"
    )
    parser.add_argument(
        "--impl",
        choices=IMPLS,
        default="exercises",
        help="what to check: your exercises (default), the solutions, or minserve itself",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="the checkout holding exercises/ and solutions/ (default: the current folder)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT,
        metavar="SECONDS",
        help=f"stop a check after this long (default {DEFAULT_TIME_LIMIT:g}; 0: no limit)",
    )
    parser.add_argument("--all", action="store_true", help="check every chapter")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON report (for grading a class)"
    )
    parser.add_argument(
        "--stats", action="store_true", help="count the exercises and the lines you write"
    )


def add_check_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `check` on the `minserve` command line; it dispatches to `check_command`."""
    parser = subparsers.add_parser(
        "check", help="check your exercises for a chapter", description=__doc__.split("\n")[0]
    )
    _add_arguments(parser)
    parser.set_defaults(run=check_command)  # minserve.cli calls args.run(args)
    return parser


def check_command(args: argparse.Namespace) -> int:
    """Run `minserve check [NN [N.M] | --all] [--impl ...] [--json] [--stats]` from parsed
    arguments; returns the exit code."""
    seconds = args.time_limit or None
    if args.exercise and (args.all or args.json or args.stats):
        print("minserve check: one exercise (NN N.M) goes without --all, --json and --stats")
        return 1
    if args.stats:
        from minserve.course.stats import print_stats

        print_stats()
        return 0
    if args.all or args.json:
        from minserve.course.grade import grade_command

        return grade_command(args.chapter, args.all, args.impl, args.root, seconds, args.json)
    if args.chapter is None:
        list_chapters()
        return 0
    return run_check(
        args.chapter, args.impl, root=args.root, time_limit=seconds, exercise=args.exercise
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m minserve.course.check 00 [0.5]`: the same as `minserve check 00 [0.5]`."""
    parser = argparse.ArgumentParser(prog="minserve check", description=__doc__.split("\n")[0])
    _add_arguments(parser)
    return check_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
