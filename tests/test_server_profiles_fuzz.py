"""Hostile run directories applied to ``profiles/`` (issue 44, item 2): the one safe reader.

A real jupyter_server with the Workbench extension serves a root holding a good run and,
per case, a run whose ``profiles/<step>/report.json``, step folder or ``profiles/`` folder
is a named pipe, a link to ``/dev/zero``, a link out of the run, a directory, too large,
or holds the bad contents of tests/test_server_fuzz.py's run.json kinds. Every endpoint
must answer promptly, the good run must stay whole, nothing outside the run may be
served, and a readable report's rows must be those a plain reference reader finds.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pytest_jupyter.jupyter_server import *  # its fixtures, for this module only
from server_async import run_async
from test_server_fuzz import (
    _RUN_JSON_FAULTS,
    GOOD_STEPS,
    _check_good,
    _good_lines,
    _good_run,
    _json_value,
    _meta,
    _path,
)
from traitlets.config import Config

from workbench import _run_file, _runs as runs
from workbench.server import _profiles as profiles

SECRET = "secret-term-outside-the-run"
READ_TIMEOUT = 1.5
_names = iter(range(10**6))


@pytest.fixture
def jp_server_config() -> Config:
    return Config({
        "ServerApp": {"jpserver_extensions": {"workbench.server": True}},
        "WorkbenchExtension": {"poll_interval": 0.05, "scan_interval": 0.1,
                               "read_timeout": READ_TIMEOUT, "read_workers": 4},
    })


@pytest.fixture
def jp_base_url() -> str:
    return "/"


@pytest.fixture
def get(jp_serverapp: Any, http_server_client: Any, jp_auth_header: dict[str, str]):
    """GET an endpoint: (status, parsed JSON body or None, raw body), answered within 20 s
    (a read that blocks fails the test instead of hanging it)."""

    async def fetch(*parts: str, **query: Any) -> tuple[int, Any, bytes]:
        resp = await asyncio.wait_for(http_server_client.fetch(
            _path(*parts, **query), raise_error=False, headers=jp_auth_header,
            request_timeout=30), 20)
        body = json.loads(resp.body) if resp.code == 200 else None
        return resp.code, body, resp.body or b""

    return fetch


@pytest.fixture
def hub(jp_serverapp: Any) -> Any:
    (app,) = jp_serverapp.extension_manager.extension_apps["workbench.server"]
    return app.hub


# ----------------------------------------------------------------------------- the reference
def _report(*terms: str, secret: bool = False) -> bytes:
    rows = [{"name": SECRET if secret else t, "predicted": 0.01 * (i + 1),
             "measured": 0.02 * (i + 1), "kind": "", "axes": [], "count": 0}
            for i, t in enumerate(terms)]
    return json.dumps({"rows": rows, "verdict": f"{terms[0] if terms else 'x'} is slower",
                       "steps": 2, "tokens_per_s": {"outside": 100.0, "during": 90.0}}).encode()


def _finite(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:   # an integer past the floats
        return False


def reference_rows(data: bytes) -> list[tuple[str, float, float]] | None:
    """(name, predicted, measured) of each usable row of a report, read by plain
    ``json.loads`` (None when the file is no JSON object): a row is an object with a string
    name and finite predicted and measured seconds; only the first 200 rows are looked at."""
    try:
        rep = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(rep, dict):
        return None
    rows = rep.get("rows") if isinstance(rep.get("rows"), list) else []
    return [(r["name"][:200], float(r["predicted"]), float(r["measured"])) for r in rows[:200]
            if isinstance(r, dict) and isinstance(r.get("name"), str)
            and _finite(r.get("predicted")) and _finite(r.get("measured"))]


def _served_rows(p: dict[str, Any]) -> list[tuple[str, float, float]]:
    return [(r["name"], r["predicted"], r["measured"]) for r in p["rows"]]


# ----------------------------------------------------------------------------- the run dirs
def _run(root: Path, name: str | None = None) -> tuple[str, Path]:
    """A finished run with three steps and one good profile, ``profiles/1``."""
    name = name or f"prof{next(_names)}"
    d = root / name
    d.mkdir()
    (d / runs.RUN_JSON).write_bytes(_meta())
    (d / runs.METRICS).write_bytes(_good_lines(range(1, 4)))
    (d / "profiles" / "1").mkdir(parents=True)
    (d / "profiles" / "1" / "report.json").write_bytes(_report("compute", "memory"))
    return name, d


def _outside(root: Path) -> Path:
    """A folder beside the server's root holding a readable report with the secret."""
    out = root.parent / f"outside{next(_names)}"
    (out / "7").mkdir(parents=True)
    (out / "7" / "report.json").write_bytes(_report("compute", secret=True))
    (out / "report.json").write_bytes(_report("compute", secret=True))
    return out


def _place(d: Path, kind: str, root: Path) -> None:
    """Makes the hostile ``kind`` in run ``d`` (next to its good ``profiles/1``)."""
    prof = d / "profiles"
    step = prof / "7"
    report = step / "report.json"
    if kind.startswith("profiles "):
        shutil.rmtree(prof)
        target, what = prof, kind.removeprefix("profiles ")
    elif kind.startswith("step folder "):
        target, what = step, kind.removeprefix("step folder ")
    else:
        step.mkdir()
        target, what = report, kind
    out = _outside(root)
    if what == "a named pipe":
        os.mkfifo(target)
    elif what == "a link to /dev/zero":
        target.symlink_to("/dev/zero")
    elif what == "a link out of the root":
        target.symlink_to(out if target != report else out / "report.json",
                          target_is_directory=target != report)
    elif what == "a link out of the run, inside the root":
        other = root / f"other{next(_names)}"
        (other / "7").mkdir(parents=True)
        (other / "7" / "report.json").write_bytes(_report("compute", secret=True))
        (other / "report.json").write_bytes(_report("compute", secret=True))
        target.symlink_to(other if target != report else other / "report.json",
                          target_is_directory=target != report)
    elif what == "a dangling link":
        target.symlink_to(root / "nowhere")
    elif what == "a link loop":
        target.symlink_to(target)
    elif what == "a file":
        target.write_bytes(_report("compute"))
    elif what == "a directory":
        target.mkdir()
    elif what == "over 4 MiB":
        with open(target, "wb") as f:   # sparse: no disk, but 5 MiB to read
            f.truncate(5 << 20)
    elif what == "a link to /dev/zero past its folder":
        target.symlink_to("../../../../../../../../../../dev/zero")
    else:
        raise AssertionError(kind)


# (case, kind, served: the names that GET .../profiles lists, words in profile 7's problem
#  (None: it is served without one))
_KINDS = [
    ("report.json a named pipe", "a named pipe", ["1", "7"], "not a regular file (a named pipe)"),
    ("report.json -> /dev/zero", "a link to /dev/zero", ["1", "7"], "outside the run directory"),
    ("report.json -> ../../../dev/zero", "a link to /dev/zero past its folder", ["1", "7"],
     "outside the run directory"),
    ("report.json a link out of the root", "a link out of the root", ["1", "7"],
     "outside the run directory"),
    ("report.json a link out of the run, inside the root",
     "a link out of the run, inside the root", ["1", "7"], "outside the run directory"),
    ("report.json a directory", "a directory", ["1", "7"], "is a directory"),
    ("report.json over 4 MiB", "over 4 MiB", ["1", "7"], "over the 4 MiB"),
    ("report.json a dangling link", "a dangling link", ["1", "7"], "outside the run directory"),
    ("report.json a link loop", "a link loop", ["1"], None),
    ("step folder a named pipe", "step folder a named pipe", ["1"], None),
    ("step folder a file", "step folder a file", ["1"], None),
    ("step folder -> /dev/zero", "step folder a link to /dev/zero", ["1"], None),
    ("step folder a link out of the root", "step folder a link out of the root", ["1", "7"],
     "outside the run directory"),
    ("step folder a link out of the run, inside the root",
     "step folder a link out of the run, inside the root", ["1", "7"],
     "outside the run directory"),
    ("step folder a dangling link", "step folder a dangling link", ["1"], None),
    ("profiles/ a named pipe", "profiles a named pipe", [], None),
    ("profiles/ a file", "profiles a file", [], None),
    ("profiles/ -> /dev/zero", "profiles a link to /dev/zero", [], None),
    ("profiles/ a link out of the root", "profiles a link out of the root", [], None),
    ("profiles/ a link out of the run, inside the root",
     "profiles a link out of the run, inside the root", [], None),
    ("profiles/ a link loop", "profiles a link loop", [], None),
]


async def _check_run(get: Any, name: str, served: list[str], problem: str | None) -> None:
    """The run's detail, metrics and profiles answer; profile 1 is whole; nothing from
    outside the run is served; the good run and the runs list are whole."""
    code, detail, raw = await get("runs", name)
    assert code == 200, raw[:300]
    assert [p["name"] for p in detail["profiles"]] == served
    code, page, raw = await get("runs", name, "metrics")
    assert code == 200 and page["columns"]["step"] == [1, 2, 3], raw[:300]
    code, body, raw = await get("runs", name, "profiles")
    assert code == 200, raw[:300]
    assert SECRET.encode() not in raw
    got = {p["name"]: p for p in body["profiles"]}
    assert sorted(got) == sorted(served)
    if "1" in got:
        assert _served_rows(got["1"]) == reference_rows(_report("compute", "memory"))
        assert got["1"]["problem"] is None
    if "7" in got:
        if problem is None:
            assert got["7"]["problem"] is None
        else:
            assert got["7"]["rows"] == [] and problem in got["7"]["problem"], got["7"]
            assert got["7"]["problem"].startswith("profiles/7/report.json ")
    await _check_good(get)


@pytest.mark.parametrize(("kind", "served", "problem"), [c[1:] for c in _KINDS],
                         ids=[c[0] for c in _KINDS])
@run_async
async def test_hostile_profile_files_affect_only_their_profile(
        get: Any, jp_root_dir: Path, kind: str, served: list[str], problem: str | None) -> None:
    """Each hostile report, step folder or profiles/ folder: every endpoint answers at once,
    the run's good profile is served whole, what lies outside the run (another run's report
    included) is never served, and the reason is named."""
    _good_run(jp_root_dir)
    name, d = _run(jp_root_dir)
    _place(d, kind, jp_root_dir)
    await _check_run(get, name, served, problem)


@run_async
async def test_a_link_inside_the_run_is_served(get: Any, jp_root_dir: Path) -> None:
    """The control: a report or profiles/ that links to a file inside the same run is
    served like the file itself (symlinks are resolved, then checked)."""
    name, d = _run(jp_root_dir)
    (d / "profiles" / "8").mkdir()
    (d / "profiles" / "8" / "report.json").symlink_to("../1/report.json")
    code, body, _ = await get("runs", name, "profiles")
    assert [(p["name"], p["problem"]) for p in body["profiles"]] == [("1", None), ("8", None)]
    assert _served_rows(body["profiles"][1]) == reference_rows(_report("compute", "memory"))
    name2, d2 = _run(jp_root_dir)
    (d2 / "profiles").rename(d2 / "kept")
    (d2 / "profiles").symlink_to("kept", target_is_directory=True)
    code, body, _ = await get("runs", name2, "profiles")
    assert [(p["name"], p["problem"]) for p in body["profiles"]] == [("1", None)]


# the contents of tests/test_server_fuzz.py's hostile run.json kinds, as a report.json
_CONTENTS = [(f"run.json kind: {c[0]}", c[1]) for c in _RUN_JSON_FAULTS] + [
    (f"run.json contents {i}", c) for i, c in enumerate(
        [b"   ", b"[]", b"null", b"{", b"NaN", b'"x"', b"\xff\xfe\x00", b'{"a":' * 100_000,
         b"{}", b'{"rows": NaN, "verdict": Infinity}', b"\x00" * 100,
         b'{"rows": [{"name": "compute", "predicted": NaN, "measured": 1}]}',
         b'{"rows": [{"name": 5, "predicted": 1, "measured": 1}], "top_ops": 3}',
         b'{"rows": [{"name": "x", "predicted": 1e999, "measured": 1}], "mesh": [1]}',
         b'{"rows": ' + json.dumps([{"name": f"t{i}", "predicted": 1, "measured": 2}
                                     for i in range(5000)]).encode() + b"}",
         json.dumps({"rows": [{"name": "x" * 10_000, "predicted": 1, "measured": 2}],
                     "verdict": "v" * 100_000}).encode(),
         b'\xef\xbb\xbf{"rows": []}', '{"rows": []}'.encode("utf-16")])]


@pytest.mark.parametrize("contents", [c[1] for c in _CONTENTS], ids=[c[0] for c in _CONTENTS])
@run_async
async def test_hostile_report_contents(get: Any, jp_root_dir: Path, contents: bytes) -> None:
    """The run.json kinds of the server fuzz table, written as a report.json: served with
    the rows a plain reader finds, or with a problem and no rows; never a 500."""
    _good_run(jp_root_dir)
    name, d = _run(jp_root_dir)
    (d / "profiles" / "7").mkdir()
    (d / "profiles" / "7" / "report.json").write_bytes(
        b"" if contents == b"DIRECTORY" else contents)
    if contents == b"DIRECTORY":
        (d / "profiles" / "7" / "report.json").unlink()
        (d / "profiles" / "7" / "report.json").mkdir()
    code, body, raw = await get("runs", name, "profiles")
    assert code == 200, raw[:300]
    seven = body["profiles"][1]
    ref = None if contents == b"DIRECTORY" else reference_rows(contents)
    if ref is None:
        assert seven["rows"] == [] and seven["problem"], seven
    else:
        assert _served_rows(seven) == ref
        assert all(len(r["name"]) <= 200 for r in seven["rows"])
        assert len(seven["verdict"]) <= 2000
    await _check_good(get)


_REPORTS = st.one_of(
    st.builds(lambda rows, extra: json.dumps({"rows": rows, **extra}).encode(),
              st.lists(st.fixed_dictionaries({}, optional={
                  "name": _json_value, "predicted": _json_value, "measured": _json_value,
                  "kind": _json_value, "axes": _json_value, "count": _json_value}), max_size=5),
              st.dictionaries(st.sampled_from(["verdict", "mesh", "steps", "tokens_per_s",
                                               "top_ops", "plan_name", "calibrated"]),
                              _json_value, max_size=4)),
    _json_value.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(contents=_REPORTS)
def test_fuzz_random_reports_are_served_checked(get: Any, jp_root_dir: Path,
                                                jp_asyncio_loop: Any, contents: bytes) -> None:
    """Random report.json contents: 200, strict JSON, the reference reader's rows (or a
    problem and none), and the good profile beside it whole."""
    async def case() -> None:
        name, d = _run(jp_root_dir)
        (d / "profiles" / "7").mkdir()
        (d / "profiles" / "7" / "report.json").write_bytes(contents)
        code, body, raw = await get("runs", name, "profiles")
        assert code == 200, raw[:300]
        one, seven = body["profiles"]
        assert _served_rows(one) == reference_rows(_report("compute", "memory"))
        ref = reference_rows(contents)
        assert _served_rows(seven) == (ref or [])
        if ref is None:
            assert seven["problem"]

    jp_asyncio_loop.run_until_complete(case())


# ----------------------------------------------------------------------------- no starvation
@run_async
async def test_twenty_pipe_reports_starve_nothing(get: Any, jp_root_dir: Path) -> None:
    """About 13 requests for profiles whose report.json is a named pipe filled the executor
    and every endpoint hung (the issue): 20 at once all answer, with the pipe named, and the
    runs list and the good run's metrics answer beside them."""
    _good_run(jp_root_dir)
    names = []
    for _ in range(20):
        name, d = _run(jp_root_dir)
        _place(d, "a named pipe", jp_root_dir)
        names.append(name)
    t0 = time.monotonic()
    answers = await asyncio.gather(*(get("runs", n, "profiles") for n in names),
                                   _check_good(get))
    assert time.monotonic() - t0 < 15
    for code, body, raw in answers[:-1]:
        assert code == 200, raw[:300]
        assert "named pipe" in body["profiles"][1]["problem"]


@run_async
async def test_stalled_reads_answer_503_and_leave_the_rest_served(
        get: Any, jp_root_dir: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second wall: reads that stall (a file system that hangs: simulated by a report
    reader that waits) take at most the pool's workers; each such request answers 503
    naming what stalled after the read timeout; the runs list keeps answering; once the
    stall ends, everything is served again."""
    _good_run(jp_root_dir)
    await _check_good(get)
    name, _ = _run(jp_root_dir)
    release = threading.Event()
    real = profiles.read_profiles

    def stalled(run_dir: Any) -> Any:
        release.wait(30)
        return real(run_dir)

    monkeypatch.setattr(profiles, "read_profiles", stalled)
    t0 = time.monotonic()
    stuck = [asyncio.ensure_future(get("runs", name, "profiles")) for _ in range(6)]
    await asyncio.sleep(0.2)
    code, body, _ = await get("runs")       # the list answers while every worker is stuck
    assert code == 200 and {r["id"] for r in body["runs"]} >= {"good", name}
    code, _, raw = await get("runs", "good", "metrics")   # no worker free: 503, not a hang
    assert code == 503 and b"reading the metrics of run 'good'" in raw, raw[:300]
    for code, _, raw in await asyncio.gather(*stuck):
        assert code == 503 and f"reading the profiles of run {name!r}".encode() in raw
    assert time.monotonic() - t0 < 4 * READ_TIMEOUT + 5
    release.set()
    for _ in range(50):
        if hub.reads.running == 0:
            break
        await asyncio.sleep(0.1)
    assert hub.reads.running == 0
    monkeypatch.setattr(profiles, "read_profiles", real)
    code, body, _ = await get("runs", name, "profiles")
    assert code == 200 and [p["name"] for p in body["profiles"]] == ["1"]
    await _check_good(get)


# ----------------------------------------------------------------------------- the reader
@pytest.mark.parametrize("kind", ["a named pipe", "a link to /dev/zero", "a directory",
                                  "over 4 MiB", "a link out of the root"])
def test_the_safe_reader_refuses_without_blocking(tmp_path: Path, kind: str) -> None:
    """The reader alone: each kind is refused at once with the path named (a pipe is never
    waited on, /dev/zero never read)."""
    root = tmp_path / "root"
    root.mkdir()
    _, d = _run(root)
    _place(d, kind, root)
    path = d / "profiles" / "7" / "report.json"
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        _run_file.read_file(path, inside=d, max_bytes=profiles.MAX_BYTES)
    assert time.monotonic() - t0 < 2
    assert str(path) in str(e.value)
    assert _run_file.read_file(d / "profiles" / "1" / "report.json", inside=d,
                               max_bytes=profiles.MAX_BYTES) == _report("compute", "memory")


@pytest.mark.parametrize("kind", ["run.json", "metrics.jsonl"])
@run_async
async def test_run_files_linked_out_of_the_run_are_not_served(get: Any, jp_root_dir: Path,
                                                               kind: str) -> None:
    """run.json and metrics.jsonl that link to another run's files (inside the root) are
    refused like profiles/: the run is listed with the reason, the other run's steps and
    fields are never served as its own."""
    _good_run(jp_root_dir)
    name, d = _run(jp_root_dir)
    (d / kind).unlink()
    (d / kind).symlink_to(jp_root_dir / "good" / kind)
    code, detail, raw = await get("runs", name)
    assert code == 200, raw[:300]
    assert "outside the run directory" in detail["problem"]
    code, page, _ = await get("runs", name, "metrics")
    want = [] if kind == runs.METRICS else [1, 2, 3]
    assert code == 200 and page["columns"]["step"] == want
    if kind == runs.RUN_JSON:
        assert detail["status"] == "error"
    assert GOOD_STEPS not in page["columns"]["step"]
    await _check_good(get)
