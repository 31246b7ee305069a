"""How OpenMP's threads wait between parallel regions: a short spin, then sleep.

torch and minserve's C kernels share one OpenMP runtime (libgomp). By default its threads
spin 300000 times at the end of each parallel region, waiting for the next one, before
they sleep. A decode step runs hundreds of short regions; when another program keeps a
core busy, a spinning thread takes the time its partner needs, and every region then waits
for a thread the operating system has put aside. Sleeping at once (`OMP_WAIT_POLICY=
PASSIVE`) costs a wake-up per region instead, a third of a quiet machine's speed. 10000
spins (`GOMP_SPINCOUNT`) cover the gap between one region and the next of a step, so a
quiet machine keeps its speed, and a thread whose partner was put aside soon gives its core
back (`benchmarks/contention.md` measures both).

libgomp reads the variable once, when `import torch` loads it, so `minserve/__init__.py`
imports this module before anything imports torch. It sets the variable only where nobody
chose (the shell, `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`); processes minserve starts inherit
it. This module must not import torch.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY, SPIN_COUNT = "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"
SPINS = "10000"  # a step's gap between regions; then the thread sleeps
# as this module is first imported: what libgomp has read, or is about to read
TORCH_LOADED_FIRST = "torch" in sys.modules
USER_CHOICE = {k: os.environ[k] for k in (WAIT_POLICY, SPIN_COUNT) if os.environ.get(k)}


def prefer_short_spins() -> None:
    """Set GOMP_SPINCOUNT=10000 unless the user chose how OpenMP threads wait."""
    if not USER_CHOICE:
        os.environ[SPIN_COUNT] = SPINS


def openmp_waits() -> str:
    """How this process's OpenMP threads wait, as the execution summary prints it."""
    if USER_CHOICE:
        return ",".join(f"{k}={v}" for k, v in USER_CHOICE.items())
    if TORCH_LOADED_FIRST:  # libgomp read its default before the variable was set
        return f"spin(torch was imported before minserve; set {SPIN_COUNT}={SPINS})"
    return f"spin({SPINS})-then-sleep"


prefer_short_spins()
