"""Tests for workbench/server: a real jupyter_server with the extension, over HTTP and websockets."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import tornado.httpclient
import tornado.websocket
from pytest_jupyter.jupyter_server import *  # its fixtures, for this module only
from server_async import run_async
from traitlets.config import Config

from workbench import _runs as runs
from workbench.server._hub import Hub
from workbench.server._index import RunIndex

# pytest-jupyter's fixtures are imported above rather than registered with `pytest_plugins`:
# registered, its autouse event-loop fixture would run around every test of the session and
# close the loop Playwright's sync API runs on in the browser tests.




@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A real run outside every run root: traversal must never reach it."""
    d = tmp_path / "outside" / "secret"
    with runs.RunWriter(d, config={"secret": 1}) as w:
        w.log({"step": 1, "loss": 1.0})
    return d


@pytest.fixture
def extra_root(tmp_path: Path) -> Path:
    return tmp_path / "extra"


@pytest.fixture
def jp_server_config(extra_root: Path) -> Config:
    return Config({
        "ServerApp": {"jpserver_extensions": {"workbench.server": True}},
        "WorkbenchExtension": {"run_roots": [str(extra_root)], "poll_interval": 0.1,
                               "scan_interval": 0.2},
    })


@pytest.fixture
def jp_base_url() -> str:
    return "/base%40url/"  # a base URL that needs escaping, as jupyter_server's own tests use


def _path(*parts: str, **query: Any) -> str:
    """Path of an endpoint; run ids are percent-encoded into one segment like the lab does."""
    path = "/".join(urllib.parse.quote(p, safe="") for p in parts)
    q = f"?{urllib.parse.urlencode(query)}" if query else ""
    return f"/base%40url/workbench/api/{path}{q}"


@pytest.fixture
def get(jp_serverapp: Any, http_server_client: Any, jp_http_port: int,
        jp_auth_header: dict[str, str]):
    """GET an endpoint; returns (status, parsed JSON or None)."""

    async def fetch(*parts: str, headers: dict[str, str] | None = None,
                    **query: Any) -> tuple[int, Any]:
        resp = await http_server_client.fetch(
            _path(*parts, **query), raise_error=False,
            headers=jp_auth_header if headers is None else headers)
        body = json.loads(resp.body) if resp.code == 200 else None
        return resp.code, body

    return fetch


@pytest.fixture
def ws(jp_serverapp: Any, http_server_client: Any, jp_http_port: int,
       jp_auth_header: dict[str, str]):
    """Opens a websocket to an endpoint (with the token unless headers are given)."""

    async def connect(*parts: str, headers: dict[str, str] | None = None, **query: Any):
        req = tornado.httpclient.HTTPRequest(
            f"ws://127.0.0.1:{jp_http_port}{_path(*parts, **query)}",
            headers=jp_auth_header if headers is None else headers)
        return await tornado.websocket.websocket_connect(req)

    return connect


async def _recv(conn: Any, timeout: float = 5.0) -> dict[str, Any]:
    msg = await asyncio.wait_for(conn.read_message(), timeout)
    assert msg is not None, "websocket closed"
    return json.loads(msg)


def _make_run(d: Path, steps: int, name: str | None = None) -> runs.RunWriter:
    w = runs.RunWriter(d, config={"model": "tiny", "lr": 3e-4}, name=name,
                       meta={"mesh": {"data": 8}, "peak_source": "measured"})
    for s in range(1, steps + 1):
        w.log({"step": s, "loss": 5.0 / s, "mfu": 0.01 * s, "tokens_per_s": 100.0 * s})
    w.flush()
    return w


ENDPOINTS = [("runs",), ("runs", "a"), ("runs", "a", "metrics")]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "token wrong"}], ids=["none", "bad"])
@pytest.mark.parametrize("parts", ENDPOINTS, ids=lambda p: "/".join(p))
@run_async
async def test_http_needs_a_valid_token(get: Any, jp_root_dir: Path, parts: tuple[str, ...],
                                        headers: dict[str, str]) -> None:
    _make_run(jp_root_dir / "a", 2).close()
    code, _ = await get(*parts, headers=headers)
    assert code == 403
    code, _ = await get(*parts)  # the same request with the token works
    assert code == 200


@pytest.mark.parametrize("parts", [("stream",), ("runs", "a", "stream")], ids=["list", "run"])
@run_async
async def test_websockets_need_a_valid_token(ws: Any, jp_root_dir: Path,
                                             parts: tuple[str, ...]) -> None:
    _make_run(jp_root_dir / "a", 2).close()
    for headers in ({}, {"Authorization": "token wrong"}):
        with pytest.raises(tornado.httpclient.HTTPClientError) as e:
            await ws(*parts, headers=headers)
        assert e.value.code == 403
    conn = await ws(*parts)
    assert (await _recv(conn))["type"] in ("runs", "run")
    conn.close()


@run_async
async def test_list_and_detail(get: Any, jp_root_dir: Path, extra_root: Path) -> None:
    _make_run(jp_root_dir / "runs" / "one", 3, name="<img src=x onerror=alert(1)>").close()
    w = _make_run(extra_root / "two", 5)
    code, body = await get("runs")
    assert code == 200
    assert body["roots"] == [str(jp_root_dir.resolve()), str(extra_root.resolve())]
    by_id = {r["id"]: r for r in body["runs"]}
    assert set(by_id) == {"runs/one", "1:two"}
    one, two = by_id["runs/one"], by_id["1:two"]
    assert one["name"] == "<img src=x onerror=alert(1)>"  # data, not markup
    assert (one["status"], one["step"], one["loss"], one["mfu"]) == ("finished", 3, 5 / 3, 0.03)
    assert (two["status"], two["step"], two["points"]) == ("running", 5, 5)
    assert two["spark"]["step"] == [1, 2, 3, 4, 5]
    assert two["spark"]["loss"] == pytest.approx([5.0 / s for s in range(1, 6)])
    code, detail = await get("runs", "1:two")
    meta = runs.read_run(extra_root / "two")
    assert detail["uid"] == meta["id"] and detail["id"] == "1:two"
    assert {k: detail[k] for k in ("config", "mesh", "config_hash", "peak_source")} == {
        k: meta[k] for k in ("config", "mesh", "config_hash", "peak_source")}
    w.close()


@pytest.mark.parametrize("rid", ["../outside/secret", "..", "/etc", "/" + "x" * 3, "a/../../outside",
                                 "link", "metalink", "runs/missing", "9:secret", "a\\b", "."])
@run_async
async def test_ids_never_leave_the_roots(get: Any, jp_root_dir: Path, outside: Path,
                                         rid: str) -> None:
    _make_run(jp_root_dir / "a", 1).close()
    (jp_root_dir / "link").symlink_to(outside, target_is_directory=True)
    (jp_root_dir / "metalink").mkdir()
    (jp_root_dir / "metalink" / "run.json").symlink_to(outside / "run.json")
    for parts in (("runs", rid), ("runs", rid, "metrics")):
        code, _ = await get(*parts)
        assert code in (400, 404), (parts, code)


@run_async
async def test_raw_dotdot_urls_are_not_served(http_server_client: Any, jp_http_port: int,
                                              jp_auth_header: dict[str, str], outside: Path,
                                              jp_root_dir: Path) -> None:
    """Raw ``..`` segments, plain or percent-encoded, never reach the run outside the roots
    (its id appears in no answer), while the same URL shape to a run inside is served."""
    _make_run(jp_root_dir / "runs" / "inside", 1).close()
    secret = runs.read_run(outside)["id"].encode()

    async def fetch(path: str) -> Any:
        return await http_server_client.fetch(f"/base%40url/workbench/api/{path}",
                                              headers=jp_auth_header, raise_error=False)

    resp = await fetch("runs/runs%2Finside")  # the control: a run inside is served
    assert resp.code == 200
    assert json.loads(resp.body)["uid"] == runs.read_run(jp_root_dir / "runs" / "inside")["id"]
    for path in ("runs/../../outside/secret", "runs/%2E%2E/outside", "runs/..%2Foutside%2Fsecret",
                 "runs/..%2Foutside%2Fsecret/metrics", "runs/runs%2F..%2F..%2Foutside%2Fsecret"):
        resp = await fetch(path)
        assert resp.code in (400, 404), (path, resp.code)
        assert secret not in resp.body, path


@run_async
async def test_symlink_inside_the_root_is_served(get: Any, jp_root_dir: Path) -> None:
    _make_run(jp_root_dir / "runs" / "a", 2).close()
    (jp_root_dir / "alias").symlink_to(jp_root_dir / "runs" / "a", target_is_directory=True)
    code, body = await get("runs", "alias", "metrics")
    assert code == 200 and body["columns"]["step"] == [1, 2]


@run_async
async def test_metrics_paging_is_columnar_and_complete(get: Any, jp_root_dir: Path) -> None:
    w = _make_run(jp_root_dir / "r", 1200)
    w.event("resume", step=1000)  # re-logged steps 1001..1100 must not come back twice
    for s in range(1001, 1301):
        w.log({"step": s, "loss": -1.0})
    w.close()
    reference = runs.read_metrics(jp_root_dir / "r")
    got: list[int] = []
    losses: list[float] = []
    since = 0
    while True:
        code, page = await get("runs", "r", "metrics", since=since, limit=500, keys="loss")
        assert code == 200 and set(page["columns"]) == {"step", "loss"}
        got += page["columns"]["step"]
        losses += page["columns"]["loss"]
        if not page["more"]:
            break
        since = page["last_step"]
    assert got == [r["step"] for r in reference] == list(range(1, 1301))
    assert losses == [r["loss"] for r in reference]
    code, page = await get("runs", "r", "metrics", since=1290)
    assert page["columns"]["step"] == list(range(1291, 1301))
    assert set(page["columns"]) >= {"step", "time", "loss"}
    code, _ = await get("runs", "r", "metrics", since="abc")
    assert code == 400


@run_async
async def test_run_stream_pushes_appended_lines(ws: Any, jp_root_dir: Path) -> None:
    w = _make_run(jp_root_dir / "live", 10)
    conn = await ws("runs", "live", "stream", since=4)
    first = await _recv(conn)
    assert first["type"] == "run" and first["run"]["status"] == "running"
    backfill = await _recv(conn)
    assert backfill["columns"]["step"] == list(range(5, 11))
    latencies = []
    for s in range(11, 14):
        appended: list[float] = []
        # the time is taken before the append: taken after it, a loaded machine can push
        # and deliver the line before the timer's thread runs again
        timer = threading.Timer(0.2, lambda s=s, out=appended: (
            out.append(time.time()), w.log({"step": s, "loss": 0.5})))
        timer.start()
        msg = await _recv(conn)
        while msg["type"] == "run":   # run.json, rewritten at most once a second as it logs
            msg = await _recv(conn)
        latencies.append(time.time() - appended[0])
        assert msg["type"] == "metrics" and msg["columns"]["step"] == [s]
        assert msg["columns"]["loss"] == [0.5]
    assert sorted(latencies)[1] < 1.0, latencies  # pushed within 1 s of the append
    w.close()
    status = await _recv(conn)
    assert status["type"] == "run" and status["run"]["status"] == "finished"
    conn.close()


@run_async
async def test_streams_lose_nothing_while_other_requests_read_the_run(
        ws: Any, get: Any, jp_root_dir: Path) -> None:
    """Every appended step reaches every socket exactly once, while REST requests and new
    sockets on the same run read it concurrently (a regression test: a request's own
    refresh once consumed lines that the sockets never got)."""
    w = _make_run(jp_root_dir / "busy", 1)
    first = await ws("runs", "busy", "stream")

    def write() -> None:
        for s in range(2, 301):
            w.log({"step": s, "loss": 1.0})
            time.sleep(0.002)

    writer = threading.Thread(target=write)
    writer.start()
    socks = [first]
    for i in range(12):
        await get("runs", "busy", "metrics", since=290)
        await get("runs", "busy")
        if i % 4 == 3:
            socks.append(await ws("runs", "busy", "stream"))
        await asyncio.sleep(0.03)
    writer.join()
    for conn in socks:
        steps: list[int] = []
        while not steps or steps[-1] < 300:
            msg = await _recv(conn, timeout=10)
            if msg["type"] == "metrics":
                steps += msg["columns"]["step"]
        assert steps == list(range(1, 301))
        conn.close()
    w.close()


@run_async
async def test_list_stream_pushes_new_changed_and_removed_runs(ws: Any, jp_root_dir: Path) -> None:
    _make_run(jp_root_dir / "old", 2).close()
    conn = await ws("stream")
    first = await _recv(conn)
    assert first["type"] == "runs" and [r["id"] for r in first["runs"]] == ["old"]
    w = _make_run(jp_root_dir / "exp" / "new", 3)

    async def until(pred: Any) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            msg = await _recv(conn)
            if pred(msg):
                return msg
        raise AssertionError("no matching message")

    msg = await until(lambda m: m["type"] == "update" and any(r["id"] == "exp/new"
                                                               for r in m["runs"]))
    assert next(r for r in msg["runs"] if r["id"] == "exp/new")["step"] == 3
    w.log({"step": 4, "loss": 0.1, "mfu": 0.4})
    msg = await until(lambda m: m["type"] == "update" and m["runs"][0]["step"] == 4)
    assert (msg["runs"][0]["loss"], msg["runs"][0]["mfu"]) == (0.1, 0.4)
    w.close()
    for p in (jp_root_dir / "exp" / "new").iterdir():
        p.unlink()
    msg = await until(lambda m: m["type"] == "removed")
    assert msg["ids"] == ["exp/new"]
    conn.close()


class Recorder:
    """A hub subscriber (``hub.RunSubscriber``) that keeps what it is sent."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.pushed: list[tuple[list[int], bool]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def push(self, records: list[dict[str, Any]], reset: bool = False) -> None:
        self.pushed.append(([r["step"] for r in records], reset))


@run_async
async def test_hub_sends_each_subscriber_its_changes_while_anyone_listens(tmp_path: Path) -> None:
    """The hub without a server: run subscribers get their run's new records and run.json
    changes, list subscribers the summaries and removals; nobody listening, nobody polls."""
    w = _make_run(tmp_path / "a", 2)
    hub = Hub(RunIndex([tmp_path], scan_interval=0.0), poll_interval=0.05)
    run_sub, list_sub, other = Recorder(), Recorder(), Recorder()
    hub.subscribe_run("a", run_sub)
    hub.subscribe_run("b", other)
    hub.subscribe_list(list_sub)
    await hub.poll_now(max_age=0.0)
    assert run_sub.pushed == [([1, 2], False)]
    assert [m["type"] for m in run_sub.messages] == ["run"]
    assert run_sub.messages[0]["run"]["uid"] == runs.read_run(tmp_path / "a")["id"]
    assert (other.messages, other.pushed) == ([], [])
    (update,) = list_sub.messages
    assert update["type"] == "update"
    assert [(r["id"], r["step"]) for r in update["runs"]] == [("a", 2)]

    w.log({"step": 3, "loss": 0.5})  # the hub's own timer polls
    for _ in range(100):
        if run_sub.pushed[-1][0] == [3]:
            break
        await asyncio.sleep(0.02)
    assert run_sub.pushed[-1] == ([3], False) and list_sub.messages[-1]["runs"][0]["step"] == 3

    w.close()
    for p in (tmp_path / "a").iterdir():
        p.unlink()
    await hub.poll_now(max_age=0.0)
    assert list_sub.messages[-1] == {"type": "removed", "ids": ["a"]}

    for sub in (run_sub, list_sub, other):
        hub.unsubscribe(sub)
    async with hub._lock:   # a poll the timer started before the last unsubscribe is over
        pass
    w2 = _make_run(tmp_path / "c", 1)
    await asyncio.sleep(0.3)  # six poll intervals: had the timer run, it would have found "c"
    assert "c" not in hub.index.watches
    w2.close()
    hub.stop()


def test_server_modules_never_import_jax() -> None:
    code = ("import sys, workbench.server, workbench.server._app, workbench.server._handlers, "
            "workbench.server._hub; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_extension_is_enabled_by_the_install() -> None:
    jupyter = Path(sys.executable).parent / "jupyter"
    out = subprocess.run([str(jupyter), "server", "extension", "list"], capture_output=True,
                         text=True, check=True)
    text = out.stdout + out.stderr
    line = next((ln for ln in text.splitlines() if "workbench.server" in ln), "")
    assert "enabled" in line, text
