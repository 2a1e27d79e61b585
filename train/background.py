"""Long jobs started under ``nice`` in a session of their own yield the CPU, also where the kernel groups by session.

Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in most distributions and
on this project's machines) shares the CPU between sessions first and applies a process's nice value only among the
processes of its own session. A regeneration started as ``setsid nice -n 19 python -m specdec_kit.train.recipe ...``
then still takes half of a 2-core machine from a benchmark run in another session (measured here: its nice-19 vLLM
worker at 159% CPU against 24% for a nice-0 test; 94% each once its session's group was niced too). Giving the
job's own session the job's nice value restores what ``nice`` promises. A job that shares its session with an
interactive shell is left alone: niceing that session would slow the shell's other jobs as well.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")


def nice_own_session(autogroup: Path = AUTOGROUP) -> int | None:
    """Give this process's session (its autogroup) the process's nice value, when the process runs niced and leads
    its session (``setsid``). The value set, or None where nothing was changed."""
    niceness = os.nice(0)
    if niceness <= 0 or os.getsid(0) != os.getpid() or not autogroup.exists():
        return None
    try:
        autogroup.write_text(str(niceness))
    except OSError:  # a kernel without autogroup writes, or not permitted: the process's nice still holds
        return None
    return niceness


def nice_own_session_and_say() -> None:
    """``nice_own_session``, saying so on standard output (a long job's log) when it changed something."""
    if (niceness := nice_own_session()) is not None:
        print(f"nice {niceness}: this run's session shares the CPU at nice {niceness} too (autogroup)", flush=True)
