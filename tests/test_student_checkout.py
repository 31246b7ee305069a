"""The student checkout (`python -m minserve.course.student_checkout DEST`): the answers are
gone, the package still imports, the exercises are the students' as generated, and a stub
the engine meets says which exercise it is and where the student's code goes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minserve.course.chapters import CHAPTERS, REPO_ROOT, get_chapter
from minserve.course.generate import chapter_exercises, render_chapter
from minserve.course.regions import solution_blocks
from minserve.course.student_checkout import (
    LEFT_OUT,
    hollow_sources,
    make_student_checkout,
    repository_files,
)

# A solution line this long names an answer; shorter ones (`return out`, `else:`) are
# everywhere. Lines the stubs keep (given code) are not answers.
ANSWER_LINE_LENGTH = 30
# Files that repeat a line of an answer, knowingly: (exercise, path) -> why it stays.
KNOWN_COPIES = {
    ("0.4", "minserve/worker/memory.py"): "the memory profile widens KV heads the same way",
    ("2.5", "minserve/attention/triton_kv8.py"): "the 8-bit KV decode kernel",
    ("2.6", "minserve/attention/triton_kv8.py"): "repeats 2.6's online softmax over int8/fp8",
    ("2.8", "minserve/attention/triton_kv8.py"): "its int8 store loads slots the same way",
    ("7.4", "minserve/course/checks_ch07.py"): "a counting communicator forwards all_reduce",
}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("student") / "course"
    make_student_checkout(dest)
    return dest


def run_in(folder: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Run `python -c code` with `folder` as the working directory (its minserve first)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300
    )


def answer_lines() -> dict[str, str]:
    """Each long line of a solution block that no stub keeps -> its exercise id."""
    answers: dict[str, str] = {}
    for chapter in CHAPTERS:
        given = render_chapter(chapter, "exercise")
        for exercise in chapter_exercises(chapter):
            for block in solution_blocks(exercise):
                for line in (raw.strip() for raw in block):
                    long_code = len(line) >= ANSWER_LINE_LENGTH and not line.startswith("#")
                    if long_code and line not in given:
                        answers.setdefault(line, exercise.id)
    return answers


def readable_text(path: Path) -> str:
    """A file's text as a reader sees it: a notebook's cell sources and text outputs."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""
    if path.suffix != ".ipynb":
        return text
    parts = []
    for cell in json.loads(text)["cells"]:
        parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            parts.append("".join(output.get("text", "")))
            parts += [
                "".join(v) for k, v in output.get("data", {}).items() if k.startswith("text/")
            ]
    return "\n".join(parts)


def test_the_checkout_holds_no_line_of_any_answer(checkout: Path) -> None:
    answers = answer_lines()
    assert len(answers) > 300  # every chapter's solutions, not an empty search
    found = []
    for path in sorted(p for p in checkout.rglob("*") if p.is_file()):
        name, text = path.relative_to(checkout).as_posix(), readable_text(path)
        for line, exercise in answers.items():
            if line in text and (exercise, name) not in KNOWN_COPIES:
                found.append(f"{name}: line of exercise {exercise}: {line}")
    assert not found, "answers left in the student checkout:\n" + "\n".join(found)


def test_solutions_instructor_docs_and_tests_are_left_out(checkout: Path) -> None:
    for folder in LEFT_OUT:
        assert not (checkout / folder).exists(), f"{folder} is in the student checkout"
    assert (checkout / "chapters").is_dir() and (checkout / "docs" / "course.md").is_file()


def test_the_exercises_are_the_repository_s_byte_for_byte(checkout: Path) -> None:
    ours = [n for n in repository_files() if n.startswith("exercises/")]
    theirs = sorted(p.relative_to(checkout).as_posix() for p in (checkout / "exercises").rglob("*"))
    assert theirs == ours
    for name in ours:
        assert (checkout / name).read_bytes() == (REPO_ROOT / name).read_bytes(), name


def test_every_other_file_is_copied_unchanged(checkout: Path) -> None:
    hollow = hollow_sources()
    for name in repository_files():
        if not name.startswith(LEFT_OUT) and name not in hollow:
            assert (checkout / name).read_bytes() == (REPO_ROOT / name).read_bytes(), name


def test_minserve_imports_there_with_every_hollowed_module(checkout: Path) -> None:
    modules = sorted({m for chapter in CHAPTERS for m in chapter.source_modules()})
    code = f"import importlib, minserve; [importlib.import_module(m) for m in {modules!r}]; "
    code += "print(minserve.__file__)"
    result = run_in(checkout, code)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(checkout)


def test_a_stub_the_engine_meets_names_the_exercise_and_the_student_s_file(
    checkout: Path,
) -> None:
    result = run_in(
        checkout, "from minserve.scheduler.budget import prefill_chunk; prefill_chunk(3, 8, True)"
    )
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("NotImplementedError: Exercise 4.1: ")
    assert "exercises/ch04_chunked_prefill.py" in last_line


def test_the_generator_there_finds_every_exercise_and_its_stubs_current(
    checkout: Path,
) -> None:
    code = (
        "from minserve.course.generate import find_drift\n"
        "print('\\n'.join(p.splitlines()[0] for p in find_drift()))"
    )
    result = run_in(checkout, code)
    assert result.returncode == 0, result.stderr
    drift = result.stdout.splitlines()
    assert drift and all(line.startswith("solutions/") for line in drift), drift


def test_keep_leaves_a_chapter_s_sources_as_they_are() -> None:
    chapters = [c for c in CHAPTERS if c.number != "04"]
    kept = {f"minserve/{source}" for source in get_chapter("04").sources}
    assert kept.isdisjoint(hollow_sources(chapters))
    hollow = hollow_sources([get_chapter("04")])
    assert set(hollow) == kept
    assert all("# >>> exercise 4." in text for text in hollow.values())


def test_an_existing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="already exists"):
        make_student_checkout(tmp_path)
