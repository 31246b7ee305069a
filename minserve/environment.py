"""The environment variables that switch a CPU path, read here and nowhere else.

    MINSERVE_C_KERNELS=0|1           the C kernels (minserve/kernels); default 1
    MINSERVE_KERNEL_ROWS=N|measured  few-row linear kernel up to N rows (0: oneDNN always);
                                     default: measured per layer shape at load
    MINSERVE_GREEDY_SCREEN=0|1       greedy tokens through the head's bf16 screen; default 1
    MINSERVE_CPU_BF16=0|1            dtype "auto" is bfloat16 on a CPU with native bfloat16
                                     (0: float32, as the tests pin it); default 1
    MINSERVE_KERNEL_CACHE=DIR        where the compiled C kernels are kept;
                                     default ~/.cache/minserve/kernels

An empty value counts as unset. The execution config (`minserve/execution.py`) resolves them
once at load, with the arguments and the machine, into the paths a run takes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

C_KERNELS, KERNEL_ROWS = "MINSERVE_C_KERNELS", "MINSERVE_KERNEL_ROWS"
GREEDY_SCREEN, KERNEL_CACHE = "MINSERVE_GREEDY_SCREEN", "MINSERVE_KERNEL_CACHE"
CPU_BF16 = "MINSERVE_CPU_BF16"
MEASURED = "measured"

LinearRows = int | Literal["measured"]


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value, None where it is unset or empty."""
    return env.get(name) or None


def env_switch(env: Mapping[str, str], name: str) -> bool:
    """A 0|1 variable; unset means on."""
    value = env_value(env, name)
    if value is None:
        return True
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 (off) or 1 (on)")
    return value == "1"


def env_linear_rows(env: Mapping[str, str]) -> LinearRows:
    """$MINSERVE_KERNEL_ROWS: a fixed row count, or measured (the default)."""
    value = env_value(env, KERNEL_ROWS)
    if value is None or value == MEASURED:
        return MEASURED
    if not (value.isascii() and value.isdigit()):
        raise ValueError(
            f"{KERNEL_ROWS}={value!r}: expected a row count (an integer >= 0; 0: oneDNN "
            f"always) or {MEASURED!r}"
        )
    return int(value)


def kernel_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the compiled C kernels are kept: $MINSERVE_KERNEL_CACHE or ~/.cache/minserve."""
    value = env_value(os.environ if environ is None else environ, KERNEL_CACHE)
    default = Path.home() / ".cache" / "minserve" / "kernels"
    return default if value is None else Path(value).expanduser()
