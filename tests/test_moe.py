"""Mixture of experts and expert parallelism: exact against one device, HLO vs hand counts.

References: the same MoE trained on one device (float32 rounding; dropless routing), the
parameter count of the built model, hand counts of the all-to-all bytes, the compiled HLO,
an uninterrupted run (bitwise resume) and an in-process run (2 x 4 processes over gloo).
"""
from __future__ import annotations

import json
import math
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import workbench as wb
import workbench._flops  # noqa: F401 - wb._flops below
from workbench import _runs as runs
from workbench import _step as S, _train_state as TS
from workbench.models import GPTConfig
from workbench.models._moe_choice import capacity
from workbench.perf._analytic_collectives import moe_collectives
from workbench._sharding.rules import Rules

pytestmark = pytest.mark.usefixtures("wb_cache")

TINY = GPTConfig.preset("moe-tiny", seq_len=16)


def _mesh(**axes):
    n = math.prod(axes.values())
    return wb.make_mesh(axes, devices=jax.devices()[:n])


# ----------------------------------------------------------------------------- config
def test_bad_moe_configs_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"experts_per_token=9 .* n_experts=8"):
        GPTConfig.preset("moe-tiny", experts_per_token=9)
    for cf in (0, -1.5):
        with pytest.raises(ValueError, match=rf"capacity_factor={cf} is out of range.*> 0.*None"):
            GPTConfig.preset("moe-tiny", capacity_factor=cf)
    with pytest.raises(ValueError, match="moe_dispatch='ring'"):
        GPTConfig.preset("moe-tiny", moe_dispatch="ring")


def test_experts_not_divisible_by_the_expert_axis_fail_before_anything_is_written(tmp_path):
    cfg = wb.TrainConfig(model="moe-tiny", model_overrides={"n_experts": 6},
                         mesh={"expert": 4, "data": 2}, rules="ep", batch=8, seq=16, steps=2)
    with pytest.raises(ValueError, match=r"n_experts=6 is not divisible by the expert mesh "
                                         r"axes \('expert',\) \(size 4\).*\[1, 2, 3, 6\]"):
        wb.Trainer(cfg, run_dir=tmp_path / "run", progress=None)
    assert not (tmp_path / "run").exists()
    six = TINY.replace(n_experts=6)
    with pytest.raises(ValueError, match="n_experts=6 is not divisible"):   # before tracing
        wb.plan(six, mesh=_mesh(expert=4, data=2), rules="ep", batch=8, progress=False)
    # planned on hardware we do not have: an estimate whose error lint says why
    p = wb.plan(six, mesh=wb.abstract_mesh("v5p-8", expert=4), rules="ep", batch=8,
                compile=False, progress=False)
    lint = next(w for w in p.warnings if w.kind == "moe_experts_uneven")
    assert lint.severity == "error" and "n_experts=6" in lint.message


@pytest.mark.parametrize("name", ["moe-tiny", "moe-small", "qwen1.5-moe-a2.7b"])
def test_param_counts_match_the_built_model(name):
    cfg = GPTConfig.preset(name, scan_layers=False)   # unrolled: blocks[0] is one block
    _, params, _ = TS.abstract_model(cfg)
    assert cfg.n_params == sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    blocks = params["blocks"][0]["mlp"]
    per_expert = sum(math.prod(blocks[w].shape[1:]) for w in ("gate", "up", "down"))
    skipped = cfg.n_layers * (cfg.n_experts - cfg.experts_per_token) * per_expert
    assert cfg.n_active_params == cfg.n_params - skipped


def test_public_moe_shapes_match_their_published_sizes():
    # Mixtral paper: 46.7B total, 12.9B active; Qwen3-30B-A3B: 30.5B / 3.3B;
    # Qwen1.5-MoE-A2.7B: 14.3B / 2.7B (model cards)
    for name, total, active in (("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3),
                                ("qwen1.5-moe-a2.7b", 14.3, 2.7)):
        cfg = GPTConfig.preset(name)
        assert cfg.n_params / 1e9 == pytest.approx(total, abs=0.06)   # published to 0.1B
        assert cfg.n_active_params / 1e9 == pytest.approx(active, abs=0.06)


def test_flops_count_active_experts_only():
    cfg = GPTConfig.preset("mixtral-8x7b")
    f = wb._flops.gpt_flops(cfg, batch=1, seq=128)
    dense = wb._flops.gpt_flops(cfg.replace(n_experts=0), batch=1, seq=128)
    k, d, fe = cfg.experts_per_token, cfg.d_model, cfg.moe_d_ff
    assert f.breakdown["mlp"] == pytest.approx(k * dense.breakdown["mlp"])
    assert f.breakdown["router"] == 3 * 2 * d * cfg.n_experts * cfg.n_layers * 128
    assert f.six_n == 6 * cfg.n_active_params * 128
    assert f.breakdown["mlp"] == 3 * 2 * 3 * d * fe * k * cfg.n_layers * 128


def test_expert_rules_presets():
    mesh = wb.abstract_mesh("v5p-16", expert=4, data=2)
    ep = Rules.preset("ep", mesh)
    assert ep["experts"] == "expert" and ep["batch"] == ("expert", "data")
    assert ep.spec(("experts", "embed", "expert_mlp")) == \
        jax.sharding.PartitionSpec("expert", None, None)
    fsdp_ep = Rules.preset("fsdp_ep", mesh)
    assert fsdp_ep["embed"] == "data"
    assert fsdp_ep.spec(("experts", "embed", "expert_mlp")) == \
        jax.sharding.PartitionSpec("expert", "data", None)
    tp = Rules.preset("ep_tp", wb.abstract_mesh("v5p-16", expert=2, data=2, model=2))
    assert tp["expert_mlp"] == "model" and tp["batch"] == ("expert", "data")
    with pytest.raises(ValueError, match="needs one mesh axis named 'expert'"):
        Rules.preset("ep", wb.abstract_mesh("v5p-16", data=8))
    with pytest.raises(ValueError, match="use 'ep_tp'"):
        Rules.preset("ep", wb.abstract_mesh("v5p-16", expert=4, model=2))
    # the dense presets replicate the experts on an expert axis (plain data parallelism)
    assert Rules.preset("fsdp", mesh)["experts"] is None


# ----------------------------------------------------------------------------- exactness
def _train(cfg, mesh, rules, steps=3):
    opt = optax.adam(1e-2)
    tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    rules = Rules.preset(rules, mesh) if isinstance(rules, str) else rules
    graphdef, state = S.init_state(cfg, opt, rules, mesh, seed=0)
    sh = TS.state_shardings(cfg, opt, rules, mesh)
    step = S.jit_train_step(S.make_train_step(graphdef, opt, rules=rules, mesh=mesh), sh,
                            TS.batch_shardings(rules, mesh))
    out = []
    for _ in range(steps):
        state, m = step(state, batch)
        out.append({k: float(v) if np.ndim(v) == 0 else np.asarray(v)
                    for k, v in jax.device_get(m).items()})
    return out


@pytest.fixture(scope="module")
def one_device():
    return _train(TINY, _mesh(data=1), "dp")


@pytest.mark.parametrize("axes,rules,changes", [
    ({"expert": 4, "data": 2}, "ep", {}),
    ({"expert": 8}, "ep", {"moe_dispatch": "all_gather"}),
    ({"expert": 4, "data": 2}, "fsdp_ep", {"scan_layers": True, "remat": "full"}),
], ids=["ep4x2-all_to_all", "ep8-all_gather", "fsdp_ep4x2-scan-remat"])
@pytest.mark.slow
def test_expert_parallel_training_equals_one_device(one_device, axes, rules, changes):
    got = _train(TINY.replace(**changes), _mesh(**axes), rules)
    ref = one_device
    # expert-sharded sums in another order, compounding over the steps: 80 eps (_tolerance)
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in ref], rel=1e-5)
    for g, r in zip(got, ref):
        # the same routing: integer loads per layer and expert, nothing dropped
        np.testing.assert_array_equal(g["moe_tokens_per_expert"], r["moe_tokens_per_expert"])
        assert g["moe_dropped"] == r["moe_dropped"] == 0
        for k in ("moe_aux_loss", "moe_z_loss", "moe_entropy", "grad_norm"):
            assert g[k] == pytest.approx(r[k], rel=1e-5), k
    tpe = ref[0]["moe_tokens_per_expert"]
    assert tpe.shape == (TINY.n_layers, TINY.n_experts)
    assert (tpe.sum(axis=1) == 8 * TINY.seq_len * TINY.experts_per_token).all()


def test_router_losses_are_in_the_loss(one_device):
    """The step's loss is cross-entropy plus the weighted router losses (JAX's reference:
    the same params' cross-entropy computed by lm_loss outside the step)."""
    cfg = TINY
    opt = optax.adam(1e-2)
    mesh = _mesh(data=1)
    rules = Rules.preset("dp", mesh)
    _, state = S.init_state(cfg, opt, rules, mesh, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
    graphdef = TS.abstract_model(cfg)[0]
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    ce = float(jax.jit(lambda p: S.lm_loss(nnx.merge(graphdef, p), batch))(state.params))
    m = one_device[0]
    router = cfg.router_aux_loss * m["moe_aux_loss"] + cfg.router_z_loss * m["moe_z_loss"]
    assert m["moe_router_loss"] == pytest.approx(router, rel=1e-6)
    assert m["loss"] == pytest.approx(ce + router, rel=1e-6)
    assert 1.0 <= m["moe_aux_loss"] < cfg.n_experts    # 1.0: perfectly balanced
    assert 0 < m["moe_entropy"] <= math.log(cfg.n_experts)


@pytest.mark.slow
def test_capacity_drops_what_overflows():
    """With a capacity factor, each device's group drops its assignments past
    ``capacity`` per expert: a hand count from the same routing (top-k of the router)."""
    cfg = TINY.replace(capacity_factor=0.5)
    m = _train(cfg, _mesh(expert=4, data=2), "ep", steps=1)[0]
    tpe = m["moe_tokens_per_expert"]
    # a lower bound by hand: over all 8 groups an expert keeps at most 8 * capacity
    cap = capacity(cfg, 8 * cfg.seq_len // 8)
    floor = int(np.maximum(tpe - 8 * cap, 0).sum())
    assert m["moe_dropped"] >= max(floor, 1)
    assert m["moe_dropped"] <= int(tpe.sum())


# ----------------------------------------------------------------------------- plans
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
@pytest.mark.slow
def test_dispatch_collectives_in_the_hlo_equal_the_hand_count(dispatch):
    # the dense path's (E, C, D) buffer (grouped rows: test_moe_grouped)
    cfg = TINY.replace(moe_dispatch=dispatch, moe_matmul="dense")
    batch, seq = 8, cfg.seq_len
    p = wb.plan(cfg, mesh=_mesh(expert=4, data=2), rules="ep", batch=batch, progress=False)
    assert p.source == "cpu-compiler"
    e, d, n, L = cfg.n_experts, cfg.d_model, 4, cfg.n_layers
    g = batch * seq // 8                               # tokens per device (one group)
    def count(kind, nbytes):   # instructions of that size over the expert axis, per step
        return sum(c.count for c in p.collectives
                   if c.kind == kind and c.axes == ("expert",) and c.bytes == nbytes)

    if dispatch == "all_to_all":
        # 2 all-to-alls per layer forward, 2 backward, each moving the (E, C, D) buffer
        assert count("all-to-all", e * g * d * 4) == 4 * L
        assert sum(c.count for c in p.collectives if c.kind == "all-to-all") == 4 * L
    else:   # tokens gathered, outputs reduce-scattered, forward and backward
        assert count("all-gather", n * g * d * 4) == 2 * L
        assert count("reduce-scatter", g * d * 4) == 2 * L
    hand = moe_collectives(cfg, p.rules, p.mesh, batch, seq)
    assert hand
    for c in hand:
        assert count(c.kind, c.bytes) == c.count
    # no FSDP gather of the experts: their shards stay where they are
    assert not [w for w in p.warnings if w.kind == "fsdp_gather"]


def test_moe_lints_on_a_pod_estimate():
    mesh = wb.abstract_mesh("v5p-128", expert=8, data=8)
    cfg = GPTConfig.preset("mixtral-8x7b", capacity_factor=0.5, scan_layers=False)
    # experts over 'expert' but the batch only over 'data': duplicated tokens
    rules = Rules.preset("ep", mesh).replace(batch="data")
    p = wb.plan(cfg, mesh=mesh, rules=rules, batch=64, compile=False, progress=False)
    kinds = {w.kind: w for w in p.warnings}
    assert "moe_expert_batch" in kinds and "'expert'" in kinds["moe_expert_batch"].message
    cap = kinds["moe_capacity"]
    assert cap.severity == "warning" and cap.value == pytest.approx(0.5, abs=0.01)
    # memory counts every expert: the expert weights' shards are 1/8 of all experts
    lay = p.layouts["params.blocks.0.mlp.gate"]
    assert lay.shard_shape[0] == cfg.n_experts // 8
    # the estimate lists the all-to-all by formula
    a2a = [c for c in p.collectives if c.kind == "all-to-all"]
    assert a2a and a2a[0].axes == ("expert",) and a2a[0].count == 4 * cfg.n_layers
    ok = wb.plan(cfg.replace(capacity_factor=1.25), mesh=mesh, rules="fsdp_ep", batch=64,
                 compile=False, progress=False)
    assert {w.kind for w in ok.warnings}.isdisjoint({"moe_expert_batch", "moe_experts_uneven"})
    assert next(w for w in ok.warnings if w.kind == "moe_capacity").severity == "info"


# ----------------------------------------------------------------------------- training runs
N = 9
CFG = wb.TrainConfig(model="moe-tiny", mesh={"expert": 4, "data": 2}, rules="ep", batch=8,
                     seq=16, steps=N, checkpoint_every=3,
                     data=wb.data.TextData(max_bytes=100_000),
                     optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=2))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe") / "ref"
    tr = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    tr.run()
    return run_dir, tr.losses


@pytest.mark.slow
def test_trainer_logs_expert_load_to_metrics_jsonl(reference_run):
    run_dir, losses = reference_run
    recs = runs.read_metrics(run_dir)
    assert [r["loss"] for r in recs] == losses and len(recs) == N
    tpe = np.array([r["moe_tokens_per_expert"] for r in recs])
    assert tpe.shape == (N, CFG.model_config().n_layers, CFG.model_config().n_experts)
    assert (tpe.sum(axis=2) == 8 * 16 * 2).all()
    assert all(r["moe_dropped"] == 0 and r["moe_entropy"] > 0 for r in recs)


@pytest.mark.slow
def test_a_new_trainer_resumes_bitwise_with_the_same_expert_loads(reference_run, tmp_path):
    """Stopped at step 3 and continued to N by a new Trainer: the router and experts restore
    exactly: the losses and every resumed step's expert loads are the uninterrupted run's.
    (A writer killed mid-step is test_resume's: checkpoints do not depend on the model.)"""
    _, reference = reference_run
    run_dir = tmp_path / "run"
    first = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    first.run(steps=3)
    first.close()
    trainer = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    assert trainer.step == 3
    trainer.run()
    assert trainer.losses == reference                     # bitwise, every step
    lines = [json.loads(x) for x in (run_dir / runs.METRICS).read_text().splitlines() if x]
    ref = {r["step"]: r for r in runs.read_metrics(reference_run[0])}
    mark = max(i for i, x in enumerate(lines) if x.get("event") == "resume")
    resumed = [x for x in lines[mark:] if "event" not in x]
    assert [x["step"] for x in resumed] == list(range(4, N + 1))
    for x in resumed:
        assert x["moe_tokens_per_expert"] == ref[x["step"]]["moe_tokens_per_expert"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_over_gloo_train_like_one(reference_run, tmp_path):
    from workbench.jobs import launch

    _, reference = reference_run
    job = launch(CFG, processes=2, devices_per_process=4, run_dir=tmp_path / "2x4",
                 platform="cpu")
    assert job.wait(600) == "finished", job.tail()
    got = [r["loss"] for r in runs.read_metrics(tmp_path / "2x4")]
    # gloo's collectives sum in another order than XLA's in-process ones
    assert got == pytest.approx(reference, rel=1e-5, abs=0)
    # and `python -m workbench train` (what each launched process runs) wrote the loads
    recs = runs.read_metrics(tmp_path / "2x4")
    assert all(np.sum(r["moe_tokens_per_expert"]) == 2 * 8 * 16 * 2 for r in recs)


def test_expert_load_heatmap_draws_the_logged_loads(reference_run, tmp_path):
    import shutil

    from workbench.widgets import _assets
    from workbench.widgets._expert_load_view import ExpertLoad

    run_dir, _ = reference_run
    recs = runs.read_metrics(run_dir)
    w = ExpertLoad(run_dir)
    assert w.data["steps"] == [r["step"] for r in recs]
    assert w.data["load"] == [r["moe_tokens_per_expert"] for r in recs]
    assert "2 MoE layer(s) x 8 experts" in repr(w)
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (needed to render the widget ESM)")
    (tmp_path / "m.mjs").write_text(_assets.esm("expert_load"))
    (tmp_path / "s.json").write_text(json.dumps({"data": w.data, "name": "ref"}))
    render = os.path.join(os.path.dirname(__file__), "widgets_js", "render.mjs")
    out = subprocess.run([node, render, str(tmp_path / "m.mjs"), str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    blocks = json.loads(out.stdout)["blocks"]
    assert len(blocks) == 8 * N                              # experts x steps
    # the cell of expert e at step s: the layers' summed load relative to balanced
    last = np.sum(recs[-1]["moe_tokens_per_expert"], axis=0)
    hot = max(range(8), key=lambda e: last[e])
    cell = next(b for b in blocks if b["data-block"] == f"{hot},{recs[-1]['step']}")
    cold = next(b for b in blocks if b["data-block"] == f"{int(np.argmin(last))},{N}")
    assert cell["style:background"] != cold["style:background"]
