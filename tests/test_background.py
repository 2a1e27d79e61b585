"""A long job started niced in a session of its own gives that session its nice value (the kernel's autogroup), so
it yields the CPU to jobs of other sessions; a job sharing a session, or not niced, leaves the session alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

AUTOGROUP = Path("/proc/self/autogroup")
PROBE = """
import sys
from pathlib import Path
from specdec_kit.train.background import nice_own_session
print(nice_own_session(Path(sys.argv[1])), Path("/proc/self/autogroup").read_text().split()[-1])
"""


def probe(*prefix: str, autogroup: Path = AUTOGROUP) -> tuple[str, ...]:
    """(what ``nice_own_session`` returned, the session's autogroup nice afterwards) in a process started so."""
    out = subprocess.run(
        [*prefix, sys.executable, "-c", PROBE, str(autogroup)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return tuple(out.stdout.split())


@pytest.mark.skipif(not AUTOGROUP.exists(), reason="this kernel has no autogroup scheduling")
def test_a_niced_job_in_its_own_session_nices_the_session_and_no_other(tmp_path):
    ours = AUTOGROUP.read_text().split()[-1]  # this test's session
    assert probe("setsid", "nice", "-n", "7") == ("7", "7")
    assert probe("setsid") == ("None", "0")  # not niced: its new session keeps the default
    assert probe("nice", "-n", "7") == ("None", ours)  # sharing this test's session: left alone
    assert AUTOGROUP.read_text().split()[-1] == ours
    # a kernel without the file (or without autogroup writes): nothing changed, no error
    assert probe("setsid", "nice", "-n", "7", autogroup=tmp_path / "none") == ("None", "0")
