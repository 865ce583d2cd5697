"""Nothing replaces a folder Workbench did not write, and a flag is a bool (issue 56, item 3
and item 9's ``progress="no"``).

Three tables:

- PEFT folders: ``wb.hf.to_peft(overwrite=True)`` and ``export_run(lora="peft",
  overwrite=True)`` on a folder ``peft``'s own ``save_pretrained`` wrote (README included),
  and on a ``to_peft`` folder the user added a README to, are refused and the tree is
  unchanged (every file's bytes); a folder ``to_peft`` wrote is replaced by the same bytes
  as a fresh export into a new folder (the reference).
- Flags: every bool argument of the public surface (walked from ``wb.__all__`` and the
  modules it exports: annotations and defaults), generated from the walk, refuses "no",
  "yes", 1 and None with a ``TypeError`` naming it; a new bool argument without a row fails.
- Unwritable destinations: an export whose parent is a file, or an immutable folder
  (``chattr +i``: it stops root too), is refused by name before anything is written.
"""
from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from tests.test_hostile_export import snapshot
from workbench.hf import _peft

TINY = dict(vocab_size=384, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8,
            d_ff=32, seq_len=16)
LORA = {"rank": 2, "alpha": 4.0}


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: Any) -> tuple[Path, Any]:
    """A one-step LoRA run (a checkpoint of its adapters) and its trained model."""
    root = tmp_path_factory.mktemp("lora-run")
    cfg = wb.TrainConfig(model="tiny", model_overrides=TINY, mesh={"data": 8}, batch=8, seq=16,
                         steps=1, checkpoint_every=1, data="synthetic", lora=LORA)
    tr = wb.Trainer(cfg, root / "run", progress=None)
    try:
        tr.run()
        tr.checkpoints.wait()
        model = tr.model
    finally:
        tr.close()
    return root / "run", model


def _peft_save(folder: Path) -> Path:
    """A folder as ``peft``'s ``save_pretrained`` writes it: adapter_config.json,
    adapter_model.safetensors and its README.md model card."""
    peft = pytest.importorskip("peft", reason="the test extra installs peft")
    import torch

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            return self.q_proj(x)

    model = peft.get_peft_model(Toy(), peft.LoraConfig(r=2, lora_alpha=4,
                                                       target_modules=["q_proj"]))
    model.save_pretrained(folder)
    assert {p.name for p in folder.iterdir()} == {_peft.ADAPTER_CONFIG, _peft.ADAPTER_WEIGHTS,
                                                  "README.md"}
    return folder


def _peft_without_readme(folder: Path) -> Path:
    (_peft_save(folder) / "README.md").unlink()   # the same names to_peft writes, no mark
    return folder


def _ours_with_readme(model: Any) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        wb.hf.to_peft(model, folder)
        (folder / "README.md").write_text("# my notes on this adapter\n")
        return folder
    return make


def _to_peft(run: Path, model: Any, dst: Path, **kw: Any) -> Path:
    return wb.hf.to_peft(model, dst, **kw)


def _export_peft(run: Path, model: Any, dst: Path, **kw: Any) -> Path:
    return wb.hf.export_run(run, dst, lora="peft", **kw)


# ----------------------------------------------------------------------------- PEFT folders
REFUSED = [
    ("peft.save_pretrained's folder, to_peft", _peft_save, _to_peft, "README.md"),
    ("peft.save_pretrained's folder, export_run", _peft_save, _export_peft, "README.md"),
    ("peft's two files without README, to_peft", _peft_without_readme, _to_peft,
     "lacks the mark"),
    ("peft's two files without README, export_run", _peft_without_readme, _export_peft,
     "lacks the mark"),
    ("a to_peft folder with the user's README, to_peft", "ours+readme", _to_peft, "README.md"),
    ("a to_peft folder with the user's README, export_run", "ours+readme", _export_peft,
     "README.md"),
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("setup", "call", "words"), [r[1:] for r in REFUSED],
                         ids=[r[0] for r in REFUSED])
def test_overwrite_refuses_an_adapter_folder_workbench_did_not_write(
        lora_run: tuple[Path, Any], tmp_path: Path, setup: Any, call: Any, words: str) -> None:
    run, model = lora_run
    make = _ours_with_readme(model) if setup == "ours+readme" else setup
    dst = make(tmp_path / "adapter")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError) as e:
        call(run, model, dst, overwrite=True)
    assert str(dst) in str(e.value) and words in str(e.value) and "new folder" in str(e.value)
    assert snapshot(tmp_path) == before   # the user's README and weights, byte for byte


@pytest.mark.parametrize("call", [_to_peft, _export_peft], ids=["to_peft", "export_run"])
def test_a_folder_to_peft_wrote_is_replaced_by_a_fresh_exports_bytes(
        lora_run: tuple[Path, Any], tmp_path: Path, call: Any) -> None:
    run, model = lora_run
    old = call(run, model, tmp_path / "adapter")
    meta = json.loads(old.joinpath(_peft.ADAPTER_WEIGHTS).read_bytes()[8:][:int.from_bytes(
        old.joinpath(_peft.ADAPTER_WEIGHTS).read_bytes()[:8], "little")])["__metadata__"]
    assert meta == _peft.PEFT_MARK
    (old / _peft.ADAPTER_CONFIG).write_text("{}")   # it changes: the new one replaces it
    fresh = call(run, model, tmp_path / "fresh")
    assert call(run, model, old, overwrite=True) == old
    want = {p.name: p.read_bytes() for p in fresh.iterdir()}
    assert {p.name: p.read_bytes() for p in old.iterdir()} == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "fresh"]   # nothing aside


# ----------------------------------------------------------------------------- flags
def _bool_param(p: inspect.Parameter) -> bool:
    a = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
    return isinstance(p.default, bool) or a.split("|")[0].strip() == "bool" or " bool" in f" {a}"


def surface_flags() -> set[tuple[str, str]]:
    """(public name, argument) of every bool argument: functions, classes and their
    public methods in ``wb.__all__`` and the ``__all__`` of the modules it exports."""
    out: set[tuple[str, str]] = set()
    seen: set[int] = set()

    def params(name: str, f: Any) -> None:
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):
            return
        out.update((name, n) for n, p in sig.parameters.items() if _bool_param(p))

    def walk(prefix: str, mod: types.ModuleType) -> None:
        for attr in getattr(mod, "__all__", ()):
            obj, name = getattr(mod, attr), f"{prefix}.{attr}"
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, types.ModuleType):
                walk(name, obj)
            elif inspect.isclass(obj):
                params(name, obj)
                for m, v in vars(obj).items():
                    v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                    if not m.startswith("_") and inspect.isfunction(v):
                        params(f"{name}.{m}", v)
            elif callable(obj):
                params(name, obj)

    walk("wb", wb)
    return out


def _tiny() -> Any:
    return wb.models.GPTConfig.preset("tiny").replace(**TINY)


def _model() -> Any:
    from flax import nnx

    return wb.models.GPT(_tiny(), rngs=nnx.Rngs(0))


def _gpt(**flag: Any) -> Any:
    return wb.models.GPTConfig(**{**TINY, **flag})


#: (public name, argument) -> a call giving the argument ``bad`` (other arguments valid, or
#: checked after it); what ``tmp`` holds is the call's.
CALLS: dict[tuple[str, str], Callable[[Any, Path], Any]] = {
    ("wb.Job", "attached"): lambda bad, tmp: wb.Job(tmp, [], [], lock=None, attached=bad),
    ("wb.plan", "compile"): lambda bad, tmp: wb.plan(_tiny(), mesh=wb.make_mesh(data=8),
                                                     batch=8, seq=16, compile=bad),
    ("wb.plan", "overlap"): lambda bad, tmp: wb.plan(_tiny(), mesh=wb.make_mesh(data=8),
                                                     batch=8, seq=16, overlap=bad),
    ("wb.plan", "progress"): lambda bad, tmp: wb.plan(_tiny(), mesh=wb.make_mesh(data=8),
                                                      batch=8, seq=16, progress=bad),
    ("wb.search", "progress"): lambda bad, tmp: wb.search(_tiny(), "v5p-8", batch=8, seq=16,
                                                          progress=bad),
    ("wb.plan", "wait"): lambda bad, tmp: wb.plan(_tiny(), mesh=wb.make_mesh(data=8),
                                                  batch=8, seq=16, wait=bad),
    ("wb.search", "wait"): lambda bad, tmp: wb.search(_tiny(), "v5p-8", batch=8, seq=16,
                                                      wait=bad),
    ("wb.search", "wait"): lambda bad, tmp: wb.search(_tiny(), "v5p-8", batch=8, seq=16,
                                                      wait=bad),
    ("wb.data.Dataset", "streaming"): lambda bad, tmp: wb.data.Dataset(
        hf="org/name", split="train", streaming=bad),
    ("wb.Rules.spec", "strict"): lambda bad, tmp: wb.Rules(batch="data").spec(("batch",),
                                                                            strict=bad),
    ("wb.Slurm", "requeue"): lambda bad, tmp: wb.Slurm(nodes=1, requeue=bad),
    **{("wb.Trainer", f): (lambda bad, tmp, f=f: wb.Trainer(
        wb.TrainConfig(model="tiny", data="synthetic"), tmp / "run", **{f: bad}))
       for f in ("fork", "force", "async_checkpoint")},
    ("wb.calibrate", "save"): lambda bad, tmp: wb.calibrate([], save=bad),
    ("wb.data.Tokenizer.from_hf", "progress"): lambda bad, tmp: wb.data.Tokenizer.from_hf(
        tmp / "none", progress=bad),
    ("wb.data.Tokenizer.apply_chat_template", "add_generation_prompt"):
        lambda bad, tmp: wb.data.Tokenizer().apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=bad),
    ("wb.generate", "cache"): lambda bad, tmp: wb.generate(_model(), [1, 2], cache=bad),
    ("wb.hf.from_hf", "progress"): lambda bad, tmp: wb.hf.from_hf(tmp / "none", progress=bad),
    ("wb.hf.hf_config", "progress"): lambda bad, tmp: wb.hf.hf_config(tmp / "none",
                                                                      progress=bad),
    ("wb.hf.to_hf", "overwrite"): lambda bad, tmp: wb.hf.to_hf(None, tmp / "x", overwrite=bad),
    ("wb.hf.to_peft", "overwrite"): lambda bad, tmp: wb.hf.to_peft(None, tmp / "x",
                                                                   overwrite=bad),
    ("wb.hf.export_run", "overwrite"): lambda bad, tmp: wb.hf.export_run(
        tmp / "run", tmp / "x", overwrite=bad),
    **{("wb.models.GPTConfig", f): (lambda bad, tmp, f=f: _gpt(**{f: bad}))
       for f in ("tie_embeddings", "context_zigzag", "scan_layers", "router_norm_topk",
                 "qkv_bias", "qk_norm", "shared_expert_gate")},
    ("wb.any_model.ModelSpec", "require_rules"): lambda bad, tmp: wb.any_model.ModelSpec(
        factory=lambda rngs: None, require_rules=bad),
    ("wb.models.blocks_per_device", "zigzag"): lambda bad, tmp: wb.models.blocks_per_device(
        4, zigzag=bad),
    ("wb.runs.find_run_dirs", "hidden"): lambda bad, tmp: wb.runs.find_run_dirs(tmp,
                                                                                hidden=bad),
    ("wb.runs.list_runs", "hidden"): lambda bad, tmp: wb.runs.list_runs([tmp], hidden=bad),
    ("wb.runs.read_run", "contained"): lambda bad, tmp: wb.runs.read_run(tmp, contained=bad),
    ("wb.runs.resolve_run", "allow_hidden"): lambda bad, tmp: wb.runs.resolve_run(
        [tmp], "x", allow_hidden=bad),
}
#: Flags reached through ``**keywords`` (not in any signature): rows of their own.
KEYWORDS = {("wb.hf.export_run", "overwrite")}
#: Arguments whose annotation says ``bool | None``: None is a value.
NONE_OK = {("wb.plan", "compile")}
#: Bool-typed arguments that are not flags, and why.
NOT_FLAGS = {
    ("wb.Trainer", "compile_cache"): "True, False or the cache's folder: a string is a path",
    ("wb.search", "exact"): "True, False or 'all': a ValueError names the three",
}


def test_every_bool_argument_of_the_surface_has_a_row() -> None:
    walked = surface_flags()
    missing = sorted(walked - set(CALLS) - set(NOT_FLAGS))
    assert not missing, f"bool arguments without a row in CALLS (check them): {missing}"
    assert sorted(set(CALLS) - walked - KEYWORDS) == []   # rows of arguments that left


FLAG_ROWS = [(key, bad) for key in sorted(CALLS) for bad in ("no", "yes", 1, None)
             if not (bad is None and key in NONE_OK)]


@pytest.mark.parametrize(("key", "bad"), FLAG_ROWS,
                         ids=[f"{k[0]}({k[1]}={b!r})" for k, b in FLAG_ROWS])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(key: tuple[str, str], bad: Any,
                                                      tmp_path: Path) -> None:
    before = snapshot(tmp_path)
    with pytest.raises(TypeError) as e:
        CALLS[key](bad, tmp_path)
    msg = str(e.value)
    assert key[1] in msg and repr(bad) in msg and "True" in msg and "False" in msg, msg
    assert snapshot(tmp_path) == before   # refused before anything is written


def test_numpy_bools_are_flags() -> None:
    import numpy as np

    from workbench._validate import check_bool

    assert check_bool(np.True_, "x") is True and check_bool(np.False_, "x") is False
    assert isinstance(wb.plan(_tiny(), mesh=wb.make_mesh(data=8), batch=8, seq=16,
                              compile=False, progress=np.False_), wb.Plan)


# ----------------------------------------------------------------------------- unwritable
def _parent_a_file(tmp: Path) -> Path:
    (tmp / "notes.txt").write_text("a file, not a folder")
    return tmp / "notes.txt" / "export"


def _immutable_parent(tmp: Path) -> Path:
    (tmp / "locked").mkdir()
    if subprocess.run(["chattr", "+i", str(tmp / "locked")], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip("chattr +i is not available here (it needs CAP_LINUX_IMMUTABLE)")
    return tmp / "locked" / "export"


def _export_merged(run: Path, model: Any, dst: Path) -> Path:
    return wb.hf.export_run(run, dst)


def _to_hf(run: Path, model: Any, dst: Path) -> Path:
    return wb.hf.to_hf(model, dst)


UNWRITABLE = [(f"{call.__name__.strip('_')}, {where.__name__.strip('_')}", where, call)
              for where in (_parent_a_file, _immutable_parent)
              for call in (_to_hf, _to_peft, _export_peft, _export_merged)]


@pytest.mark.parametrize(("where", "call"), [r[1:] for r in UNWRITABLE],
                         ids=[r[0] for r in UNWRITABLE])
def test_an_unwritable_destination_is_refused_before_anything_is_written(
        lora_run: tuple[Path, Any], tmp_path: Path, where: Any, call: Any) -> None:
    run, model = lora_run
    dst = where(tmp_path)
    try:
        before = snapshot(tmp_path)
        with pytest.raises(OSError) as e:
            call(run, model, dst)
        assert type(e.value) in (PermissionError, NotADirectoryError), repr(e.value)
        assert f"cannot write {dst}" in str(e.value) and "choose a" in str(e.value)
        assert snapshot(tmp_path) == before
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "locked")], capture_output=True,
                       check=False)
    shutil.rmtree(tmp_path, ignore_errors=True)
