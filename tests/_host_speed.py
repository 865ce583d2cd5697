"""How fast the host's cores ran during a test session, printed at its end.

The suite keeps both cores busy from its first test to its last, so its duration is its
CPU work divided by how fast the cores ran, and on a shared virtual machine that speed
moves: a fixed loop of this machine's Python took 4.4 s on one core and 8.4 s on the same
core minutes later (the CPU seconds of the same work, nothing else of ours running), and
`make test` of one commit took 25:46 in one session and 50:28 in the next. So the
session's controller (which idles while its pytest-xdist workers test) times a fixed piece
of work on each core every ``every`` seconds: the *CPU* time it takes (``thread_time``),
which a busy neighbour on the host's core or a lower clock raise, and our own workers'
time-slicing does not. The summary gives each core's median and the run's spread, so a
slow run can be told apart from a slow host. Cost: 20-45 ms of CPU per core and sample.

It does not extrapolate the session's time from that spread: a clean clone's `make test`
took 39:11 with the median sample 1.57x the fastest tenth and 32:36 at 1.01x (the same
tests), so the suite slowed 1.20x where the loop said 1.57x (the suite's compiles and
kernels do not slow like one Python loop; an earlier version's "~25 min at that speed"
was wrong).
"""
from __future__ import annotations

import os
import statistics
import threading
import time

#: Iterations of the timed loop (``sum(range(WORK))``): 20-45 ms of one core here.
WORK = 1_000_000


class HostSpeed:
    """Samples the cores' speed in a daemon thread until :meth:`stop`."""

    def __init__(self, every: float = 20.0) -> None:
        self.every = every
        self.samples: list[tuple[float, int, float]] = []   # (time, core, CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-speed", daemon=True)
        self._started = time.monotonic()

    def start(self) -> HostSpeed:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        cores = sorted(os.sched_getaffinity(0))
        me = threading.get_native_id()
        while True:
            for core in cores:
                try:
                    os.sched_setaffinity(me, {core})   # this thread only
                except OSError:
                    return
                t0 = time.thread_time()
                sum(range(WORK))
                self.samples.append((time.time(), core, time.thread_time() - t0))
            if self._stop.wait(self.every):
                return

    def summary(self) -> str:
        """One line per core: median, fastest and slowest milliseconds of the loop."""
        if not self.samples:
            return "host speed: no sample (the session was shorter than one interval)"
        lines = [f"host speed: CPU ms of a fixed loop (sum(range({WORK:_}))), sampled every "
                 f"{self.every:.0f} s on each core; more ms = a slower core"]
        for core in sorted({c for _, c, _ in self.samples}):
            ms = sorted(s * 1e3 for _, c, s in self.samples if c == core)
            lines.append(f"  core {core}: median {statistics.median(ms):.1f} ms, fastest "
                         f"{ms[0]:.1f}, slowest {ms[-1]:.1f} ({len(ms)} samples)")
        every = sorted(s for _, _, s in self.samples)
        fastest = statistics.median(every[:max(1, len(every) // 10)])
        slower = statistics.median(every) / fastest
        elapsed = time.monotonic() - self._started
        lines.append(f"  the run's median sample took {slower:.2f}x its fastest tenth, over the "
                     f"{elapsed / 60:.1f} min since the session started")
        return "\n".join(lines)
