"""The Workbench jupyter_server extension: configuration, polling hub, handler wiring."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_server.extension.application import ExtensionApp
from tornado.ioloop import PeriodicCallback
from traitlets import Bool, Float, Int, List, Unicode

from workbench.server.handlers import handlers
from workbench.server.index import Change, RunIndex

if TYPE_CHECKING:
    from workbench.server.handlers import ListStreamHandler, RunStreamHandler, _Socket


class Hub:
    """Polls the run index while someone listens and pushes changes to websockets."""

    def __init__(self, index: RunIndex, poll_interval: float) -> None:
        self.index = index
        self.poll_interval = poll_interval
        self.run_subs: dict[str, set[RunStreamHandler]] = {}
        self.list_subs: set[ListStreamHandler] = set()
        self._lock = asyncio.Lock()
        self._last_poll = -float("inf")
        self._timer = PeriodicCallback(self._tick, poll_interval * 1000)

    def subscribe_run(self, rid: str, sock: RunStreamHandler) -> None:
        """``sock`` gets the run's new metrics and ``run.json`` changes."""
        self.run_subs.setdefault(rid, set()).add(sock)
        self._start()

    def subscribe_list(self, sock: ListStreamHandler) -> None:
        """``sock`` gets summaries of runs that appear, change or vanish."""
        self.list_subs.add(sock)
        self._start()

    def _start(self) -> None:
        if not self._timer.is_running():
            self._timer.start()

    def unsubscribe(self, sock: _Socket) -> None:
        """Forgets ``sock``; polling stops when nobody listens."""
        self.list_subs.discard(sock)  # type: ignore[arg-type]
        for subs in self.run_subs.values():
            subs.discard(sock)  # type: ignore[arg-type]
        self.run_subs = {k: v for k, v in self.run_subs.items() if v}
        if not self.list_subs and not self.run_subs and self._timer.is_running():
            self._timer.stop()

    def stop(self) -> None:
        """Stops polling."""
        self._timer.stop()

    async def _tick(self) -> None:
        await self.poll_now(max_age=0.0)

    async def poll_now(self, max_age: float = 0.1) -> None:
        """Polls the run roots in a worker thread (unless polled ``max_age`` s ago)."""
        async with self._lock:
            if time.monotonic() - self._last_poll < max_age:
                return
            changes, removed = await asyncio.to_thread(self.index.poll)
            self._last_poll = time.monotonic()
        self._dispatch(changes, removed)

    def _dispatch(self, changes: list[Change], removed: list[str]) -> None:
        for c in changes:
            for sock in list(self.run_subs.get(c.watch.id, ())):
                if c.meta_changed:
                    sock.send({"type": "run", "run": c.watch.detail()})
                sock.push(c.records, reset=c.reset)
        if not self.list_subs:
            return
        update = [c.watch.summary() for c in changes if c.watch.meta]
        for sock in list(self.list_subs):
            if update:
                sock.send({"type": "update", "runs": update})
            if removed:
                sock.send({"type": "removed", "ids": removed})


class WorkbenchExtension(ExtensionApp):
    """Serves the runs under the server's root and ``run_roots`` to the Workbench lab panel.

    Configure in ``jupyter_server_config.py``::

        c.WorkbenchExtension.run_roots = ["/data/runs"]
        c.WorkbenchExtension.max_depth = 4
    """

    name = "workbench"
    load_other_extensions = True

    run_roots = List(Unicode(), default_value=[], config=True,
                     help="Extra directories searched for runs, besides the server's root "
                          "directory (relative paths are relative to the root directory).")
    include_root_dir = Bool(True, config=True,
                            help="Search the server's root directory for runs (else only run_roots).")
    max_depth = Int(4, config=True, help="How many directory levels below a root to search "
                                         "for run.json.")
    poll_interval = Float(0.25, config=True, help="Seconds between polls of the run files "
                                                  "while a websocket listens.")
    scan_interval = Float(2.0, config=True, help="Seconds between directory scans for new runs.")

    def roots(self) -> list[Path]:
        """The run roots, the server's root directory first; duplicates dropped."""
        base = Path(os.path.expanduser(self.serverapp.root_dir)).resolve()
        out: list[Path] = [base] if self.include_root_dir else []
        for r in self.run_roots:
            p = Path(os.path.expanduser(r))
            p = (p if p.is_absolute() else base / p).resolve()
            if p not in out:
                out.append(p)
        return out

    def initialize_settings(self) -> None:
        index = RunIndex(self.roots(), max_depth=self.max_depth, scan_interval=self.scan_interval)
        self.hub = Hub(index, self.poll_interval)
        self.settings["workbench_hub"] = self.hub
        self.log.info("Workbench runs from %s", ", ".join(map(str, index.roots)))

    def initialize_handlers(self) -> None:
        self.handlers.extend(handlers())

    async def stop_extension(self) -> None:
        self.hub.stop()


def extension_points() -> list[dict[str, Any]]:
    """The entry for ``_jupyter_server_extension_points``."""
    return [{"module": "workbench.server", "app": WorkbenchExtension}]
