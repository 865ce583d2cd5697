"""A fuzzer over the whole public API (issue 44, item 7): every public callable, each argument
given hostile values (the wrong type, None, NaN/inf, negative, zero, huge, empty, strings
with newlines), the others valid. Every call works, or raises a Workbench error naming the
argument; nothing hangs; nothing is written outside the sandbox's run folder.

The surface is walked, not listed: ``workbench.__all__`` and the ``__all__`` of each module
it exports (``wb.data``, ``wb.hf``, ``wb.models``, ``wb.train``, ``wb.runs``). A public name added
later is fuzzed once it has a recipe (valid base arguments, ``tests/_api_fuzz_worker.py``)
or is exempt below with the reason; otherwise ``test_every_public_callable_is_fuzzed``
fails and says which to add. A class whose instances have an entry point of their own
(``TrainConfig.check``, which reads the files a config names) has it called on every
instance a fuzzed call made (``THEN`` in the worker), so hostile values reach it too.

What a call may do (the rule the fuzzer checks, one call at a time):

- return (a result that starts something, a job or a trainer, is stopped and closed); or
- raise an error of Workbench's: an instance of ValueError or TypeError, or of a class
  defined in a ``workbench`` module, (a) raised by a frame of Workbench's own code (the
  innermost frame of the traceback lies under ``workbench/``: a raw exception from NumPy,
  JAX or the standard library is raised in their frames, or in a C function called from
  Workbench's frame with their message, hence also (b)), whose message (b) names the
  argument: its name as a whole word (for ``**kwargs``, the key given);
- and finish within CALL_TIMEOUT seconds (a hang kills the worker process: reported);
- and write nothing outside the run folder (the worker's cwd), the caches and the
  calibration folder the environment points at: no new file under HOME (a sandbox
  folder), none left in TMPDIR after the call, no new entry beside those folders (and the
  checkout's ``git status`` is unchanged at the end of the session: conftest checks it).

Calls run in one worker process (tests/_api_fuzz_worker.py), started with cwd, HOME, TMPDIR,
XDG folders, WORKBENCH_CACHE, WORKBENCH_CALIBRATION and HF_HOME in a temporary sandbox, and
``HF_HUB_OFFLINE=1`` (a test never reaches the network: a string given as ``from_hf``'s path
is then looked up in the empty sandbox cache). Hypothesis draws (argument, kind, value) with
a fixed seed (``derandomize``, seeded by the drawing function's source): EXAMPLES calls per
callable.

Beyond one argument at a time (issue 56 item 10): ``test_arguments_hostile_together`` gives
2 or 3 arguments hostile values at once (COMBINATIONS calls per callable; the message names
one of them); ``test_calls_after_hostile_edits_of_what_calls_wrote`` lets a call write its
files (a run directory, a trained run, a TPU plan's cache record, a token cache), edits one
(``worker.EDITS``: truncated, garbage, empty, a directory, a FIFO, negative numbers, numbers
as strings), then calls each public reader of them (``worker.TARGETS``): it works (a cache
answers as from the files as written) or raises a Workbench error naming the file, within
FILES_TIMEOUT, and no other saved file of the run is removed or cut.

``WORKBENCH_FUZZ_COLLECT=1`` records every failure instead of stopping at the first, and
``WORKBENCH_FUZZ_REPORT=<file>`` writes the counts and failures as JSON (the numbers of
issue 44's closing note). Issue 56's numbers (one process, 2 shared cores): 90 callables,
1,069 single calls + 512 combinations + 167 file cases: ~36 s of CPU, 42-65 s wall (one
argument at a time alone, before: 1,057 calls, ~23 s of CPU, 30 s wall). Found while it
grew: RunWriter on a metrics.jsonl that is a directory (raw error) or a FIFO (hung), wb.show({})
and from_nnx(config=nan) naming no argument: fixed (``tests/test_hostile_fuzz_finds.py``);
run at 06:09 (after the other parts): 6 failures; at 06:15: 4 (wb.search's hardware= and
mesh_shapes=; FileNotFoundError from resolve_run and from_hf, left to their owners).
"""
from __future__ import annotations

import inspect
import json
import math
import os
import re
import select
import subprocess
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import _api_fuzz_worker as worker
import workbench as wb
import workbench._sharding.placement as placement
import workbench.perf as perf
from _api_fuzz_worker import Opaque

#: ~36 s of CPU in one worker process (`make test`; `make test-fast` leaves it out).
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
REPO = Path(__file__).resolve().parents[1]
#: Hypothesis examples (calls) per callable; a hang is reported after CALL_TIMEOUT seconds
#: (a first call may compile: a tiny Trainer's step is ~10 s on one loaded core).
EXAMPLES = int(os.environ.get("WORKBENCH_FUZZ_EXAMPLES", "12"))
CALL_TIMEOUT = 90.0
#: Calls per callable with several arguments hostile at once (2 or 3 of them).
COMBINATIONS = int(os.environ.get("WORKBENCH_FUZZ_COMBINATIONS", "8"))
#: A call after an edit of the files an earlier one wrote (a compile at most) answers within:
FILES_TIMEOUT = 60.0
COLLECT = os.environ.get("WORKBENCH_FUZZ_COLLECT") == "1"


# --- the surface --------------------------------------------------------------------------------

#: Documented modules outside ``wb.*`` whose functions are fuzzed too, as ``wb.<module>.<name>``:
#: ``workbench._sharding.placement`` (the one default mesh and rules, issue 46).
#: ``workbench.perf.fit_collectives`` too (issue 48: the collective model fitted to profiles),
#: and the predictors with their cost record (issue 60: ``predict(StepCost, spec)``,
#: ``predict_plan(report, spec)``); the module's other names are formulas and result types,
#: kept off the surface.
_PERF = ("fit_collectives", "predict", "predict_plan", "StepCost")
EXTRA_MODULES: list[tuple[str, Any]] = [
    ("wb._sharding.placement", placement),
    ("wb.perf", types.SimpleNamespace(__all__=list(_PERF),
                                      **{n: getattr(perf, n) for n in _PERF}))]


def walk_surface() -> dict[str, Any]:
    """Every public callable: dotted name -> object, each object once (under the first
    name found: ``wb.TrainConfig``, not ``wb.train.TrainConfig``). Exception classes and
    constants (``PRESETS``, ``DataSpec``'s union) are not calls and are left out."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    todo: list[tuple[str, Any]] = [("wb", wb), *EXTRA_MODULES]
    while todo:
        prefix, module = todo.pop(0)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if isinstance(obj, types.ModuleType):
                todo.append((f"{prefix}.{attr}", obj))
            elif (callable(obj) and not isinstance(obj, types.UnionType)
                  and not (isinstance(obj, type) and issubclass(obj, BaseException))
                  and id(obj) not in seen):
                seen.add(id(obj))
                out[f"{prefix}.{attr}"] = obj
    return out


SURFACE = walk_surface()

#: Public callables not fuzzed, each with the reason.
EXEMPT: dict[str, str] = {
    "wb.Plan": "a result type, made by wb.plan from compiled internals; users never build one",
    "wb.SearchResult": "a result type, made by wb.search",
    "wb.Job": "a result type, made by wb.launch / wb.attach around started processes",
    "wb.MeshInfo": "a result type (wb.show's description of a mesh), made by the mesh code",
    "wb.Layout": "a result type, made by wb.layout (which is fuzzed)",
    "wb.DeviceInfo": "a result type, one row of wb.devices() (which is fuzzed)",
    "wb.hf.HFSource": "a result type: where wb.hf.from_hf's model came from (model.hf_source)",
    "wb._sharding.placement.Placement": "a result type, made by resolve_placement (fuzzed)",
}

#: Other names a message may give an argument by: (function, argument) -> names.
ALIASES: dict[tuple[str, str], tuple[str, ...]] = {
    ("wb.layout", "x"): ("shape",),   # x is the shape: an element is named shape[i]
}

# --- hostile values -----------------------------------------------------------------------------

def _with_newline(parts: list[str]) -> str:
    return "\n".join(parts) if len(parts) > 1 else parts[0] + "\n"


_TEXT = st.text(alphabet=st.sampled_from("ab $`'\";|\x00\ud800é"), max_size=6)
KINDS: dict[str, st.SearchStrategy[Any]] = {
    "none": st.just(None),
    "nan": st.just(math.nan),
    "inf": st.sampled_from([math.inf, -math.inf]),
    "negative": st.integers(-2**70, -1) | st.floats(-1e30, -1e-6),
    "zero": st.sampled_from([0, 0.0]),
    "huge": st.integers(10**9, 10**30) | st.just(1e300),
    "fraction": st.floats(0.01, 1e4).filter(lambda x: not x.is_integer()),
    "bool": st.booleans(),
    "empty": st.sampled_from(["", [], (), {}]),
    "newline": st.lists(_TEXT, min_size=1, max_size=3).map(_with_newline),
    "wrong_type": st.sampled_from([Opaque(), b"\x00\xff", "bogus", [None], {"bogus": None},
                                   1j, [Opaque()]]),
    # bool-like strings: truthy all, so a flag that takes one reads "no" as yes
    "truthy_string": st.sampled_from(["no", "false", "0", "yes", "True"]),
}


def _flag_taken(name: str, hostile: dict[str, tuple[str, Any]], ok: bool) -> str | None:
    """A bool argument (annotated ``bool``) that took a bool-like string without an error."""
    try:
        params = inspect.signature(SURFACE[name]).parameters
    except (TypeError, ValueError):
        return None
    flags = [p for p, (kind, _) in hostile.items() if kind == "truthy_string" and p in params
             and str(params[p].annotation).split("|")[0].strip() == "bool"]
    return f"the flag {flags[0]}= took the string {hostile[flags[0]][1]!r}" if ok and flags \
        else None


# --- the worker ---------------------------------------------------------------------------------

class Worker:
    """The worker process and its sandbox; restarted after a hang or a crash."""

    def __init__(self, root: Path) -> None:
        self.root, self.sandbox = root, root / "sandbox"
        for sub in ("run", "home", "tmp", "cache", "calibration", "hf"):
            (self.sandbox / sub).mkdir(parents=True, exist_ok=True)
        self.allowed_top = set(os.listdir(self.sandbox)) | {"fixtures"}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(root / "worker.log", "ab")

    def env(self) -> dict[str, str]:
        s = self.sandbox
        return dict(os.environ, WORKBENCH_FUZZ_SANDBOX=str(s), HOME=str(s / "home"),
                    TMPDIR=str(s / "tmp"), XDG_CACHE_HOME=str(s / "home" / ".cache"),
                    XDG_CONFIG_HOME=str(s / "home" / ".config"), WORKBENCH_CACHE=str(s / "cache"),
                    WORKBENCH_CALIBRATION=str(s / "calibration"), HF_HOME=str(s / "hf"),
                    HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu",
                    PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import _api_fuzz_worker as w; w.main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            cwd=self.sandbox / "run", env=self.env())
        ready = self._read(120.0)
        assert ready == {"ready": True}, f"the fuzz worker did not start: {ready}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _read(self, timeout: float) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        try:
            return worker.receive(self.proc.stdout)
        except (EOFError, OSError):
            return {"died": self.proc.wait()}

    def call(self, name: str, hostile: dict[str, Any]) -> dict[str, Any]:
        """``name`` called with the arguments in ``hostile`` replaced (none, one or several)."""
        return self.request(("call", name, hostile), CALL_TIMEOUT)

    def files(self, case: tuple[str, str, str, str]) -> dict[str, Any]:
        """A target's files written, one edited, then read: ``worker.file_cases()``' row."""
        return self.request(("files", *case), FILES_TIMEOUT)

    def request(self, message: tuple[Any, ...], timeout: float) -> dict[str, Any]:
        if self.proc is None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        worker.send(self.proc.stdin, message)
        started = time.monotonic()
        out = self._read(timeout)
        if out is None:
            self.stop()
            return {"hang": round(time.monotonic() - started, 1)}
        if "died" in out:
            self.proc = None
        return out


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("api-fuzz"))
    yield w
    w.stop()
    w.log.close()
    if os.environ.get("WORKBENCH_FUZZ_REPORT"):
        Path(os.environ["WORKBENCH_FUZZ_REPORT"]).write_text(json.dumps(STATS, indent=1,
                                                                        default=repr))


STATS: dict[str, Any] = {"calls": 0, "combination_calls": 0, "file_calls": 0,
                         "functions": [], "failures": [], "seconds": {}}


# --- the rule -----------------------------------------------------------------------------------

def names_argument(message: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def judge(out: dict[str, Any], function: str, hostile: Sequence[str]) -> str | None:
    """What is wrong with one call's outcome (None: nothing); ``hostile``: the parameters
    given hostile values (the message names one of them)."""
    arguments = [_argument_name(function, param) for param in hostile]
    names = [n for a in arguments for n in (a, *ALIASES.get((function, a), ()))]
    return _outcome(out) or _message(out, names, " or ".join(map(repr, arguments)))


def _outcome(out: dict[str, Any]) -> str | None:
    """What is wrong with an outcome whatever the call: a hang, a crash, files written
    outside, saved files lost, an answer other than the reference's, a raw exception."""
    if "hang" in out:
        return f"no answer after {out['hang']} s (a hang)"
    if "died" in out:
        return f"the worker process died (exit status {out['died']})"
    if "setup" in out:
        return f"the recipe's base arguments failed:\n{out['setup']}"
    files = [f"wrote {where}: {out[key]}" for key, where in (
        ("new_top", "beside the run folder"), ("new_home", "under HOME"),
        ("tmp_left", "to TMPDIR and left it"), ("changed_cwd", "the cwd (os.chdir)"))
        if out.get(key)]
    if files:
        return "; ".join(files)
    if out.get("lost"):
        return "saved data lost: " + "; ".join(out["lost"])
    if out.get("differs"):
        return f"it answered otherwise than from the files as written: {out['differs']}"
    if out["ok"]:
        return None
    raw = _raw(out)
    if not (out["value_or_type_error"] or out["workbench_class"]):
        return f"a raw {raw}"
    if not out["in_workbench"]:
        return f"raised outside Workbench's code: {raw}"
    return None


def _raw(out: dict[str, Any]) -> str:
    return f"{out['type']}: {out['message'][:600]} (raised at {out['frame']})"


def _message(out: dict[str, Any], names: Sequence[str], what: str) -> str | None:
    """What is wrong with an error's message: it names none of ``names`` (none given:
    any message will do)."""
    if out["ok"] or not names or any(names_argument(out["message"], n) for n in names):
        return None
    return f"the message does not name {what}: {_raw(out)}"


def _argument_name(name: str, param: str | None) -> str | None:
    """The name the message must give: the parameter, or the key of a ``**kwargs`` one."""
    if param is None:
        return None
    kinds = dict(worker.parameters(name, SURFACE[name]))
    if kinds.get(param) == "var_keyword":
        return worker.fuzz_key(worker.RECIPES[name](_NoFixtures()), param)
    return param


class _NoFixtures:
    """Fixtures as seen from the test process: only the recipes' keys matter here."""

    def __getattr__(self, name: str) -> Any:
        return None

    def fresh(self, stem: str) -> str:
        return stem


# --- the tests ----------------------------------------------------------------------------------

def test_every_public_callable_is_fuzzed():
    missing = sorted(set(SURFACE) - set(worker.RECIPES) - set(EXEMPT))
    assert not missing, (
        f"public callables without a fuzz recipe: {missing}; add valid base arguments for each "
        "to RECIPES in tests/_api_fuzz_worker.py (or, for a result type users never build, "
        "an EXEMPT row with the reason in tests/test_api_fuzz.py)")
    stale = sorted((set(worker.RECIPES) | set(EXEMPT)) - set(SURFACE))
    assert not stale, f"recipes or exemptions for names that are not public (any more): {stale}"
    assert not set(worker.RECIPES) & set(EXEMPT)


FUZZED = sorted(set(SURFACE) - set(EXEMPT))


class _Calls:
    """The calls one test makes of one callable, and the problems they showed."""

    def __init__(self, name: str, fuzz: Worker, counter: str) -> None:
        if name not in worker.RECIPES:
            pytest.fail(f"{name} has no recipe (see test_every_public_callable_is_fuzzed)")
        self.name, self.fuzz, self.counter = name, fuzz, counter
        self.params = [p for p, _ in worker.parameters(name, SURFACE[name])]
        self.problems: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def __call__(self, hostile: dict[str, tuple[str, Any]]) -> None:
        """One call, ``hostile``: parameter -> (kind, value)."""
        STATS[self.counter] += 1
        out = self.fuzz.call(self.name, {p: v for p, (_, v) in hostile.items()})
        problem = judge(out, self.name, list(hostile)) or _flag_taken(self.name, hostile,
                                                                      out.get("ok", False))
        if problem is None:
            return
        given = ", ".join(f"{p}={v!r}" for p, (_, v) in hostile.items())
        row = {"function": self.name, "argument": ", ".join(hostile) or None,
               "kind": ", ".join(k for k, _ in hostile.values()) or None,
               "value": ", ".join(repr(v) for _, v in hostile.values()),
               "problem": problem, "traceback": out.get("traceback", "")[-1500:]}
        if COLLECT:
            if not any(p["argument"] == row["argument"] and p["kind"] == row["kind"]
                       for p in self.problems):
                self.problems.append(row)
            return
        raise AssertionError(f"{self.name}({given}): {problem}\n{row['traceback']}")

    def finish(self, label: str) -> None:
        STATS["failures"] += self.problems
        STATS["seconds"][label] = round(time.monotonic() - self.started, 1)
        assert not self.problems, json.dumps(self.problems, indent=1)


def _derandomized(examples: int) -> Any:
    """Hypothesis, ``examples`` draws from a fixed seed (the same calls on every run)."""
    def decorate(test: Any) -> Any:
        return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                        phases=[Phase.generate, Phase.shrink], report_multiple_bugs=False,
                        suppress_health_check=list(HealthCheck))(given(data=st.data())(test))
    return decorate


@pytest.mark.parametrize("name", FUZZED)
def test_every_call_works_or_names_its_argument(name, fuzz):
    calls = _Calls(name, fuzz, "calls")
    if not calls.params:
        calls({})
    else:
        @_derandomized(EXAMPLES)
        def draw(data: st.DataObject) -> None:
            param = data.draw(st.sampled_from(calls.params), label="argument")
            kind = data.draw(st.sampled_from(sorted(KINDS)), label="kind")
            calls({param: (kind, data.draw(KINDS[kind], label="value"))})

        draw()
    STATS["functions"].append(name)
    calls.finish(name)


TOGETHER = [n for n in FUZZED if len(worker.parameters(n, SURFACE[n])) >= 2]


@pytest.mark.parametrize("name", TOGETHER)
def test_arguments_hostile_together(name, fuzz):
    """Two or three arguments hostile at once (COMBINATIONS calls per callable, drawn as the
    single ones): the call works or raises an error naming one of them."""
    calls = _Calls(name, fuzz, "combination_calls")

    @_derandomized(COMBINATIONS)
    def draw(data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(calls.params), min_size=2, max_size=3,
                                    unique=True), label="arguments")
        hostile = {}
        for param in chosen:
            kind = data.draw(st.sampled_from(sorted(KINDS)), label=f"kind of {param}")
            hostile[param] = (kind, data.draw(KINDS[kind], label=param))
        calls(hostile)

    draw()
    calls.finish(f"{name} (together)")


@pytest.mark.parametrize("target", list(worker.TARGETS))
def test_calls_after_hostile_edits_of_what_calls_wrote(target, fuzz):
    """A run directory, a trained run, a plan-cache record and a token cache as a call
    wrote them; one file edited (truncated, garbage, empty, a directory, a FIFO, negative
    numbers, numbers as strings: ``worker.EDITS``); then each call that reads it
    (``worker.TARGETS``). It works (a cache answers as from the files as written) or
    raises a Workbench error naming the file; it never hangs, and nothing else saved in a
    run directory is removed or cut."""
    started, problems = time.monotonic(), []
    for case in [c for c in worker.file_cases() if c[0] == target]:
        STATS["file_calls"] += 1
        out = fuzz.files(case)
        names = [n for n in (out.get("file"), out.get("folder")) if n]
        problem = _outcome(out) or _message(out, names, f"the file it read ({case[1]})")
        if problem is None:
            continue
        row = {"function": case[3], "argument": f"{target}: {case[1]}", "kind": case[2],
               "value": None, "problem": problem, "traceback": out.get("traceback", "")[-1500:]}
        if not COLLECT:
            raise AssertionError(f"{case[3]} after {case[1]} of the {target} was made "
                                 f"{case[2]}: {problem}\n{row['traceback']}")
        problems.append(row)
    STATS["failures"] += problems
    STATS["seconds"][f"files: {target}"] = round(time.monotonic() - started, 1)
    assert not problems, json.dumps(problems, indent=1)
