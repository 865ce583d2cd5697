"""Layering: headless core never imports display libraries; the server never imports jax."""
import subprocess
import sys

CORE = ["workbench", "workbench.devices", "workbench.mesh", "workbench.layout", "workbench.rules",
        "workbench.models", "workbench.flops", "workbench.step", "workbench.plan", "workbench.runs",
        "workbench.train", "workbench.data", "workbench.launch"]
BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def __init__(self, names): self.names = names
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in self.names:
            raise ImportError(f'blocked import of {name}')
sys.meta_path.insert(0, Block(%r))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_core_imports_without_display_libraries():
    mods = [m for m in CORE if _exists(m)]
    code = BLOCK % ["IPython", "ipywidgets", "anywidget", "plotly"] + "\n".join(
        f"import {m}" for m in mods) + "\nprint('ok')"
    out = _run(code)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_server_and_runs_do_not_import_jax():
    mods = [m for m in ("workbench.runs", "workbench.server") if _exists(m)]
    assert mods, "workbench.runs should exist"
    code = BLOCK % ["jax", "jaxlib", "flax", "numpy"] + "\n".join(
        f"import {m}" for m in mods) + "\nprint('ok')"
    out = _run(code)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_import_workbench_is_light_and_silent():
    out = _run("import sys, workbench; print(sorted(m for m in ('jax', 'IPython') if m in sys.modules))")
    assert out.stdout.strip() == "[]" and out.stderr == ""


def _exists(mod: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


def test_public_functions_survive_importing_their_modules():
    """``import workbench.layout`` (or .plan, .launch) must not replace ``wb.layout`` with a
    module that cannot be called: the public function and the submodule share a name."""
    code = ("import workbench.layout, workbench.plan, workbench.launch, workbench.devices\n"
            "import workbench as wb\n"
            "from workbench.layout import layout\n"
            "lay = wb.layout((8, 4), ('x', None), wb.abstract_mesh(x=4))\n"
            "assert lay.bytes_per_device[0] == layout((8, 4), ('x', None),"
            " wb.abstract_mesh(x=4)).bytes_per_device[0] == 32\n"
            "assert all(callable(f) for f in (wb.plan, wb.launch, wb.devices))\n"
            "print('ok')")
    out = _run(code)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]
