"""`minserve check NN N.M` checks one exercise; the report shows the first failure of each
exercise, names NaN and inf with their usual causes, points a Triton kernel's error at the
lines the student wrote, and closes with the `minserve hint` to ask."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minserve.cli import main as cli_main
from minserve.course.chapters import CHAPTERS, REPO_ROOT, Chapter, get_chapter
from minserve.course.check import main, run_check
from minserve.course.exercise_map import check_exercises
from minserve.course.generate import chapter_exercises
from minserve.course.nonfinite import nonfinite_note
from minserve.course.your_lines import written_lines


def _student(tmp_path: Path, module: str, edits: list[tuple[str, str]]) -> Path:
    """A checkout whose exercises/<module>.py is the solution with `edits` (old, new) made."""
    text = (REPO_ROOT / "solutions" / f"{module}.py").read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, f"the solution no longer holds {old!r}"
        text = text.replace(old, new)
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / f"{module}.py").write_text(text, encoding="utf-8")
    return tmp_path


def _report(chapter: str, root: Path, exercise: str | None = None) -> tuple[int, str]:
    stream = io.StringIO()
    code = run_check(chapter, stream=stream, root=root, exercise=exercise)
    return code, stream.getvalue()


def _owned_by(chapter: str, exercise: str) -> list[str]:
    return [
        name for name, owner in check_exercises(get_chapter(chapter)).items() if owner == exercise
    ]


# chapter 04 with a bug in 4.1 (chunks without chunked prefill) and one in 4.3 (a release
# gives back one block's bytes, whatever the sequence held); 4.2 is right
CHUNKS_WITHOUT_CHUNKING = (
    "    return budget_left if enable_chunked_prefill else 0\n",
    "    return budget_left\n",
)
RELEASES_ONE_BLOCK = (
    "        self.used_bytes -= self.num_blocks(key) * self.block_nbytes\n",
    "        self.used_bytes -= self.block_nbytes\n",
)


@pytest.fixture(scope="module")
def two_bugs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two_bugs")
    return _student(root, "ch04_chunked_prefill", [CHUNKS_WITHOUT_CHUNKING, RELEASES_ONE_BLOCK])


@pytest.fixture(scope="module")
def chapter_report(two_bugs: Path) -> tuple[int, str]:
    return _report("04", two_bugs)


# --- every check belongs to an exercise -----------------------------------------------------


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: f"ch{c.number}")
def test_every_check_belongs_to_an_exercise_of_its_chapter(chapter: Chapter) -> None:
    owners = check_exercises(chapter)
    exercises = [e.id for e in chapter_exercises(chapter)]
    assert set(owners.values()) == set(exercises)  # every exercise has checks, no check lacks one
    assert len(owners) == len(chapter.load_checks())  # check names are unique


# --- one exercise -----------------------------------------------------------------------------


def test_one_exercise_runs_only_its_own_checks(two_bugs: Path) -> None:
    code, report = _report("04", two_bugs, "4.2")  # 4.1 and 4.3 are wrong, 4.2 is right
    owned = _owned_by("04", "4.2")
    assert code == 0
    assert "checking exercises/ch04_chunked_prefill.py: Exercise 4.2, recompute or swap" in report
    assert report.count("\n  ✓ ") == len(owned) + 1  # its checks, and its exercise line
    assert all(f"  ✓ {name}" in report for name in owned)
    assert "4.1" not in report and "4.3" not in report
    assert f"{len(owned)}/{len(owned)} checks of Exercise 4.2 passed." in report
    assert "Exercise 4.2 passes. Check the whole chapter: `minserve check 04`." in report


def test_one_failing_exercise_shows_its_failure_and_its_hint(two_bugs: Path) -> None:
    code, report = _report("04", two_bugs, "4.3")
    assert code == 1
    assert "4.3, first failure: " in report and "4.1" not in report
    assert report.rstrip().endswith(
        "Next: fix the first failure of 4.3 above, then run `minserve check 04 4.3` again. "
        "Stuck? `minserve hint 04 4.3` gives a hint."
    )


def test_an_exercise_can_be_named_by_its_number_within_the_chapter(two_bugs: Path) -> None:
    assert _report("04", two_bugs, "2") == _report("04", two_bugs, "4.2")


def test_an_unknown_exercise_is_an_error_listing_the_chapters_exercises(two_bugs: Path) -> None:
    code, report = _report("04", two_bugs, "4.9")
    assert code == 1
    assert report.startswith("minserve check: no exercise '4.9' in chapter 04; its exercises are:")
    for exercise in chapter_exercises(get_chapter("04")):
        assert f"\n  {exercise.id} {exercise.title}" in report


def test_one_exercise_on_the_command_line(two_bugs: Path, capsys) -> None:
    assert cli_main(["check", "04", "4.2", "--root", str(two_bugs)]) == 0
    assert "checks of Exercise 4.2 passed." in capsys.readouterr().out
    assert main(["04", "4.1", "--root", str(two_bugs)]) == 1
    assert "4.1, first failure: " in capsys.readouterr().out


def test_python_dash_m_checks_one_exercise(two_bugs: Path) -> None:
    command = [sys.executable, "-m", "minserve.course.check", "04", "4.9", "--root", str(two_bugs)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "no exercise '4.9' in chapter 04; its exercises are:" in done.stdout


def test_one_exercise_goes_without_all_and_json(capsys) -> None:
    assert main(["04", "4.1", "--all"]) == 1
    assert "one exercise (NN N.M) goes without --all" in capsys.readouterr().out


# --- the whole chapter: the first failure of each exercise -----------------------------------


def test_each_exercise_shows_its_own_first_failure(chapter_report: tuple[int, str]) -> None:
    code, report = chapter_report
    assert code == 1
    assert report.count("4.1, first failure: ") == 1 and report.count("4.3, first failure: ") == 1
    assert "4.2, first failure" not in report
    first_41 = report.split("4.1, first failure: ", 1)[1].split("\n\n", 1)[0]
    assert "expected 0, got 14" in first_41 and "return budget_left" in first_41
    first_43 = report.split("4.3, first failure: ", 1)[1].split("\n\n", 1)[0]
    assert "used_bytes" in first_43


def test_a_line_per_exercise_counts_its_checks(chapter_report: tuple[int, str]) -> None:
    _, report = chapter_report
    titles = {e.id: e.title for e in chapter_exercises(get_chapter("04"))}
    owned = {exercise: len(_owned_by("04", exercise)) for exercise in titles}
    assert f"  ✓ 4.2 {titles['4.2']}: {owned['4.2']}/{owned['4.2']} passed\n" in report
    for exercise in ("4.1", "4.3"):
        line = f"  ✗ {exercise} {titles[exercise]}: "
        counts = report.split(line, 1)[1].split("\n", 1)[0]
        assert re.fullmatch(rf"(\d+)/{owned[exercise]} passed, (\d+) failed", counts), counts


def test_the_closing_line_names_the_first_failing_exercise_and_its_hint(chapter_report) -> None:
    _, report = chapter_report
    assert report.rstrip().splitlines()[-1] == (
        "Next: fix the first failure of 4.1 above, then run `minserve check 04 4.1` again. "
        "Stuck? `minserve hint 04 4.1` gives a hint."
    )


# --- NaN and inf --------------------------------------------------------------------------

ONLINE_SOFTMAX = """\
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m = m_new
"""
WITHOUT_THE_MAX = """\
        p = tl.exp2(scores)  # [BLOCK_G, BLOCK_N]: exp2 of scores in the hundreds overflows
        l = l + tl.sum(p, axis=1)  # noqa: E741
        acc = acc + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
"""


def test_nan_from_an_online_softmax_without_its_max_is_named_with_the_max_subtraction(tmp_path):
    root = _student(tmp_path, "ch02_paged_attention", [(ONLINE_SOFTMAX, WITHOUT_THE_MAX)])
    code, report = _report("02", root, "2.6")
    assert code == 1
    failure = report.split("2.6, first failure: ", 1)[1]
    assert failure.startswith("Scale 20: scores in the hundreds")
    message = failure.split("\n", 1)[1]
    assert message.startswith("  your result holds NaN in ")  # said first, before the error
    causes = message.split("\n  softmax scale 20: ", 1)[0]
    assert "max was not subtracted first" in causes and "the scores here reach" in causes
    assert causes.index("max was not subtracted") < causes.index("a load outside the context")
    assert "max error nan" in message


def test_a_finite_result_has_no_note_and_inf_is_counted() -> None:
    assert nonfinite_note(torch.tensor([1.0, -2.0])) == ""
    assert nonfinite_note([float("nan")]) == ""  # not a tensor: nothing to say
    note = nonfinite_note(torch.tensor([1.0, float("inf"), float("nan"), float("-inf")]))
    assert note.startswith("your result holds NaN in 1 and inf in 2 of its 4 values; look for")
    assert "max was not subtracted" in note and "fully masked row" in note and "log of 0" in note


# --- Triton: the student's own lines ----------------------------------------------------------

ONE_TILE_OUT = "    out = tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0)  # [BLOCK_D]\n"
TILE_STORE = "tl.store(out_ptr + head * stride_oh + dims, out, mask=dims < head_dim)"


def _line_of(root: Path, text: str) -> int:
    lines = (root / "exercises" / "ch02_paged_attention.py").read_text().splitlines()
    return next(number for number, line in enumerate(lines, start=1) if text in line)


def test_an_error_raised_in_a_kernel_helper_points_at_the_students_lines(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # run from the checkout: paths show as exercises/...
    helper = (
        "\n\n@triton.jit\ndef weighted_sum(p, v):\n"
        "    return tl.dot(p, v)  # p is one row: tl.dot wants 2-D tiles\n\n\n"
        "# Exercise 2.5:"
    )
    root = _student(
        tmp_path,
        "ch02_paged_attention",
        [
            (ONE_TILE_OUT, "    out = weighted_sum(p, v) / tl.sum(p, axis=0)\n"),
            ("\n\n# Exercise 2.5:", helper),
        ],
    )
    code, report = _report("02", root, "2.5")
    failure = report.split("2.5, first failure: ", 1)[1].split("\n\n", 1)[0]
    assert code == 1
    helper_line, call_line = (
        _line_of(root, "return tl.dot(p, v)"),
        _line_of(root, "weighted_sum(p, v) /"),
    )
    assert (
        f"your code at exercises/ch02_paged_attention.py:{helper_line}, in weighted_sum" in failure
    )
    assert (
        f"called from your code at exercises/ch02_paged_attention.py:{call_line}, "
        "in tile_attention_kernel" in failure
    )
    assert "AssertionError: input and other must have equal ranks" in failure  # Triton's own
    assert "InterpreterError" not in failure and TILE_STORE not in failure


def test_an_error_in_the_given_store_names_the_students_line_that_set_its_value(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    root = _student(
        tmp_path, "ch02_paged_attention", [(ONE_TILE_OUT, "    out = p[:, None] * v\n")]
    )
    code, report = _report("02", root, "2.5")
    failure = report.split("2.5, first failure: ", 1)[1].split("\n\n", 1)[0]
    store, out = _line_of(root, TILE_STORE), _line_of(root, "out = p[:, None] * v")
    assert code == 1
    assert f"given code (not yours) at exercises/ch02_paged_attention.py:{store}" in failure
    assert (
        f"`out` there was last set by your code at exercises/ch02_paged_attention.py:{out}:\n"
        "      out = p[:, None] * v" in failure
    )


def test_written_lines_are_the_ones_the_stub_does_not_have() -> None:
    stub = "def f(x):\n    y = 1\n    raise NotImplementedError\n    return y\n"
    yours = "def f(x):\n    y = 1\n    y += x\n    y *= 2\n    return y\n"
    assert written_lines(yours, stub) == {3, 4}
