"""How many of this process's CPUs the other processes on the machine leave free, from the kernel's counters.

A parallel region on two threads is only as fast as its slower thread: when another process keeps one of the two
CPUs busy, the second thread runs in slices of that CPU and the whole region waits for it (issue #36: a cold 4K
prompt took 36x its idle time beside one busy process). So large chunk work asks, before each call, how many CPUs are
free of other processes, and runs on that many threads (ced/batched.py).

What others use = the busy time of this process's CPUs (/proc/stat, one line per CPU) minus this process's own CPU
time, over the time since the last reading. Readings closer together than `min_interval_s` return the last answer:
a shorter window is mostly noise. Where /proc/stat cannot be read (not Linux), every CPU counts as free.
"""

from __future__ import annotations

import os
import time

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class FreeCpus:
    def __init__(self, min_interval_s: float = 0.05, stat_path: str = "/proc/stat"):
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        self.min_interval_s, self.stat_path = min_interval_s, stat_path
        self._last = self._reading()
        self._free = float(len(self.cpus))

    def free(self) -> float:
        """CPUs' worth of this process's CPUs that other processes did not use since the last reading."""
        if self._last is not None and time.monotonic() - self._last[0] < self.min_interval_s:
            return self._free  # not read again: the kernel's counters cost more than a decode step's Python
        now = self._reading()
        if now is None or self._last is None:
            return self._free
        elapsed = now[0] - self._last[0]
        busy_s = (now[1] - self._last[1]) / TICKS_PER_S
        own_s = now[2] - self._last[2]
        others = max(0.0, busy_s - own_s) / elapsed
        self._last, self._free = now, max(0.0, len(self.cpus) - others)
        return self._free

    def threads(self, most: int, shared_ok: float = 0.25) -> int:
        """Threads for a parallel call of at most `most`: one per CPU that is free (a CPU others use for at most
        `shared_ok` of its time counts as free), at least one."""
        return max(1, min(most, int(self.free() + shared_ok)))

    def _reading(self) -> tuple[float, int, float] | None:
        """(monotonic time, busy ticks of our CPUs, this process's CPU seconds), or None without /proc/stat."""
        try:
            with open(self.stat_path) as stat:
                lines = stat.read().splitlines()
        except OSError:
            return None
        wanted, busy = {f"cpu{n}" for n in self.cpus}, 0
        for line in lines:
            fields = line.split()
            if fields and fields[0] in wanted:
                # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
                ticks = [int(value) for value in fields[1:9]]
                busy += sum(ticks) - ticks[3] - ticks[4]
        return time.monotonic(), busy, time.process_time()
