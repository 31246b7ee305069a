"""A checkout to hand to students: minserve's sources with every exercise's answer taken out.

    python -m minserve.course.student_checkout DEST [--keep NN ...]

copies the repository (the files git tracks, and new ones it does not ignore) to DEST,
leaves out `solutions/`, `docs/instructors/` and `tests/` (the tests import the solutions
and hold reference implementations), and, in every minserve source that holds exercise
regions, replaces each solution block by the stub the generator writes into `exercises/`,
its message saying that minserve's own is left out. The region markers stay, so `minserve
check`, `minserve hint` and the generator still find every exercise, and `exercises/` stays
current. The package imports; a stub raises `NotImplementedError` only when called.
`--keep NN` keeps minserve's own code for chapter NN (say, one already graded).

minserve's engine calls those regions at run time, so in the checkout it runs the
student's code, plugged in through `CoursePlugins` (docs/course.md), and stops with the
exercise's name wherever it meets a stub. Checks that compare a student's code with
minserve's own need the reference: grade in the full repository with `minserve check --all
--json --root DEST` (docs/instructors/README.md; for students, docs/student_checkout.md).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from minserve.course.chapters import CHAPTERS, PACKAGE_DIR, REPO_ROOT, Chapter, get_chapter
from minserve.course.regions import render_source

LEFT_OUT = ("solutions/", "docs/instructors/", "tests/")  # what students do not get


def refusal(chapter: Chapter) -> str:
    """What a stub in the checkout's minserve adds to the exercise's label: whose code is
    missing, and where the student's goes."""
    return (
        " (minserve's own is left out of this student checkout; yours goes in "
        f"exercises/{chapter.module}.py: see docs/student_checkout.md)"
    )


def hollow_sources(chapters: Sequence[Chapter] = CHAPTERS) -> dict[str, str]:
    """The chapters' exercise-bearing sources, by path in the repository
    ("minserve/model/ops.py"), each solution block replaced by its stub, markers kept."""
    hollow = {}
    for chapter in chapters:
        for source in chapter.sources:
            path = f"minserve/{source}"
            text = (PACKAGE_DIR / source).read_text(encoding="utf-8")
            hollow[path] = render_source(text, path, "exercise", True, refusal(chapter))
    return hollow


def repository_files(root: Path = REPO_ROOT) -> list[str]:
    """The checkout's files, relative to `root`: tracked, plus untracked ones git does not
    ignore; a tracked file deleted from the working tree is left out."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    names = sorted({name for name in listing.split("\0") if name})
    return [name for name in names if (root / name).is_file() or (root / name).is_symlink()]


def make_student_checkout(
    dest: Path, keep: Sequence[str] = (), root: Path = REPO_ROOT
) -> list[str]:
    """Write the student checkout to `dest`, a new folder, keeping minserve's own code for
    the chapters numbered in `keep`; return the sources whose solutions were taken out."""
    if dest.exists():
        raise FileExistsError(f"{dest} already exists; choose a new folder for the checkout")
    kept = {get_chapter(number).number for number in keep}
    hollow = hollow_sources([chapter for chapter in CHAPTERS if chapter.number not in kept])
    for name in repository_files(root):
        if name.startswith(LEFT_OUT):
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name in hollow:
            target.write_text(hollow[name], encoding="utf-8")
            shutil.copymode(root / name, target)
        else:
            shutil.copy2(root / name, target, follow_symlinks=False)
    return sorted(hollow)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write the checkout and say what it holds."""
    parser = argparse.ArgumentParser(
        prog="python -m minserve.course.student_checkout", description=__doc__.split("\n")[0]
    )
    parser.add_argument("dest", type=Path, help="a new folder for the student checkout")
    parser.add_argument(
        "--keep",
        nargs="+",
        default=[],
        metavar="NN",
        help="chapters whose minserve code stays (for example those already graded)",
    )
    args = parser.parse_args(argv)
    try:
        hollowed = make_student_checkout(args.dest, args.keep)
    except (FileExistsError, KeyError) as error:
        print(f"student_checkout: {error.args[0]}", file=sys.stderr)
        return 1
    print(f"wrote a student checkout to {args.dest}, without {', '.join(LEFT_OUT)}")
    print(f"solutions taken out of {len(hollowed)} minserve sources:")
    for name in hollowed:
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
