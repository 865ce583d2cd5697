"""libtpu is quieted only where needed: a fresh interpreter imports every module of the
package and neither JAX's backend table nor the environment changes; the entry points
that need it (a TPU plan, ``wb.devices``) quiet libtpu, once."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from workbench.hardware import libtpu_installed

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "workbench"


def _modules() -> list[str]:
    """Every module of the package (``__main__`` is the CLI entry point: it runs when run,
    and is imported too; the lab extension is not Python)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if "labextension" in rel.parts:
            continue
        parts = list(rel.parts)
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


_CHECK = """
import importlib, os, sys
from jax._src import xla_bridge
def snapshot():
    reg = xla_bridge._backend_factories.get("tpu")
    return (None if reg is None else reg.factory), dict(os.environ)
before = snapshot()
for name in {modules!r}:
    importlib.import_module(name)
after = snapshot()
assert after[0] is before[0], "importing workbench replaced JAX's TPU backend factory"
changed = {{k for k in set(before[1]) | set(after[1]) if before[1].get(k) != after[1].get(k)}}
assert not changed, f"importing workbench changed the environment: {{sorted(changed)}}"
assert not xla_bridge.backends_are_initialized(), "importing workbench started JAX"
import workbench as wb
cfg = wb.models.GPTConfig.preset("tiny")
mesh = wb.abstract_mesh("v5e-4", data=2, model=2)
wb.plan(cfg, mesh=mesh, batch=4, seq=32, compile=False, progress=False)   # formulas only
assert snapshot()[0] is before[0], "an analytic plan replaced JAX's TPU backend factory"
print("unchanged")
{tpu_part}
"""

_TPU_PART = """
p = wb.plan(cfg, mesh=mesh, batch=4, seq=32, progress=False)   # the TPU compiler
assert p.source == "tpu-compiler", p.source_reason
quiet = xla_bridge._backend_factories["tpu"].factory
assert getattr(quiet, "_workbench_quiet", False), "a TPU plan did not quiet libtpu"
from workbench.hardware import quiet_libtpu
quiet_libtpu(); quiet_libtpu()
assert xla_bridge._backend_factories["tpu"].factory is quiet, "quiet_libtpu is not idempotent"
print("quieted")
"""


@pytest.mark.multiprocess
@pytest.mark.tpu
def test_importing_every_module_changes_nothing_until_a_tpu_plan():
    mods = _modules()
    assert len(mods) > 60 and "workbench.hardware._catalogue" in mods
    tpu = libtpu_installed()
    code = _CHECK.format(modules=mods, tpu_part=_TPU_PART if tpu else "")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env=env, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == (["unchanged", "quieted"] if tpu else ["unchanged"]), \
        out.stdout + out.stderr[-2000:]


@pytest.mark.multiprocess
@pytest.mark.skipif(not libtpu_installed(), reason="libtpu is not installed")
def test_quiet_libtpu_changes_only_the_tpu_factory_and_only_once():
    code = ("from jax._src import xla_bridge\n"
            "before = dict(xla_bridge._backend_factories)\n"
            "from workbench.hardware import quiet_libtpu\n"
            "assert quiet_libtpu() and quiet_libtpu()\n"
            "after = dict(xla_bridge._backend_factories)\n"
            "assert set(before) == set(after)\n"
            "assert all(before[k] is after[k] for k in before if k != 'tpu')\n"
            "assert after['tpu'].factory._workbench_quiet\n"
            "import jax; print(jax.devices()[0].platform)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.stdout.split() == ["cpu"], out.stderr[-3000:]
    assert "TPU accelerator type" not in out.stderr, out.stderr
