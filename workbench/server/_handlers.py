"""REST and websocket handlers of the Workbench server extension (all authenticated).

Run ids travel URL-encoded in one path segment (``runs%2Ftiny``). Reading runs needs
the same permission as reading files (``contents``/``read``): a run directory is files
under the server's root. Every handler gets the :class:`~workbench.server._hub.Hub` as
its ``hub`` argument (see :func:`handlers`); the websockets implement the hub's
``Subscriber`` protocols and subscribe to it.

Every file a handler serves is read by the one safe reader (``workbench._run_file``:
regular files inside the run directory, bounded, never blocking), in the hub's bounded
read pool (:mod:`workbench.server._reads`): a read that overruns answers 503 and leaves
the other requests their workers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from tornado import web, websocket

from workbench import _runs as runs
from workbench.server import _profiles as profiles
from workbench.server._reads import ReadsBusy

if TYPE_CHECKING:
    from workbench.server._hub import Hub
    from workbench.server._watch import RunWatch

AUTH_RESOURCE = "contents"
MAX_LIMIT = 200_000  # metrics records in one response
PAGE, MAX_PAGE = 100, 1000  # runs in one page of the runs list: by default, at most
EVERY_STEP = -(2**53)  # ``since`` when none is given: below every valid step


def metrics_payload(watch: RunWatch, records: list[dict[str, Any]],
                    keys: list[str] | None = None) -> dict[str, Any]:
    """Columnar JSON of step records: ``{"id", "columns": {"step": [...], ...}, "gaps"}``.

    ``keys`` limits the columns (``step`` is always sent). A record without a key has
    null in that column; a value that is null, NaN or +-Infinity in the file is sent as
    null too, and its row index is listed in ``gaps[key]`` (charts break the line there,
    while they join across missing values).
    """
    if keys:
        cols = {k: [r.get(k) for r in records] for k in dict.fromkeys(["step", *keys])}
    else:
        cols = {"step": [], **runs.columns(records)}
    gaps: dict[str, list[int]] = {}
    for key, col in cols.items():
        bad = [i for i, v in enumerate(col) if v is None or (v.__class__ is float and v - v)]
        bad = [i for i in bad if key in records[i]]
        if bad:
            gaps[key] = bad
            for i in bad:
                col[i] = None
    return {"id": watch.id, "count": len(records),
            "last_step": records[-1]["step"] if records else None, "columns": cols,
            "gaps": gaps}


def dumps(message: Any) -> str:
    """Strict JSON text of a message; non-finite numbers anywhere in it become null."""
    try:
        return json.dumps(message, allow_nan=False)
    except ValueError:
        return json.dumps(runs.json_safe(message), allow_nan=False)


def _keys_arg(handler: web.RequestHandler) -> list[str] | None:
    return [k for k in handler.get_query_argument("keys", "").split(",") if k] or None


def _int_arg(handler: web.RequestHandler, name: str, default: int, lo: int = -2**53,
             hi: int = 2**53) -> int:
    """Query argument ``name`` as an integer in ``[lo, hi]``; 400 with the reason if not."""
    raw = handler.get_query_argument(name, None)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if len(raw) <= 20 else None
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise web.HTTPError(400, f"query argument {name}={raw[:40]!r} must be an integer "
                                 f"from {lo} to {hi}")
    return value


class _Base(JupyterHandler):
    auth_resource = AUTH_RESOURCE
    hub: Hub

    def initialize(self, hub: Hub) -> None:  # type: ignore[override]
        self.hub = hub

    async def lookup(self, rid: str) -> RunWatch:
        """The run's watch, up to date; 400 for malformed ids, 404 for unknown runs.

        Only this run is read again. The refresh goes through the hub, which pushes what
        it read to the run's websockets: a refresh of its own would consume appended
        lines unseen by them. When the file system stalls, it answers from what the last
        read found.
        """
        try:
            watch = self.hub.index.watch(rid)
        except ValueError as e:
            raise web.HTTPError(400, str(e)) from None
        except FileNotFoundError as e:
            raise web.HTTPError(404, str(e)) from None
        try:
            await self.hub.poll_run(watch)
        except ReadsBusy as e:
            self.log.warning("workbench: %s", e)
        return watch

    async def bounded_read(self, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the hub's bounded read pool; 503 naming ``what`` when it (or
        its wait for a free worker) takes longer than the pool's timeout."""
        try:
            return await self.hub.reads.run(what, fn, *args)
        except ReadsBusy as e:
            raise web.HTTPError(503, str(e)) from None


class RunsHandler(_Base, APIHandler):
    """``GET /workbench/api/runs?limit=<n>&cursor=<next>``: one page of run summaries.

    ``{"roots", "runs", "total", "next", "truncated"}``: at most ``limit`` runs (default
    100, at most 1000), newest created first; ``total`` runs are listed in all; ``next``
    is the cursor of the following page (null on the last); ``truncated``: the search
    stopped at its folder limit, so some runs under the roots are not listed.
    """

    @web.authenticated
    @authorized("read")
    async def get(self) -> None:
        limit = _int_arg(self, "limit", PAGE, lo=1, hi=MAX_PAGE)
        self.finish(dumps(await runs_page(self, limit, self.get_query_argument("cursor", None))))


async def runs_page(handler: _Base, limit: int, cursor: str | None) -> dict[str, Any]:
    """A page of the runs list with the roots; 400 for a bad cursor. When the file system
    stalls, the page of what earlier reads found."""
    try:
        try:
            page = await handler.hub.page(limit, cursor or None)
        except ReadsBusy as e:
            handler.log.warning("workbench: %s", e)
            page = handler.hub.index.page(limit, cursor or None, read=False)[0]
    except ValueError as e:
        raise web.HTTPError(400, str(e)) from None
    return {"roots": [_display(r) for r in handler.hub.index.roots], **page}


def _display(path: Path) -> str:
    """A root as text to show (bytes that are not UTF-8 as U+FFFD)."""
    return os.fsencode(path).decode("utf-8", "replace")


class RunHandler(_Base, APIHandler):
    """``GET /workbench/api/runs/<id>``: the run's ``run.json`` (plus ``uid``, ``events``)."""

    @web.authenticated
    @authorized("read")
    async def get(self, rid: str) -> None:
        watch = await self.lookup(rid)
        self.finish(dumps(watch.detail()))


class MetricsHandler(_Base, APIHandler):
    """``GET /workbench/api/runs/<id>/metrics?since=<step>&limit=<n>&keys=loss,mfu``.

    Returns the step records above ``since`` as columns; ``more`` says that ``limit``
    cut the answer short (ask again with ``since=last_step``); without ``since``, every
    step (zero and negative ones too). ``since`` is an integer (|since| <= 2**53),
    ``limit`` a positive one (at most 200000 are sent); anything else answers 400.
    """

    @web.authenticated
    @authorized("read")
    async def get(self, rid: str) -> None:
        since = _int_arg(self, "since", EVERY_STEP)
        limit = min(_int_arg(self, "limit", MAX_LIMIT, lo=1), MAX_LIMIT)
        keys = _keys_arg(self)
        watch = await self.lookup(rid)
        records = await self.bounded_read(f"reading the metrics of run {watch.id!r}",
                                          watch.read, since, limit + 1)
        more = len(records) > limit
        payload = metrics_payload(watch, records[:limit], keys)
        payload.update(since=None if since == EVERY_STEP else since, more=more)
        self.finish(dumps(payload))


class ProfilesHandler(_Base, APIHandler):
    """``GET /workbench/api/runs/<id>/profiles``: ``{"id", "profiles": [...]}``, each of
    the run's ``profiles/<step>/report.json`` (``trainer.profile()``) checked, oldest
    first: its ``rows`` (one per term of the plan's prediction: ``name``, ``predicted``
    and ``measured`` seconds per step, collective ``kind`` and ``axes``), ``verdict`` (the
    largest disagreement in words), ``tokens_per_s`` during and outside the profile and
    ``overhead``, ``top_ops``; ``problem`` when a report could not be used."""

    @web.authenticated
    @authorized("read")
    async def get(self, rid: str) -> None:
        watch = await self.lookup(rid)
        found = await self.bounded_read(f"reading the profiles of run {watch.id!r}",
                                        profiles.read_profiles, watch.path)
        self.finish(dumps({"id": watch.id, "profiles": found}))


class _Socket(WebSocketMixin, websocket.WebSocketHandler, _Base):
    """Authenticated, authorized websocket that the hub sends JSON messages to (a
    :class:`~workbench.server._hub.Subscriber`)."""

    async def pre_get(self) -> None:
        ok = await ensure_async(self.authorizer.is_authorized(self, self.current_user,
                                                              "read", AUTH_RESOURCE))
        if not ok:
            raise web.HTTPError(403)

    def send(self, message: dict[str, Any]) -> None:
        """Writes one JSON message; a closed socket unsubscribes itself."""
        try:
            self.write_message(dumps(message))
        except websocket.WebSocketClosedError:
            self.hub.unsubscribe(self)

    def on_message(self, message: str | bytes) -> None:
        """Clients only listen; messages are ignored."""

    def on_close(self) -> None:
        self.hub.unsubscribe(self)


class RunStreamHandler(_Socket):
    """``WS /workbench/api/runs/<id>/stream?since=<step>&keys=loss,mfu`` (a
    :class:`~workbench.server._hub.RunSubscriber`).

    Sends ``{"type": "run", "run": ...}`` first and whenever ``run.json`` changes,
    then ``{"type": "metrics", "columns": ...}`` with every record above ``since`` (all
    when not given) and,
    as lines are appended, the new ones. ``{"type": "reset"}`` means the metrics file
    was replaced: drop what you have.
    """

    rid: str = ""

    @ws_authenticated
    async def get(self, rid: str) -> None:
        await self.pre_get()
        self.watch = await self.lookup(rid)
        self.since = _int_arg(self, "since", EVERY_STEP)
        self.keys = _keys_arg(self)
        res = super().get(rid)
        if res is not None:
            await res

    async def open(self, rid: str) -> None:  # type: ignore[override]
        super().open(rid)
        self.last_step = self.since
        self.send({"type": "run", "run": self.watch.detail()})
        while True:  # backfill in pages
            try:
                records = await self.hub.reads.run(
                    f"reading the metrics of run {self.watch.id!r}", self.watch.read,
                    self.last_step, 50_000)
            except ReadsBusy as e:   # 1013: try again later
                self.close(1013, str(e)[:120])
                return
            self.push(records)
            if len(records) < 50_000:
                break
        # no await from here: nothing appended between this read and subscribing is lost
        self.push(self.watch.read(self.last_step, None))
        self.hub.subscribe_run(self.watch.id, self)

    def push(self, records: list[dict[str, Any]], reset: bool = False) -> None:
        """Sends the records above the last one sent (after a reset: all of them)."""
        if reset:
            self.last_step = -(2**62)
            self.send({"type": "reset"})
        records = [r for r in records if r["step"] > self.last_step]
        if records:
            self.last_step = records[-1]["step"]
            self.send({"type": "metrics", **metrics_payload(self.watch, records, self.keys)})


class ListStreamHandler(_Socket):
    """``WS /workbench/api/stream?limit=<n>``: ``{"type": "runs", "runs": [...], "total",
    "next"}`` on connect (the first page of ``GET /runs``; fetch the others there with
    ``cursor=next``), then ``{"type": "update", "runs": [changed summaries]}`` (any run,
    paged or not) and ``{"type": "removed", "ids": [...]}``.
    """

    limit: int = PAGE

    @ws_authenticated
    async def get(self) -> None:
        await self.pre_get()
        self.limit = _int_arg(self, "limit", PAGE, lo=1, hi=MAX_PAGE)
        res = super().get()
        if res is not None:
            await res

    async def open(self) -> None:  # type: ignore[override]
        super().open()
        self.send({"type": "runs", **await runs_page(self, self.limit, None)})
        self.hub.subscribe_list(self)


def handlers(hub: Hub) -> list[tuple[str, type, dict[str, Any]]]:
    """URL patterns (below the server's base URL), their handlers and the handlers' ``hub``."""
    rid = r"(?P<rid>[^/]+)"
    return [
        (r"/workbench/api/runs/?", RunsHandler, {"hub": hub}),
        (r"/workbench/api/stream", ListStreamHandler, {"hub": hub}),
        (rf"/workbench/api/runs/{rid}/metrics", MetricsHandler, {"hub": hub}),
        (rf"/workbench/api/runs/{rid}/profiles", ProfilesHandler, {"hub": hub}),
        (rf"/workbench/api/runs/{rid}/stream", RunStreamHandler, {"hub": hub}),
        (rf"/workbench/api/runs/{rid}", RunHandler, {"hub": hub}),
    ]
