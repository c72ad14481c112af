"""FreeCpus reads what other processes use of this process's CPUs from /proc/stat's counters."""

from __future__ import annotations

import os

import pytest

from ced import cpu_share
from ced.cpu_share import TICKS_PER_S, FreeCpus


class Machine:
    """A /proc/stat file and the clocks FreeCpus reads, advanced by hand."""

    def __init__(self, path, monkeypatch, cpus=(0, 1)):
        self.path, self.cpus, self.now, self.own_s = path, cpus, 100.0, 5.0
        self.busy = {cpu: 0 for cpu in cpus}
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
        monkeypatch.setattr(cpu_share.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_share.time, "process_time", lambda: self.own_s)
        self.write()

    def write(self):
        lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]  # the total line: not read
        for cpu in self.cpus:  # user nice system idle iowait irq softirq steal guest guest_nice
            lines.append(f"cpu{cpu} {self.busy[cpu]} 0 0 {10 ** 6} 77 0 0 0 0 0")
        lines.append("cpu7 999999 0 0 0 0 0 0 0 0 0")  # a CPU outside the affinity set: not ours
        self.path.write_text("\n".join(lines) + "\nintr 1 2 3\n")

    def run(self, seconds, own_s, busy_s):
        """`seconds` pass; this process uses `own_s` of CPU; the CPUs are busy `busy_s` each (anyone)."""
        self.now += seconds
        self.own_s += own_s
        for cpu, spent in zip(self.cpus, busy_s):
            self.busy[cpu] += round(spent * TICKS_PER_S)
        self.write()


def test_a_busy_process_beside_us_takes_one_cpu_of_two(tmp_path, monkeypatch):
    machine = Machine(tmp_path / "stat", monkeypatch)
    cpus = FreeCpus(stat_path=str(machine.path))
    machine.run(1.0, own_s=1.5, busy_s=(1.0, 0.5))  # only we ran: 1.5 s of our own CPU time
    assert cpus.free() == pytest.approx(2.0) and cpus.threads(2) == 2
    machine.run(1.0, own_s=1.0, busy_s=(1.0, 1.0))  # another process kept one CPU busy
    assert cpus.free() == pytest.approx(1.0) and cpus.threads(2) == 1
    machine.run(1.0, own_s=0.0, busy_s=(1.0, 1.0))  # two busy processes, we idle: still one thread
    assert cpus.free() == pytest.approx(0.0) and cpus.threads(2) == 1
    machine.run(1.0, own_s=0.2, busy_s=(0.2, 0.2))  # a process a fifth busy leaves the CPU free
    assert cpus.threads(2) == 2
    assert cpus.threads(1) == 1
    machine.run(1.0, own_s=1.0, busy_s=(1.0, 0.4))  # one 40 % busy: free for a caller that shares half a CPU
    assert cpus.threads(2) == 1 and cpus.threads(2, shared_ok=0.5) == 2


def test_readings_too_close_together_keep_the_last_answer(tmp_path, monkeypatch):
    machine = Machine(tmp_path / "stat", monkeypatch)
    cpus = FreeCpus(min_interval_s=0.05, stat_path=str(machine.path))
    machine.run(1.0, own_s=0.0, busy_s=(1.0, 0.0))
    assert cpus.free() == pytest.approx(1.0)
    machine.run(0.01, own_s=0.0, busy_s=(0.0, 0.0))  # 10 ms: noise
    assert cpus.free() == pytest.approx(1.0)
    machine.run(0.1, own_s=0.0, busy_s=(0.0, 0.0))  # counted from the last reading that was used
    assert cpus.free() == pytest.approx(2.0)


def test_without_proc_stat_every_cpu_counts_as_free(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    cpus = FreeCpus(stat_path=str(tmp_path / "missing"))
    assert cpus.free() == 3.0 and cpus.threads(2) == 2


def test_on_this_machine_the_answer_is_a_share_of_our_cpus():
    cpus = FreeCpus(min_interval_s=0.0)
    assert 0.0 <= cpus.free() <= len(os.sched_getaffinity(0))
