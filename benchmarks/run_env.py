"""What a benchmark run needs around it: torch threads, a quiet machine, and a record of both.

Every program here writes its results with the command that produced them, the date, the
machine and how loaded it was: the ratios they report are measured within one run, and the
record says under what conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from minserve.bench.options import set_threads

REPO_ROOT = Path(__file__).resolve().parent.parent


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write (110 dpi) and close a matplotlib figure; its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """How a program here was started: `python -m benchmarks.NAME ARGS`, the interpreter
    relative to the working directory when it lives there (`.venv/bin/python`)."""
    python = sys.executable
    if Path(python).is_relative_to(Path.cwd()):
        python = os.path.relpath(python)
    else:
        python = "python"
    return shlex.join([python, "-m", module, *(sys.argv[1:] if argv is None else argv)])


# ---------------------------------------------------------------- the machine


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (platform.processor() is often empty)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def busy_cores(interval_s: float = 2.0) -> float:
    """Cores kept busy over the last `interval_s` seconds, from /proc/stat (0 if unreadable).

    The load average trails by a minute; this sees a job that started a second ago.
    """

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, IndexError, ValueError):
        return 0.0
    busy = 1 - (idle1 - idle0) / max(total1 - total0, 1)
    return busy * (os.cpu_count() or 1)


def wait_for_quiet(max_load: float | None, max_wait_s: float) -> float:
    """Sleep until the 1-minute load average is below `max_load` and the cores are idle now
    (or until `max_wait_s` runs out); the load average at the end."""
    deadline = time.monotonic() + max_wait_s
    while max_load is not None and time.monotonic() < deadline:
        if os.getloadavg()[0] < max_load and busy_cores() < 0.5:
            break
        time.sleep(5)
    return round(os.getloadavg()[0], 2)


# ---------------------------------------------------------------- the record


@dataclass
class RunRecord:
    """How a benchmark ran: the command, when, on what machine, under which load."""

    command: str
    date: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    machine: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls, command: str, threads: int | None, max_load: float | None, max_wait_s: float
    ) -> RunRecord:
        """Set torch's threads, wait (up to `max_wait_s`) for a quiet machine, note the load."""
        set_threads(threads)
        load = wait_for_quiet(max_load, max_wait_s)
        return cls(command, machine={**machine_info(), "load_average_1min_start": load})

    def finish(self) -> None:
        """Note the load averages (1, 5, 15 minutes) as the run ends."""
        self.machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]

    def header_lines(self, title: str) -> list[str]:
        """A markdown report's opening: its title, the command, the date and the machine."""
        return [f"# {title}", "", f"- command: `{self.command}`", f"- date: {self.date}",
                self.load_line()]  # fmt: skip

    def load_line(self) -> str:
        """One markdown line saying what the numbers were measured on, and how busy it was."""
        m = self.machine
        end = m.get("load_average_end", ["?"] * 3)
        return (
            f"- machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
            f"{m.get('torch_threads', '?')} torch threads; load average (os.getloadavg) "
            f"{m.get('load_average_1min_start', '?')} (1 min) at start, "
            f"{end[0]} / {end[1]} / {end[2]} (1 / 5 / 15 min) at end"
        )


def record_parser(
    module: str, doc: str, add_arguments: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """A program's options: the `minserve bench` command's (`add_arguments`), then the
    record's: --max-load, --max-wait and --output (default benchmarks/NAME, no suffix)."""
    name = module.rpartition(".")[2]
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--max-load", type=float, default=None, help="wait for a load below this")
    parser.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for it")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / name,
                        help="writes OUTPUT.json and OUTPUT.md (and OUTPUT.png)")  # fmt: skip
    return parser


def measure_recorded(
    module: str, argv: Sequence[str] | None, args: argparse.Namespace,
    measure: Callable[[argparse.Namespace], Any], threads: int | None,
) -> tuple[RunRecord, Any]:  # fmt: skip
    """Start the record (torch threads, a quiet machine), `measure(args)`, finish the record."""
    record = RunRecord.start(command_line(module, argv), threads, args.max_load, args.max_wait)
    measured = measure(args)
    record.finish()
    return record, measured


def write_json(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def write_results(
    report: dict[str, Any],
    output: Path,
    page: str,
    plot: Callable[[dict[str, Any], Path], Path] | None = None,
) -> list[Path]:
    """A benchmark's results beside each other: output.json, output.md (`page`) and, with
    `plot`, output.png; prints the page and where the files went."""
    paths = [write_json(report, output.with_suffix(".json"))]
    paths.append(output.with_suffix(".md"))
    paths[-1].write_text(page)
    if plot is not None:
        paths.append(plot(report, output.with_suffix(".png")))
    print(page)
    print("wrote " + ", ".join(map(str, paths)))
    return paths
