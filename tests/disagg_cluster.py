"""The fixtures of a test module that runs a disaggregated cluster of the tiny llama.

A module binds them under their own names, so that pytest finds them there, with what it
runs differently (topology, hand-off, step timeout, engine options):

    model_dir, oracle, cluster = cluster_fixtures("1P2D", "transfer", step_timeout_s=30, **OPTIONS)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from minserve import LLM
from minserve.disagg.proxy_engine import DisaggregatedEngine


def cluster_fixtures(
    topology: str, transfer_policy: str, step_timeout_s: float, **options: Any
) -> tuple[object, object, object]:
    """Module-scoped fixtures: `model_dir` (the tiny llama's folder), `oracle` (colocated
    `LLM` on it) and `cluster` (`DisaggregatedEngine`), both with `options`."""

    @pytest.fixture(scope="module")
    def model_dir(tiny_model: Callable[[str], Path]) -> Path:
        return tiny_model("llama")

    @pytest.fixture(scope="module")
    def oracle(model_dir: Path) -> LLM:
        return LLM(model_dir, **options)

    @pytest.fixture(scope="module")
    def cluster(model_dir: Path) -> Iterator[DisaggregatedEngine]:
        with DisaggregatedEngine(
            model_dir, topology, transfer_policy, step_timeout_s=step_timeout_s, **options
        ) as engine:
            yield engine

    return model_dir, oracle, cluster
