"""The one placement default (workbench/_sharding/placement.py): the resolver's table of cases
against hand-written rules, its errors, and every caller that picks a mesh or rules when none
is given (wb.plan, the Trainer through TrainConfig, wb.hf.export_run, wb.hf.from_hf,
wb.generate, wb.search) ending up where the resolver says, on the 8 simulated devices."""
from __future__ import annotations

import json

import jax
import pytest

import workbench as wb
from workbench.models import GPT, GPTConfig
from workbench._sharding.placement import DEFAULT_AXIS, Placement, default_preset, resolve_placement
from workbench._sharding.rules import Rules
from workbench._train_state import abstract_model, param_specs

TINY = GPTConfig.preset("tiny", n_layers=1)
NONE = dict.fromkeys(("seq", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
                      "experts", "expert_mlp"))


def fsdp(axes):
    return Rules(**{**NONE, "batch": axes, "embed": axes})


def fsdp_tp(data, model):
    tp = dict.fromkeys(("heads", "kv_heads", "mlp", "vocab", "expert_mlp"), model)
    return Rules(**{**NONE, **tp, "batch": data, "embed": data})


# --- the resolver's table ---------------------------------------------------------------------

@pytest.mark.parametrize("mesh, shape, preset, rules, because", [
    (None, {"data": 8}, "fsdp", fsdp("data"), "no mesh given: every device"),
    ({"data": 8}, {"data": 8}, "fsdp", fsdp("data"), "batch and the weights' embed dim"),
    ({"data": 4, "model": 2}, {"data": 4, "model": 2}, "fsdp_tp", fsdp_tp("data", "model"),
     "model axis 'model' (size 2) splits the weights"),
    ({"data": -1, "model": 2}, {"data": 4, "model": 2}, "fsdp_tp", fsdp_tp("data", "model"),
     "given as {'data': -1, 'model': 2}"),
    ({"data": 2, "tensor": 4}, {"data": 2, "tensor": 4}, "fsdp_tp", fsdp_tp("data", "tensor"),
     "model axis 'tensor'"),
    ({"data": 8, "model": 1}, {"data": 8, "model": 1}, "fsdp", fsdp(("data", "model")),
     "model axis 'model' has size 1"),
    ({"data": 2, "model": 2, "tp": 2}, {"data": 2, "model": 2, "tp": 2}, "fsdp",
     fsdp(("data", "model", "tp")), "2 model axes ('model', 'tp')"),
    ({"stage": 2, "data": 4}, {"stage": 2, "data": 4}, "fsdp",
     fsdp("data").replace(layers="stage"), "no rules given: 'fsdp'"),
    ({"data": 2, "context": 4}, {"data": 2, "context": 4}, "fsdp", fsdp(("data", "context")),
     "rules='fsdp_cp'"),
    ({"expert": 4, "data": 2}, {"expert": 4, "data": 2}, "fsdp", fsdp(("expert", "data")),
     "rules='fsdp_ep'"),
])
def test_default_table(mesh, shape, preset, rules, because):
    p = resolve_placement(mesh)
    assert isinstance(p, Placement) and isinstance(p.mesh, jax.sharding.Mesh)
    assert dict(p.mesh.shape) == shape and p.mesh.size == 8
    assert p.preset == preset and p.rules == rules
    assert because in p.why and "no rules given" in p.why
    got_mesh, got_rules = p   # unpacks as (mesh, rules)
    assert got_mesh is p.mesh and got_rules is p.rules


def test_abstract_meshes_are_taken_as_given():
    abstract = wb.abstract_mesh("v5e-16", data=4, model=4)
    p = resolve_placement(abstract)
    assert p.mesh is abstract and p.preset == "fsdp_tp" and p.rules == fsdp_tp("data", "model")
    assert default_preset(abstract)[0] == "fsdp_tp"
    assert default_preset(wb.abstract_mesh("v5e-16", data=16))[0] == "fsdp"


def test_what_is_given_keeps_its_meaning():
    mesh = wb.make_mesh(data=4, model=2)
    assert resolve_placement(mesh).mesh is mesh
    p = resolve_placement(mesh, "fsdp")   # a preset name: that preset, never the default
    assert p.preset == "fsdp" and p.rules == fsdp(("data", "model")) and "(given)" in p.why
    assert resolve_placement(mesh, "dp").rules == Rules.preset("dp", mesh)
    table = Rules.preset("tp", mesh).replace(embed="data")
    p = resolve_placement(mesh, table)
    assert p.rules is table and p.preset is None
    assert resolve_placement(mesh, {"batch": ["data"], "embed": None}).rules == \
        Rules(batch="data", embed=None)
    one = jax.devices()[3:4]   # the devices a made mesh spans (wb.generate: the model's one)
    p = resolve_placement(devices=one)
    assert dict(p.mesh.shape) == {DEFAULT_AXIS: 1} and list(p.mesh.devices.flat) == one
    assert p.preset == "fsdp" and "the 1 given device(s)" in p.why


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mesh": 3}, TypeError, r"where: mesh=3 is a int; expected a mesh"),
    ({"mesh": [8]}, TypeError, r"mesh=\[8\] is a list"),
    ({"rules": 3}, TypeError, r"where: rules=3 \(int\) must be a preset name \(dp, fsdp"),
    ({"rules": {1: "data"}}, TypeError, r"where: rules=\{1: 'data'\} is not a table of logical"),
    ({"rules": {"batch": 3}}, TypeError, r"rules=\{'batch': 3\} is not a table .* must be a "
                                         r"mesh axis name"),
    ({"rules": "fdsp"}, ValueError, r"rules='fdsp': unknown rules preset 'fdsp'; choose one"),
    ({"rules": "tp"}, ValueError, r"rules='tp' on mesh \{'data': 8\}: preset 'tp' needs "
                                  r"exactly one model axis"),
    ({"rules": Rules(batch="model")}, ValueError,
     r"rules map 'batch' to mesh axis 'model', but the mesh has axes \('data',\); add 'model'"),
    ({"mesh": {"data": 3}}, ValueError, r"mesh=\{'data': 3\}: mesh data=3 needs 3 devices"),
    ({"mesh": {"data": 8}, "devices": []}, ValueError, r"devices=\[\] is empty"),
])
def test_errors_name_the_argument_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        resolve_placement(**kwargs, where="where")


def test_devices_with_a_mesh_of_its_own_is_refused():
    with pytest.raises(ValueError, match="devices= chooses the devices of a mesh to be made"):
        resolve_placement(wb.make_mesh(data=8), devices=jax.devices()[:2])


# --- every caller, given no mesh or rules ---------------------------------------------------

def specs_of(model):
    """``{path: PartitionSpec}`` of a GPT's parameters as they lie."""
    from flax import nnx

    from workbench._sharding.pytrees import path_str

    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {path_str(p): leaf.sharding.spec
            for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def expected_specs(cfg, rules):
    from workbench._sharding.pytrees import path_str

    _, params, logical = abstract_model(cfg)
    specs = param_specs(params, logical, rules)
    return {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs)[0]}


def assert_placed(mesh, rules, want: Placement):
    assert dict(mesh.shape) == dict(want.mesh.shape)
    assert tuple(mesh.axis_names) == tuple(want.mesh.axis_names)
    assert rules == want.rules


@pytest.mark.parametrize("mesh", [None, {"data": 4, "model": 2}])
def test_plan(mesh):
    want = resolve_placement(mesh)
    plan = wb.plan(TINY, mesh=mesh if mesh is None else wb.make_mesh(mesh), batch=8, seq=16,
                   compile=False, progress=False)
    assert_placed(plan.mesh, plan.rules, want)
    assert plan.report.placement.endswith(want.rules_why) and want.preset in plan.report.placement
    assert f"placement: {plan.report.placement}" in plan.report.summary()
    assert type(plan.report).from_json(json.loads(json.dumps(
        plan.report.to_json()))).placement == plan.report.placement


@pytest.mark.parametrize("mesh", [{"data": -1}, {"data": 4, "model": 2}])
def test_train_config(mesh):
    from workbench.train._setup import build_parts

    want = resolve_placement(mesh)
    parts = build_parts(wb.TrainConfig(model=TINY, mesh=mesh, batch=8, seq=16,
                                       data="synthetic"))
    assert_placed(parts.mesh, parts.rules, want)
    assert parts.placement == {"preset": want.preset, "why": want.why}


def test_a_stored_fsdp_config_keeps_fsdp():
    from workbench.train._setup import build_parts

    cfg = wb.TrainConfig(model=TINY, mesh={"data": 4, "model": 2}, rules="fsdp", batch=8,
                         seq=16, data="synthetic")
    assert build_parts(cfg).rules == fsdp(("data", "model"))
    assert wb.TrainConfig().rules is None and wb.TrainConfig().to_dict()["rules"] is None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step run with the default placement, and its Hugging Face export."""
    root = tmp_path_factory.mktemp("placement")
    cfg = wb.TrainConfig(model=TINY, batch=8, seq=16, steps=1, checkpoint_every=1,
                         data="synthetic")
    trainer = wb.Trainer(cfg, root / "run", progress=None)
    try:
        trainer.run()
        placed = (trainer.mesh, trainer.rules)
    finally:
        trainer.close()
    return root, placed


def test_trainer_records_its_placement(trained):
    root, (mesh, rules) = trained
    want = resolve_placement()
    assert_placed(mesh, rules, want)
    run = json.loads((root / "run" / "run.json").read_text())
    assert run["placement"] == {"preset": "fsdp", "why": resolve_placement({"data": -1}).why}


def test_export_run(trained):
    from workbench.hf._export import restore_params
    from workbench._sharding.pytrees import path_str

    root, _ = trained
    params, cfg, _ = restore_params(root / "run")
    want = resolve_placement()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    assert {tuple(x.sharding.mesh.shape.items()) for _, x in leaves} == {
        tuple(want.mesh.shape.items())}
    assert {path_str(p): x.sharding.spec for p, x in leaves} == \
        expected_specs(cfg, want.rules)


@pytest.mark.parametrize("mesh", [None, {"data": 4, "model": 2}])
def test_from_hf_and_generate(trained, mesh):
    from workbench._generate import _layout

    root, _ = trained
    folder = wb.hf.export_run(root / "run", root / f"hf-{len(mesh or {})}", overwrite=True)
    want = resolve_placement(mesh)
    model = wb.hf.from_hf(folder, mesh=None if mesh is None else want.mesh, progress=False)
    assert specs_of(model) == expected_specs(model.cfg, want.rules)
    assert dict(model.embed[...].sharding.mesh.shape) == dict(want.mesh.shape)
    got_mesh, got_rules = _layout(model, None, batch=8)   # generate runs as it was loaded
    assert_placed(got_mesh, got_rules, want)
    out = wb.generate(model, [1, 2, 3], max_new_tokens=2)
    assert out.shape == (1, 5)


def test_generate_on_an_unsharded_model():
    from flax import nnx

    from workbench._generate import _layout

    model = GPT(TINY, rngs=nnx.Rngs(0))
    device = next(iter(model.embed[...].devices()))
    mesh, rules = _layout(model, None, batch=1)
    want = resolve_placement(devices=[device])
    assert_placed(mesh, rules, want)
    assert list(mesh.devices.flat) == [device]


def test_search_spans_the_default_devices():
    from workbench._search.space import hardware

    want = resolve_placement()
    hw = hardware(None)
    assert hw.size == want.mesh.size
    assert list(hw.mesh({"data": 8}).devices.flat) == list(want.mesh.devices.flat)
    res = wb.search(TINY, batch=8, seq=16, exact=False, progress=False,   # its own meshes:
                    strategies=("fsdp",), remat=("none",), mesh_shapes=[{"data": -1}])
    assert [r["mesh"] for r in res.rows] == [dict(want.mesh.shape)]
    best = res.best
    assert_placed(best.mesh, best.rules, want)


def test_a_model_factory_gets_the_same_rules_from_plan_and_trainer():
    """Given no rules, a factory's annotations pick them (here the Flax guide's model, which
    names the mesh axis ``model``), the same way for wb.plan and the Trainer."""
    import sys
    from pathlib import Path

    import jax.numpy as jnp

    from workbench.train._setup import build_parts

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _models import DotReluDot

    def loss(model, batch):
        x = jax.nn.one_hot(batch["inputs"], 64).mean(1)
        return jnp.mean((model(x) - jax.nn.one_hot(batch["targets"], 64).mean(1)) ** 2)

    spec = wb.any_model.from_nnx(lambda rngs: DotReluDot(64, rngs), loss_fn=loss, vocab_size=64,
                              name="guide")
    mesh = {"data": 2, "model": 4}
    parts = build_parts(wb.TrainConfig(model=spec, mesh=mesh, batch=8, seq=16,
                                       data="synthetic"))
    plan = wb.plan(spec, mesh=wb.make_mesh(mesh), batch=8, seq=16, compile=False,
                   progress=False)
    assert parts.rules == plan.rules and parts.rules["batch"] == "data"
    assert parts.placement["why"] == plan.report.placement
    assert "from the model's annotations ('fsdp_tp'" in plan.report.placement
