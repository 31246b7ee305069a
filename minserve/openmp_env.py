"""How OpenMP's threads wait between parallel regions: asleep, unless someone chose.

torch and minserve's C kernels share one OpenMP runtime (libgomp). By default its threads
spin for a while at the end of each parallel region, waiting for the next one. A decode
step runs hundreds of short regions; when another program keeps a core busy, a spinning
thread takes the time its partner needs, and every region then waits for a thread the
operating system has put aside. `OMP_WAIT_POLICY=PASSIVE` makes waiting threads sleep
instead (`benchmarks/contention.md` measures both).

libgomp reads the variable once, when `import torch` loads it, so `minserve/__init__.py`
imports this module before anything imports torch. It sets the variable only where nobody
chose (the shell, `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`); processes minserve starts inherit
it. This module must not import torch.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY, SPIN_COUNT = "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"
# as this module is first imported: what libgomp has read, or is about to read
TORCH_LOADED_FIRST = "torch" in sys.modules
USER_CHOICE = {k: os.environ[k] for k in (WAIT_POLICY, SPIN_COUNT) if os.environ.get(k)}


def prefer_passive_waits() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user chose how OpenMP threads wait."""
    if not USER_CHOICE:
        os.environ[WAIT_POLICY] = "PASSIVE"


def openmp_waits() -> str:
    """How this process's OpenMP threads wait, as the execution summary prints it."""
    if USER_CHOICE:
        return ",".join(f"{k}={v}" for k, v in USER_CHOICE.items())
    if TORCH_LOADED_FIRST:  # libgomp read its default before the variable was set
        return "spin(torch was imported before minserve; set OMP_WAIT_POLICY=PASSIVE)"
    return "passive"


prefer_passive_waits()
