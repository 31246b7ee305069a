"""The course: exercises and solutions come from minserve's marked regions, and one suite of
checks runs on every implementation (minserve itself, the solutions, the untouched stubs)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
from functools import cache
from pathlib import Path

import hypothesis
import pytest

from minserve.cli import main as cli_main
from minserve.course.chapters import CHAPTERS, REPO_ROOT, Chapter, get_chapter
from minserve.course.check import Implementation, load_implementation, main, run_check
from minserve.course.generate import (
    chapter_exercises,
    find_drift,
    generated_files,
    has_local_edits,
    render_chapter,
    write_all,
)
from minserve.course.grade import grade_command
from minserve.course.hints import hints_for, show_hint
from minserve.course.regions import MarkerError, parse_exercises, render_source, solution_blocks
from minserve.course.stats import print_stats
from minserve.course.time_limit import CheckTimeout, time_limit

CASES = [
    pytest.param(chapter, check, id=f"ch{chapter.number}-{check.__name__}")
    for chapter in CHAPTERS
    for check in chapter.load_checks()
]


@cache
def _implementation(chapter: Chapter, impl: str) -> Implementation:
    return load_implementation(chapter, impl, REPO_ROOT)


def _report(*args: str, root: Path = REPO_ROOT, time_limit: float = 10.0) -> tuple[int, str]:
    stream = io.StringIO()
    code = run_check(*args, stream=stream, root=root, time_limit=time_limit)
    return code, stream.getvalue()


# --- one suite, three implementations ---------------------------------------------------


@pytest.mark.parametrize("impl", ["minserve", "solutions"])
@pytest.mark.parametrize(("chapter", "check"), CASES)
def test_reference_implementations_pass_every_check(chapter, check, impl):
    check(_implementation(chapter, impl).module)


@pytest.mark.parametrize(("chapter", "check"), CASES)
def test_untouched_exercises_raise_not_implemented_and_nothing_else(chapter, check):
    path = REPO_ROOT / chapter.generated_path("exercise")
    if has_local_edits(path.read_text(encoding="utf-8")):
        pytest.skip(f"{path.name} holds a student's edits, so it is not the untouched stub")
    with pytest.raises(NotImplementedError, match=rf"^Exercise {int(chapter.number)}\.\d+: \S"):
        check(_implementation(chapter, "exercises").module)


def test_generated_files_match_sources():
    problems = find_drift(REPO_ROOT)
    assert not problems, "\n\n".join(problems)


# --- marked regions -----------------------------------------------------------------------

SOURCE = '''\
"""A module with two exercises."""


# >>> exercise 7.1: double it
def double(x: int) -> int:
    """Twice x."""
    # >>> solution
    y = x * 2
    return y
    # <<< solution
# <<< exercise


class Counter:
    """Counts."""

    # >>> exercise 7.2: add one
    def add_one(self, x: int) -> int:
        """x + 1."""
        if x < 0:
            # >>> solution
            raise ValueError("negative")
            # <<< solution
        # >>> solution
        return x + 1
        # <<< solution
    # <<< exercise
'''


def test_parse_finds_ids_titles_and_lines():
    exercises = parse_exercises(SOURCE, "ops.py")
    assert [(e.id, e.title, e.start, e.end) for e in exercises] == [
        ("7.1", "double it", 4, 11),
        ("7.2", "add one", 17, 27),
    ]
    assert exercises[0].label == "Exercise 7.1: double it"


def test_solution_drops_only_the_markers():
    solution = render_source(SOURCE, "ops.py", "solution")
    assert ">>>" not in solution and "<<<" not in solution
    assert "    y = x * 2\n    return y\n" in solution
    assert len(solution.splitlines()) == len(SOURCE.splitlines()) - 10


def test_stub_raises_at_the_solution_markers_indentation():
    stub = render_source(SOURCE, "ops.py", "exercise")
    assert 'def double(x: int) -> int:\n    """Twice x."""\n' in stub
    assert '    raise NotImplementedError("Exercise 7.1: double it")\n' in stub
    assert "y = x * 2" not in stub


def test_stub_of_a_method_stays_inside_its_class():
    stub = render_source(SOURCE, "ops.py", "exercise")
    assert (
        textwrap.dedent('''\
        class Counter:
            """Counts."""

            def add_one(self, x: int) -> int:
                """x + 1."""
                if x < 0:
                    raise NotImplementedError("Exercise 7.2: add one")
                raise NotImplementedError("Exercise 7.2: add one")
        ''')
        in stub
    )
    compile(stub, "ops.py", "exec")


def _error(source: str) -> str:
    with pytest.raises(MarkerError) as caught:
        parse_exercises(textwrap.dedent(source), "ops.py")
    return str(caught.value)


def test_nested_exercise_is_an_error_naming_both_lines():
    message = _error("""\
        # >>> exercise 1.1: outer
        # >>> exercise 1.2: inner
        """)
    assert message.startswith("ops.py:2: ") and "exercise 1.1 opened at line 1" in message


def test_nested_solution_is_an_error_with_its_line():
    message = _error("""\
        # >>> exercise 1.1: a
        # >>> solution
        # >>> solution
        """)
    assert message.startswith("ops.py:3: ") and "opened at line 2" in message


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("# >>> exercise 1.1: a\nx = 1\n", "ops.py:1: exercise 1.1 is never closed"),
        ("x = 1\n# <<< exercise\n", "ops.py:2: `# <<< exercise` without"),
        ("# >>> solution\n", "ops.py:1: `# >>> solution` outside any exercise"),
        ("# >>> exercise 1.1: a\n# <<< solution\n", "ops.py:2: `# <<< solution` without"),
        ("# >>> exercise 1.1: a\n# >>> solution\n# <<< exercise\n", "ops.py:3: `# <<< exercise`"),
        ("# >>> exercise 1.1: a\nx = 1\n# <<< exercise\n", "ops.py:1: exercise 1.1 has no"),
        ("# >>> exercise one: a\n", "ops.py:1: unrecognised marker"),
    ],
)
def test_unbalanced_or_malformed_markers_name_the_line(source, expected):
    assert _error(source).startswith(expected)


def test_duplicate_exercise_id_is_an_error_naming_both_places():
    region = "# >>> exercise 1.1: a\n# >>> solution\n# <<< solution\n# <<< exercise\n"
    message = _error(region + region)
    assert message.startswith("ops.py:5: duplicate exercise id 1.1") and "ops.py:1" in message


# --- generated files ----------------------------------------------------------------------


@pytest.fixture
def course(tmp_path: Path) -> tuple[Path, Path, Chapter]:
    """A synthetic chapter 07 with its sources in `package/` and a checkout in `repo/`."""
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "ops.py").write_text(SOURCE)
    chapter = Chapter(
        number="07",
        slug="ops",
        title="Operations",
        module="ch07_ops",
        sources=("ops.py",),
        header='"""Chapter 07."""\n',
        checks="unused",
    )
    return tmp_path / "package", tmp_path / "repo", chapter


def _files(package: Path, chapter: Chapter):
    return generated_files([chapter], package)


def test_render_chapter_dedents_each_region_under_its_title(course):
    package, _, chapter = course
    stub = render_chapter(chapter, "exercise", package)
    assert "# Exercise 7.2: add one\ndef add_one(self, x: int) -> int:\n" in stub
    assert "this file is yours" in stub and "minserve check 07" in stub
    solution = render_chapter(chapter, "solution", package)
    assert solution.startswith(
        "# Generated from minserve/ops.py by `python -m minserve.course.generate`;\n"
        "# edit the marked regions there, not here.\n"
        '"""Chapter 07."""\n'
    )
    compile(stub, "stub", "exec")
    compile(solution, "solution", "exec")


def test_exercise_ids_must_match_their_chapter(course):
    package, _, chapter = course
    wrong = dataclasses.replace(chapter, number="08")
    with pytest.raises(MarkerError, match=r"minserve/ops.py:4: exercise 7.1 belongs to chapter 08"):
        render_chapter(wrong, "solution", package)


def test_drift_is_found_when_a_region_changes_without_regenerating(course):
    package, repo, chapter = course
    write_all(repo, _files(package, chapter))
    assert find_drift(repo, _files(package, chapter)) == []
    (package / "ops.py").write_text(SOURCE.replace("double it", "double x"))
    problems = find_drift(repo, _files(package, chapter))
    assert [p.split(" ", 1)[0] for p in problems] == [
        "exercises/ch07_ops.py",
        "solutions/ch07_ops.py",
    ]
    assert '+    raise NotImplementedError("Exercise 7.1: double x")' in problems[0]


def test_a_students_edits_are_not_drift_and_are_kept(course):
    package, repo, chapter = course
    write_all(repo, _files(package, chapter))
    exercise = repo / "exercises" / "ch07_ops.py"
    edited = exercise.read_text().replace(
        'raise NotImplementedError("Exercise 7.1: double it")', "return x + x"
    )
    exercise.write_text(edited)
    assert has_local_edits(edited)
    assert find_drift(repo, _files(package, chapter)) == []
    (package / "ops.py").write_text(SOURCE.replace("Twice x.", "Double x."))
    assert find_drift(repo, _files(package, chapter))  # the stub moved on: report it
    report = dict(write_all(repo, _files(package, chapter)))
    assert report["exercises/ch07_ops.py"].startswith("kept (has your edits, but its stub")
    assert exercise.read_text() == edited
    write_all(repo, _files(package, chapter), force=True)
    assert find_drift(repo, _files(package, chapter)) == []


def test_a_removed_fingerprint_counts_as_edited(course):
    package, _, chapter = course
    stub = render_chapter(chapter, "exercise", package)
    assert not has_local_edits(stub)
    without = "".join(line for line in stub.splitlines(True) if "fingerprint" not in line)
    assert has_local_edits(without)


# --- the report ---------------------------------------------------------------------------


def test_report_for_the_solutions_is_all_ticks():
    code, report = _report("00", "solutions")
    checks = len(get_chapter("00").load_checks())
    exercises = len(chapter_exercises(get_chapter("00")))
    assert code == 0
    assert report.startswith("Chapter 00: The model we serve\nchecking solutions/ch00_model.py")
    assert report.count("  ✓ ") == checks + exercises and "✗" not in report  # a line each
    assert f"{checks}/{checks} checks passed." in report


def test_report_for_untouched_exercises_says_not_implemented_yet():
    path = REPO_ROOT / "exercises" / "ch00_model.py"
    if has_local_edits(path.read_text(encoding="utf-8")):
        pytest.skip("exercises/ch00_model.py holds a student's edits")
    code, report = _report("00", "exercises")
    checks = len(get_chapter("00").load_checks())
    assert code == 1
    assert "not implemented yet (Exercise 0.1)" in report
    assert "✓" not in report and "✗" not in report
    assert f"0/{checks} checks passed." in report
    assert "Next: Exercise 0.1: RMSNorm, in exercises/ch00_model.py" in report
    assert "`minserve check 00 0.1`" in report and "`minserve hint 00 0.1`" in report


def test_a_brief_report_gives_the_exercises_and_the_next_step_without_a_line_per_check(tmp_path):
    full, brief = io.StringIO(), io.StringIO()
    root = _student_root(tmp_path, WRONG_TOP_K)
    assert (
        run_check("00", stream=full, root=root)
        == run_check("00", stream=brief, root=root, brief=True)
        == 1
    )
    checks = len(get_chapter("00").load_checks())
    assert "  ✗ k = 2 keeps the two largest logits" in full.getvalue()
    assert "  ✗ k = 2 keeps the two largest logits" not in brief.getvalue()
    summary = full.getvalue()[full.getvalue().index("\n  ○ 0.1 RMSNorm: ") :]
    assert brief.getvalue().endswith(summary) and f"/{checks} checks passed." in summary


WRONG_TOP_K = """\
import torch


def apply_top_k(logits, top_k):
    third = logits.sort(dim=-1, descending=True).values[:, 2:3]  # always 3 tokens
    return logits.masked_fill(logits < third, float("-inf"))


def apply_top_p(logits, top_p):
    return logits.topk(top_p, dim=-1)


def apply_min_p(logits, min_p):
    raise NotImplementedError("Exercise 0.7: min-p filtering")


def rms_norm(x, weight, eps):
    raise NotImplementedError("Exercise 0.1: RMSNorm")


def apply_rope(x, cos, sin):
    raise NotImplementedError("Exercise 0.2: rotary position embedding (RoPE)")


def swiglu(gate, up):
    raise NotImplementedError("Exercise 0.3: SwiGLU")


def attend(q, k, v, start):
    raise NotImplementedError("Exercise 0.4: grouped-query causal attention")


def apply_penalties(logits, rows):
    raise NotImplementedError("Exercise 0.8: repetition, frequency and presence penalties")


def rope_inverse_frequencies(config):
    raise NotImplementedError("Exercise 0.9: RoPE's frequencies")
"""


def _student_root(tmp_path: Path, code: str) -> Path:
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "ch00_model.py").write_text(code)
    return tmp_path


def test_report_for_a_wrong_value_shows_expected_vs_got_and_the_students_line(tmp_path):
    code, report = _report("00", root=_student_root(tmp_path, WRONG_TOP_K))
    assert code == 1
    first_failure = report.split("0.5, first failure: ", 1)[1]
    assert "  ✗ k = 2 keeps the two largest logits" in report
    assert "expected to keep tokens [1, 2], got [1, 2, 3]" in first_failure
    assert "exercises/ch00_model.py:6, in apply_top_k" in first_failure
    assert 'return logits.masked_fill(logits < third, float("-inf"))' in first_failure
    assert "not implemented yet (Exercise 0.7)" in report
    assert "Next: fix the first failure of 0.5 above" in report


def test_report_for_an_error_in_student_code_shows_the_raising_line(tmp_path):
    code = WRONG_TOP_K.replace("values[:, 2:3]", "values[top_k]")  # rows, not columns
    status, report = _report("00", root=_student_root(tmp_path, code))
    first_failure = report.split("0.5, first failure: ", 1)[1]
    assert status == 1
    assert "IndexError: " in first_failure
    assert "your code at " in first_failure
    assert "exercises/ch00_model.py:5, in apply_top_k" in first_failure
    assert "third = logits.sort(dim=-1, descending=True).values[top_k]" in first_failure


def test_report_when_not_run_from_the_repo_root(tmp_path):
    code, report = _report("00", root=tmp_path)
    assert code == 1
    assert "no exercises/ folder" in report and "from the root of the minserve repository" in report


def test_report_for_an_unknown_chapter_lists_the_known_ones():
    code, report = _report("42")
    assert code == 1 and "no chapter '42'; the course has chapters 00" in report


def test_check_without_a_chapter_lists_chapters(capsys):
    assert main([]) == 0
    assert (
        "00  The model we serve  (exercises 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)"
        in capsys.readouterr().out
    )


# --- the time limit -----------------------------------------------------------------------

ENDLESS_TOP_K = WRONG_TOP_K.replace(
    "    third = logits.sort(dim=-1, descending=True).values[:, 2:3]  # always 3 tokens\n",
    "    while True:\n        pass\n",
)


def test_an_endless_loop_stops_at_the_time_limit_and_names_the_exercise(tmp_path):
    started = time.monotonic()
    code, report = _report("00", root=_student_root(tmp_path, ENDLESS_TOP_K), time_limit=0.5)
    assert time.monotonic() - started < 30  # one check times out; the rest are skipped
    assert code == 1
    assert "⧗ k = 2 keeps the two largest logits" in report
    first_failure = report.split("0.5, first failure: ", 1)[1]
    assert "Exercise 0.5: your code ran 0.5 s without finishing" in first_failure
    assert "--time-limit SECONDS" in first_failure
    assert "stopped in your code at" in first_failure and "in apply_top_k" in first_failure
    assert "- apply_top_k returns a new tensor" in report
    assert "skipped: it calls apply_top_k" in report
    assert "✓" not in report  # 0.6 and 0.7 still run: top-p wrong, min-p not implemented
    assert "not implemented yet (Exercise 0.7)" in report


def test_the_progress_note_of_an_exercise_says_what_must_change(tmp_path):
    solution = (REPO_ROOT / "solutions" / "ch03_scheduler.py").read_text(encoding="utf-8")
    endless = solution.replace(
        "        self.waiting.sort(key=self.policy)\n", "        while True:\n            pass\n", 1
    )
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "ch03_scheduler.py").write_text(endless)
    code, report = _report("03", root=tmp_path, time_limit=0.5)
    assert code == 1
    assert "Exercise 3.2: your loop made no progress in 0.5 s: each pass must take" in report
    assert "in _admit_waiting" in report and "skipped: it calls _admit_waiting" in report


def test_minserve_check_in_a_terminal_stops_an_endless_loop(tmp_path):
    root = _student_root(tmp_path, ENDLESS_TOP_K)
    command = [sys.executable, "-m", "minserve.cli", "check", "00", "--root", str(root)]
    started = time.monotonic()
    done = subprocess.run(
        [*command, "--time-limit", "1"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Exercise 0.5: your code ran 1 s without finishing" in done.stdout
    assert time.monotonic() - started < 120


def test_off_the_main_thread_checks_run_without_a_limit():
    """Signals reach the main thread only (a terminal's, or a notebook kernel's)."""
    found: list[bool] = []

    def work() -> None:
        with time_limit(0.05):
            time.sleep(0.2)
        found.append(True)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=10)
    assert found == [True]


def test_the_time_limit_leaves_slow_code_that_is_not_yours_alone():
    with time_limit(0.05, {"/nowhere/yours.py"}):
        time.sleep(0.2)  # not your file: runs to the end
    with pytest.raises(CheckTimeout), time_limit(0.05):
        time.sleep(0.2)


# --- hints ----------------------------------------------------------------------------------


def _hint(*args, **kwargs) -> tuple[int, str]:
    stream = io.StringIO()
    code = show_hint(*args, stream=stream, **kwargs)
    return code, stream.getvalue()


def test_hint_levels_show_the_ones_before_them():
    near_code = hints_for(get_chapter("03"), "3.1")[2]
    code, first = _hint("03", "3.1")
    assert code == 0 and "Hint 1 (the idea)" in first and "Hint 2" not in first
    assert "More: --level 2" in first
    _, third = _hint("03", "1", level=3)  # "1" is exercise 3.1
    assert all(f"Hint {n}" in third for n in (1, 2, 3)) and "More:" not in third
    assert " ".join(near_code.split()[:5]) in " ".join(third.split())


def test_hint_without_an_exercise_lists_the_commands():
    code, listing = _hint("03")
    assert code == 0 and "minserve hint 03 3.1" in listing and "Exercise 3.1:" in listing


def test_hint_for_an_unknown_exercise_or_a_chapter_without_hints(monkeypatch):
    code, text = _hint("03", "3.9")
    assert code == 1 and "no exercise '3.9' in chapter 03; its exercises are 3.1" in text
    monkeypatch.setattr("minserve.course.hints.chapter_hints", lambda chapter: {})
    code, text = _hint("03", "3.1")
    assert code == 1 and "chapter 03 has no hints yet" in text


def test_minserve_hint_on_the_command_line(capsys):
    assert cli_main(["hint", "03", "3.1", "--level", "2"]) == 0
    assert "Hint 2 (the structure)" in capsys.readouterr().out


# --- grading: --all --json, and the statistics -------------------------------------------


def test_json_report_has_a_row_per_check_and_counts(tmp_path):
    stream = io.StringIO()
    root = _student_root(tmp_path, WRONG_TOP_K)
    code = grade_command("00", False, "exercises", root, 10.0, True, stream)
    report = json.loads(stream.getvalue())
    rows = report["checks"]
    assert code == 1 and len(rows) == len(get_chapter("00").load_checks())
    assert set(rows[0]) == {"chapter", "exercise", "check", "status", "message"}
    first = next(row for row in rows if row["status"] == "fail")
    assert (first["chapter"], first["exercise"]) == ("00", "0.5")
    assert "expected to keep tokens [1, 2], got [1, 2, 3]" in first["message"]
    assert "exercises/ch00_model.py:6, in apply_top_k" in first["message"]
    assert {row["exercise"] for row in rows} == {f"0.{i}" for i in range(1, 10)}
    todo = {row["exercise"] for row in rows if row["status"] == "not implemented"}
    assert todo == {"0.1", "0.2", "0.3", "0.4", "0.7", "0.8", "0.9"}
    summary = report["summary"]
    assert summary["total"] == len(rows) == sum(v for k, v in summary.items() if k != "total")
    assert report["chapters"]["00"] == summary


def test_json_report_for_a_checkout_without_exercises_fails_every_check(tmp_path):
    stream = io.StringIO()
    assert grade_command("00", False, "exercises", tmp_path, 10.0, True, stream) == 1
    rows = json.loads(stream.getvalue())["checks"]
    assert rows and all(r["status"] == "fail" for r in rows)
    assert all("no exercises/ folder" in r["message"] for r in rows)


def test_stats_count_the_lines_inside_solution_blocks(capsys):
    total = print_stats()
    text = capsys.readouterr().out
    lines = [
        len(block)
        for chapter in CHAPTERS
        for exercise in chapter_exercises(chapter)
        for block in solution_blocks(exercise)
    ]
    assert total == sum(lines) and all(lines)
    assert text.splitlines()[-1].split()[-1] == str(total)
    assert "03 Continuous batching" in text


def test_hypothesis_is_a_core_dependency_pinned_to_the_installed_version():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert f"hypothesis=={hypothesis.__version__}" in project["project"]["dependencies"]
    install = (REPO_ROOT / "scripts" / "install.sh").read_text(encoding="utf-8")
    assert 'install -e ".${extras}"' in install  # core dependencies with or without --dev
