"""The host link as ``host_seconds`` walks a schedule: the transfers in flight share each
direction's bandwidth, compute advances the clock, a done waits for its bytes."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class _Link:
    """The host link during a walk: the bytes each transfer in flight has still to cross,
    by direction; the transfers in one direction share its bandwidth equally (DMAs run
    concurrently: the compiler waits for the small ones first)."""

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.left: dict[str, dict[str, float]] = {"to_host": {}, "to_device": {}}
        self.where: dict[str, str] = {}

    def start(self, name: str, direction: str, nbytes: float) -> None:
        self.where[name] = direction
        self.left[direction][name] = float(nbytes)

    def in_flight(self, name: str) -> bool:
        return name in self.where and name in self.left[self.where[name]]

    def advance(self, dt: float) -> None:
        """The link moves bytes for ``dt`` seconds."""
        for flows in self.left.values():
            t = dt
            while flows and t > 1e-15:
                share = self.bandwidth / len(flows)
                first = min(flows.values())
                step = min(t, first / share)
                for k in list(flows):
                    flows[k] -= share * step
                    if flows[k] <= 1e-6:
                        del flows[k]
                t -= step

    def until_done(self, name: str) -> float:
        """Seconds until ``name`` has crossed (the link itself unchanged)."""
        flows = self.left[self.where[name]]
        saved, t = dict(flows), 0.0
        while name in flows:
            share = self.bandwidth / len(flows)
            step = min(flows.values()) / share
            for k in list(flows):
                flows[k] -= share * step
                if flows[k] <= 1e-6:
                    del flows[k]
            t += step
        flows.clear()
        flows.update(saved)
        return t


def walk(events: Sequence[Sequence[Any]], bandwidth: float, clock_hz: float,
          kernel_seconds: float) -> float:
    """Seconds one run of a computation's schedule waits for its host transfers
    (:class:`_Link`): compute advances the clock, a done waits until its bytes crossed, a
    synchronous transfer at once."""
    link = _Link(bandwidth)
    now, wait = 0.0, 0.0
    for ev in events:
        kind = ev[0]
        if kind == "c":
            dt = ev[1] / clock_hz + ev[2] * kernel_seconds
            link.advance(dt)
            now += dt
        elif kind == "s":
            link.start(ev[1], ev[2], ev[3])
        elif kind in ("d", "x"):
            name = ev[1]
            if kind == "x":   # synchronous: the program waits for it (sharing the link)
                name = f"sync-{now}"
                link.start(name, ev[1], ev[2])
            if link.in_flight(name):
                dt = link.until_done(name)
                link.advance(dt)
                wait, now = wait + dt, now + dt
    # started here, done elsewhere: assumed to wait at the end of this run
    rest = max((link.until_done(k) for k in link.where if link.in_flight(k)), default=0.0)
    return wait + rest
