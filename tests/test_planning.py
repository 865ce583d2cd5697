"""Plans: compiled and analytic numbers checked against XLA, JAX shards and hand counts."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import workbench as wb
from workbench._compiled.groups import groups_to_axes, parse_replica_groups
from workbench._compiled.hlo import parse_collectives
from workbench.any_model import MLPClassifier, classifier_loss
from workbench.models import GPTConfig
from workbench._sharding.rules import Rules
from workbench._train_state import TrainState

TINY = GPTConfig.preset("tiny")


@pytest.fixture(scope="module")
def mesh():
    return wb.make_mesh(data=4, model=2)


@pytest.fixture(scope="module")
def fsdp_tp(mesh):
    # plain AdamW (not the default's clipping): the tests below name its state
    # (opt_state.0.mu) and the all-reduces of the activations alone
    return wb.plan(TINY, mesh=mesh, rules="fsdp_tp", batch=8, seq=128,
                   optimizer=optax.adamw(3e-4))


def _kinds(plan, kind):
    return {w.kind for w in plan.warnings} & {kind}


# -- compiled plan ------------------------------------------------------------------------

def test_compiled_plan_accessors(fsdp_tp):
    p = fsdp_tp
    assert not p.report.is_estimate and p.compiled is not None
    assert {"params", "optimizer", "temp", "total", "limit"} <= set(p.memory)
    cost = p.compiled.cost_analysis()
    assert p.report.compiled_flops_per_device == float(
        (cost[0] if isinstance(cost, list) else cost)["flops"])
    # XLA also computes the masked half of attention and elementwise ops: factor a bit below 1
    assert 0.75 < p.report.replicated_compute_factor <= 1.0
    assert isinstance(p.shardings, TrainState)
    assert jax.tree.structure(p.shardings) == jax.tree.structure(p.abstract_state)
    q = p.layouts["params.blocks.0.attn.q"]
    assert q.logical_axes == ("embed", "heads", "head_dim")
    assert q.partition_spec == jax.sharding.PartitionSpec("data", "model", None)
    assert p.layouts["opt_state.0.mu.blocks.0.attn.q"].logical_axes == q.logical_axes
    # compiled here, or served from this process's compile cache (another test planned it)
    assert ("from the compile cache" if p.report.compile_cached else "compiled in") in str(p)
    assert "cpu-compiler" in str(p) and "fsdp_tp" in repr(p)


def test_compiled_arguments_equal_layout_bytes(fsdp_tp):
    """XLA's per-device argument bytes == params + optimizer + batch shards (+ int32 step)."""
    ma = fsdp_tp.compiled.memory_analysis()
    m = fsdp_tp.memory
    assert ma.argument_size_in_bytes == m["params"] + m["optimizer"] + m["batch"] + 4
    assert m["total"] == ma.argument_size_in_bytes + ma.output_size_in_bytes \
        - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    assert m["gradients"] == m["params"] and m["temp"] == ma.temp_size_in_bytes


def test_materialize_matches_plan_shardings_and_bytes(fsdp_tp):
    model = fsdp_tp.materialize(seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    per_device: dict[int, int] = {}
    for arr, want in zip(jax.tree.leaves(params), jax.tree.leaves(fsdp_tp.shardings.params),
                         strict=True):
        assert arr.sharding == want
        for shard in arr.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    assert set(per_device) == set(range(8))
    assert set(per_device.values()) == {fsdp_tp.memory["params"]}
    up = params["blocks"][0]["mlp"]["up"]
    assert max(s.data.size for s in up.addressable_shards) == up.size // 8   # never whole
    out = jax.jit(lambda t: model(t))(jnp.zeros((8, 16), jnp.int32))
    assert out.shape == (8, 16, TINY.vocab_size)


def test_compiled_step_runs_and_collectives_name_mesh_axes(fsdp_tp):
    kinds = {(c.kind, c.axes) for c in fsdp_tp.collectives}
    assert ("all-gather", ("data",)) in kinds          # FSDP weight gathers
    assert ("all-reduce", ("model",)) in kinds         # tensor-parallel activations
    tp_ar = [c for c in fsdp_tp.collectives if c.kind == "all-reduce" and c.axes == ("model",)
             and "f32[2,128,64]" in c.shapes]
    assert tp_ar and all(c.group_size == 2 and c.bytes % (2 * 128 * 64 * 4) == 0 for c in tp_ar)
    step = fsdp_tp.train_step()
    state = fsdp_tp.init_state(seed=0)
    tok = jax.random.randint(jax.random.key(0), (8, 129), 0, TINY.vocab_size)
    state, metrics = step(state, {"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))


# -- replica group formats ------------------------------------------------------------------

def test_replica_group_formats():
    assert parse_replica_groups("replica_groups={{0,1},{2,3}}, x", 4) == [[0, 1], [2, 3]]
    assert parse_replica_groups("replica_groups={}, x", 4) == [[0, 1, 2, 3]]
    assert parse_replica_groups("replica_groups=[4,2]<=[8], x", 8) == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parse_replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), x", 8) == \
        [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert parse_replica_groups("replica_groups=[4,2]<=[2,2,2]T(2,1,0), x", 8) == \
        [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert parse_replica_groups(
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, x", 8) == \
        [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert parse_replica_groups(
        "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, x",
        8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups_to_axes([[0, 2, 4, 6], [1, 3, 5, 7]], ("data", "model"), (4, 2)) == \
        (("data",), True)
    assert groups_to_axes([[0, 4], [2, 6], [1, 5], [3, 7]], ("data", "model"), (4, 2)) == \
        (("data",), False)
    hlo = ("ENTRY %main (p: f32[8]) -> f32[8] {\n"
           "  %ar = (f32[2,128,64]{2,1,0}, f32[64]{0}) all-reduce(%a, %b), channel_id=1, "
           "replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add\n"
           "  %ag = bf16[64,128]{1,0} all-gather-start(%c), replica_groups={{0,2,4,6},{1,3,5,7}}"
           ", dimensions={0}\n}\n")
    ag, ar = sorted(parse_collectives(hlo, ("data", "model"), (4, 2)), key=lambda c: c.kind)
    assert (ar.kind, ar.axes, ar.bytes, ar.group_size) == ("all-reduce", ("model",),
                                                           (2 * 128 * 64 + 64) * 4, 2)
    assert ar.wire_bytes == ar.bytes                    # 2(n-1)/n with n=2
    assert (ag.kind, ag.axes, ag.bytes) == ("all-gather", ("data",), 64 * 128 * 2)


# -- lints: each fires on a bad layout and stays silent on a good one ---------------------------

def _abstract(rules, cfg=TINY, **kw):
    return wb.plan(cfg, mesh=wb.abstract_mesh(data=4, model=2), rules=rules, batch=8, seq=128,
                   **kw)


def test_lint_uneven_dims():
    bad = wb.plan(TINY, mesh=wb.abstract_mesh(data=2, model=4), rules="tp", batch=8, seq=128)
    w = [w for w in bad.warnings if w.kind == "uneven"]
    assert w and "'kv_heads', size 2" in w[0].message and "'model' (size 4)" in w[0].message
    assert "2 of 4 blocks are empty" in w[0].message and "blocks.0.attn.k" in w[0].path
    assert w[0].value == sum(bad.layouts[p].padding_waste for p in w[0].paths) > 0
    assert not _kinds(_abstract("fsdp_tp"), "uneven")


def test_lint_replicated_large_params():
    bad = _abstract("dp", replicated_threshold=32 * 1024)
    (w,) = [w for w in bad.warnings if w.kind == "replicated"]
    assert w.path in w.paths
    assert set(w.paths) == {"params.embed", "params.lm_head", *(
        f"params.blocks.{i}.mlp.{m}" for i in range(2) for m in ("gate", "up", "down"))}
    assert "8 devices hold identical copies" in w.message
    assert not _kinds(_abstract("fsdp", replicated_threshold=32 * 1024), "replicated")


def test_lint_redundant_compute_is_quantified(mesh):
    rules = Rules.preset("dp", mesh).replace(batch="data")     # 'model' splits nothing
    bad = wb.plan(TINY, mesh=mesh, rules=rules, batch=8, seq=128, name="idle-model")
    (w,) = [w for w in bad.warnings if w.kind == "redundant_compute"]
    assert w.path == "model" and w.value == 0.5 and "50%" in w.message
    good = wb.plan(TINY, mesh=mesh, rules="dp", batch=8, seq=128)
    assert not _kinds(good, "redundant_compute")
    # the compiled step confirms it: each device does twice the work of the dp plan (2%:
    # XLA counts the whole step's HLO, where a few small ops do not double; not float error)
    ratio = bad.report.compiled_flops_per_device / good.report.compiled_flops_per_device
    assert ratio == pytest.approx(2.0, rel=0.02)
    # and the estimates for a mesh of that shape split the compute as XLA does
    est_bad, est_good = _abstract(rules), _abstract("dp")
    assert est_bad.flops_per_device / est_good.flops_per_device == pytest.approx(ratio, rel=0.02)
    assert bad.report.replicated_compute_factor == pytest.approx(
        good.report.replicated_compute_factor / 2, rel=0.02)
    table = wb.compare([good, bad])
    assert [r["name"] for r in table.rows] == ["dp", "idle-model"]
    assert "idle-model" in table.table()


def test_lint_fsdp_gathers_report_bytes(fsdp_tp):
    (w,) = [w for w in fsdp_tp.warnings if w.kind == "fsdp_gather"]
    gathers = [c for c in fsdp_tp.collectives if c.kind == "all-gather" and "data" in c.axes]
    assert w.value == sum(c.total_wire_bytes for c in gathers) > 0
    assert "compiled step" in w.message
    assert not _kinds(_abstract("tp"), "fsdp_gather")
    # A compiled step that gathers no weight (XLA moved activations instead) is said so,
    # not reported as a cost of 0 all-gathers.
    from workbench.planning import _lints as _plan_lints

    params = {k[len("params."):]: v for k, v in fsdp_tp.layouts.items() if k.startswith("params.")}
    others = [c for c in fsdp_tp.collectives if c.kind != "all-gather"]
    (none,) = _plan_lints.fsdp_gathers(params, fsdp_tp.rules, fsdp_tp.mesh, others, True)
    assert none.value == 0 and "gathers none of them" in none.message
    assert none.paths == w.paths


def test_lint_memory_over_limit():
    bad = _abstract("fsdp", memory_limit=1024 ** 2)
    (w,) = [w for w in bad.warnings if w.kind == "memory"]
    assert w.severity == "error" and bad.fits is False
    assert w.value == bad.memory["total"] - 1024 ** 2
    assert not _kinds(_abstract("fsdp", memory_limit=1024 ** 3), "memory")


def test_lint_unmapped_logical_axes():
    partial = Rules(batch="data", embed=None, heads="model", mlp="model", vocab="model",
                    seq=None, head_dim=None)
    bad = _abstract(partial)
    (w,) = [w for w in bad.warnings if w.kind == "unmapped"]
    assert w.path == "kv_heads" and "blocks.0.attn.k" in w.paths and len(w.paths) == 4
    assert "kv_heads=None" in w.fix
    assert bad.layouts["params.blocks.0.attn.k"].partition_spec == \
        jax.sharding.PartitionSpec(None, None, None)
    assert not _kinds(_abstract(partial.replace(kv_heads="model")), "unmapped")


# -- analytic plans ---------------------------------------------------------------------------

def test_analytic_plan_for_a_pod():
    mesh = wb.abstract_mesh("v5p-1024", data=-1, model=4)
    p = wb.plan(GPTConfig.preset("70b"), mesh=mesh, rules="fsdp_tp", batch=512, seq=8192,
                compile=False)
    assert p.report.is_estimate and p.compiled is None and "ESTIMATE" in str(p)
    assert p.memory["limit"] == mesh.memory_per_device
    # 70.55e9 params, f32, sharded 512 ways (embed over data=128, heads/mlp over model=4);
    # 1%: the norm scales, replicated rather than split 512 ways, and shard padding
    assert p.memory["params"] == pytest.approx(GPTConfig.preset("70b").n_params * 4 / 512,
                                               rel=0.01)
    assert p.memory["optimizer"] == pytest.approx(2 * p.memory["params"], rel=0.01)
    assert p.report.replicated_compute_factor == 1.0
    assert all(c.names[0].startswith("estimate") for c in p.collectives)
    with pytest.raises(RuntimeError, match="needs real devices"):
        p.materialize()


def test_analytic_estimate_matches_compiled_where_exact(fsdp_tp):
    est = _abstract("fsdp_tp", optimizer=optax.adamw(3e-4))   # the fixture's optimizer
    for k in ("params", "optimizer", "batch", "gradients"):
        assert est.memory[k] == fsdp_tp.memory[k]
    assert {(c.kind, c.axes) for c in est.collectives} >= {("all-gather", ("data",)),
                                                            ("all-reduce", ("model",))}


def test_plan_of_a_factory_model(mesh):
    factory = lambda rngs: MLPClassifier(32, (64,), 10, rngs=rngs)
    example = {"x": jax.ShapeDtypeStruct((16, 32), jnp.float32),
               "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
    p = wb.plan(factory, mesh=mesh, rules=Rules(batch="data", embed=None, mlp="model"),
                batch=16, loss_fn=classifier_loss, example_batch=example)
    # Hand count: forward two matmuls; backward two weight gradients and one input gradient
    # (the first layer's input is data, so it gets none).
    forward = 2 * 16 * (32 * 64 + 64 * 10)
    assert p.model_flops == forward + 2 * 16 * (32 * 64 + 2 * 64 * 10)
    assert p.layouts["params.weights.0"].partition_spec == jax.sharding.PartitionSpec(None,
                                                                                        "model")
    assert p.report.compiled_flops_per_device > 0 and not p.warnings


def test_compare_figure_and_table(fsdp_tp):
    other = _abstract("dp")
    cmp = wb.compare([fsdp_tp, other])
    rows = cmp.rows
    assert rows[0]["memory_per_device"] == fsdp_tp.memory["total"]
    assert rows[1]["estimate"] is True
    fig = cmp.figure()
    assert {t.name for t in fig.data} >= {"params", "optimizer"}
    assert math.isfinite(rows[0]["comm_bytes_per_device"])
    with pytest.raises(ValueError):
        wb.compare([])


# -- widget -------------------------------------------------------------------------------------

def test_plan_widget_payload_and_render(fsdp_tp, tmp_path):
    import json
    import pathlib
    import shutil
    import subprocess

    from workbench.widgets import _assets
    from workbench.widgets._plan_view import PlanView, plan_payload

    p = plan_payload(fsdp_tp)
    per = p["memory"]["per_device"]
    assert per["params"] == [fsdp_tp.memory["params"]] * 8
    assert per["optimizer"] == [fsdp_tp.memory["optimizer"]] * 8
    assert json.loads(json.dumps(p)) == p                  # JSON-clean
    assert isinstance(fsdp_tp.widget(), PlanView)
    w = wb.show(fsdp_tp)
    assert isinstance(w, PlanView)
    rows = {r["path"]: r for r in w.tensors.table.payload["rows"]}
    assert set(rows) >= {"params.blocks.0.attn.q", "opt_state.0.mu.blocks.0.attn.q"}
    assert rows["params.blocks.0.attn.q"]["logical"] == ["embed", "heads", "head_dim"]
    # the table shows the shards the compiled step takes as arguments
    q_in = fsdp_tp.compiled.input_shardings[0][0].params["blocks"][0]["attn"]["q"]
    assert rows["params.blocks.0.attn.q"]["shard"] == list(q_in.shard_shape((64, 4, 16)))
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    bad = _abstract("fsdp", memory_limit=1024 ** 2)          # over the limit: a lint + a line
    harness = pathlib.Path(__file__).parent / "widgets_js" / "render.mjs"
    (tmp_path / "plan.mjs").write_text(_assets.esm("plan"))
    (tmp_path / "state.json").write_text(json.dumps({"payload": plan_payload(bad)}))
    out = subprocess.run([node, str(harness), str(tmp_path / "plan.mjs"),
                          str(tmp_path / "state.json")], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert len(rep["cols"]) == 8 and rep["classes"]["wb-plan-limit"] == 1
    top = max(bad.memory["limit"], bad.memory["total"])
    assert float(rep["cols"][0]["style:height"][:-2]) == pytest.approx(
        120 * bad.memory["total"] / top, rel=1e-3)
    assert rep["classes"]["wb-lint"] == len(bad.warnings) and "ESTIMATE" in rep["text"]
    assert rep["handlers_left"] == 0


def test_explicit_axes_are_refused_with_the_fix():
    explicit = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match=r"needs Auto axes: build the mesh with wb.make_mesh"):
        wb.plan(TINY, mesh=explicit, rules="fsdp_tp", batch=8, seq=64)
    with pytest.raises(ValueError, match="unknown rules preset"):
        wb.plan(TINY, mesh=wb.abstract_mesh(data=8), rules="ddp", batch=8)
    with pytest.raises(ValueError, match="dtype='bfloat16' applies to a GPTConfig"):
        wb.plan(lambda rngs: MLPClassifier(4, (4,), 2, rngs=rngs), mesh=wb.abstract_mesh(data=8),
                rules=Rules(batch="data", embed=None, mlp=None), batch=8, dtype="bfloat16")


def test_remat_estimate_matches_the_compiled_remat_step(mesh, fsdp_tp):
    """remat="full": the estimate's FLOPs per device (model FLOPs + recompute) grow by the
    factor XLA counts in the compiled steps with and without remat; activations shrink in
    both. Model FLOPs stay the same (MFU never counts recompute)."""
    cfg = TINY.replace(remat="full")
    compiled = wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=8, seq=128)
    base, remat = _abstract("fsdp_tp"), _abstract("fsdp_tp", cfg=cfg)
    xla = compiled.report.compiled_flops_per_device / fsdp_tp.report.compiled_flops_per_device
    assert xla > 1.1                                                  # remat recomputes
    # 2%: the estimate's recompute against XLA's own count (a model, not float error)
    assert remat.flops_per_device / base.flops_per_device == pytest.approx(xla, rel=0.02)
    assert remat.model_flops == base.model_flops == compiled.model_flops
    assert remat.memory["activations"] < base.memory["activations"]
    assert compiled.memory["temp"] < fsdp_tp.memory["temp"]
