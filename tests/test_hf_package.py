"""``wb.hf`` as a package: its public names, the aliases elsewhere, and its place above
``models`` and ``step``.

What the functions do is tested in test_hf.py, test_hostile_hf.py and test_hostile_export.py.
"""
from __future__ import annotations

import subprocess
import sys

import workbench as wb
from tests.test_layering import PACKAGE, imports, module_name

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
