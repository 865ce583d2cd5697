"""The server's view of the run roots: the runs found, polled within a budget, and listed
in pages.

Pure bookkeeping over ``workbench._runs`` (no tornado, no jax). All methods are
thread-safe: the extension calls them from a worker thread so that reading a large
metrics file never blocks the server's event loop.
"""
from __future__ import annotations

import base64
import bisect
import json
import os
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench import _runs as runs
from workbench.server._scan import RunScan
from workbench.server._watch import RunWatch, number

__all__ = ["Change", "RunIndex", "decode_cursor", "encode_cursor"]


@dataclass
class Change:
    """What one poll found for one run."""

    watch: RunWatch
    records: list[dict[str, Any]] = field(default_factory=list)
    meta_changed: bool = False
    reset: bool = False


class RunIndex:
    """The runs under a list of roots, found by a bounded-depth scan and polled.

    Each real directory has one watch, however many ids (symlinked aliases, overlapping
    roots) lead to it: the first id found keeps it. Scans are incremental
    (:class:`~workbench.server._scan.RunScan`); a budgeted :meth:`poll` looks at the runs in
    turn and reads only those that changed on disk, so its cost per call is bounded
    however many runs there are.

    Args:
      roots: run roots; ids under ``roots[0]`` are relative paths, ``"k:path"`` otherwise
        (both as :func:`workbench._runs.run_id` encodes them).
      max_depth: how deep below each root to look for ``run.json``.
      scan_interval: seconds between directory scans for new or removed runs.
      allow_hidden: list and serve runs under hidden directories (Jupyter's
        ``ContentsManager.allow_hidden``).
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]], *, max_depth: int = 4,
                 scan_interval: float = 2.0, allow_hidden: bool = False) -> None:
        self.roots = [Path(r) for r in roots]
        self.max_depth = max_depth
        self.scan_interval = scan_interval
        self.allow_hidden = allow_hidden
        self.watches: dict[str, RunWatch] = {}
        self._by_real: dict[Path, RunWatch] = {}
        self._scans = [RunScan(r, max_depth, allow_hidden) for r in self.roots]
        self._order: list[RunWatch] = []   # the watches, in the order polls visit them
        self._turn = 0                     # where the next budgeted poll starts in _order
        self._next_scan = -float("inf")
        self._found: dict[Path, str] | None = None   # what the last full scan found
        self._lock = threading.RLock()

    def watch(self, rid: str) -> RunWatch:
        """The watch of run ``rid`` (resolved safely inside the roots; raises
        ``ValueError`` for malformed ids, ``FileNotFoundError`` for unknown or hidden
        runs). An alias of a watched directory gets that directory's watch."""
        path = runs.resolve_run(self.roots, rid, allow_hidden=self.allow_hidden)
        with self._lock:
            w = self._by_real.get(path)
            if w is not None:
                return w
            old = self.watches.get(rid)
            if old is not None:  # the id leads elsewhere now
                self._by_real.pop(old.path, None)
            w = self.watches[rid] = self._by_real[path] = RunWatch(rid, path)
            self._order = list(self.watches.values())
        return w

    def scan(self) -> tuple[list[str], list[str]]:
        """Re-walks the roots (only folders that changed are listed again): ``(added ids,
        removed ids)``. The next scan is due after ``scan_interval`` or twenty times this
        scan's duration, whichever is longer, so scans cost at most ~5% of one core."""
        t0 = time.monotonic()
        found: dict[Path, str] = {}
        first = self._found is None
        listed = [scan.scan() for scan in self._scans]
        if self._found is not None and not any(scan.listed for scan in self._scans):
            self._next_scan = time.monotonic() + max(self.scan_interval, 20 * (time.monotonic() - t0))
            return [], []   # no folder changed: the same runs
        for k, (root, rels) in enumerate(zip(self.roots, listed)):
            real_root = Path(os.path.realpath(root))
            for rel in rels:   # folders entered are no symlinks: real = real root/rel
                rid = runs.encode_rel(rel) if rel else "."
                found.setdefault(real_root / rel, rid if k == 0 else f"{k}:{rid}")
        self._found = found
        with self._lock:
            now = time.monotonic()
            self._next_scan = now + max(self.scan_interval, 20 * (now - t0))
            added = [rid for real, rid in found.items() if real not in self._by_real]
            removed = [rid for rid, w in self.watches.items()
                       if w.path not in found and not os.path.lexists(w.path / runs.RUN_JSON)]
            for real, rid in found.items():
                if real not in self._by_real:
                    old = self.watches.get(rid)
                    if old is not None:
                        self._by_real.pop(old.path, None)
                    w = self.watches[rid] = self._by_real[real] = RunWatch(rid, real)
                    w.initial = first
            for rid in removed:
                w = self.watches.pop(rid)
                if self._by_real.get(w.path) is w:
                    del self._by_real[w.path]
            if added or removed:
                self._order = list(self.watches.values())
        return added, removed

    @property
    def truncated(self) -> bool:
        """Whether the last scan stopped at its folder limit (some runs are not listed)."""
        return any(s.truncated for s in self._scans)

    def poll(self, force_scan: bool = False, *, budget: float | None = None,
             first: Collection[str] = ()) -> tuple[list[Change], list[str]]:
        """Scans when due, then refreshes runs: ``(changes, removed ids)``.

        Without ``budget``, every run. With one, the runs ``first`` (those someone watches)
        and then, for at most ``budget`` seconds, the others in turn, each read only if it
        changed on disk (:meth:`RunWatch.stale`); the next poll goes on where this one
        stopped.
        """
        removed: list[str] = []
        scanned = force_scan or time.monotonic() >= self._next_scan
        if scanned:
            _, removed = self.scan()
        t0 = time.monotonic()
        with self._lock:
            order = self._order
        changes: list[Change] = []
        if budget is None:
            visited = list(order)
            for w in visited:
                self._refresh(w, changes)
        else:
            visited = [w for w in (self.watches.get(rid) for rid in first) if w is not None]
            for w in visited:
                self._refresh(w, changes)
            visited += self._turns(order, t0 + budget, set(first), changes)
        if any(w.gone for w in visited):  # a run vanished: say so now
            for w in visited:
                if w.gone:
                    self._forget(w)
            _, more = self.scan()
            removed += more
            changes = [c for c in changes if c.watch.id not in removed]
        return changes, removed

    def _turns(self, order: list[RunWatch], deadline: float, skip: set[str],
               changes: list[Change]) -> list[RunWatch]:
        """Refreshes the stale runs of ``order`` from this turn on until ``deadline``:
        the runs refreshed. A run of the first scan not read yet is not read: its stamp is
        taken (its page reads it), so that only later changes are sent as updates."""
        out = []
        n = len(order)
        i = 0
        while i < n and time.monotonic() < deadline:
            w = order[(self._turn + i) % n]
            i += 1
            if w.id in skip:
                continue
            if w.initial and not w.refreshed and w._disk is None:
                w.baseline()   # its page reads it; from now on a change is news
            elif w.stale():
                self._refresh(w, changes)
                out.append(w)
        self._turn = (self._turn + i) % n if n else 0
        return out

    def poll_run(self, watch: RunWatch) -> tuple[list[Change], list[str]]:
        """Refreshes one run only (a request for it): ``(changes, removed ids)``."""
        changes: list[Change] = []
        self._refresh(watch, changes)
        return changes, []

    def _refresh(self, w: RunWatch, changes: list[Change]) -> None:
        records, meta_changed, reset = w.refresh()
        if records or meta_changed or reset:
            changes.append(Change(w, records, meta_changed, reset))

    def _forget(self, w: RunWatch) -> None:
        """The next scan lists the folder of a run whose run.json went."""
        for root, scan in zip(self.roots, self._scans):
            try:
                rel = w.path.relative_to(os.path.realpath(root))
            except ValueError:
                continue
            scan.forget("" if rel == Path(".") else rel.as_posix())

    def page(self, limit: int, cursor: str | None = None, *, read: bool = True
             ) -> tuple[dict[str, Any], list[Change], list[str]]:
        """One page of the runs list, newest created first (ties by id): ``({"runs",
        "total", "next"}, changes, removed ids)``. ``next`` is the cursor of the page after
        (None after the last); a run created after the first page comes before the cursor
        and is not repeated, the list stream sends it instead.

        Reads every run's ``run.json`` once (what the order needs) and refreshes the runs of
        the page that changed on disk; ``changes`` are what that refresh found. With
        ``read=False`` it reads nothing: the page of what earlier reads found.
        """
        after = decode_cursor(cursor) if cursor else None
        removed: list[str] = []
        if read and time.monotonic() >= self._next_scan:
            _, removed = self.scan()
        with self._lock:
            order = self._order
        if read:
            self.read_metas()
        listed = sorted((w for w in order if w.listed), key=_page_key)
        start = 0 if after is None else bisect.bisect_right([_page_key(w) for w in listed],
                                                            after)
        chunk = listed[start:start + limit]
        changes: list[Change] = []
        for w in chunk if read else ():
            if not w.refreshed or w.stale():
                self._refresh(w, changes)
        more = start + limit < len(listed)
        return ({"runs": [w.summary() for w in chunk], "total": len(listed),
                 "next": encode_cursor(_page_key(chunk[-1])) if more and chunk else None,
                 "truncated": self.truncated}, changes, removed)

    def read_metas(self) -> None:
        """Reads the ``run.json`` of every run not read yet (what the list's order needs;
        it consumes no metrics, so it needs no turn in the hub's order of reads)."""
        with self._lock:
            order = self._order
        for w in order:
            if not w.seen:
                w.refresh_meta()

    def summaries(self) -> list[dict[str, Any]]:
        """Summaries of every run found, most recently updated first."""
        with self._lock:
            watches = [w for w in self.watches.values() if w.listed]
        return sorted((w.summary() for w in watches), key=lambda s: -s["updated"])


def _page_key(w: RunWatch) -> tuple[float, str]:
    """The runs list's order: newest ``created`` first (never changes), then id."""
    created = number(w.meta.get("created")) if w.meta else None
    return (-float(created or 0.0), w.id)


def encode_cursor(key: tuple[float, str]) -> str:
    """A page cursor: the last run's sort key, as URL-safe base64 of JSON."""
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """The sort key in ``cursor``; ``ValueError`` naming it when it is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        neg_created, rid = json.loads(raw)
        if isinstance(neg_created, (int, float)) and isinstance(rid, str):
            return (float(neg_created), rid)
    except (ValueError, TypeError, UnicodeError):
        pass
    raise ValueError(f"cursor={cursor[:60]!r} is not a runs-list cursor; pass the 'next' of "
                     "the previous page, or no cursor for the first page")
