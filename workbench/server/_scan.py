"""The server's search for run directories, incremental: a folder is listed again only when
its modification time changed.

It finds what ``workbench._runs.find_run_dirs`` finds (the same depth, hidden, skipped and
symlinked folders, breadth first, in name order) but remembers each folder's entries with
its ``st_mtime_ns``: a later scan stats the folders that are not runs and lists again only
those whose time changed (an entry added, removed or renamed changes its folder's time).
Run folders are not looked at again at all (the index notices a run whose ``run.json``
went, and :meth:`RunScan.forget` makes the next scan list it again). A folder changed in
the last :data:`FRESH` seconds is always listed again: on file systems with coarse times
two changes can share one.
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from workbench import _runs as runs

FRESH = 2.0  # seconds: a folder whose time is this recent is listed again


@dataclass
class _Folder:
    mtime_ns: int
    is_run: bool
    children: list[str]  # sub-folders that may hold runs, in name order


class RunScan:
    """The run folders under one root, found again cheaply.

    Args:
      root: the run root.
      max_depth: how deep below it to look for ``run.json``.
      hidden: enter hidden folders.
      max_dirs: folders looked at per scan (the rest is not searched; :attr:`truncated`).
    """

    def __init__(self, root: Path, max_depth: int, hidden: bool,
                 max_dirs: int = 20_000) -> None:
        self.root = root
        self.max_depth = max_depth
        self.hidden = hidden
        self.max_dirs = max_dirs
        self.truncated = False
        self.listed = 0  # folders listed (scandir) by the last scan: what it cost
        self._folders: dict[str, _Folder] = {}  # by path relative to the root ("" = root)

    def forget(self, rel: str) -> None:
        """Lists folder ``rel`` (a path relative to the root) again at the next scan."""
        self._folders.pop(rel, None)

    def scan(self) -> list[str]:
        """Relative paths (POSIX, as ``os.fsdecode`` text) of the run folders, breadth first."""
        found: list[str] = []
        queue: list[tuple[str, int]] = [("", 0)]
        seen: dict[str, _Folder] = {}
        self.listed = 0
        now = time.time_ns()
        head = 0
        while head < len(queue) and head < self.max_dirs:
            rel, depth = queue[head]
            head += 1
            folder = self._folder(rel, now)
            if folder is None:
                continue
            seen[rel] = folder
            if folder.is_run:
                found.append(rel)
            elif depth < self.max_depth:
                queue.extend((f"{rel}/{c}" if rel else c, depth + 1) for c in folder.children)
        self.truncated = head < len(queue)
        self._folders = seen
        return found

    def _folder(self, rel: str, now: int) -> _Folder | None:
        old = self._folders.get(rel)
        if old is not None and old.is_run:
            return old
        path = os.path.join(self.root, rel) if rel else os.fspath(self.root)
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return None
        if old is not None and old.mtime_ns == mtime and now - mtime > FRESH * 1e9:
            return old
        return self._list(path, mtime)

    def _list(self, path: str, mtime: int) -> _Folder | None:
        self.listed += 1
        try:   # a run folder: one lstat, no listing (a symlinked run.json marks no run)
            if not stat.S_ISLNK(os.lstat(os.path.join(path, runs.RUN_JSON)).st_mode):
                return _Folder(mtime, True, [])
        except OSError:
            pass
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            return None
        if any(e.name == runs.RUN_JSON and not e.is_symlink() for e in entries):
            return _Folder(mtime, True, [])
        children = []
        for e in entries:
            try:
                if (e.is_dir(follow_symlinks=False) and (self.hidden or not e.name.startswith("."))
                        and e.name not in runs._SKIP_DIRS):
                    children.append(e.name)
            except OSError:
                continue
        return _Folder(mtime, False, children)
