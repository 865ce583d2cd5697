"""Importing any workbench module changes nothing: environment, JAX config, logging, backends.

Reference: the interpreter's own state before the imports. A fresh interpreter imports
JAX (so its config and backend registry exist to compare) and the third-party modules
that the package's imports load (found by a first interpreter; their own import-time
habits, such as orbax's absl logging calling ``logging.basicConfig``, are theirs), records
the state, imports every module of the package (``pkgutil.walk_packages``: core, widgets,
server, exercises), and records it again; the two records must be equal. Starting a
backend, setting an environment variable or a JAX option, adding a logging handler or a
warnings filter, or loading a backend plugin at import time would each show up as a
difference.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Modules a backend is made of: never imported ahead, so a workbench module that loads
#: one shows up.
BACKEND_ROOTS = ("libtpu", "jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin",
                 "jax_rocm60_plugin", "jax_rocm7_plugin")

DISCOVER = r"""
import importlib, json, pkgutil, sys
import jax
before = list(sys.modules)
import workbench
for m in ["workbench"] + sorted(m.name for m in pkgutil.walk_packages(workbench.__path__,
                                                                       "workbench.")):
    importlib.import_module(m)
seen = set(before)
print(json.dumps([m for m in sys.modules if m not in seen]))
"""

SNAPSHOT = r"""
import importlib, json, logging, os, sys, warnings
import jax
from jax._src import xla_bridge

BACKEND_ROOTS = %r
for dep in json.loads(sys.argv[1]):   # the dependencies' own import-time effects first
    if dep.split(".")[0] not in BACKEND_ROOTS + ("workbench",) and dep != "__main__":
        try:
            importlib.import_module(dep)
        except Exception:   # private or platform-specific submodules: imported as needed
            pass

def snapshot():
    every = {**logging.Logger.manager.loggerDict, "<root>": logging.root}
    handlers = {name: [type(h).__name__ for h in getattr(lg, "handlers", [])]
                for name, lg in every.items()}
    levels = {name: [getattr(lg, "level", 0), getattr(lg, "disabled", False)]
              for name, lg in every.items()}
    factories = {name: repr(getattr(reg, "factory", reg))
                 for name, reg in xla_bridge._backend_factories.items()}
    return {
        "environ": dict(os.environ),
        "jax_config": {k: repr(v) for k, v in jax.config.values.items()},
        "loggers": {k: v for k, v in handlers.items() if v or k == "<root>"},
        "logger_levels": {k: v for k, v in levels.items() if any(v) or k == "<root>"},
        "warnings_filters": [repr(f) for f in warnings.filters],
        "backends_started": xla_bridge.backends_are_initialized(),
        "backend_factories": factories,
        "backend_modules": sorted(m for m in sys.modules
                                  if m.split(".")[0] in BACKEND_ROOTS),
        "jax_platforms": os.environ.get("JAX_PLATFORMS"),
    }

before = snapshot()
import pkgutil, workbench
names = ["workbench"] + sorted(m.name for m in pkgutil.walk_packages(workbench.__path__, "workbench."))
imported = []
for name in names:
    importlib.import_module(name)
    imported.append(name)
after = snapshot()
print(json.dumps({"before": before, "after": after, "imported": imported}))
""" % (BACKEND_ROOTS,)


def _python(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def record() -> dict:
    dependencies = _python(DISCOVER)
    return json.loads(_python(SNAPSHOT, dependencies))


@pytest.mark.slow
def test_every_module_is_imported(record):
    imported = set(record["imported"])
    for name in ("workbench._sharding.tracing", "workbench.models._gpt", "workbench.models._layers",
                 "workbench.planning", "workbench.train", "workbench.jobs",
                 "workbench.widgets", "workbench.server", "workbench.__main__"):
        assert name in imported, name


@pytest.mark.parametrize("part", ["environ", "jax_config", "loggers", "logger_levels",
                                  "warnings_filters", "backends_started",
                                  "backend_factories", "backend_modules", "jax_platforms"])
@pytest.mark.slow
def test_importing_the_package_changes_nothing(record, part):
    before, after = record["before"][part], record["after"][part]
    if isinstance(before, dict):
        changed = {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                   if before.get(k) != after.get(k)}
        assert not changed, f"importing workbench changed {part}: {changed}"
    else:
        assert before == after, f"importing workbench changed {part}: {before} -> {after}"
