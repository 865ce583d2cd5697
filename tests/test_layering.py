"""Layering: headless core never imports display libraries; the server never imports jax."""
import subprocess
import sys

CORE = ["workbench", "workbench.hardware", "workbench.mesh", "workbench.layouts", "workbench.rules",
        "workbench.models", "workbench.flops", "workbench.step", "workbench.planning", "workbench.runs",
        "workbench.train", "workbench.data", "workbench.jobs"]
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


PUBLIC_FUNCTIONS = {"devices": "workbench.hardware", "layout": "workbench.layouts",
                    "plan": "workbench.planning", "launch": "workbench.jobs",
                    "show": "workbench.widgets", "simulate_devices": "workbench.hardware"}


def test_public_functions_are_plain_functions_whatever_was_imported_first():
    """``wb.layout`` / ``wb.plan`` / ``wb.devices`` / ``wb.launch`` / ``wb.show`` are the
    functions themselves (real signature and docstring), whether their modules were imported
    before or after the name was first used, and ``from workbench import layout`` too."""
    check = ("import inspect, types, workbench as wb\n"
             "for name, mod in %r.items():\n"
             "    f = getattr(wb, name)\n"
             "    assert type(f) is types.FunctionType, (name, type(f))\n"
             "    assert f is getattr(__import__(mod, fromlist=['x']), name), name\n"
             "    assert 'args' not in inspect.signature(f).parameters, name\n"
             "    assert f.__doc__ and f.__module__.startswith(mod), name\n"
             "from workbench import layout, plan, devices, launch, show\n"
             "assert all(type(f) is types.FunctionType for f in (layout, plan, devices, launch, show))\n"
             "print('ok')\n") % PUBLIC_FUNCTIONS
    modules_first = "".join(f"import {m}\n" for m in sorted(set(PUBLIC_FUNCTIONS.values())))
    names_first = ("import workbench as wb\n"
                   + "".join(f"wb.{n}\n" for n in PUBLIC_FUNCTIONS)
                   + modules_first)
    for prefix in (modules_first, names_first, "import workbench as wb\nwb.simulate_devices(8)\n"):
        out = _run(prefix + check)
        assert out.stdout.strip() == "ok", (prefix, out.stderr[-3000:])
