"""What a benchmark report says about its run (`benchmarks/run_env.py`)."""

from __future__ import annotations

from benchmarks.run_env import RunRecord


def test_a_report_opens_with_its_title_command_date_and_machine() -> None:
    run = RunRecord("python bench.py --x 1", date="2026-12-02T00:00:00+00:00",
                    machine={"cpu": "Xeon", "cores": 2, "torch_threads": 2,
                             "load_average_1min_start": 0.5})  # fmt: skip
    run.machine["load_average_end"] = [1.0, 0.75, 0.5]
    assert run.header_lines("Kernels") == [
        "# Kernels",
        "",
        "- command: `python bench.py --x 1`",
        "- date: 2026-12-02T00:00:00+00:00",
        "- machine: Xeon, 2 cores, 2 torch threads; load average (os.getloadavg) 0.5 (1 min) "
        "at start, 1.0 / 0.75 / 0.5 (1 / 5 / 15 min) at end",
    ]
