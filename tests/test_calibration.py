"""Calibration: the analytic memory model against XLA's memory_analysis and hand counts; the
shape of the calibration tables ``make bench`` writes (benchmarks/bench_calibration.py)."""
import math

import jax
import numpy as np
import pytest

import workbench as wb
from benchmarks import bench_calibration as bc
from workbench import hardware as hw
from workbench.models import GPTConfig
from workbench.perf import _analytic as analytic

TINY = GPTConfig.preset("tiny")


@pytest.fixture(scope="module")
def mesh():
    return wb.make_mesh(data=4, model=2)


@pytest.fixture(scope="module")
def tiny_fsdp(mesh):
    return wb.plan(TINY, mesh=mesh, rules="fsdp", batch=8, seq=128)


def _compiled_total(plan):
    """Per-device bytes by XLA's own buffer assignment."""
    ma = plan.compiled.memory_analysis()
    return (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes)


def test_tiny_fsdp_estimate_within_10_percent_of_memory_analysis(tiny_fsdp):
    assert tiny_fsdp.report.memory_estimate["total"] / _compiled_total(tiny_fsdp) == \
        pytest.approx(1.0, abs=0.10)
    # the arguments are the same layouts' shards, exactly
    ma = tiny_fsdp.compiled.memory_analysis()
    est = tiny_fsdp.report.memory_estimate
    assert est["params"] + est["optimizer"] + est["batch"] == pytest.approx(
        ma.argument_size_in_bytes, abs=64)


@pytest.mark.parametrize("rules", ["dp", "tp", "fsdp_tp"])
def test_tiny_estimates_within_10_percent_on_the_cpu_mesh(mesh, rules):
    p = wb.plan(TINY, mesh=mesh, rules=rules, batch=8, seq=128)
    assert p.report.memory_estimate["total"] / _compiled_total(p) == pytest.approx(1.0, abs=0.10)


def test_cpu_gradient_all_reduce_holds_two_copies(mesh):
    """DP with few tokens: XLA:CPU's peak is its one all-reduce of every gradient, the
    unreduced and the reduced copy: 2 x the gradient shards (hand count: the layouts)."""
    p = wb.plan(TINY, mesh=mesh, rules="dp", batch=8, seq=16)
    t = analytic.temp_breakdown(TINY, 8, 16, p.rules, p.mesh)
    grads = sum(v.padded_bytes_per_device for k, v in p.layouts.items()
                if k.startswith("params."))
    assert t["phase"] == "reduction" and t["reduction_peak"] == 2 * grads
    assert t["temp"] / p.compiled.memory_analysis().temp_size_in_bytes == \
        pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("preset", ["tiny", "small", "1b", "7b"])
@pytest.mark.parametrize("rules", ["dp", "fsdp", "tp", "fsdp_tp"])
def test_weight_inventory_matches_the_models_layouts(preset, rules):
    """The breakdown's own weight list (gradients, FSDP-gathered block weights) against
    the layouts of the real model's abstract state (compile=False: layouts only)."""
    cfg = GPTConfig.preset(preset)
    p = wb.plan(cfg, mesh=wb.abstract_mesh("v5p-16", data=4, model=2), rules=rules,
                batch=8, seq=128, compile=False, progress=False)
    cpu = wb.plan(cfg, mesh=wb.make_mesh(data=4, model=2), rules=rules, batch=8, seq=128,
                  compile=False, progress=False)
    t = analytic.temp_breakdown(cfg, 8, 128, cpu.rules, cpu.mesh)
    assert t["gradients"] == p.report.memory_estimate["gradients"] \
        == cpu.report.memory_estimate["gradients"]
    batch_axes = set(analytic.batch_axes(cpu.rules, cpu.mesh))
    whole_blocks = 0
    for name, lay in cpu.layouts.items():
        if not name.startswith("params.blocks."):
            continue
        over = [a for axes in lay.spec for a in axes if a in batch_axes]
        if over:   # FSDP-sharded: the gather makes it whole over the batch axes
            whole_blocks += lay.padded_bytes_per_device * analytic.axes_size(cpu.mesh, over)
    assert t["gathered"] == whole_blocks


def test_accelerator_terms_by_hand():
    """An abstract v5p slice, bfloat16: logits (and their gradient), saved activations and FSDP gathers by
    hand from the model's shapes (XLA attention: the T x T scores saved; the default fused
    kernel saves none); remat lowers the saved set (full < dots < none)."""
    cfg = GPTConfig.preset("small", dtype="bfloat16", attention="xla")
    mesh = wb.abstract_mesh("v5p-16", data=4, model=2)
    p = wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=32, seq=1024, compile=False,
                progress=False)
    t = analytic.temp_breakdown(cfg, 32, 1024, p.rules, p.mesh)
    tokens, d, f, heads, hd, v = 32 * 1024 // 4, 768, 2048 // 2, 12 // 2, 64, 50304 // 2
    assert t["logits"] == tokens * v * (2 + 2)     # bf16 logits and their gradient
    per_token = 2 * (3 * d + 3 * f + 2 * heads * hd + 2 * heads * hd) + heads * 1024 * (4 + 2)
    assert t["saved"] == tokens * per_token * cfg.n_layers
    fused = analytic.temp_breakdown(cfg.replace(attention="auto"), 32, 1024, p.rules, p.mesh)
    assert fused["saved"] == tokens * (per_token - heads * 1024 * (4 + 2)) * cfg.n_layers
    layer = (4 * d * heads * hd + 3 * d * f + 2 * d) * 2   # q, k, v, o, MLP, norms; bf16
    assert t["gathered"] == v * d * 2 + 2 * layer     # the output projection + two layers
    saved = {r: analytic.temp_breakdown(cfg.replace(remat=r), 32, 1024, p.rules, p.mesh)
             ["saved"] for r in ("none", "dots", "full")}
    assert saved["full"] < saved["dots"] < saved["none"]
    assert saved["full"] == tokens * 2 * d * cfg.n_layers


@pytest.mark.slow
def test_cpu_remat_lowers_the_peak_as_compiled(mesh):
    """XLA:CPU (JAX 0.12) keeps less with remat, the same set under "full" as under
    "dots"; the estimate falls with it and stays within the calibration band (0.9-1.1 of
    the compiled temp at this size)."""
    plans = {r: wb.plan(TINY.replace(remat=r), mesh=mesh, rules="fsdp_tp", batch=8, seq=128)
             for r in ("none", "dots", "full")}
    temp = {r: p.memory["temp"] for r, p in plans.items()}
    est = {r: p.report.memory_estimate["temp"] for r, p in plans.items()}
    assert temp["full"] < 0.8 * temp["none"] and est["full"] < 0.8 * est["none"]
    assert temp["full"] == pytest.approx(temp["dots"], rel=0.01) and est["full"] == est["dots"]
    for r in plans:
        assert 0.9 < est[r] / temp[r] < 1.1, (r, est[r], temp[r])


# -- the tables' producers ---------------------------------------------------------------------

def _check_row(row):
    assert set(row) >= {"name", "value", "unit", "target", "ok", "notes", "table"}
    assert row["ok"] in (True, False, None) and isinstance(row["notes"], str)


def test_memory_row_shape(mesh, tiny_fsdp):
    case = ("tiny", "fsdp", "none", 8, 128, {})
    [row] = bc.memory_rows([case], mesh, "cpu")
    _check_row(row)
    assert row["table"] == "memory" and row["compiler"] == "cpu"
    ratio = tiny_fsdp.report.memory_estimate["total"] / tiny_fsdp.memory["total"]
    assert row["value"] == round(ratio, 3)
    assert row["ok"] == (0.9 <= ratio <= 1.1) and row["target"] == "0.90-1.10"
    assert "exact (same layouts)" in row["notes"] and "forward-end peak" in row["notes"]
    assert row["compiled"]["total"] == tiny_fsdp.memory["total"]
    assert row["analytic"]["total"] == tiny_fsdp.report.memory_estimate["total"]
    assert row["terms"]["temp"] - row["terms"]["gradients"] == row["analytic"]["activations"]


@pytest.mark.slow
def test_step_rows_shape():
    """One real step window (no timing asserted), then the row built from its result."""
    [res] = bc.measure_steps([("tiny", "fsdp", 8, 32, 1)], windows=1)
    assert len(res["seconds"]) == 1 and res["seconds"][0] > 0 and res["predicted"] > 0
    assert res["hosts"] == 1 and res["bound"] in ("compute", "memory", "communication")
    row = bc.step_row(res, "1 process x 8 devices")
    _check_row(row)
    assert row["table"] == "step" and row["value"] == round(res["predicted"] /
                                                            res["seconds"][0], 3)
    assert row["target"] == "0.75-1.25"


def test_hardware_row_and_cpu_entry():
    jax.devices()
    row = bc.hardware_row(refresh=False)
    _check_row(row)
    assert row["peak_flops"] == hw.measured_cpu_peak()
    assert row["collective_bandwidth"] == hw.measured_cpu_collective_bandwidth() > 0
    spec = hw.cpu_spec(8)
    assert spec.nvlink_bandwidth == row["collective_bandwidth"]
    assert spec.network_bandwidth == hw.measured_loopback_bandwidth() / 8
    assert spec.source_of("network_bandwidth").startswith("measured")
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in
               ("memory_bandwidth", "loopback_bandwidth"))


def test_two_process_mesh_is_predictable():
    """A mesh spanning two processes (abstract CPU hosts) times its collectives as one
    gloo ring over TCP loopback (every rank of the group, a process's own devices too:
    ``perf._predict``'s CPU links) instead of raising for a missing network bandwidth:
    2 (n - 1) ring steps of the table's per-message latency and 2 (n - 1) / n of the bytes."""
    from workbench._sharding.mesh import MeshInfo
    from workbench._compiled.hlo import Collective
    from workbench.perf._collective_time import collective_seconds

    jax.devices()
    info = MeshInfo(axis_names=("data",), axis_sizes=(8,), device_ids=np.arange(8),
                    device_kind="cpu", platform="cpu",
                    process_index=np.repeat(np.arange(2), 4))
    c = Collective(kind="all-reduce", axes=("data",), aligned=True, group_size=8,
                   bytes=4 * 2**20, wire_bytes=0, count=1, shapes=(), names=())
    t = collective_seconds(c, info, hw.cpu_spec(8))
    assert t.seconds > 0 and "gloo over TCP loopback (8 ranks in 2 processes)" in t.links
    (part,) = t.parts
    assert part["link"] == "tcp" and part["messages"] == 2 * (8 - 1)
    assert part["bytes"] == pytest.approx(2 * 7 / 8 * 4 * 2**20)
