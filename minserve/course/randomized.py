"""The settings of a check that draws random cases (Hypothesis), in one place.

A check must give every student the same verdict on the same code, quickly and quietly:
the cases are derandomized (the same every run), nothing is saved between runs, no case
has a deadline, Hypothesis's health checks (too slow, too much filtering) are not the
student's problem, and the report shows the first failing case at once, unshrunk, rather
than minutes of shrinking on a slow engine.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, Verbosity, settings


def randomized(max_examples: int, shrink: bool = True) -> settings:
    """Settings for a check's random cases: `max_examples` of them, always the same ones;
    `shrink=False` reports the first failing case as it was drawn."""
    phases = tuple(Phase) if shrink else (Phase.generate,)
    return settings(
        max_examples=max_examples,
        report_multiple_bugs=False,
        deadline=None,
        database=None,
        derandomize=True,
        verbosity=Verbosity.quiet,
        suppress_health_check=list(HealthCheck),
        phases=phases,
    )
