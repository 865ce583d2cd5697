"""The hub: polls the run index while someone listens and pushes what changed to subscribers.

It knows its subscribers only through the :class:`Subscriber` and :class:`RunSubscriber`
protocols (the websocket handlers implement them; ``app.py`` wires hub and handlers), so
it imports no handler and runs without a server in tests.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from tornado.ioloop import PeriodicCallback

from workbench.server.index import Change, RunIndex

log = logging.getLogger(__name__)


class Subscriber(Protocol):
    """What the hub needs from a listener of the runs list: somewhere to send messages."""

    def send(self, message: dict[str, Any]) -> None:
        """Delivers one JSON-able message (a closed subscriber unsubscribes itself)."""


class RunSubscriber(Subscriber, Protocol):
    """A listener of one run: also takes its new step records."""

    def push(self, records: list[dict[str, Any]], reset: bool = False) -> None:
        """Takes the run's new step records; ``reset``: the metrics file was replaced."""


class Hub:
    """Polls the run index while someone listens and pushes changes to subscribers.

    Args:
      index: the runs it polls.
      poll_interval: seconds between polls while anyone is subscribed.
    """

    def __init__(self, index: RunIndex, poll_interval: float) -> None:
        self.index = index
        self.poll_interval = poll_interval
        self.run_subs: dict[str, set[RunSubscriber]] = {}
        self.list_subs: set[Subscriber] = set()
        self._lock = asyncio.Lock()
        self._last_poll = -float("inf")
        self._timer = PeriodicCallback(self._tick, poll_interval * 1000)

    def subscribe_run(self, rid: str, sub: RunSubscriber) -> None:
        """``sub`` gets the run's new metrics and ``run.json`` changes."""
        self.run_subs.setdefault(rid, set()).add(sub)
        self._start()

    def subscribe_list(self, sub: Subscriber) -> None:
        """``sub`` gets summaries of runs that appear, change or vanish."""
        self.list_subs.add(sub)
        self._start()

    def unsubscribe(self, sub: Subscriber) -> None:
        """Forgets ``sub``; polling stops when nobody listens."""
        self.list_subs.discard(sub)
        for subs in self.run_subs.values():
            subs.discard(sub)  # type: ignore[arg-type]
        self.run_subs = {k: v for k, v in self.run_subs.items() if v}
        if not self.list_subs and not self.run_subs and self._timer.is_running():
            self._timer.stop()

    def stop(self) -> None:
        """Stops polling."""
        self._timer.stop()

    def _start(self) -> None:
        if not self._timer.is_running():
            self._timer.start()

    async def _tick(self) -> None:
        await self.poll_now(max_age=0.0)

    async def poll_now(self, max_age: float = 0.1) -> None:
        """Polls the run roots in a worker thread (unless polled ``max_age`` s ago)."""
        async with self._lock:
            if time.monotonic() - self._last_poll < max_age:
                return
            changes, removed = await asyncio.to_thread(self.index.poll)
            self._last_poll = time.monotonic()
        self.dispatch(changes, removed)

    def dispatch(self, changes: list[Change], removed: list[str]) -> None:
        """Sends one poll's changes to the subscribers of each run and of the list."""
        for c in changes:
            for sub in list(self.run_subs.get(c.watch.id, ())):
                try:
                    if c.meta_changed:
                        sub.send({"type": "run", "run": c.watch.detail()})
                    sub.push(c.records, reset=c.reset)
                except Exception:  # one failing subscriber must not starve the others
                    log.exception("workbench: sending run %s to a subscriber failed", c.watch.id)
        if not self.list_subs:
            return
        update = [c.watch.summary() for c in changes if c.watch.listed]
        for sub in list(self.list_subs):
            try:
                if update:
                    sub.send({"type": "update", "runs": update})
                if removed:
                    sub.send({"type": "removed", "ids": removed})
            except Exception:
                log.exception("workbench: sending the runs list to a subscriber failed")
