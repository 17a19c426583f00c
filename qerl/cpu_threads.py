"""Torch's CPU thread count, kept to the cores that other processes leave idle.

torch runs each GEMM on one OpenMP thread per core, and every thread waits at the end of
each operation for the slowest. When another process holds a core, the thread that shares
it waits for the scheduler while the others spin, at every one of a decode step's thousand
operations: on two cores beside one busy process, two threads ran a CPU rollout many times
slower than one (``qerl bench step --device cpu --busy 1`` measures a step both ways).

``CPUThreads.adjust()``, called before each unit of work (a training step, a batch of
samples), sets the count to the cores the other processes left idle since the last call
(``restore()`` puts back the count it found):
the machine's busy time (/proc/stat) less this process's own (os.times), so that its own
threads, spinning or not, never count against it. ``OMP_NUM_THREADS`` set by the user
fixes the count instead; off Linux nothing is changed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

STAT = Path("/proc/stat")
# A core counts as free once others leave it at least this idle (0.5: the idle cores rounded
# to the nearest whole).
FREE_FROM = 0.5


@dataclass(frozen=True)
class Sample:
    wall: float  # s
    busy: float  # s of CPU time over all cores (every process)
    own: float  # s of CPU time of this process (all its threads)


def sample() -> Sample | None:
    """The machine's and this process's CPU time so far; None where /proc/stat is missing."""
    try:
        fields = STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: busy is all but idle, iowait.
    ticks = [int(v) for v in fields[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return Sample(time.monotonic(), busy, own.user + own.system)


def threads_for(before: Sample, after: Sample, cores: int, most: int) -> int:
    """The threads to run with: the cores that processes other than this one left idle
    between the two samples (at least one, at most ``most``)."""
    wall = after.wall - before.wall
    if wall <= 0:
        return most
    others = max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall
    return max(1, min(most, int(cores - others + (1 - FREE_FROM))))


class CPUThreads:
    """Adjusts torch's thread count to the idle cores at each ``adjust()`` (see the module
    docstring). ``most`` defaults to torch's count when made: the cores this process may
    use."""

    def __init__(self, most: int | None = None):
        self.found = torch.get_num_threads()
        self.most = most or self.found
        self.fixed = "OMP_NUM_THREADS" in os.environ
        self.cores = os.cpu_count() or 1  # /proc/stat counts every core of the machine
        self.last = None if self.fixed else sample()

    def adjust(self) -> int:
        """Set torch's thread count for the work that follows; returns it."""
        now = None if self.last is None else sample()
        if now is not None:
            torch.set_num_threads(threads_for(self.last, now, self.cores, self.most))
            self.last = now
        return torch.get_num_threads()

    def restore(self) -> None:
        torch.set_num_threads(self.found)
