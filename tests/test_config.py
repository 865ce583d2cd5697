"""TrainConfig (JSON round trip, stable hash, validation) and the AdamW spec (optax)."""
import dataclasses
import hashlib
import json
import math
import pickle
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import workbench as wb
from workbench import _runs as runs
from workbench.data import SyntheticData, TextData
from workbench.models import GPTConfig
from workbench._sharding.rules import Rules
from workbench.train import RUN_CONTROL_FIELDS, AdamW, TrainConfig

ISSUE_EXAMPLE = {"model": "tiny", "mesh": {"data": 8}, "rules": "fsdp", "batch": 8, "seq": 128,
                 "steps": 200, "checkpoint_every": 20, "keep": 3, "seed": 0, "data": "text"}


def test_issue_example_and_every_field_has_a_default():
    cfg = wb.TrainConfig(**ISSUE_EXAMPLE)
    assert all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
               for f in dataclasses.fields(TrainConfig))
    # rules None: workbench._sharding.placement's default for the mesh (fsdp on {"data": -1})
    assert TrainConfig() == TrainConfig(**{**ISSUE_EXAMPLE, "mesh": {"data": -1}, "rules": None})
    assert cfg.model_config() == GPTConfig.preset("tiny")
    assert cfg.data == TextData() and cfg.optimizer == AdamW()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch = 4  # type: ignore[misc]


@pytest.mark.parametrize("cfg", [
    TrainConfig(**ISSUE_EXAMPLE),
    TrainConfig(model=GPTConfig.preset("tiny", n_layers=3), data="synthetic",
                optimizer=AdamW(lr=1e-3, accumulate=2, clip_norm=None), batch=16),
    TrainConfig(model="small", model_overrides={"n_layers": 2}, mesh={"data": 4, "model": 2},
                rules=Rules(batch="data", embed=None, heads="model", kv_heads="model",
                            head_dim=None, mlp="model", vocab="model", seq=None),
                data=TextData(root="/usr/share", patterns=("*.txt",), max_bytes=10_000)),
    TrainConfig(rules={"batch": ["data"], "embed": None}, data=SyntheticData(vocab_size=64)),
])
def test_json_round_trip_is_exact(cfg):
    text = cfg.to_json()
    back = TrainConfig.from_json(text)
    assert back == cfg and back.to_json() == text and back.hash() == cfg.hash()
    assert TrainConfig.from_json(json.loads(text)) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(back) == hash(cfg)


def test_hash_is_stable_across_processes_and_key_order():
    cfg = TrainConfig(**ISSUE_EXAMPLE)
    code = ("import workbench as wb, json; "
            f"print(wb.TrainConfig.from_json({cfg.to_json()!r}).hash())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == cfg.hash()
    shuffled = dict(reversed(list(cfg.to_dict().items())))
    assert TrainConfig.from_dict(shuffled).hash() == cfg.hash()
    assert cfg.replace(seed=1).hash() != cfg.hash()
    assert cfg.hash(exclude=("seed",)) == cfg.replace(seed=1).hash(exclude=("seed",))


def test_hash_is_the_config_hash_of_run_json(tmp_path):
    cfg = TrainConfig(**ISSUE_EXAMPLE)
    text = json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":"))
    assert cfg.hash() == hashlib.sha256(text.encode()).hexdigest()[:12]       # by hand
    runs.RunWriter(tmp_path / "run", config=cfg.to_dict()).close()
    assert runs.read_run(tmp_path / "run")["config_hash"] == cfg.hash()
    kept = {k: v for k, v in cfg.to_dict().items() if k not in RUN_CONTROL_FIELDS}
    assert cfg.hash(exclude=RUN_CONTROL_FIELDS) == runs.config_hash(kept) != cfg.hash()
    assert cfg.replace(keep=9).hash(exclude=RUN_CONTROL_FIELDS) == runs.config_hash(kept)


def test_replace_and_diff():
    cfg = TrainConfig(**ISSUE_EXAMPLE)
    new = cfg.replace(seq=64, optimizer=cfg.optimizer.replace(lr=1e-4))
    assert new.seq == 64 and cfg.seq == 128
    assert cfg.diff(new) == {"optimizer.lr": (3e-3, 1e-4), "seq": (128, 64)}


@pytest.mark.parametrize("changes, match", [
    ({"batch": 0}, r"TrainConfig.batch=0 .*must be a positive integer"),
    ({"steps": -1}, r"TrainConfig.steps=-1"),
    ({"steps": 0}, r"TrainConfig.steps=0 .*must be a positive integer: .*e.g. steps=200"),
    ({"seed": -1}, r"TrainConfig.seed=-1 .*from 0 to 4294967295: .*seed % 2\*\*32"),
    ({"rules": "fdsp"}, r"TrainConfig.rules='fdsp' is not a rules preset; choose one of dp"),
    ({"model_overrides": {"dmodel": 8}}, r"unknown GPTConfig fields \['dmodel'\]"),
    ({"model": "huge"}, r"unknown GPT preset 'huge'"),
    ({"batch": 6, "optimizer": AdamW(accumulate=4)},
     r"batch=6 is not divisible by optimizer.accumulate=4"),
    ({"data": "imagenet"}, r"unknown data 'imagenet'"),
])
def test_bad_fields_are_clear_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**changes)


@pytest.mark.parametrize("changes, match", [
    ({"mesh": {"data": "8"}}, r"TrainConfig.mesh\['data'\]='8' is a string; .*: write "
                              r"TrainConfig.mesh\['data'\]=8"),
    ({"mesh": {"data": True}}, r"TrainConfig.mesh\['data'\]=True is a bool"),
    ({"steps": True}, r"TrainConfig.steps=True is a bool; .*must be a positive integer"),
    ({"batch": 8.0}, r"TrainConfig.batch=8.0 is a float; .*: write TrainConfig.batch=8"),
    ({"seed": "abc"}, r"TrainConfig.seed='abc' is a string; .*from 0 to 4294967295"),
    ({"optimizer": "adam"}, r"TrainConfig.optimizer='adam' must be a wb.train.AdamW"),
    ({"model": 3}, r"TrainConfig.model=3 must be a preset name \(tiny, small"),
])
def test_wrong_types_are_type_errors(changes, match):
    with pytest.raises(TypeError, match=match):
        TrainConfig(**changes)


@pytest.mark.parametrize("changes, match", [
    ({"lr": "3e-3"}, r"AdamW.lr='3e-3' must be a finite number"),
    ({"lr": float("nan")}, r"AdamW.lr=nan must be a finite number"),
    ({"accumulate": True}, r"AdamW.accumulate=True is a bool"),
    ({"decay_steps": 2.5}, r"AdamW.decay_steps=2.5 is a float; .*pick AdamW.decay_steps=2 or"),
])
def test_optimizer_fields_of_the_wrong_type_are_type_errors(changes, match):
    with pytest.raises(TypeError, match=match):
        AdamW(**changes)


def test_seq_longer_than_the_model_warns_naming_both_and_the_override_silences_it():
    import warnings

    with pytest.warns(UserWarning, match=r"TrainConfig.seq=256 is longer than the model's "
                                         r"seq_len=128.*model_overrides=\{'seq_len': 256\}"):
        TrainConfig(seq=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TrainConfig(seq=256, model_overrides={"seq_len": 256}).seq == 256
        TrainConfig(seq=64)


def test_unknown_fields_in_json_are_rejected():
    with pytest.raises(ValueError, match=r"unknown TrainConfig fields \['lr'\]"):
        TrainConfig.from_dict({**TrainConfig().to_dict(), "lr": 0.1})


def test_schedule_is_linear_warmup_then_cosine_to_end_ratio():
    opt = AdamW(lr=1e-2, warmup_steps=10, end_ratio=0.1)
    sched = opt.schedule(110)
    for k in (0, 5, 10, 60, 110, 500):
        if k <= 10:
            want = 1e-2 * k / 10
        else:
            frac = min(k - 10, 100) / 100
            want = 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + math.cos(math.pi * frac))
        assert float(sched(k)) == pytest.approx(want, rel=1e-5, abs=1e-9)


def test_clipping_and_decay_mask_act_as_specified():
    params = {"w": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
    opt = AdamW(lr=0.1, warmup_steps=0, decay_steps=10, weight_decay=0.5, clip_norm=1.0)
    tx = opt.build(10)
    state = tx.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, state, params)
    # zero gradients: only decoupled weight decay moves w (lr * wd * w); the 1-D scale stays
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
    np.testing.assert_array_equal(updates["scale"], np.zeros(2))
    big = {"w": jnp.full((2, 2), 100.0), "scale": jnp.full((2,), 100.0)}
    clipped, _ = optax.clip_by_global_norm(1.0).update(big, None)
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0, rel=1e-6)


def test_accumulation_averages_micro_batches_before_one_update():
    params = {"w": jnp.arange(4.0).reshape(2, 2)}
    g1, g2 = {"w": jnp.full((2, 2), 1.0)}, {"w": jnp.full((2, 2), 3.0)}
    acc = AdamW(lr=0.1, warmup_steps=0, decay_steps=10, accumulate=2).build(10)
    one = AdamW(lr=0.1, warmup_steps=0, decay_steps=10).build(10)
    s = acc.init(params)
    u1, s = acc.update(g1, s, params)
    np.testing.assert_array_equal(u1["w"], np.zeros((2, 2)))        # no update yet
    u2, s = acc.update(g2, s, params)
    ref, _ = one.update({"w": jnp.full((2, 2), 2.0)}, one.init(params), params)
    np.testing.assert_allclose(u2["w"], ref["w"], rtol=1e-6)        # mean gradient, one step


# -- values when made, files in check() ---------------------------------------------------

_OPENED: list[str] | None = None   # paths opened or listed while recording


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event in ("open", "os.listdir", "os.scandir") and args:
        _OPENED.append(str(args[0]))


sys.addaudithook(_audit)   # records only inside _files_touched (audit hooks stay for good)


def _files_touched(under, make):
    """``make()``'s result and the paths below ``under`` it opened or listed."""
    global _OPENED
    _OPENED = []
    try:
        result = make()
    finally:
        seen, _OPENED = _OPENED, None
    return result, sorted({p for p in seen if p.startswith(str(under))})


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A Hugging Face folder of a 1-layer model: not the 2-layer ``tiny`` preset."""
    from flax import nnx

    folder = tmp_path_factory.mktemp("init") / "one-layer"
    cfg = GPTConfig.preset("tiny").replace(n_layers=1, vocab_size=128)
    wb.hf.to_hf(wb.models.GPT(cfg, rngs=nnx.Rngs(0)), folder)
    return folder


def test_making_a_config_reads_no_file_and_check_reads_them(tmp_path, other_model):
    """A config naming a missing data file, and an init folder of another model, is made
    (from Python and from its JSON) without opening or listing a file; ``check()`` then
    raises what the Trainer and launch raised before: the data glob that matches nothing,
    the architecture fields that differ."""
    from workbench.data._files import DataFileNotFound

    missing = tmp_path / "docs" / "*.jsonl"
    data = wb.data.Dataset(files=str(missing))     # byte-level tokenizer: no file of its own
    cfg, touched = _files_touched(tmp_path, lambda: TrainConfig(data=data))
    assert touched == []
    back, touched = _files_touched(tmp_path, lambda: TrainConfig.from_json(cfg.to_json()))
    assert back == cfg and touched == []
    for c in (cfg, back):
        with pytest.raises(DataFileNotFound, match=rf"no files match {re.escape(repr(str(missing)))}"):
            c.check()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text('{"text": "hello"}\n')
    assert cfg.check() is cfg                        # found now; check returns the config

    wrong, touched = _files_touched(other_model.parent, lambda: TrainConfig(
        model="tiny", model_overrides={"vocab_size": 128}, init=str(other_model)))
    assert touched == [] and wrong.init == str(other_model)
    with pytest.raises(ValueError, match="different architecture.*n_layers"):
        wrong.check()
    right = TrainConfig(model=wb.hf.hf_config(other_model), init=str(other_model))
    _, touched = _files_touched(other_model.parent, right.check)
    assert touched == [str(other_model / "config.json")]   # config.json only, no weights
    gone = right.replace(init=str(other_model.parent / "moved-away"))
    assert gone.check() is gone      # a resumed run needs the folder no more (the Trainer
    #                                  names it when a run without checkpoints needs it)


def test_text_data_folders_are_checked_by_check(tmp_path):
    from workbench.data._files import DataFileNotFound

    cfg = TrainConfig(data=TextData(root=str(tmp_path / "nowhere")))
    with pytest.raises(DataFileNotFound, match="text corpus root .*nowhere.* is not a directory"):
        cfg.check()


def test_post_init_imports_nothing():
    """Every module the value checks need is imported once, at the top of the module (no
    import hides inside ``__post_init__`` or the checks it calls)."""
    import ast
    import inspect
    import textwrap

    from workbench.train import _config as module

    for fn in (TrainConfig.__post_init__, TrainConfig._checked_model,
               TrainConfig._check_pipeline, TrainConfig._check_init):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], \
            fn.__qualname__
    assert module.Dataset is wb.data.Dataset
