"""What a benchmark run needs around it: torch threads, a quiet machine, and a record of both.

Shared by `minserve bench chunked-itl` and `minserve bench scheduler-overhead`: the ratios
they report are measured within one run, and the record says how loaded the machine was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from minserve.bench.offline_suite import machine_info, wait_for_quiet


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
        if threads is not None:
            if threads < 1:
                raise ValueError(f"--threads must be at least 1, got {threads}")
            torch.set_num_threads(threads)
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
