"""``wb.hf`` as a package: its public names, the aliases elsewhere, the old module paths
(shims that warn and forward), and its place above ``models`` and ``step``.

What the functions do is tested in test_hf.py, test_hostile_hf.py and test_hostile_export.py.
"""
from __future__ import annotations

import subprocess
import sys

import workbench as wb
from tests.test_layering import PACKAGE, imports, module_name

#: old module path -> where it moved.
MOVED = {"workbench.models.hf": "workbench.hf._load",
         "workbench.models.hf_export": "workbench.hf._save",
         "workbench.models.hf_families": "workbench.hf._families",
         "workbench.models.hf_tensors": "workbench.hf._tensors",
         "workbench.train.export": "workbench.hf._export"}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_every_public_name_resolves_to_its_module():
    for name in wb.hf.__all__:
        obj = getattr(wb.hf, name)
        assert obj.__module__.startswith("workbench.hf."), (name, obj.__module__)
    assert set(wb.hf.__all__) <= set(dir(wb.hf))


def test_the_old_public_names_are_the_same_functions():
    assert wb.models.from_hf is wb.hf.from_hf
    assert wb.models.hf_config is wb.hf.hf_config
    assert wb.models.to_hf is wb.hf.to_hf
    assert wb.train.export_run is wb.hf.export_run
    from workbench.models import from_hf, to_hf
    from workbench.train import export_run
    assert (from_hf, to_hf, export_run) == (wb.hf.from_hf, wb.hf.to_hf, wb.hf.export_run)


def test_old_module_paths_warn_with_the_new_path_and_forward_every_name():
    """In a fresh process (a module warns when it is first imported): each old path warns
    once, naming its new path, and any of its names (public or not) is the new module's."""
    code = ("import importlib, warnings\n"
            f"moved = {MOVED!r}\n"
            "for old, new in moved.items():\n"
            "    with warnings.catch_warnings(record=True) as w:\n"
            "        warnings.simplefilter('always')\n"
            "        shim = importlib.import_module(old)\n"
            "    msgs = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
            "    assert len(msgs) == 1 and new in msgs[0] and old in msgs[0], (old, msgs)\n"
            "    mod = importlib.import_module(new)\n"
            "    names = [n for n in vars(mod) if not n.startswith('__')]\n"
            "    assert names and all(getattr(shim, n) is getattr(mod, n) for n in names), old\n"
            "    assert set(names) <= set(dir(shim)), old\n"
            "    try:\n"
            "        shim.no_such_name\n"
            "    except AttributeError as e:\n"
            "        assert new in str(e), e\n"
            "    else:\n"
            "        raise AssertionError(old)\n"
            "from workbench.models.hf import from_hf, CheckpointError\n"
            "from workbench.hf._load import from_hf as f2, CheckpointError as c2\n"
            "assert from_hf is f2 and CheckpointError is c2\n"
            "print('ok')\n")
    out = _run(code)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_importing_wb_hf_is_light():
    out = _run("import sys, workbench.hf as h; h.__all__; "
               "print(sorted(m for m in ('jax', 'safetensors', 'workbench.hf._load') "
               "if m in sys.modules))")
    assert out.stdout.strip() == "[]", out.stderr[-3000:]


def test_models_and_step_never_import_hf():
    """hf sits above ``models`` and ``step``: they never import it, not even inside a
    function. ``models/__init__`` resolves the aliases (``wb.models.from_hf``) on first
    use; the shims of the old paths name theirs as a string."""
    below = sorted((PACKAGE / "models").glob("*.py")) + [PACKAGE / "_step.py"]
    found = []
    for path in below:
        if path.relative_to(PACKAGE).as_posix() == "models/__init__.py":
            continue
        for line, name in imports(path.read_text(), module_name(path),
                                  is_package=path.name == "__init__.py"):
            if name == "workbench.hf" or name.startswith("workbench.hf."):
                found.append((path.relative_to(PACKAGE).as_posix(), line, name))
    assert not found, found
