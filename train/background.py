"""Long jobs started under ``nice`` in a session of their own yield the CPU, also where the kernel groups by session.

Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in most distributions and
on this project's machines) shares the CPU between sessions first and applies a process's nice value only among the
processes of its own session. A regeneration started as ``setsid nice -n 19 python -m specdec_kit.train.recipe ...``
then still takes half of a 2-core machine from a benchmark run in another session (measured here: its nice-19 vLLM
worker at 159% CPU against 24% for a nice-0 test; 94% each once its session's group was niced too). Giving the
job's own session the job's nice value restores what ``nice`` promises. A job that shares its session with an
interactive shell is left alone: niceing that session would slow the shell's other jobs as well. Where the kernel
does not group this process by session (autogroup switched off, or the process placed in a CPU cgroup of its own, as
in most containers: its ``/proc/self/autogroup`` then reads empty), nice already holds and nothing is changed.

Such a job is also stopped from outside (``kill``, the end of a login session) while it holds an engine's worker in a
session of its own; ``exit_cleanly_on_signals`` lets it end that worker as it goes.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")
AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")


def session_nice(autogroup: Path = AUTOGROUP, enabled: Path = AUTOGROUP_ENABLED) -> int | None:
    """The nice value the kernel shares the CPU at between this process's session and others, or None where it
    does not share by session (no autogroup, switched off, or the process in a CPU cgroup of its own)."""
    try:
        if enabled.read_text().strip() != "1":
            return None
        fields = autogroup.read_text().split()  # "/autogroup-987 nice 0"; empty outside the root CPU cgroup
    except OSError:
        return None
    if len(fields) != 3 or fields[1] != "nice":
        return None
    return int(fields[2])


def nice_own_session(autogroup: Path = AUTOGROUP, enabled: Path = AUTOGROUP_ENABLED) -> int | None:
    """Give this process's session (its autogroup) the process's nice value, when the process runs niced, leads
    its session (``setsid``) and the kernel shares the CPU by session. The value set, or None where nothing was
    changed."""
    if os.getsid(0) != os.getpid():
        return None
    return _give_nice(autogroup, enabled)


def nice_worker_session(pid: int, enabled: Path = AUTOGROUP_ENABLED) -> int | None:
    """Give the session of worker ``pid`` this process's nice value. A worker started in a session of its own (so
    that one kill ends it and its engine's processes) inherits the nice value but not the niced session: beside other
    sessions its whole session would take a full share of the CPU (seen here: a niced regeneration's vLLM worker at
    113% CPU while a build in another session got 30% a core). The value set, or None where nothing was changed."""
    return _give_nice(Path(f"/proc/{pid}/autogroup"), enabled)


def _give_nice(autogroup: Path, enabled: Path) -> int | None:
    """Write this process's nice value to ``autogroup`` when the process runs niced and the kernel shares the CPU
    by session."""
    niceness = os.nice(0)
    if niceness <= 0 or session_nice(autogroup, enabled) is None:
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


def exit_cleanly_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Turn the first of ``signals`` into ``SystemExit(128 + signal)``, so that ``finally`` blocks run: Python's default
    for SIGTERM and SIGHUP ends the process on the spot, which leaves an engine's worker (in a session of its own, so
    not reached by a kill of this process's group) running with its engine: seen here, a killed regeneration's vLLM
    processes went on taking both cores. A second signal ends the process at once, as the default would."""

    def stop(signum: int, frame) -> None:
        for each in signals:
            signal.signal(each, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (a job's main run from a thread keeps the defaults)
    for each in signals:
        signal.signal(each, stop)
