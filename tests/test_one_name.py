"""One name per thing: every module has one path (the old ones raise
``ModuleNotFoundError``; no import turns a public function into a module), each public
object one public place, ``wb.plan`` / ``wb.search`` one way to pass each option, and a
run directory written before the old paths went still resumes.

References: Python's own import system in a fresh interpreter, the objects' own
``__module__``, ``inspect.signature``, and ``tests/old_paths_run`` (a run directory the code
before this change wrote, commit in its ``expected.json``; made by training the config to
step 2, copying the run directory, and training the original on to step 4).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import workbench as wb
from tests.test_public_api import PUBLIC_MODULES
from workbench._search.space import SearchOptions
from workbench.planning._options import PlanOptions

ROOT = Path(__file__).resolve().parents[1]
OLD_RUN = Path(__file__).parent / "old_paths_run"
TINY = wb.models.GPTConfig.preset("tiny")

#: A sample of the old paths ``workbench/_moved.py`` answered: its MOVED table (modules
#: moved to another package, private paths too) ...
MOVED_SAMPLE = ("workbench.planning.analytic", "workbench.planning.hlo", "workbench.models.hf",
                "workbench.models.hf_export", "workbench.train.export",
                "workbench.models.adapters", "workbench.models.generate",
                "workbench.models._generate", "workbench.perf._hlo", "workbench.mesh",
                "workbench._rules", "workbench.tracing", "workbench.planning.search",
                "workbench.planning._search_space", "workbench.planning.search_result")
#: ... and modules made private in place (``workbench.<pkg>.<name>`` for ``<pkg>/_<name>.py``).
PRIVATE_IN_PLACE = ("workbench.step", "workbench.flops", "workbench.generate",
                    "workbench.perf.predict", "workbench.perf.calibrate",
                    "workbench.data.tokenizer", "workbench.train.trainer",
                    "workbench.hardware.catalogue", "workbench.planning.stages")


def _python(code: str, *args: str) -> str:
    """stdout of ``code`` run in a fresh interpreter (the import system's own answer)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("kind, paths", [("moved", MOVED_SAMPLE),
                                         ("private in place", PRIVATE_IN_PLACE)])
def test_old_module_paths_are_not_found(kind, paths):
    """Each old path is a ModuleNotFoundError naming it, while its new module exists (so
    the path is really gone, not mistyped here)."""
    said = json.loads(_python("""
        import importlib, importlib.util, json, sys
        said = {}
        for old in sys.argv[1:]:
            try:
                importlib.import_module(old)
            except ModuleNotFoundError as e:
                said[old] = e.name
            else:
                said[old] = "imported"
        print(json.dumps(said))
    """, *paths))
    assert all(old.startswith(said[old]) for old in paths), said
    for old in PRIVATE_IN_PLACE if kind == "private in place" else ():
        parent, _, name = old.rpartition(".")
        assert (ROOT / parent.replace(".", "/") / f"_{name}.py").exists() or \
            (ROOT / parent.replace(".", "/") / f"_{name}").is_dir(), f"{old}: no _{name} there"


def test_importing_an_old_path_leaves_the_public_functions_functions():
    """The two reproduced cases: ``import workbench.generate`` and ``from
    workbench.perf.predict import predict`` fail, and ``wb.generate`` / ``wb.perf.predict``
    are still the functions (before, each became a module)."""
    out = _python("""
        import types, workbench as wb
        for line in ("import workbench.generate",
                     "from workbench.perf.predict import predict"):
            try:
                exec(line)
            except ModuleNotFoundError as e:
                print(e.name)
        import workbench.perf
        print(type(wb.generate).__name__, wb.generate.__module__)
        print(type(wb.perf.predict).__name__, wb.perf.predict.__module__)
    """).split()
    assert out == ["workbench.generate", "workbench.perf.predict",
                   "function", "workbench._generate", "function", "workbench.perf._predict"]


def test_no_public_name_that_is_not_a_module_imports_as_one():
    """For every public module and every name of its ``__all__`` that is not a module,
    ``import <module>.<name>`` is a ModuleNotFoundError, and the name is still the object
    it was (nothing imported can replace it)."""
    out = json.loads(_python("""
        import importlib, json, sys, types
        bad = []
        for module in sys.argv[1:]:
            mod = importlib.import_module(module)
            for name in mod.__all__:
                before = getattr(mod, name)
                if isinstance(before, types.ModuleType):
                    continue
                try:
                    importlib.import_module(f"{module}.{name}")
                    bad.append(f"{module}.{name} imports")
                except ModuleNotFoundError:
                    pass
                if getattr(mod, name) is not before:
                    bad.append(f"{module}.{name} was replaced")
        print(json.dumps(bad))
    """, *PUBLIC_MODULES))
    assert out == []


def test_importing_workbench_leaves_the_import_system_as_it_was():
    """``import workbench`` changes neither ``sys.meta_path`` nor ``sys.path_hooks``; after
    its packages (and the libraries they import, absl's finder among them), no finder
    there is Workbench's."""
    out = _python("""
        import sys
        before = list(sys.meta_path), list(sys.path_hooks)
        import workbench
        print(before == (list(sys.meta_path), list(sys.path_hooks)))
        import workbench.planning, workbench.perf, workbench.hardware, workbench.train
        print([type(f).__module__ for f in sys.meta_path + sys.path_hooks
               if getattr(type(f), "__module__", "").startswith("workbench")
               or getattr(f, "__module__", "").startswith("workbench")])
    """)
    assert out.split() == ["True", "[]"]


def test_the_old_data_names_are_gone():
    for old, new in (("dataset", "grain_dataset"), ("data_spec", "as_spec")):
        with pytest.raises(AttributeError, match=old):
            getattr(wb.data, old)
        assert callable(getattr(wb.data, new))


def _public_places(obj: object) -> list[str]:
    """The public modules whose ``__all__`` names ``obj``."""
    mods = [importlib.import_module(m) for m in PUBLIC_MODULES]
    return [m.__name__ for m in mods if any(getattr(m, n) is obj for n in m.__all__)]


@pytest.mark.parametrize("name, place, defined_in", [
    ("calibrate", "workbench", "workbench.perf._calibrate"),
    ("remove_calibration", "workbench", "workbench.hardware._calibration"),
    ("Calibration", "workbench.hardware", "workbench.hardware._calibration"),
])
def test_each_calibration_name_has_one_public_place(name, place, defined_in):
    """``wb.calibrate`` and ``wb.remove_calibration`` (the verbs a user types, as the docs
    and notebooks do), ``wb.hardware.Calibration`` (beside ``load_calibration`` and the
    effective spec that reads it): each the object its module defines, public nowhere else."""
    obj = getattr(importlib.import_module(defined_in), name)
    assert obj.__module__ == defined_in
    assert _public_places(obj) == [place]


def _module_paths(text: str) -> set[str]:
    return set(re.findall(r"\bworkbench(?:\.[A-Za-z_]\w*)+", text))


def test_the_saved_run_names_no_module_path_that_is_gone():
    """What a run directory stores (run.json, metrics, Orbax's metadata with its handlers'
    module paths, Grain's state): every module path it names still imports."""
    named: set[str] = set()
    for f in (OLD_RUN / "run").rglob("*"):
        if f.is_file():
            text = f.read_bytes().decode("utf-8", "ignore")
            named |= _module_paths(text)
            named |= set(re.findall(r'"((?:orbax|grain)(?:\.\w+)+)\.[A-Z]\w*"', text))
    assert any(n.startswith("orbax.") for n in named)   # the handlers are read at all
    for module in named:
        importlib.import_module(module)


@pytest.mark.slow
def test_a_run_saved_before_the_old_paths_went_resumes(tmp_path):
    """The saved run restores at step 2 and trains on to the losses its uninterrupted run
    logged: bitwise under the same JAX and XLA flags, else to float32 rounding grown by
    Adam's normalised updates (test_fast_init's tolerance)."""
    expected = json.loads((OLD_RUN / "expected.json").read_text())
    run_dir = tmp_path / "run"
    shutil.copytree(OLD_RUN / "run", run_dir)
    tr = wb.Trainer(wb.TrainConfig.from_dict(expected["config"]), run_dir=run_dir,
                    progress=None)
    assert tr.step == 2
    tr.run(steps=4)
    tr.close()
    assert tr.losses[:2] == expected["losses"][:2]   # the history it had
    if (jax.__version__, os.environ.get("XLA_FLAGS")) == (expected["jax"], expected["xla_flags"]):
        assert tr.losses[2:] == expected["losses"][2:]
    else:
        np.testing.assert_allclose(tr.losses[2:], expected["losses"][2:], rtol=1e-3)


# --- one way to pass each option: wb.plan's and wb.search's real signatures -------------------

def _keywords(fn) -> dict[str, object]:
    """``{name: default}`` of ``fn``'s keyword parameters (inspect: what an editor shows)."""
    params = inspect.signature(fn).parameters.values()
    assert not [p for p in params if p.kind is p.VAR_KEYWORD], f"{fn.__name__} has **keywords"
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


def _defaults(cls) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_plan_and_search_show_every_option_in_their_signatures():
    """Each option is a keyword of its own with the record's default (``PlanOptions``,
    ``SearchOptions``), and ``options=`` is gone; ``wb.PlanOptions`` is not public."""
    plan, search = _keywords(wb.plan), _keywords(wb.search)
    assert "options" not in plan and "options" not in search
    assert _defaults(PlanOptions).items() <= plan.items()
    assert set(plan) - set(_defaults(PlanOptions)) == {"mesh", "rules", "batch", "seq", "wait"}
    searched = {k: v for k, v in _defaults(PlanOptions).items()
                if k not in ("name", "compile", "pipeline", "overlap")}
    assert searched.items() <= search.items()
    assert _defaults(SearchOptions).items() <= search.items()
    assert "name" not in search and "compile" not in search
    assert not hasattr(wb, "PlanOptions") and "PlanOptions" not in wb.planning.__all__


@pytest.mark.parametrize("call", [
    lambda: wb.plan(TINY, batch=8, optimiser=optax.sgd(1e-2)),
    lambda: wb.plan(TINY, batch=8, options={"progress": False}),
    lambda: wb.search(TINY, "v5p-8", batch=8, strategy="dp"),
    lambda: wb.search(TINY, "v5p-8", batch=8, compile=False),
], ids=["plan-optimiser", "plan-options", "search-strategy", "search-compile"])
def test_a_wrong_keyword_is_pythons_type_error_naming_it(call):
    with pytest.raises(TypeError, match=r"got an unexpected keyword argument '(optimiser|"
                                        r"options|strategy|compile)'"):
        call()


@pytest.mark.parametrize("fn, args", [(wb.plan, ()), (wb.search, ("v5p-8",))],
                         ids=["plan", "search"])
def test_a_flag_that_is_not_a_bool_names_itself(fn, args):
    with pytest.raises(TypeError, match=r"progress='no' must be True or False.*progress=False"):
        fn(TINY, *args, batch=8, progress="no")


def test_each_keyword_reaches_the_plan():
    """A hand count: SGD keeps no optimizer state, AdamW two float32 moments per parameter
    (the default plan's optimizer memory is twice its parameter memory)."""
    mesh = wb.abstract_mesh("v5p-8", data=4)
    kw = dict(mesh=mesh, rules="fsdp", batch=8, seq=64, compile=False, progress=False)
    sgd = wb.plan(TINY, optimizer=optax.sgd(1e-2), name="sgd", memory_limit=2**30, **kw)
    adam = wb.plan(TINY, **kw)
    assert (sgd.memory["optimizer"], sgd.memory["limit"], sgd.report.name) == (0, 2**30, "sgd")
    assert adam.memory["optimizer"] > 2 * adam.memory["params"] * 0.99


def test_search_hands_its_plan_keywords_to_every_candidate():
    kw = dict(batch=8, seq=64, strategies=("dp", "fsdp"), remat=("none",), top_k=0,
              progress=False)
    sgd = wb.search(TINY, "v5p-8", optimizer=optax.sgd(1e-2), **kw)
    adam = wb.search(TINY, "v5p-8", **kw)
    assert sgd.plans and all(p.memory["optimizer"] == 0 for p in sgd.plans.values())
    assert all(p.memory["optimizer"] > 0 for p in adam.plans.values())
    assert sorted(r["layout"] for r in sgd.rows) == sorted(r["layout"] for r in adam.rows)
