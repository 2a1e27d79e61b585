"""A long job started niced in a session of its own gives that session its nice value (the kernel's autogroup), so
it yields the CPU to jobs of other sessions; a job sharing a session, or not niced, or on a kernel that does not share
the CPU by session, leaves the session alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_kit.train.background import nice_own_session, session_nice

PROBE = """
import sys
from pathlib import Path
from specdec_kit.train.background import nice_own_session, session_nice
print(nice_own_session(Path(sys.argv[1])), session_nice())
"""


def probe(*prefix: str, autogroup: Path = Path("/proc/self/autogroup")) -> tuple[str, ...]:
    """(what ``nice_own_session`` returned, the session's autogroup nice afterwards) in a process started so."""
    out = subprocess.run(
        [*prefix, sys.executable, "-c", PROBE, str(autogroup)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return tuple(out.stdout.split())


@pytest.mark.skipif(session_nice() is None, reason="this kernel does not share the CPU by session here")
def test_a_niced_job_in_its_own_session_nices_the_session_and_no_other(tmp_path):
    ours = str(session_nice())  # this test's session
    niced = str(min(os.nice(0) + 7, 19))  # nice adds to the niceness the tests run at
    assert probe("setsid", "nice", "-n", "7") == (niced, niced)
    if os.nice(0) == 0:
        assert probe("setsid") == ("None", "0")  # not niced: its new session keeps the default
    assert probe("nice", "-n", "7") == ("None", ours)  # sharing this test's session: left alone
    assert str(session_nice()) == ours
    # a kernel without the file (or without autogroup writes): nothing changed, no error
    assert probe("setsid", "nice", "-n", "7", autogroup=tmp_path / "none") == ("None", "0")


def test_no_session_sharing_is_read_where_the_kernel_does_not_group_by_session(tmp_path):
    """Containers put processes in a CPU cgroup of their own, where the autogroup file reads empty; autogroup can
    also be switched off. Either way nice already holds, and nothing is written."""
    group, enabled = tmp_path / "autogroup", tmp_path / "enabled"
    group.write_text("/autogroup-12 nice 3\n")
    enabled.write_text("1\n")
    assert session_nice(group, enabled) == 3
    enabled.write_text("0\n")
    assert session_nice(group, enabled) is None
    enabled.write_text("1\n")
    group.write_text("")
    assert session_nice(group, enabled) is None
    assert session_nice(tmp_path / "missing", enabled) is None
    assert nice_own_session(group, enabled) is None  # whatever this process's nice and session
    assert group.read_text() == ""


WORKER_PROBE = """
import subprocess, sys
from specdec_kit.train.background import nice_worker_session
worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                          start_new_session=True)
given = nice_worker_session(worker.pid)
print(given, open(f"/proc/{worker.pid}/autogroup").read().split()[-1])
worker.stdin.close()
worker.wait()
"""


@pytest.mark.skipif(session_nice() is None, reason="this kernel does not share the CPU by session here")
def test_a_niced_jobs_worker_in_a_session_of_its_own_gets_the_jobs_nice():
    """The regeneration's engine worker runs in a session of its own (one kill ends its engine's processes): without
    this its session would share the CPU at nice 0, whatever the job's nice."""

    def run(*prefix: str) -> tuple[str, ...]:
        out = subprocess.run([*prefix, sys.executable, "-c", WORKER_PROBE], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return tuple(out.stdout.split())

    niced = str(min(os.nice(0) + 9, 19))  # nice adds to the niceness the tests run at
    assert run("setsid", "nice", "-n", "9") == (niced, niced)
    assert run("nice", "-n", "9") == (niced, niced)  # the worker's own session, not this test's: niced all the same
    if os.nice(0) == 0:
        assert run() == ("None", "0")  # not niced: nothing to give
