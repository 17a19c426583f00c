"""Torch's CPU thread count follows the cores that other processes leave idle."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from qerl import cpu_threads
from qerl.cpu_threads import CPUThreads, Sample, threads_for


@pytest.mark.parametrize(("others", "own", "threads"), [
    (0.0, 0.0, 4),   # an idle machine: every core
    (0.0, 4.0, 4),   # our own threads busy on every core: still every core
    (1.0, 2.0, 3),   # one core busy elsewhere
    (1.4, 0.0, 3),   # 2.6 idle cores round to 3
    (1.6, 0.0, 2),   # 2.4 to 2
    (9.0, 1.0, 1),   # oversubscribed: never fewer than one
])
def test_threads_are_the_cores_others_leave_idle(others, own, threads):
    """Four cores over a 2 s window: busy time is every process's, own time ours."""
    before = Sample(wall=10.0, busy=100.0, own=5.0)
    after = Sample(wall=12.0, busy=100.0 + 2 * (others + own), own=5.0 + 2 * own)
    assert threads_for(before, after, cores=4, most=4) == threads
    assert threads_for(before, after, cores=4, most=2) == min(threads, 2)


def test_a_sample_reads_the_machine_and_this_process(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait.
    stat.write_text("cpu  100 20 30 500 40 5 6 7 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    monkeypatch.setattr(cpu_threads, "STAT", stat)
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    got = cpu_threads.sample()
    assert got.busy == pytest.approx((100 + 20 + 30 + 5 + 6 + 7) / 100)
    assert got.own > 0  # this process has run
    monkeypatch.setattr(cpu_threads, "STAT", tmp_path / "missing")
    assert cpu_threads.sample() is None


def test_a_user_choice_of_threads_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    assert CPUThreads(most=8).adjust() == before


@pytest.mark.skipif(cpu_threads.sample() is None, reason="no /proc/stat")
def test_a_busy_process_beside_takes_a_thread_away():
    """A process spinning on one core for the whole window: at most cores - 1 threads; and
    restore() gives back the count found."""
    before = torch.get_num_threads()
    threads = CPUThreads(most=64)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        got = threads.adjust()
    finally:
        busy.kill()
        busy.wait()
        threads.restore()
    assert 1 <= got <= max(1, threads.cores - 1)
    assert torch.get_num_threads() == before
