"""The hub: polls the run index while someone listens and pushes what changed to subscribers.

It knows its subscribers only through the :class:`Subscriber` and :class:`RunSubscriber`
protocols (the websocket handlers implement them; ``app.py`` wires hub and handlers), so
it imports no handler and runs without a server in tests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Protocol

from tornado.ioloop import PeriodicCallback

from workbench.server._index import Change, RunIndex
from workbench.server._reads import Reads, ReadsBusy

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
      reads: the bounded pool every blocking read of the server runs in (polls and the
        handlers' reads); default ``Reads()``.
    """

    def __init__(self, index: RunIndex, poll_interval: float, reads: Reads | None = None
                 ) -> None:
        self.index = index
        self.poll_interval = poll_interval
        self.reads = reads if reads is not None else Reads()
        self._polling: concurrent.futures.Future[Any] | None = None
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
        """Stops polling and reading."""
        self._timer.stop()
        self.reads.close()

    def _start(self) -> None:
        if not self._timer.is_running():
            self._timer.start()

    async def _tick(self) -> None:
        await self.poll_now(max_age=0.0)

    async def poll_now(self, max_age: float = 0.1) -> None:
        """Polls the run roots in the bounded read pool (unless polled ``max_age`` s ago).

        A poll still running from before (a file system that stalls) is not waited for
        and not doubled: callers answer from what the last finished poll read, and the
        stalled poll's changes are sent to the subscribers once it ends.
        """
        what = "polling the run directories"
        async with self._lock:
            if time.monotonic() - self._last_poll < max_age:
                return
            if self._polling is not None and not self._polling.done():
                return
            try:
                self._polling = fut = await self.reads.start(what, self.index.poll)
                changes, removed = await self.reads.wait(what, fut)
            except ReadsBusy as e:
                log.warning("workbench: %s", e)
                if self._polling is not None and not self._polling.done():
                    loop = asyncio.get_running_loop()

                    def ended(f: concurrent.futures.Future[Any]) -> None:
                        if not loop.is_closed():
                            loop.call_soon_threadsafe(self._late, f)
                    self._polling.add_done_callback(ended)
                return
            self._last_poll = time.monotonic()
        self.dispatch(changes, removed)

    def _late(self, fut: concurrent.futures.Future[Any]) -> None:
        """Sends what a poll that overran its time found, once it ends."""
        if not fut.cancelled() and fut.exception() is None:
            self._last_poll = time.monotonic()
            self.dispatch(*fut.result())

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
