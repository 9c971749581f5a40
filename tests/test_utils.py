"""`pagellm.utils.wait_or_kill`: the end of the core process's and the TP workers' clean-up
(`engine/core_process.cleanup`, `executor/multiproc_executor._cleanup`), with real children."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from pagellm.utils import wait_or_kill

# a child that ignores SIGTERM (as a rank stuck in a collective ignores the polite ways),
# says it is ready, then sleeps
STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_a_child_that_will_not_exit_is_killed_after_the_timeout_and_reaped():
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.terminate()  # ignored
    start = time.monotonic()
    wait_or_kill(proc, 0.5)
    took = time.monotonic() - start
    assert proc.returncode == -signal.SIGKILL  # reaped: the exit status is known
    assert 0.5 <= took < 30
    proc.stdout.close()


def test_a_child_that_exits_in_time_keeps_its_exit_code():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    wait_or_kill(proc, 60)
    assert proc.returncode == 3
