"""The hub: polls the run index while someone listens and pushes what changed to subscribers.

It knows its subscribers only through the :class:`Subscriber` and :class:`RunSubscriber`
protocols (the websocket handlers implement them; ``app.py`` wires hub and handlers), so
it imports no handler and runs without a server in tests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tornado.ioloop import PeriodicCallback

from workbench.server._index import Change, RunIndex
from workbench.server._watch import RunWatch
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

    Each tick refreshes the runs that have a run subscriber, then looks at the others in
    turn for at most ``poll_share`` of the tick's interval (:meth:`RunIndex.poll` with a
    budget): a poll's cost is bounded however many runs there are. While only the list is
    watched and nothing changes, the interval doubles up to ``4 * poll_interval``.

    Args:
      index: the runs it polls.
      poll_interval: seconds between polls while anyone is subscribed.
      reads: the bounded pool every blocking read of the server runs in (polls and the
        handlers' reads); default ``Reads()``.
      poll_share: the fraction of one core a tick may spend looking at runs nobody watches.
    """

    def __init__(self, index: RunIndex, poll_interval: float, reads: Reads | None = None,
                 poll_share: float = 0.02) -> None:
        self.index = index
        self.poll_interval = poll_interval
        self.poll_share = poll_share
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
        self._timer.callback_time = 1000 * self.poll_interval

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
        if not self._timer.is_running():   # stopped while this tick was due
            return
        interval = self._timer.callback_time / 1000
        found = await self.poll_now(max_age=0.0, budget=self.poll_share * interval)
        idle = not found and not self.run_subs
        self._timer.callback_time = 1000 * (min(2 * interval, 4 * self.poll_interval) if idle
                                            else self.poll_interval)

    async def poll_run(self, watch: RunWatch) -> None:
        """Refreshes one run only (a request for it) and sends what changed to its
        subscribers; ReadsBusy when the read overruns or a poll still runs."""
        await self._exclusive(f"reading run {watch.id!r}",
                              functools.partial(self.index.poll_run, watch))

    async def page(self, limit: int, cursor: str | None) -> dict[str, Any]:
        """One page of the runs list (:meth:`RunIndex.page`); what its refreshes found goes
        to the subscribers. ValueError for a bad cursor, ReadsBusy as :meth:`poll_run`."""
        await self.reads.run("listing the runs", self.index.read_metas)   # the long part
        return await self._exclusive("listing the runs",
                                     functools.partial(self.index.page, limit, cursor))

    async def poll_now(self, max_age: float = 0.1, budget: float | None = None) -> bool:
        """Polls the run roots in the bounded read pool (unless polled ``max_age`` s ago):
        every run, or with ``budget`` (seconds) as :meth:`RunIndex.poll` does. Returns
        whether it found anything.

        A poll still running from before (a file system that stalls) is not waited for
        and not doubled: callers answer from what the last finished poll read, and the
        stalled poll's changes are sent to the subscribers once it ends.
        """
        if time.monotonic() - self._last_poll < max_age:
            return False
        poll = functools.partial(self.index.poll, budget=budget, first=list(self.run_subs))
        try:
            changes, removed = await self._exclusive("polling the run directories", poll)
        except ReadsBusy as e:
            log.warning("workbench: %s", e)
            return False
        self._last_poll = time.monotonic()
        return bool(changes or removed)

    async def _exclusive(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` in the read pool, one at a time (so each run's changes are sent in
        order); ``fn`` returns ``(changes, removed)`` or ``(value, changes, removed)``,
        the changes are dispatched and the rest returned. A read that overruns raises
        ReadsBusy and sends its changes once it ends; until then others raise it at once."""
        async with self._lock:
            if self._polling is not None and not self._polling.done():
                raise ReadsBusy(f"{what}: an earlier read of the run directories has not "
                                "ended (a file system that stalls?); try again")
            self._polling = fut = await self.reads.start(what, fn)
            try:
                out = await self.reads.wait(what, fut)
            except ReadsBusy:
                loop = asyncio.get_running_loop()

                def ended(f: concurrent.futures.Future[Any]) -> None:
                    if not loop.is_closed():
                        loop.call_soon_threadsafe(self._late, f)
                fut.add_done_callback(ended)
                raise
            self.dispatch(*out[-2:])
        return out[0] if len(out) == 3 else out

    def _late(self, fut: concurrent.futures.Future[Any]) -> None:
        """Sends what a read that overran its time found, once it ends."""
        if not fut.cancelled() and fut.exception() is None:
            self.dispatch(*fut.result()[-2:])

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
