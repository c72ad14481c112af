"""A fixed CPU burner for the contention cells: one process of the benchmark's own spinning on one core, as an
unrelated busy process on a shared machine would. It stops itself at its deadline, and the context manager kills it
on the way out whatever happened inside, so a failed cell never leaves it running."""

from __future__ import annotations

import contextlib
import subprocess
import sys

# A pure-Python busy loop: one core, no memory traffic to speak of, no threads (one runnable thread competing for
# the 2 cores is the case issue #36 reports).
_BURN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def cpu_burner(limit_s: float):
    """One busy process beside the block, for at most `limit_s` seconds; yields its pid."""
    process = subprocess.Popen([sys.executable, "-c", _BURN, str(limit_s)], stdin=subprocess.DEVNULL)
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()
