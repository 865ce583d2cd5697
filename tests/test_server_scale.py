"""Tests for workbench/server at scale and with hostile folder names: every listed id opens
(REST and websocket), the runs list is paged, a run request reads only that run, and scans
and polls look again only at what changed (issue 56 item 5; timings: bench_panel)."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from pytest_jupyter.jupyter_server import *  # its fixtures, for this module only
from server_async import run_async
from test_server import (_make_run, _recv, extra_root, get, jp_base_url,  # noqa: F401 - fixtures
                         jp_server_config, ws)

from workbench import _runs as runs
from workbench.server._index import RunIndex
from workbench.server._scan import RunScan

# folder names (relative paths under the server's root) and the id the server must list
HOSTILE = [
    ("colon:name", "colon%3Aname"),
    ("1:looks-like-root", "1%3Alooks-like-root"),
    ("back\\slash", "back%5Cslash"),
    (os.fsdecode(b"byte-\xff-name"), "byte-%FF-name"),
    ("ünïcødé 日本", "ünïcødé 日本"),
    ("with space", "with space"),
    ("50%", "50%25"),
    ("a#b", "a#b"),
    ("what?now", "what?now"),
    ("nested/deeper/run", "nested/deeper/run"),
    ("nested/x:y/z%2F", "nested/x%3Ay/z%252F"),
]


@pytest.mark.parametrize(("name", "rid"), HOSTILE, ids=[r for _, r in HOSTILE])
@run_async
async def test_every_listed_id_opens(get: Any, ws: Any, jp_root_dir: Path, name: str,
                                     rid: str) -> None:
    """The id listed for any folder name opens over REST and the run websocket; before,
    ``colon:name``, ``1:looks-like-root``, ``back\\slash`` and a 0xFF byte answered 400."""
    w = _make_run(jp_root_dir / name, 3)
    code, body = await get("runs")
    assert code == 200 and [r["id"] for r in body["runs"]] == [rid]
    assert runs.run_id(jp_root_dir, jp_root_dir / name) == rid
    assert runs.resolve_run([jp_root_dir], rid) == (jp_root_dir / name).resolve()
    code, detail = await get("runs", rid)
    assert code == 200 and detail["uid"] == runs.read_run(jp_root_dir / name)["id"]
    code, page = await get("runs", rid, "metrics")
    assert code == 200 and page["columns"]["step"] == [1, 2, 3]
    conn = await ws("runs", rid, "stream")
    assert (await _recv(conn))["run"]["id"] == rid
    assert (await _recv(conn))["columns"]["step"] == [1, 2, 3]
    w.log({"step": 4, "loss": 1.0})
    w.flush()
    msg = await _recv(conn)
    while msg["type"] == "run":   # run.json changes may come first
        msg = await _recv(conn)
    assert msg["columns"]["step"] == [4]
    conn.close()
    w.close()


@pytest.mark.parametrize("rid", ["colon:name", "back\\slash", "50%", "with%20space", "a%3ab",
                                 "1%3Alooks-like-root%"])
def test_ids_not_as_listed_are_refused(tmp_path: Path, rid: str) -> None:
    """An id the server would not list (raw ``:``/``\\``/``%``, a needless or lower-case
    escape) is refused with the reason, never read as another folder."""
    for name in ("colon:name", "back\\slash", "50%", "with space", "a:b", "1:looks-like-root%"):
        _make_run(tmp_path / name, 1).close()
    with pytest.raises(ValueError, match="not the id the server lists"):
        runs.resolve_run([tmp_path], rid)


def _hand_made(root: Path, n: int, created: float = 1000.0) -> list[str]:
    """``n`` runs, created one second apart from ``created`` on (run ``r0`` oldest): their
    folders, newest first."""
    for k in range(n):
        _make_run(root / "runs" / f"r{k}", 2).close()
        meta = json.loads((root / "runs" / f"r{k}" / runs.RUN_JSON).read_text())
        meta["created"] = created + k
        (root / "runs" / f"r{k}" / runs.RUN_JSON).write_text(json.dumps(meta))
    return [f"runs/r{k}" for k in reversed(range(n))]


@run_async
async def test_the_runs_list_is_paged(get: Any, ws: Any, jp_root_dir: Path) -> None:
    """Pages of 3 of 8 runs: each run once, newest created first, the total right; a run
    created between pages comes before the cursor (the list stream sends it) and a run with
    an older ``created`` added between pages is on a later page; bad cursors answer 400."""
    expected = _hand_made(jp_root_dir, 8)
    seen: list[str] = []
    code, page = await get("runs", limit=3)
    assert (code, page["total"], page["truncated"]) == (200, 8, False)
    seen += [r["id"] for r in page["runs"]]
    _make_run(jp_root_dir / "runs" / "new", 1).close()           # newest: before the cursor
    _hand_made(jp_root_dir / "late", 1, created=900.0)          # the oldest: the last
    await asyncio.sleep(0.3)   # the next scan is due (scan_interval 0.2 s)
    while page["next"]:
        code, page = await get("runs", limit=3, cursor=page["next"])
        assert code == 200 and page["total"] == 10
        seen += [r["id"] for r in page["runs"]]
    assert seen == [*expected, "late/runs/r0"]
    code, page = await get("runs", limit=1000)
    assert [r["id"] for r in page["runs"]][:1] == ["runs/new"] and page["next"] is None
    for query in ({"cursor": "bogus"}, {"cursor": "W10"}, {"limit": 0}, {"limit": 1001}):
        assert (await get("runs", **query))[0] == 400, query
    conn = await ws("stream", limit=2)
    first = await _recv(conn)
    assert (first["type"], first["total"], len(first["runs"])) == ("runs", 10, 2)
    assert first["next"]
    conn.close()


def _opens_during(fn: Any) -> list[str]:
    """Paths opened (the ``open`` audit event: builtin ``open`` and ``os.open``) while
    ``fn()`` runs in this thread or another."""
    seen: list[str] = []
    _AUDIT["sink"] = seen
    try:
        fn()
    finally:
        _AUDIT["sink"] = None
    return seen


_AUDIT: dict[str, list[str] | None] = {"sink": None}


def _hook(event: str, args: tuple[Any, ...]) -> None:
    sink = _AUDIT["sink"]
    if sink is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        sink.append(os.fsdecode(args[0]))


sys.addaudithook(_hook)


@run_async
async def test_a_run_request_reads_only_that_run(get: Any, jp_root_dir: Path) -> None:
    """With 60 runs that all grew since the last look, a request for one run opens only
    that run's files (before, each request polled, and opened, every run)."""
    writers = [_make_run(jp_root_dir / "runs" / f"r{k}", 2) for k in range(60)]
    assert len((await get("runs", limit=1000))[1]["runs"]) == 60
    for w in writers:
        w.log({"step": 3, "loss": 0.5})
        w.flush()
    loop_opens: list[str] = []
    _AUDIT["sink"] = loop_opens
    try:
        for parts in (("runs", "runs/r7"), ("runs", "runs/r7", "metrics")):
            code, body = await get(*parts)
            assert code == 200
    finally:
        _AUDIT["sink"] = None
    assert body["columns"]["step"] == [1, 2, 3]
    touched = {p.split("/runs/", 1)[1].split("/")[0] for p in loop_opens if "/runs/r" in p}
    assert touched == {"r7"}, sorted(touched)
    for w in writers:
        w.close()


def test_a_budgeted_poll_reads_the_watched_runs_and_takes_turns(tmp_path: Path) -> None:
    """``poll(budget=0)`` refreshes only the runs someone watches; with a budget, the
    others are read in turn and only when they changed on disk."""
    writers = [_make_run(tmp_path / f"r{k}", 1) for k in range(12)]
    index = RunIndex([tmp_path])
    index.poll(force_scan=True)
    for w in writers:
        w.log({"step": 2, "loss": 0.5})
        w.flush()
    changes, _ = index.poll(budget=0.0, first=["r3"])
    assert [c.watch.id for c in changes] == ["r3"]
    changes, _ = index.poll(budget=10.0, first=["r3"])
    assert sorted(c.watch.id for c in changes) == sorted(f"r{k}" for k in range(12) if k != 3)
    for w in writers:
        w.close()   # status finished: run.json changes once
    index.poll(budget=10.0)
    opened = _opens_during(lambda: index.poll(budget=10.0))
    assert opened == []   # nothing changed on disk: stats only


def test_a_scan_lists_again_only_folders_that_changed(tmp_path: Path) -> None:
    """The second scan of 20 runs lists no folder; a run added lists its parent and itself."""
    for k in range(20):
        _make_run(tmp_path / "runs" / f"r{k}", 1).close()
    old = 1_000_000_000
    for d in [tmp_path, tmp_path / "runs", *(tmp_path / "runs").iterdir()]:
        os.utime(d, (old, old))
    scan = RunScan(tmp_path, max_depth=4, hidden=False)
    first = scan.scan()
    assert (len(first), scan.listed) == (20, 22)
    assert (scan.scan(), scan.listed) == (first, 0)
    _make_run(tmp_path / "runs" / "r20", 1).close()
    os.utime(tmp_path / "runs", (old + 5, old + 5))
    os.utime(tmp_path / "runs" / "r20", (old, old))
    assert (len(scan.scan()), scan.listed) == (21, 2)
    assert sorted(scan.scan()) == sorted(runs.run_id(tmp_path, d)
                                         for d in runs.find_run_dirs(tmp_path))


def test_a_budgeted_poll_takes_the_first_scans_runs_as_known(tmp_path: Path) -> None:
    """A budgeted poll opens none of the runs the first scan found (their pages read them)
    and sends none of them as news; a run appearing later, or one of them changing, is."""
    writers = [_make_run(tmp_path / f"r{k}", 1) for k in range(6)]
    for w in writers:
        w.close()
    index = RunIndex([tmp_path], scan_interval=0.0)
    index.scan()
    changes: list[Any] = []
    assert _opens_during(lambda: changes.extend(index.poll(budget=10.0)[0])) == []
    assert changes == []
    _make_run(tmp_path / "new", 1).close()
    writers[2] = _make_run(tmp_path / "r2", 2)   # resumed: run.json and metrics change
    changes, _ = index.poll(budget=10.0)
    assert sorted(c.watch.id for c in changes) == ["new", "r2"]
    writers[2].close()
