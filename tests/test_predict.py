"""Predictions: hand-counted roofline cases (a lone matmul, a lone all-gather, HBM-bound)."""
import math

import pytest

import workbench as wb
from workbench.hardware import hardware_spec
from workbench._compiled.hlo import Collective
from workbench.hardware import effective_spec
from workbench.perf import StepCost
from workbench.perf._predict import predict
from workbench._sharding.mesh import mesh_info


def _gather(nbytes, n, axes, kind="all-gather", count=1):
    return Collective(kind=kind, axes=axes, aligned=True, group_size=n, bytes=nbytes,
                      wire_bytes=0.0, count=count, shapes=())


def _table(mesh):
    """The mesh's hardware entry alone (the CPU measured here), no calibration."""
    return effective_spec(mesh_info(mesh), calibration=False)


def test_lone_matmul_is_compute_bound_at_peak():
    mesh = wb.abstract_mesh("v5p-8", data=4)
    m = k = n = 8192
    flops = 2 * m * k * n                      # one bf16 matmul per device
    hbm = 2 * (m * k + k * n + m * n)          # read A, B; write C
    p = predict(StepCost(flops=flops, bytes_accessed=hbm, collectives=[], mesh=mesh,
                         tokens_per_step=m, model_flops=4 * flops), _table(mesh))
    assert p.step_seconds == pytest.approx(flops / 459e12)
    assert p.bound == "compute"
    assert p.mfu == pytest.approx(1.0)
    assert p.tokens_per_s == pytest.approx(m / (flops / 459e12))
    assert "459 TFLOP/s" in p.sources["peak_flops"]


def test_elementwise_is_memory_bound_at_hbm_bandwidth():
    mesh = wb.abstract_mesh("v5e-4", data=4)
    size = 2**28                                # f32 add: read 2, write 1 per element
    p = predict(StepCost(flops=size, bytes_accessed=3 * 4 * size, mesh=mesh), _table(mesh))
    assert p.step_seconds == pytest.approx(3 * 4 * size / 8.1e11)
    assert p.bound == "memory" and p.mfu is None


#: seconds per ring step the catalogue charges over NVLink (the collective model's alpha:
#: NCCL's tuning.cc); TPU entries have none (no published ICI or DCN figure)
NVLINK_STEP = 3.4e-6


def test_lone_all_gather_on_a_torus_dimension():
    # v5p-128 = 64 chips, 4x4x4: a whole cube, so every dimension wraps around. The last
    # mesh axis runs along x (coords are x-fastest): a ring of 4 chips using both links.
    mesh = wb.abstract_mesh("v5p-128", a=4, b=4, c=4)
    nbytes = 2**30
    p = predict(StepCost(flops=0, bytes_accessed=0, collectives=[_gather(nbytes, 4, ("c",))],
                         mesh=mesh), _table(mesh))
    expected = (4 - 1) / 4 * nbytes / (2 * 9e10)    # scaling book: 9e10 B/s per link one way
    assert p.step_seconds == pytest.approx(expected)   # no ICI latency published: none
    assert p.bound == "communication"
    (c,) = p.breakdown["collectives"]
    assert c.bandwidth == 2 * 9e10 and c.axes == ("c",) and "torus" in c.links


def test_all_gather_without_wraparound_uses_one_link_per_dimension():
    # v5p-8 = 2x2x1 chips: no wraparound; a group over both mesh axes spans x and y.
    mesh = wb.abstract_mesh("v5p-8", data=2, model=2)
    nbytes = 3 * 2**20
    gather = _gather(nbytes, 4, ("data", "model"))
    p = predict(StepCost(flops=0, bytes_accessed=0, collectives=[gather], mesh=mesh),
                _table(mesh))
    assert p.step_seconds == pytest.approx(3 / 4 * nbytes / (9e10 + 9e10))


@pytest.mark.parametrize("kind, factor, steps", [
    ("all-reduce", lambda n: 2 * (n - 1) / n, 2 * 7), ("reduce-scatter", lambda n: n - 1, 7),
    ("collective-permute", lambda n: 1.0, 1)])
def test_ring_formulas_on_gpus_in_one_server(kind, factor, steps):
    mesh = wb.abstract_mesh("8xH100", data=8)
    nbytes = 2**26
    gather = _gather(nbytes, 8, ("data",), kind)
    p = predict(StepCost(flops=0, bytes_accessed=0, collectives=[gather], mesh=mesh),
                _table(mesh))
    assert p.step_seconds == pytest.approx(factor(8) * nbytes / 450e9   # NVLink 900 GB/s bidi
                                           + steps * NVLINK_STEP)


def test_all_reduce_across_servers_is_hierarchical():
    mesh = wb.abstract_mesh("2x8xH100", data=16)
    b = 2**28
    reduce = _gather(b, 16, ("data",), "all-reduce")
    p = predict(StepCost(flops=0, bytes_accessed=0, collectives=[reduce], mesh=mesh),
                _table(mesh))
    inside = 2 * 7 / 8 * b / 450e9 + 2 * 7 * NVLINK_STEP   # ring of 8 over NVLink
    # ring of 2 over 400 Gbit/s InfiniBand, 1/8 each
    across = 2 * 1 / 2 * (b / 8) / 50e9 + 2 * 1 * 9.6e-6
    assert p.step_seconds == pytest.approx(inside + across)


def test_dcn_axis_of_two_slices():
    mesh = wb.abstract_mesh("v5e-16", data=-1, model=4, dcn={"data": 2})
    assert mesh.shape == {"data": 8, "model": 4} and mesh.num_slices == 2
    b = 2**26
    reduce = _gather(b, 8, ("data",), "all-reduce")
    p = predict(StepCost(flops=0, bytes_accessed=0, collectives=[reduce], mesh=mesh),
                _table(mesh))
    (c,) = p.breakdown["collectives"]
    assert "dcn across 2" in c.links
    # within a slice: 4 chips along y of a 4x4 v5e (no wraparound below 16) -> 1 link
    inside = 2 * 3 / 4 * b / 4.5e10
    across = 2 * 1 / 2 * (b / 4) / (50e9 / 8)
    assert p.step_seconds == pytest.approx(inside + across)


def test_overlap_and_bound_labels():
    mesh = wb.abstract_mesh("v5p-8", data=4)
    spec = hardware_spec("TPU v5p")
    flops = 1e12
    coll = [_gather(2**30, 4, ("data",), "all-reduce")]
    cost = StepCost(flops=flops, bytes_accessed=0, collectives=coll, mesh=mesh)
    full, none = predict(cost, _table(mesh)), predict(cost, _table(mesh), overlap=0.0)
    t_comp, t_comm = flops / spec.peak_flops, none.breakdown["communication_total"]
    assert full.step_seconds == pytest.approx(max(t_comp, t_comm))
    assert none.step_seconds == pytest.approx(t_comp + t_comm)
    assert full.breakdown["no_overlap_step"] == pytest.approx(none.step_seconds)
    assert full.bound == ("communication" if t_comm > t_comp else "compute")
    assert "latency-hiding" in full.sources["overlap"]


def test_every_gpu_and_tpu_entry_has_sourced_bandwidths():
    for kind in ("TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite", "NVIDIA A100-SXM4-80GB",
                 "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200"):
        spec = hardware_spec(kind)
        assert spec.hbm_bandwidth and spec.source_of("hbm_bandwidth") != "unknown", kind
        link = "ici_link_bandwidth" if spec.platform == "tpu" else "nvlink_bandwidth"
        assert getattr(spec, link) and spec.source_of(link) != "unknown", kind
        assert math.isfinite(spec.peak_flops / spec.hbm_bandwidth)


def test_cpu_mesh_uses_measured_entry():
    mesh = wb.make_mesh(data=8)
    p = predict(StepCost(flops=1e9, bytes_accessed=0, collectives=[], mesh=mesh), _table(mesh))
    assert p.sources["peak_flops"].startswith("measured") and p.bound == "compute"
    assert p.sources["overlap"].startswith("assumed 0")


def test_tensor_parallel_collectives_stay_on_the_critical_path():
    # compute 10 ms; an FSDP gather over "data" (hidden behind compute on TPU) and a
    # tensor-parallel all-reduce over "model" (the next matmul waits for it: never hidden)
    mesh = wb.abstract_mesh("v5p-128", data=16, model=4)
    flops = 0.010 * 459e12
    gather = _gather(2**28, 16, ("data",))
    reduce = _gather(2**26, 4, ("model",), kind="all-reduce")
    both = predict(StepCost(flops=flops, bytes_accessed=0, collectives=[gather, reduce],
                            mesh=mesh, exposed_axes=("model",)), _table(mesh))
    alone = {c.kind: predict(StepCost(flops=0, bytes_accessed=0, collectives=[c], mesh=mesh),
                             _table(mesh)).step_seconds
             for c in (gather, reduce)}
    assert alone["all-gather"] < 0.010                       # fits behind the compute
    assert both.step_seconds == pytest.approx(0.010 + alone["all-reduce"])
    by_kind = {c.kind: c.overlap for c in both.breakdown["collectives"]}
    assert by_kind == {"all-gather": 1.0, "all-reduce": 0.0}
    hidden = predict(StepCost(flops=flops, bytes_accessed=0, collectives=[gather, reduce],
                              mesh=mesh), _table(mesh))
    assert hidden.step_seconds == pytest.approx(0.010)      # without exposed axes: all hidden


def test_a_cost_analysis_that_leaves_out_matmuls_gives_way_to_the_model_flops():
    """XLA:GPU's cost analysis does not count the GEMMs its cuBLAS custom calls run (GPT
    "small" in bfloat16 on an H200: about a fifth of 6 N T): a compiled count below the
    model's own FLOPs per device is not the step's, and the prediction falls back to the
    analytic FLOPs, saying why. Reference: a real CPU plan, whose compiled count covers
    the model's (it adds the optimizer, norms and softmax), then that plan with its count
    cut to a fifth, as the GPU reports it."""
    import workbench as wb
    from workbench.models import GPTConfig

    p = wb.plan(GPTConfig.preset("tiny"), mesh=wb.make_mesh(data=4, model=2), rules="fsdp",
                batch=16, seq=64, progress=False)
    floor = p.model_flops / p.report.compute_split             # tiny: no remat, no kernel
    counted = p.report.cost["flops"]
    assert counted >= floor                              # what XLA:CPU counts
    assert p.predicted.sources["flops"] == "cpu-compiler cost analysis"
    whole = p.predict(calibration=False)
    p.report.compiled_numbers.cost["flops"] = counted / 5       # as XLA:GPU counts it
    cut = p.predict(calibration=False)
    assert cut.sources["flops"].startswith("analytic: the cpu-compiler cost analysis counts")
    assert "cuBLAS" in cut.sources["flops"]
    # the local compute term is FLOPs / peak: it scales from the compiled to the model count
    assert cut.breakdown["compute"] / whole.breakdown["compute"] == \
        pytest.approx(floor / counted, rel=1e-9)
