"""Fuzz and table tests of the server's hardening (issue 12): no run's files break the others.

A real jupyter_server with the Workbench extension serves a root holding a good run and,
per case, a run with random or adversarial ``run.json`` / ``metrics.jsonl`` contents.
Every endpoint must answer, the good run must stay complete, and the bad run's steps must
be exactly those a plain reference reader finds (``json.loads`` line by line, the rules
of docs/contracts.md). The table-driven cases are named after the issue's wording.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import tornado.httpclient
import tornado.websocket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pytest_jupyter.jupyter_server import *  # its fixtures, for this module only
from server_async import run_async
from traitlets.config import Config

from workbench import _tail, _runs as runs

GOOD_STEPS = 40
STATUSES = (*runs.STATUSES, "error")
_names = itertools.count()


# ----------------------------------------------------------------------------- the server
@pytest.fixture
def allow_hidden() -> bool:
    return False


@pytest.fixture
def jp_server_config(allow_hidden: bool) -> Config:
    return Config({
        "ServerApp": {"jpserver_extensions": {"workbench.server": True}},
        "ContentsManager": {"allow_hidden": allow_hidden},
        "WorkbenchExtension": {"poll_interval": 0.05, "scan_interval": 0.1},
    })


@pytest.fixture
def jp_base_url() -> str:
    return "/"


def _path(*parts: str, **query: Any) -> str:
    path = "/".join(urllib.parse.quote(p, safe="") for p in parts)
    q = f"?{urllib.parse.urlencode(query)}" if query else ""
    return f"/workbench/api/{path}{q}"


@pytest.fixture
def get(jp_serverapp: Any, http_server_client: Any, jp_auth_header: dict[str, str]):
    """GET an endpoint: (status, parsed JSON body or None, raw body)."""

    async def fetch(*parts: str, **query: Any) -> tuple[int, Any, bytes]:
        resp = await http_server_client.fetch(_path(*parts, **query), raise_error=False,
                                              headers=jp_auth_header)
        body = json.loads(resp.body) if resp.code == 200 else None
        return resp.code, body, resp.body or b""

    return fetch


@pytest.fixture
def ws(jp_serverapp: Any, jp_http_port: int, jp_auth_header: dict[str, str]):
    async def connect(*parts: str, **query: Any) -> Any:
        url = f"ws://127.0.0.1:{jp_http_port}{_path(*parts, **query)}"
        req = tornado.httpclient.HTTPRequest(url, headers=jp_auth_header)
        return await tornado.websocket.websocket_connect(req)

    return connect


@pytest.fixture
def hub(jp_serverapp: Any) -> Any:
    (app,) = jp_serverapp.extension_manager.extension_apps["workbench.server"]
    return app.hub


async def _recv(conn: Any, timeout: float = 5.0) -> dict[str, Any]:
    msg = await asyncio.wait_for(conn.read_message(), timeout)
    assert msg is not None, "websocket closed"
    return json.loads(msg)


async def _steps_from(conn: Any, want: list[int], timeout: float = 10.0) -> list[int]:
    """Steps of the metrics messages on a run stream until ``want`` arrived (or time ran out)."""
    got: list[int] = []
    deadline = time.monotonic() + timeout
    while len(got) < len(want):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            msg = await _recv(conn, left)
        except asyncio.TimeoutError:
            break
        if msg["type"] == "metrics":
            got += msg["columns"]["step"]
    return got


def _good_run(root: Path) -> Path:
    d = root / "good"
    if not (d / runs.RUN_JSON).exists():
        with runs.RunWriter(d, config={"model": "tiny"}) as w:
            for s in range(1, GOOD_STEPS + 1):
                w.log({"step": s, "loss": 1.0 / s})
    return d


async def _check_good(get: Any) -> list[dict[str, Any]]:
    """The runs list answers and the good run in it is whole; returns the list (every run:
    one page of up to 1000)."""
    code, body, raw = await get("runs", limit=1000)
    assert code == 200, raw[:500]
    good = next(r for r in body["runs"] if r["id"] == "good")
    assert (good["status"], good["step"], good["points"], good["problem"]) == (
        "finished", GOOD_STEPS, GOOD_STEPS, None)
    code, page, _ = await get("runs", "good", "metrics")
    assert code == 200 and page["columns"]["step"] == list(range(1, GOOD_STEPS + 1))
    return body["runs"]


# ----------------------------------------------------------------------------- the reference
def _depth(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    return 0


def reference_steps(data: bytes) -> list[int]:
    """The steps a plain reader finds in a metrics.jsonl (contracts.md's rules): whole
    lines that are JSON objects without ``event``, with an integer (not boolean) step,
    |step| < 2**53, nested at most 32 deep, each above the last step taken."""
    out: list[int] = []
    for raw in data.split(b"\n")[:-1]:
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if not isinstance(rec, dict) or "event" in rec:
            continue
        s = rec.get("step")
        if type(s) is not int or not -2**53 < s < 2**53 or _depth(rec) > 32:
            continue
        if not out or s > out[-1]:
            out.append(s)
    return out


def reference_run_json(path: Path) -> dict[str, Any] | None:
    """``run.json`` parsed by plain ``json.loads`` when it is a JSON object (else None)."""
    if not path.is_file():  # a directory or a pipe
        return None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and _depth(data) <= 64 else None


# ----------------------------------------------------------------------------- strategies
_floats = st.floats(allow_nan=True, allow_infinity=True)
_deep = st.sampled_from([33, 40, 999, 5000, 100_000])


def _record(step: Any, **extra: Any) -> bytes:
    return json.dumps({"step": step, "time": 1.7e9, **extra}).encode()  # NaN/Infinity literals


_line = st.one_of(
    st.builds(lambda s, loss: _record(s, loss=loss), st.integers(-3, 60), _floats),
    st.builds(lambda s, n: _record(s, x="[" * 5) [:-1] + b", \"y\": " + b"[" * n + b"]" * n
              + b"}", st.integers(0, 60), st.sampled_from([30, 31, 32, 33, 40, 2000])),
    st.builds(lambda n: b"[" * n, _deep),
    st.builds(lambda n: b'{"a":' * n + b"1" + b"}" * n, _deep),
    st.builds(lambda s, lit: b'{"step": %d, "loss": %s}' % (s, lit), st.integers(0, 60),
              st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999",
                               b"1" + b"0" * 30, b"9" * 5000])),
    st.sampled_from([b'{"step": "abc"}', b'{"step": true}', b'{"step": 1.5}', b'{"step": null}',
                     b'{"step": []}', b'{"step": {}}', b'{"step": 1' + b"0" * 30 + b"}",
                     b'{"step": -9007199254740993}', b'{"loss": 1.0}', b"[1, 2]", b'"x"', b"5",
                     b"null", b"", b"   ", b'{"event": "compile", "seconds": 1.5}',
                     b'{"event": 5}', b'{"event": "x", "v": NaN}', b"\xef\xbb\xbf{\"step\": 7}",
                     b'{"step": 3}{"step": 4}', b'{"step": 5}, {"step": 6}', b'{"a":"}',
                     b'{"b":1}"}', b"\x00\x01\x02", b'{"step": 8, "time": "yesterday"}']),
    st.builds(lambda s, k: _record(s, loss=0.5)[:k], st.integers(0, 60), st.integers(0, 30)),
    st.binary(max_size=64),
    st.text(max_size=32).map(str.encode),
)
_metrics = st.builds(lambda lines, tail: b"\n".join(lines) + b"\n" + tail,
                     st.lists(_line, max_size=25), st.sampled_from([b"", b'{"step": 99', b"\xff"]))

_json_value = st.recursive(
    st.none() | st.booleans() | _floats | st.integers(-10**30, 10**30) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)
_run_fields = st.fixed_dictionaries({}, optional={
    k: _json_value for k in ("id", "name", "status", "created", "updated", "step",
                             "target_steps", "pid", "pid_start", "config", "mesh", "devices",
                             "peak_flops", "device_kind", "error", "prediction", "host")})
_run_dict = st.builds(
    lambda base, fields: json.dumps({**base, **fields}).encode(),
    st.fixed_dictionaries({
        "status": st.sampled_from(["running", "finished", "bogus"]),
        "host": st.just(socket.gethostname()),
        "pid": st.sampled_from([10**30, -1, 0, 1, os.getpid(), True, "12", 2**63]),
        "step": st.one_of(st.integers(0, 100), st.just("abc"), st.just(True)),
        "updated": st.one_of(_floats, st.just("yesterday"), st.integers(0, 10**400)),
    }),
    _run_fields)
_run_json = st.one_of(
    _run_dict, _run_dict,
    st.sampled_from([b"", b"   ", b"[]", b"null", b"{", b"NaN", b'"x"', b"\xff\xfe\x00",
                     b"[" * 100_000, b'{"a":' * 100_000, b'{"a":' * 70 + b"1" + b"}" * 70,
                     b"{}", b'{"step": NaN, "updated": Infinity}', b"DIRECTORY"]),
    st.binary(max_size=64))


def _write_run(root: Path, run_json: bytes, metrics: bytes | None) -> tuple[str, Path]:
    name = f"fuzz{next(_names)}"
    d = root / name
    d.mkdir()
    for file, contents in ((runs.RUN_JSON, run_json), (runs.METRICS, metrics)):
        if contents == b"DIRECTORY":
            (d / file).mkdir()
        elif contents == b"FIFO":
            os.mkfifo(d / file)  # a named pipe: opening it for reading would block
        elif contents is not None:
            (d / file).write_bytes(contents)
    return name, d


async def _check_bad(get: Any, ws: Any, name: str, d: Path, metrics: bytes | None) -> None:
    """Every endpoint of the bad run answers; its steps are the reference reader's."""
    code, detail, raw = await get("runs", name)
    assert code == 200, raw[:300]
    ref = reference_run_json(d / runs.RUN_JSON)
    assert detail["status"] in STATUSES
    if ref is None:
        assert detail["status"] == "error" and detail["problem"], detail
    want = reference_steps(metrics if metrics not in (None, b"DIRECTORY", b"FIFO") else b"")
    code, page, raw = await get("runs", name, "metrics")
    assert code == 200, raw[:300]
    assert page["columns"]["step"] == want
    for col in page["columns"].values():  # strict JSON: no NaN came through
        assert all(v is None or not isinstance(v, float) or v == v for v in col)
    runs_list = await _check_good(get)
    (bad,) = [r for r in runs_list if r["id"] == name]
    assert bad["status"] == detail["status"] and bad["points"] == len(want)
    conn = await ws("runs", name, "stream")
    first = await _recv(conn)
    assert first["type"] == "run" and first["run"]["id"] == name
    assert await _steps_from(conn, want, timeout=5.0) == want
    conn.close()


# ----------------------------------------------------------------------------- fuzz
_FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow, HealthCheck.data_too_large])


@_FUZZ
@given(run_json=_run_json, metrics=st.one_of(st.none(), _metrics))
@pytest.mark.slow
def test_fuzz_random_run_files_affect_only_their_run(
        get: Any, ws: Any, jp_root_dir: Path, jp_asyncio_loop: Any, run_json: bytes,
        metrics: bytes | None) -> None:
    """Random and adversarial run.json + metrics.jsonl: every endpoint answers 200, the
    good run stays whole, the list websocket stays open, the bad run's steps are exactly
    the reference reader's on REST and on its stream."""
    _good_run(jp_root_dir)

    async def case() -> None:
        listener = await ws("stream")
        assert (await _recv(listener))["type"] == "runs"
        good = await ws("runs", "good", "stream")
        assert (await _recv(good))["type"] == "run"
        assert await _steps_from(good, list(range(1, GOOD_STEPS + 1)))
        name, d = _write_run(jp_root_dir, run_json, metrics)
        await _check_bad(get, ws, name, d, metrics)
        code, _, _ = await get("runs", name, "metrics", since=-5, limit=3, keys="loss,time")
        assert code == 200
        with pytest.raises(asyncio.TimeoutError):  # the good run's stream is still open
            await asyncio.wait_for(good.read_message(), 0.02)
        good.close()
        while True:  # the list stream is still open and delivered the new run
            msg = await _recv(listener)
            if msg["type"] == "update" and any(r["id"] == name for r in msg["runs"]):
                break
        listener.close()

    jp_asyncio_loop.run_until_complete(case())


_piece = st.integers(1, 40)


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(bad=st.lists(_line, min_size=1, max_size=8), cuts=st.lists(_piece, min_size=5,
                                                                  max_size=30))
def test_fuzz_live_appends_with_bad_lines_reach_every_client_once(
        get: Any, ws: Any, jp_root_dir: Path, jp_asyncio_loop: Any, bad: list[bytes],
        cuts: list[int]) -> None:
    """A live run gets good steps with bad lines between them, written in pieces that cut
    lines anywhere, then is truncated (replaced): each of 5 listening clients receives
    every valid step exactly once, in order, and after the reset the new file's steps."""
    _good_run(jp_root_dir)

    async def case() -> None:
        name, d = _write_run(jp_root_dir, json.dumps({"status": "finished"}).encode(), b"")
        conns = [await ws("runs", name, "stream") for _ in range(5)]
        for c in conns:
            assert (await _recv(c))["type"] == "run"
        lines = []
        for s in range(1, 61):
            lines.append(_record(s, loss=float("nan") if s % 7 == 0 else 1.0 / s))
            if s % 5 == 0:
                lines.append(bad[s % len(bad)] if b"\n" not in bad[s % len(bad)] else b"x")
        data = b"\n".join(lines) + b"\n"
        want = reference_steps(data)
        pieces = itertools.cycle(cuts)
        pos = 0
        with open(d / runs.METRICS, "ab") as f:
            while pos < len(data):
                n = next(pieces) * 7
                f.write(data[pos:pos + n])
                f.flush()
                pos += n
                await asyncio.sleep(0.003)
        for c in conns:
            assert await _steps_from(c, want) == want
        (d / runs.METRICS).write_bytes(b'{"step": 1, "loss": 2.0}\n')  # replaced: shorter
        for c in conns:
            while (msg := await _recv(c))["type"] != "reset":
                pass
            assert await _steps_from(c, [1]) == [1]
            c.close()
        await _check_good(get)

    jp_asyncio_loop.run_until_complete(case())


# ----------------------------------------------------------------------------- the issue's cases
def _good_lines(steps: range, **extra: Any) -> bytes:
    return b"".join(_record(s, loss=1.0 / s, **extra) + b"\n" for s in steps)


def _meta(**fields: Any) -> bytes:
    base = {"id": "x", "name": "x", "status": "finished", "created": 1.0, "updated": 2.0,
            "step": 3, "host": socket.gethostname(), "pid": os.getpid()}
    return json.dumps({**base, **fields}).encode()


# (name after the issue's wording, run.json bytes, metrics.jsonl bytes or None,
#  a word the reason must hold (None: the run is readable), status expected)
_FILE_CASES = [
    ("metrics line of 100,000 nested [", _meta(),
     _good_lines(range(1, 3)) + b"[" * 100_000 + b"\n" + _good_lines(range(3, 5)), "nested",
     "finished"),
    ("run.json running, this host, pid 10**30", _meta(status="running", pid=10**30),
     _good_lines(range(1, 4)), None, "interrupted"),
    ("NaN / Infinity literals in metrics.jsonl",
     _meta(), _good_lines(range(1, 3)) + b'{"step": 3, "loss": NaN, "mfu": Infinity}\n'
     b'{"step": 4, "loss": -Infinity, "mfu": 1e999}\n', None, "finished"),
    ("runs list 500 while a last record is NaN", _meta(),
     _good_lines(range(1, 3)) + b'{"step": 3, "loss": NaN, "time": NaN}\n', None, "finished"),
    ('run.json with "step": "abc"', _meta(step="abc"), _good_lines(range(1, 3)), "step",
     "finished"),
    ('run.json with "updated": "yesterday"', _meta(updated="yesterday"),
     _good_lines(range(1, 3)), "updated", "finished"),
    ("metrics.jsonl missing while run.json exists", _meta(), None, None, "finished"),
    ('"step": true counts as a step', _meta(),
     _good_lines(range(1, 3)) + b'{"step": true, "loss": 0.1}\n' + _good_lines(range(3, 4)),
     "true", "finished"),
    ("run.json binary", b"\x89PNG\r\n\x1a\n\x00\xff", _good_lines(range(1, 3)), "UTF-8", "error"),
    ("run.json empty", b"", _good_lines(range(1, 3)), "empty", "error"),
    ("run.json a JSON list", b"[1, 2]", _good_lines(range(1, 3)), "list", "error"),
    ("run.json a directory", b"DIRECTORY", _good_lines(range(1, 3)), "directory", "error"),
    ("run.json deeply nested", b"[" * 100_000, _good_lines(range(1, 3)), "nested", "error"),
    ("run.json step NaN", _meta().replace(b'"step": 3', b'"step": NaN'),
     _good_lines(range(1, 3)), None, "finished"),
    ("run.json huge ints", _meta(updated=10**400, created=10**30, target_steps=10**30),
     _good_lines(range(1, 3)), "target_steps", "finished"),
    ("run.json unknown status", _meta(status="bogus"), _good_lines(range(1, 3)), "status",
     "error"),
    ("truncated lines", _meta(), _good_lines(range(1, 3)) + b'{"step": 3, "lo\n'
     + _good_lines(range(4, 6)) + b'{"step": 6, "loss"', "line 3", "finished"),
    ("no line borrows its neighbours' text", _meta(),
     b'{"a":"}\n{"b":1}"}\n{"step": 5},{"step": 6}\n' + _good_lines(range(7, 9)), "line 1",
     "finished"),
    ("run.json a named pipe", b"FIFO", None, "not a regular file", "error"),
    ("metrics.jsonl a directory", _meta(), b"DIRECTORY", "not a regular file", "finished"),
    ("metrics.jsonl a named pipe", _meta(), b"FIFO", "not a regular file", "finished"),
    ("wrong types in metrics", _meta(), b'{"step": "abc"}\n{"step": 1.5}\n{"step": null}\n'
     + _good_lines(range(1, 3)) + b'{"step": 3, "time": "yesterday", "loss": "x"}\n',
     "'step' is \"abc\"", "finished"),
]


@pytest.mark.parametrize(("run_json", "metrics", "reason", "status"),
                         [c[1:] for c in _FILE_CASES], ids=[c[0] for c in _FILE_CASES])
@run_async
async def test_issue_case_affects_only_its_run(get: Any, ws: Any, jp_root_dir: Path,
                                               run_json: bytes, metrics: bytes | None,
                                               reason: str | None, status: str) -> None:
    """Each malformed file of the issue: the list, the good run and the websockets stay
    healthy; the run is listed with its status and, where something was unreadable, the
    reason; its steps are the reference reader's, NaN/Infinity arrive as null gaps."""
    _good_run(jp_root_dir)
    listener = await ws("stream")
    assert (await _recv(listener))["type"] == "runs"
    name, d = _write_run(jp_root_dir, run_json, metrics)
    await _check_bad(get, ws, name, d, metrics)
    code, detail, _ = await get("runs", name)
    assert detail["status"] == status
    if reason is None:
        assert detail["problem"] is None
    else:
        assert reason in detail["problem"], detail["problem"]
    runs_list = await _check_good(get)
    (summary,) = [r for r in runs_list if r["id"] == name]
    assert (summary["status"], summary["problem"]) == (status, detail["problem"])
    code, page, _ = await get("runs", name, "metrics")
    text = metrics if metrics not in (b"DIRECTORY", b"FIFO") else b""
    want = reference_steps(text or b"")
    ref = [json.loads(line) for line in (text or b"").split(b"\n")[:-1] if _is_step(line)]
    for key, col in page["columns"].items():  # NaN / Infinity -> null and listed as a gap
        gaps = [i for i, r in enumerate(ref) if key in r and not _finite_or_text(r[key])]
        assert page["gaps"].get(key, []) == gaps, key
        assert all(col[i] is None for i in gaps)
    assert len(ref) == len(want)
    msg = await _recv(listener)  # the list websocket is open and tells about the run
    while not (msg["type"] == "update" and any(r["id"] == name for r in msg["runs"])):
        msg = await _recv(listener)
    listener.close()


@pytest.mark.parametrize("kind", ["FIFO", "DIRECTORY"])
@run_async
async def test_the_first_listing_shows_a_run_whose_run_json_is_not_a_file(
        get: Any, jp_root_dir: Path, kind: str) -> None:
    """Issue 29: a run whose run.json is a named pipe (or a directory), there before the
    server's first listing, is in that listing as an error naming why (later listings
    showed it; the first left it out)."""
    _good_run(jp_root_dir)
    name, _ = _write_run(jp_root_dir, kind.encode(), _good_lines(range(1, 3)))
    runs_list = await _check_good(get)          # the first request of this server
    (summary,) = [r for r in runs_list if r["id"] == name]
    assert summary["status"] == "error"
    assert ("not a regular file" if kind == "FIFO" else "is a directory") in summary["problem"]
    assert [r["id"] for r in runs.list_runs([jp_root_dir]) if r["id"] == name] == [name]


def _is_step(line: bytes) -> bool:
    return bool(reference_steps(line + b"\n"))


def _finite_or_text(v: Any) -> bool:
    return not isinstance(v, float) or v - v == 0


@run_async
async def test_metrics_file_appearing_later_reaches_the_open_stream(get: Any, ws: Any,
                                                                    jp_root_dir: Path) -> None:
    """A run directory whose metrics.jsonl is missing while run.json exists: the stream
    opens (the run, no metrics), and steps written later arrive on it."""
    name, d = _write_run(jp_root_dir, _meta(), None)
    conn = await ws("runs", name, "stream")
    assert (await _recv(conn))["type"] == "run"
    (d / runs.METRICS).write_bytes(_good_lines(range(1, 4)))
    assert await _steps_from(conn, [1, 2, 3]) == [1, 2, 3]
    conn.close()


@pytest.mark.parametrize("query", [{"limit": -5}, {"limit": 0}, {"limit": "abc"},
                                   {"limit": 10**30}, {"since": "1e3"}, {"since": "9" * 5000},
                                   {"since": 2**60}],
                         ids=lambda q: "&".join(f"{k}={str(v)[:12]}" for k, v in q.items()))
@run_async
async def test_bad_query_params_answer_400_with_a_message(get: Any, jp_root_dir: Path,
                                                          query: dict[str, Any]) -> None:
    """limit=-5 answers more: true (the issue): now 400 naming the argument and its range."""
    _good_run(jp_root_dir)
    code, _, body = await get("runs", "good", "metrics", **query)
    assert code == 400
    (key,) = query
    assert f"{key}=".encode() in body and b"integer" in body
    code, page, _ = await get("runs", "good", "metrics", limit=10**6)  # large: capped, fine
    assert code == 200 and page["more"] is False and page["count"] == GOOD_STEPS


@pytest.mark.parametrize("allow_hidden", [False, True])
@run_async
async def test_hidden_directories_follow_allow_hidden(get: Any, jp_root_dir: Path,
                                                      jp_serverapp: Any,
                                                      allow_hidden: bool) -> None:
    """Runs under hidden directories (.hidden/run) are served when asked by id and then
    listed for every client (the issue): now only with ContentsManager.allow_hidden, as
    Jupyter's own contents API does (the reference: what it answers for the same path)."""
    _good_run(jp_root_dir)
    for rel in (".hidden/run", "sub/.dot/run"):
        with runs.RunWriter(jp_root_dir / rel, config={}) as w:
            w.log({"step": 1, "loss": 1.0})
    (jp_root_dir / "alias").symlink_to(jp_root_dir / ".hidden" / "run", target_is_directory=True)
    contents = jp_serverapp.contents_manager
    assert contents.allow_hidden is allow_hidden
    for rid in (".hidden/run", "sub/.dot/run"):
        try:
            model = contents.get(f"{rid}/run.json", content=False)
            if asyncio.iscoroutine(model):
                await model
            jupyter_serves = True
        except Exception:  # noqa: BLE001 - tornado.web.HTTPError 404 for hidden paths
            jupyter_serves = False
        assert jupyter_serves is allow_hidden
        for parts in (("runs", rid), ("runs", rid, "metrics")):
            code, _, _ = await get(*parts)
            assert code == (200 if allow_hidden else 404), (parts, code)
    code, _, _ = await get("runs", "alias")  # a symlink into a hidden directory
    assert code == (200 if allow_hidden else 404)
    await asyncio.sleep(0.3)  # a scan
    listed = {r["id"] for r in await _check_good(get)}
    assert ({".hidden/run", "sub/.dot/run"} <= listed) is allow_hidden
    assert not allow_hidden or listed.isdisjoint({".hidden/run", "sub/.dot/run"}) is False


@run_async
async def test_symlink_loop_and_aliases_share_one_watch(get: Any, jp_root_dir: Path,
                                                        hub: Any) -> None:
    """A symlink loop under the root made each alias a new permanent watch that re-parses
    the whole file (the issue): every alias of a real directory gets its one watch."""
    _good_run(jp_root_dir)
    (jp_root_dir / "good" / "loop").symlink_to(jp_root_dir / "good", target_is_directory=True)
    (jp_root_dir / "self").symlink_to(jp_root_dir, target_is_directory=True)
    (jp_root_dir / "a").symlink_to(jp_root_dir / "b")
    (jp_root_dir / "b").symlink_to(jp_root_dir / "a")  # a loop that resolves nowhere
    await _check_good(get)
    watch = hub.index.watches["good"]
    before = dict(hub.index.watches)
    for rid in ("good/loop", "good/loop/loop/loop", "self/good", "self/self/good/loop"):
        code, page, _ = await get("runs", rid, "metrics")
        assert code == 200 and page["id"] == "good"
        assert page["columns"]["step"] == list(range(1, GOOD_STEPS + 1))
    for rid in ("a", "a/b", "b/run"):
        code, _, _ = await get("runs", rid)
        assert code == 404
    await asyncio.sleep(0.3)
    assert hub.index.watches == before and hub.index.watches["good"] is watch
    assert [r["id"] for r in await _check_good(get)] == ["good"]


@run_async
async def test_unterminated_50mb_last_line_costs_nothing_per_poll(
        get: Any, jp_root_dir: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 50 MB last line without a newline was re-read on every poll (the issue): it is
    not read again until the file grows; then only the new bytes are searched."""
    _good_run(jp_root_dir)
    name, d = _write_run(jp_root_dir, _meta(), _good_lines(range(1, 4)))
    with open(d / runs.METRICS, "ab") as f:
        f.write(b'{"step": 4, "note": "' + b"x" * (50 << 20))
    await get("runs", name)
    await hub.poll_now(max_age=0.0)   # the good run read once too (a request reads only its run)
    searched: list[int] = []
    parsed: list[int] = []
    real_search, real_records = _tail._last_newline, _tail._records
    monkeypatch.setattr(_tail, "_last_newline",
                        lambda p, lo, hi: searched.append(hi - lo) or real_search(p, lo, hi))
    monkeypatch.setattr(_tail, "_records",
                        lambda p, a, b: parsed.append(b - a) or real_records(p, a, b))
    for _ in range(5):
        await hub.poll_now(max_age=0.0)
    assert (searched, parsed) == ([], [])
    with open(d / runs.METRICS, "ab") as f:
        f.write(b"y" * 1000)
    await hub.poll_now(max_age=0.0)
    assert searched == [1000] and parsed == []
    with open(d / runs.METRICS, "ab") as f:
        f.write(b'"}\n' + _good_lines(range(5, 7)))
    await hub.poll_now(max_age=0.0)
    code, page, _ = await get("runs", name, "metrics")
    assert page["columns"]["step"] == [1, 2, 3, 5, 6]  # the 50 MB line: skipped as too long
    code, detail, _ = await get("runs", name)
    assert "line 4: longer than" in detail["problem"]


@run_async
async def test_nan_line_at_step_500_of_a_live_run_loses_no_step_for_20_clients(
        ws: Any, get: Any, jp_root_dir: Path) -> None:
    """One NaN line appended at step 500 of a live run: all 20 listening clients silently
    lost steps 495-519 (the issue). Now each gets every step exactly once, NaN as a gap."""
    _good_run(jp_root_dir)
    d = jp_root_dir / "live"
    w = runs.RunWriter(d, config={})
    for s in range(1, 495):
        w.log({"step": s, "loss": 1.0})
    conns = [await ws("runs", "live", "stream") for _ in range(20)]

    def write() -> None:
        for s in range(495, 520):
            if s == 500:
                with open(d / runs.METRICS, "a") as f:  # another tool's NaN, and garbage
                    f.write('{"step": 500, "loss": NaN}\n[[[[\n{"step": true}\n')
                continue
            w.log({"step": s, "loss": 1.0})
            time.sleep(0.005)

    writer = threading.Thread(target=write)
    writer.start()
    await asyncio.sleep(0.05)
    writer.join()
    for c in conns:
        got: list[int] = []
        gaps: list[int] = []
        while len(got) < 519:
            msg = await _recv(c, timeout=10)
            if msg["type"] == "metrics":
                gaps += [msg["columns"]["step"][i] for i in msg["gaps"].get("loss", [])]
                got += msg["columns"]["step"]
        assert got == list(range(1, 520)) and gaps == [500]
        c.close()
    w.close()
    await _check_good(get)


# ----------------------------------------------------------------------------- read_run
_RUN_JSON_FAULTS = [  # (the issue's wording, contents, words the error must hold)
    ("binary", b"\x89PNG\r\n\x1a\n\x00\xff", "not UTF-8"),
    ("empty", b"", "is empty"),
    ("a JSON list", b"[1, 2]", "JSON list"),
    ("a directory", b"DIRECTORY", "is a directory"),
    ("deeply nested", b"[" * 100_000, "nested"),
    ("deeply nested object", b'{"a":' * 70 + b"1" + b"}" * 70, "nested more than 64"),
    ("not JSON", b'{"step": 3', "not valid JSON"),
]


@pytest.mark.parametrize(("contents", "words"), [c[1:] for c in _RUN_JSON_FAULTS],
                         ids=[c[0] for c in _RUN_JSON_FAULTS])
def test_read_run_names_the_file_the_fault_and_the_fix(tmp_path: Path, contents: bytes,
                                                       words: str) -> None:
    """run.json that is binary, empty, a JSON list, a directory or deeply nested gave raw
    UnicodeDecodeError / JSONDecodeError / AttributeError / IsADirectoryError /
    RecursionError without the path (the issue): one RunFileError that names them; the
    CLI's runs list shows the run as an error instead of failing."""
    _, d = _write_run(tmp_path, contents, _good_lines(range(1, 3)))
    with pytest.raises(runs.RunFileError) as e:
        runs.read_run(d)
    assert str(d / runs.RUN_JSON) in str(e.value) and words in str(e.value)
    assert "move it aside" in str(e.value)
    with pytest.raises(runs.RunFileError):
        runs.RunWriter(d, config={})  # a writer refuses it the same way, before writing
    (listed,) = runs.list_runs([tmp_path])
    assert (listed["status"], listed["problem"]) == ("error", str(e.value))


def test_run_json_nan_step_and_wrong_types_resume_cleanly(tmp_path: Path) -> None:
    """run.json with step NaN gave "Out of range float" on resume (the issue): NaN reads as
    null, fields of the wrong type are ignored, and the writer resumes and logs."""
    d = tmp_path / "r"
    d.mkdir()
    (d / runs.RUN_JSON).write_bytes(b'{"id": "abc", "step": NaN, "created": "yesterday", '
                                    b'"updated": Infinity, "target_steps": true}')
    meta = runs.read_run(d)
    assert meta["step"] is None and meta["updated"] is None
    checked, problems = runs.check_run(meta)
    assert checked["created"] is None and checked["target_steps"] is None
    assert sorted(p.split("'")[1] for p in problems) == ["created", "target_steps"]
    with runs.RunWriter(d, config={}) as w:
        w.log({"step": 1, "loss": float("nan")})
    after = runs.read_run(d)
    assert (after["id"], after["step"], after["status"]) == ("abc", 1, "finished")
    assert isinstance(after["created"], float)
