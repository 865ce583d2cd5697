"""``wb.hf`` as a package: its public names (the one name of each), and its place above
``models``, ``step``, ``train`` and the format package below train (``workbench._hf_format``).

What the functions do is tested in test_hf.py, test_hostile_hf.py and test_hostile_export.py.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

import workbench as wb
from tests.test_layering import PACKAGE, imports, module_name

def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)


#: The public names of ``wb.hf`` defined below it: the Hub's error, and the format's (what
#: ``train`` reads a folder with).
BELOW = {"HubError": "workbench._hub", "CheckpointError": "workbench._hf_format.tensors",
         "HFConfigError": "workbench._hf_format.families",
         "HFSource": "workbench._hf_format.load", "hf_config": "workbench._hf_format.config"}


def test_every_public_name_resolves_to_its_module():
    for name in wb.hf.__all__:
        obj = getattr(wb.hf, name)
        if name in BELOW:
            assert obj.__module__ == BELOW[name], (name, obj.__module__)
        else:
            assert obj.__module__.startswith("workbench.hf._"), (name, obj.__module__)
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
               "print(sorted(m for m in ('jax', 'safetensors', 'workbench.hf._load', "
               "'workbench._hf_format.load') "
               "if m in sys.modules))")
    assert out.stdout.strip() == "[]", out.stderr[-3000:]


def test_models_step_and_the_format_never_import_hf():
    """hf sits above ``models``, ``step`` and ``_hf_format``: they never import it, not even
    inside a function."""
    below = sorted((PACKAGE / "models").glob("*.py")) + [PACKAGE / "_step.py"] + sorted(
        (PACKAGE / "_hf_format").glob("*.py"))
    found = []
    for path in below:
        for line, name in imports(path.read_text(), module_name(path),
                                  is_package=path.name == "__init__.py"):
            if name == "workbench.hf" or name.startswith("workbench.hf."):
                found.append((path.relative_to(PACKAGE).as_posix(), line, name))
    assert len(below) > 10 and not found, found


#: A fresh interpreter: a Trainer started from the Hugging Face folder argv[1] (run in
#: argv[2]), its first parameters read; prints which hf modules were imported, whether the
#: format's loader was, and saves the embedding table it loaded.
_TRAIN_FROM_FOLDER = """
import json, sys
import numpy as np
import workbench.train as train

folder, run_dir = sys.argv[1:3]
config = train.TrainConfig(model="tiny", model_overrides={"n_layers": 1, "vocab_size": 128},
                           init=folder, mesh={"data": -1}, batch=8, seq=8, steps=1,
                           data="synthetic")
trainer = train.Trainer(config, run_dir, progress=None)
np.save(run_dir + "/embed.npy", np.asarray(trainer.state.params["embed"]))
trainer.close()
print(json.dumps({"hf": sorted(m for m in sys.modules if m.split(".")[:2] == ["workbench", "hf"]),
                  "loader": "workbench._hf_format.load" in sys.modules}))
"""


@pytest.mark.slow
def test_a_trainer_starts_from_a_folder_without_importing_hf(tmp_path):
    """``train`` sits below ``hf`` (``export_run`` restores runs) and reads ``init=``'s folder
    through ``workbench._hf_format``: a Trainer started from a Hugging Face folder in a fresh
    interpreter loads its weights (the folder's embedding table, bitwise) and never imports
    ``workbench.hf`` (tests/test_import_graph.py checks the source: no import, lazy or not)."""
    import json

    import numpy as np
    from flax import nnx

    cfg = wb.models.GPTConfig.preset("tiny").replace(n_layers=1, vocab_size=128)
    model = wb.models.GPT(cfg, rngs=nnx.Rngs(3))
    folder = wb.hf.to_hf(model, tmp_path / "one-layer")
    (tmp_path / "run").mkdir()
    out = _run(_TRAIN_FROM_FOLDER, str(folder), str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    assert said == {"hf": [], "loader": True}, said
    saved = nnx.to_pure_dict(nnx.state(model, nnx.Param))["embed"]
    np.testing.assert_array_equal(np.load(tmp_path / "run" / "embed.npy"), saved)
