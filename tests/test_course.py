"""The course: exercises and solutions come from minserve's marked regions, and one suite of
checks runs on every implementation (minserve itself, the solutions, the untouched stubs)."""

from __future__ import annotations

import dataclasses
import io
import textwrap
from functools import cache
from pathlib import Path

import pytest

from minserve.course.chapters import CHAPTERS, REPO_ROOT, Chapter, get_chapter
from minserve.course.check import Implementation, load_implementation, main, run_check
from minserve.course.generate import (
    find_drift,
    generated_files,
    has_local_edits,
    render_chapter,
    write_all,
)
from minserve.course.regions import MarkerError, parse_exercises, render_source

CASES = [
    pytest.param(chapter, check, id=f"ch{chapter.number}-{check.__name__}")
    for chapter in CHAPTERS
    for check in chapter.load_checks()
]


@cache
def _implementation(chapter: Chapter, impl: str) -> Implementation:
    return load_implementation(chapter, impl, REPO_ROOT)


def _report(*args: str, root: Path = REPO_ROOT) -> tuple[int, str]:
    stream = io.StringIO()
    code = run_check(*args, stream=stream, root=root)
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
    assert code == 0
    assert report.startswith("Chapter 00: The model we serve\nchecking solutions/ch00_model.py")
    assert report.count("  ✓ ") == checks and "✗" not in report
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
    assert "Hint: next is Exercise 0.1: RMSNorm, in exercises/ch00_model.py" in report


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
"""


def _student_root(tmp_path: Path, code: str) -> Path:
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "ch00_model.py").write_text(code)
    return tmp_path


def test_report_for_a_wrong_value_shows_expected_vs_got_and_the_students_line(tmp_path):
    code, report = _report("00", root=_student_root(tmp_path, WRONG_TOP_K))
    assert code == 1
    first_failure = report.split("First failure: ", 1)[1]
    assert "  ✗ k = 2 keeps the two largest logits" in report
    assert "expected to keep tokens [1, 2], got [1, 2, 3]" in first_failure
    assert "exercises/ch00_model.py:6, in apply_top_k" in first_failure
    assert 'return logits.masked_fill(logits < third, float("-inf"))' in first_failure
    assert "not implemented yet (Exercise 0.7)" in report
    assert "Hint: fix the first failure above" in report


def test_report_for_an_error_in_student_code_shows_the_raising_line(tmp_path):
    code = WRONG_TOP_K.replace("values[:, 2:3]", "values[top_k]")  # rows, not columns
    status, report = _report("00", root=_student_root(tmp_path, code))
    first_failure = report.split("First failure: ", 1)[1]
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
        "00  The model we serve  (exercises 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)"
        in capsys.readouterr().out
    )
