"""How the simulated XLA:CPU devices of one process share the host's cores: each op's share of
the host's time (``StepProfile.shared``; the rule is in ``_trace``'s module docstring)."""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from workbench.perf._trace_events import OpEvent


def shared_time(events: Sequence[OpEvent], collective: Sequence[bool], cores: float,
                 available: float) -> tuple[dict[str, float], float, float, float, float]:
    """The host's time of XLA:CPU ops whose devices share ``cores``: ``(seconds per op
    name, idle, host, others, window)`` over the window from the first op to the last,
    with ``sum(per op) + idle + host + others == window``.

    At each instant the running non-collective ops split the ``available`` cores (those
    other processes left) evenly, one op on at most one core, and each op is charged its
    core time / ``cores``: the time it would take with the cores to itself. Cores they
    leave unused go to the collectives in progress, else to ``idle``; ``host`` is time no
    op runs at all; ``others`` the (``cores - available``) / ``cores`` other processes
    took. An op's nested ops (a loop body in its while) are its own, not its parent's.
    """
    segs: list[tuple[float, float, str, bool]] = []
    for ev, coll in zip(events, collective):
        cur = ev.start
        for s, e in sorted(ev.children):
            if s > cur:
                segs.append((cur, s, ev.name, coll))
            cur = max(cur, e)
        if ev.end > cur:
            segs.append((cur, ev.end, ev.name, coll))
    if not segs:
        return {}, 0.0, 0.0, 0.0, 0.0
    starts = np.array([x[0] for x in segs])
    ends = np.array([x[1] for x in segs])
    is_coll = np.array([x[3] for x in segs])
    pts = np.unique(np.concatenate([starts, ends]))
    i0, i1 = np.searchsorted(pts, starts), np.searchsorted(pts, ends)
    running = np.zeros((2, len(pts)))
    for row, mask in ((0, ~is_coll), (1, is_coll)):
        np.add.at(running[row], i0[mask], 1.0)
        np.add.at(running[row], i1[mask], -1.0)
    local, comm = np.cumsum(running, axis=1)[:, :-1].round()
    dt = np.diff(pts)
    used = np.minimum(local, available)
    rate_local = np.where(local > 0, used / np.maximum(local, 1.0), 0.0) / cores
    rate_comm = np.where(comm > 0, (available - used) / np.maximum(comm, 1.0), 0.0) / cores
    idle = float(np.sum(np.where((comm == 0) & (local > 0), (available - used) / cores, 0.0)
                        * dt))
    host = float(np.sum(np.where((comm == 0) & (local == 0), dt * available / cores, 0.0)))
    others = float(np.sum(dt)) * (cores - available) / cores
    cum_local = np.concatenate([[0.0], np.cumsum(rate_local * dt)])
    cum_comm = np.concatenate([[0.0], np.cumsum(rate_comm * dt)])
    share = np.where(is_coll, cum_comm[i1] - cum_comm[i0], cum_local[i1] - cum_local[i0])
    out: dict[str, float] = defaultdict(float)
    for (_, _, name, _), v in zip(segs, share):
        out[name] += float(v)
    return dict(out), idle, host, others, float(pts[-1] - pts[0])


def host_core_ids() -> list[int] | None:
    """The cores this process may run on (its CPU affinity), or None where the OS does not
    say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def host_cores() -> int:
    """How many cores this process may run on, what its simulated devices share."""
    ids = host_core_ids()
    return len(ids) if ids else os.cpu_count() or 1
