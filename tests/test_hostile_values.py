"""Issue 56 items 8 and 9: a misspelt logical axis and values that were ignored or wrong get
a clear error naming the argument, the value and the fix. One row per case of the issue;
each failed (accepted in silence, or a raw exception) before the fix."""
from __future__ import annotations

import contextlib
import io
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import workbench as wb
from workbench.__main__ import main
from workbench.hardware import Calibration, CalibrationWarning, load_calibration
from workbench.models import GPTConfig
from workbench.train import TrainConfig, Trainer

TINY = GPTConfig.preset("tiny")
GOOD = {"model": "tiny", "mesh": {"data": 8}, "batch": 8, "seq": 32, "steps": 2,
        "data": "synthetic"}
X = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32)}


def mse(model, batch):
    return jnp.mean(model(batch["x"]) ** 2)


class Hidden(nnx.Module):
    """A user model naming its own logical axis, 'hidden'."""

    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "hidden"))
        self.w = nnx.Param(init(rngs.params(), (16, 64)))

    def __call__(self, x):
        return x @ self.w[...]


def plan(model=TINY, **kw):
    kw.setdefault("mesh", wb.make_mesh(data=8))
    if model is TINY:
        kw.setdefault("seq", 32)
    return wb.plan(model, batch=8, compile=kw.pop("compile", False), progress=False, **kw)


def trainer(tmp: pathlib.Path, **fields) -> Trainer:
    return Trainer(TrainConfig(**{**GOOD, **fields}), run_dir=tmp / "runs" / "v",
                   progress=None, compile_cache=False)


# -- item 8: a misspelt logical axis --------------------------------------------------------

# (rules with a name no tensor uses, the rules meant, what the error must list)
MISSPELT = [
    pytest.param({"not_a_logical": "data", "batch": "data"}, {"embed": "data", "batch": "data"},
                 r"'not_a_logical'.*embed, .*vocab", id="dict-not_a_logical"),
    pytest.param(wb.Rules(bogus="data", batch="data"), wb.Rules(embed="data", batch="data"),
                 r"'bogus'.*embed, .*vocab", id="Rules-bogus"),
    pytest.param({"embedd": "data", "batch": "data"}, {"embed": "data", "batch": "data"},
                 r"'embedd'.*[Dd]id you mean 'embed'", id="dict-embedd"),
]


@pytest.mark.parametrize("bad, meant, listed", MISSPELT)
def test_a_rule_no_tensor_uses_is_refused_listing_the_axes(bad, meant, listed):
    # reference: the rule spelt right shards the weights; without it they are replicated
    # (what the misspelt table did: 7.46 MB per device instead of 1.43 MB)
    sharded = plan(rules=meant).memory["params"]
    replicated = plan(rules={"batch": "data"}).memory["params"]
    assert sharded * 4 < replicated
    with pytest.raises(ValueError, match=listed):
        plan(rules=bad)


def test_the_trainer_refuses_a_misspelt_rule_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"'embedd'.*[Dd]id you mean 'embed'"):
        trainer(tmp_path, rules={"embedd": "data", "batch": "data"})
    assert not (tmp_path / "runs").exists()


def test_a_user_models_own_axis_names_are_the_valid_ones():
    spec = wb.any_model.from_nnx(Hidden, example_batch=X, loss_fn=mse)
    good = plan(spec, mesh=wb.make_mesh(data=2, model=4), rules=wb.Rules(batch="data",
                                                                         hidden="model"))
    assert good.shardings.params["w"].spec == jax.sharding.PartitionSpec(None, "model")
    with pytest.raises(ValueError, match=r"'hiden'.*[Dd]id you mean 'hidden'.*hidden"):
        plan(spec, mesh=wb.make_mesh(data=2, model=4),
             rules=wb.Rules(batch="data", hiden="model"))


# -- item 9: values silently ignored or wrong ------------------------------------------------

def cli(*argv: object) -> None:
    """``python -m workbench ARGV`` in this process; a non-zero exit raises SystemExit with
    its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    if code:
        raise SystemExit(f"exit {code}: {err.getvalue()}")


def config_file(tmp: pathlib.Path) -> pathlib.Path:
    (tmp / "in").mkdir(exist_ok=True)
    path = tmp / "in" / "config.json"
    path.write_text(json.dumps(GOOD))
    return path


def stored_calibration(tmp: pathlib.Path, factor: float) -> Calibration | None:
    """A calibration file of 'H100' with ``compute_factor=factor``, loaded back."""
    (tmp / "cal").mkdir()
    fields = {"device_kind": "H100", "compute_factor": factor, "memory_factor": 0.5,
              "matmul_flops": 1e14, "hbm_bandwidth": 1e12, "collectives": {},
              "overlap": None, "provenance": [{"directory": "p", "date": "2026-01-01"}]}
    (tmp / "cal" / "h100.json").write_text(json.dumps(fields))
    return load_calibration("H100")




# (case as the issue words it, call(tmp), exception, message regex)
CASES = [
    ("dense moe_matmul='bogus'", lambda t: TINY.replace(moe_matmul="bogus"),
     ValueError, r"moe_matmul='bogus'.*'auto', 'grouped', 'dense'"),
    ("dense capacity_factor=-1", lambda t: TINY.replace(capacity_factor=-1),
     ValueError, r"capacity_factor=-1 .*> 0"),
    ("dense capacity_factor=nan", lambda t: TINY.replace(capacity_factor=math.nan),
     ValueError, r"capacity_factor=nan is not finite"),
    ("dense router_aux_loss=nan", lambda t: TINY.replace(router_aux_loss=math.nan),
     ValueError, r"router_aux_loss=nan is not finite"),
    ("dense experts_per_token=99", lambda t: TINY.replace(experts_per_token=99),
     ValueError, r"experts_per_token=99 on a dense config.*n_experts >= 99"),
    ("peak_flops('bogus-chip')", lambda t: wb.peak_flops("bogus-chip"),
     ValueError, r"device='bogus-chip' is not a device kind.*H100.*jax.Device"),
    ("Calibration(compute_factor=1e300)", lambda t: Calibration(
        device_kind="H100", compute_factor=1e300, memory_factor=0.5, matmul_flops=1e14,
        hbm_bandwidth=1e12, collectives={}, overlap=None, provenance=[]),
     ValueError, r"compute_factor is 1e\+300, not a factor in \[0.0001, 100\]"),
    ("TrainConfig(steps=2**31)", lambda t: TrainConfig(**{**GOOD, "steps": 2 ** 31}),
     ValueError, r"TrainConfig.steps=2147483648 is past 2147483647 .*int32 step counter"),
    ("Trainer.run(steps=2**31)", lambda t: trainer(t).run(steps=2 ** 31),
     ValueError, r"Trainer.run: steps=2147483648 is past 2147483647"),
    ("CLI train --steps 2**31", lambda t: cli("train", config_file(t), "--run-dir",
                                             t / "runs" / "cli", "--steps", 2 ** 31),
     SystemExit, r"(?s)exit 2:.*--steps: 2147483648 is past the int32 step counter"),
    ("CLI launch --steps 2**31", lambda t: cli("launch", config_file(t), "--run-dir",
                                              t / "runs" / "cli", "--steps", 2 ** 31),
     SystemExit, r"(?s)exit 2:.*--steps: 2147483648 is past the int32 step counter"),
    ("search(stages=[3])", lambda t: wb.search(TINY, "v5e-8", batch=16, seq=32, stages=[3],
                                               exact=False, progress=False),
     ValueError, r"stages\[0\]=3: no candidate mesh's data axis.*\[2, 4, 8\]"),
    ("plan(loss_fn='xent')", lambda t: plan(loss_fn="xent"),
     TypeError, r"loss_fn='xent' is a str, not a callable"),
    ("plan(example_batch={'inputs': 5})", lambda t: plan(
        wb.any_model.from_nnx(Hidden), example_batch={"inputs": 5}, loss_fn=mse),
     TypeError, r"example_batch=.*'inputs': 5 is not a name -> array shape.*ShapeDtypeStruct"),
    ("plan(a factory returning 5)", lambda t: plan(lambda rngs: 5, example_batch=X,
                                                   loss_fn=mse),
     TypeError, r"returned 5 .*not an nnx.Module"),
    ("plan(overlap={'bogus': 1})", lambda t: plan(overlap={"bogus": 1}, compile=True),
     ValueError, r"overlap=\{'bogus': 1\}: the cpu compiler refused it.*overlap=True"),
    ("TrainConfig.from_json('[1]')", lambda t: TrainConfig.from_json("[1]"),
     TypeError, r"from_dict: \[1\] is a list, not an object of TrainConfig fields"),
    ("model_overrides as a string", lambda t: TrainConfig(
        **{**GOOD, "model_overrides": "n_layers=4"}),
     TypeError, r"model_overrides='n_layers=4' is a str; give a dict.*\{'n_layers': 4\}"),
]


@pytest.mark.parametrize("case, call, exc, match", CASES, ids=[c[0] for c in CASES])
def test_a_value_that_was_ignored_or_wrong_is_refused(case, call, exc, match, tmp_path,
                                                      monkeypatch):
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path / "cal"))
    with pytest.raises(exc, match=match):
        call(tmp_path)
    assert not trained(tmp_path)   # nothing trained, nothing saved


def trained(tmp: pathlib.Path) -> list[pathlib.Path]:
    """Metrics or checkpoints written under ``tmp/runs`` (a Trainer's run.json may be)."""
    return [p for p in (tmp / "runs").rglob("*") if p.parent.name == "checkpoints"
            or (p.name == "metrics.jsonl" and p.stat().st_size)]


def test_the_good_values_still_work():
    """The reference beside the rows: what they meant is accepted as before."""
    assert TINY.replace(capacity_factor=1.25, router_aux_loss=0.0).capacity_factor == 1.25
    assert GPTConfig.preset("moe-tiny", experts_per_token=1).experts_per_token == 1
    assert wb.peak_flops("H100")[1].startswith("table")
    assert wb.peak_flops("cpu")[1].startswith("measured")
    assert TrainConfig(**{**GOOD, "steps": 2 ** 31 - 1}).steps == 2 ** 31 - 1


def test_a_stored_calibration_out_of_range_is_ignored_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path / "cal"))
    with pytest.warns(CalibrationWarning, match=r"h100.json is ignored: compute_factor is "
                                                r"1e\+300, not a factor in"):
        assert stored_calibration(tmp_path, 1e300) is None


def test_search_notes_each_mesh_its_stage_count_does_not_divide():
    res = wb.search(TINY, "v5e-8", batch=16, seq=32, stages=[2], strategies=("fsdp",),
                    mesh_shapes=[(8, 1), (1, 8)], exact=False, progress=False)
    reasons = [s["reason"] for s in res.skipped]
    assert any("stages=2 does not divide the data axis of mesh {'data': 1, 'model': 8}" in r
               for r in reasons), reasons
    assert any(r["mesh"].get("stage") == 2 for r in res.rows)
