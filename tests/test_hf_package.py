"""``wb.hf`` as a package: its public names (the one name of each), and its place above
``models``, ``step`` and ``train``.

What the functions do is tested in test_hf.py, test_hostile_hf.py and test_hostile_export.py.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

import workbench as wb
from tests.test_layering import PACKAGE, imports, module_name

def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_every_public_name_resolves_to_its_module():
    for name in wb.hf.__all__:
        obj = getattr(wb.hf, name)
        home = "workbench._hub" if name == "HubError" else "workbench.hf."   # the Hub: below
        assert obj.__module__.startswith(home), (name, obj.__module__)
    assert set(wb.hf.__all__) <= set(dir(wb.hf))


def test_each_function_has_one_name():
    """``wb.hf`` is the one home of from_hf / hf_config / to_hf / export_run; ``wb.models``
    and ``wb.train`` name none of them (nor ``any_model``'s), not even lazily."""
    for package, names in ((wb.models, ("from_hf", "hf_config", "to_hf", "from_nnx",
                                        "from_penzai", "ModelSpec", "MLPClassifier")),
                           (wb.train, ("export_run",))):
        for name in names:
            assert name not in package.__all__, name
            with pytest.raises(AttributeError, match=name):
                getattr(package, name)
    assert wb.any_model.from_nnx.__module__ == "workbench.any_model._spec"


def test_importing_wb_hf_is_light():
    out = _run("import sys, workbench.hf as h; h.__all__; "
               "print(sorted(m for m in ('jax', 'safetensors', 'workbench.hf._load') "
               "if m in sys.modules))")
    assert out.stdout.strip() == "[]", out.stderr[-3000:]


def test_models_and_step_never_import_hf():
    """hf sits above ``models`` and ``step``: they never import it, not even inside a
    function."""
    below = sorted((PACKAGE / "models").glob("*.py")) + [PACKAGE / "_step.py"]
    found = []
    for path in below:
        for line, name in imports(path.read_text(), module_name(path),
                                  is_package=path.name == "__init__.py"):
            if name == "workbench.hf" or name.startswith("workbench.hf."):
                found.append((path.relative_to(PACKAGE).as_posix(), line, name))
    assert not found, found


def test_train_reads_hf_folders_through_the_reader_the_root_names(monkeypatch):
    """``train`` never imports ``hf`` (it sits below: ``export_run`` restores runs); the
    root names the module that reads ``TrainConfig.init``'s folder, and without it the
    reader says where it is named."""
    from workbench import _hf_reader
    from workbench.hf import _load

    assert _hf_reader.reader() is _load
    assert all(callable(getattr(_load, n)) for n in ("check_matches", "check_weights",
                                                      "load_params"))
    monkeypatch.setitem(_hf_reader._READER, "module", None)
    with pytest.raises(RuntimeError, match=r"workbench/__init__.py.*read_with"):
        _hf_reader.reader()
