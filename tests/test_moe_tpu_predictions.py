"""MoE plans compiled by the TPU compiler predict physically possible steps.

The TPU compiler marks some instructions of an MoE backward pass unknown
(``scatter_offload_custom_fusion`` with ``estimated_cycles`` = 2**63-1); summed as cycles,
they made every MoE plan predict 1e10 s per step (MFU 5e-17), and ``wb.search`` ranked it
best. Here, for ep, fsdp_ep, ep_tp and fsdp, dropless and with a capacity factor, the local
work is checked against an independent count read from the HLO text by this file's own
parse (the known cycles at the clock, plus each unknown instruction's operand and result
bytes at the HBM bandwidth), the prediction against its physical bounds, and the
all-to-alls against the hand count ``_analytic_collectives.moe_collectives``.
"""
import math
import re

import pytest

import workbench as wb
from workbench.hardware import hardware_spec
from workbench.models import GPTConfig
from workbench.perf._analytic_collectives import moe_collectives
from workbench.perf._bounds import MFU_CEILING
from workbench._compiled.loops import computation_multiplicity
from workbench.hardware import effective_spec
from workbench.perf import StepCost
from workbench.perf._predict import predict
from workbench._sharding.mesh import mesh_info
from workbench._sharding.topology import tpu_compiler_available

needs_tpu = pytest.mark.skipif(not tpu_compiler_available(),
                               reason="the TPU compiler (libtpu) is not installed")

#: moe-tiny's routing (8 experts, top-2), small widths
MOE = GPTConfig.preset("moe-tiny").replace(
    n_layers=2, d_model=128, n_heads=4, n_kv_heads=4, head_dim=32, d_ff=256,
    expert_d_ff=128, vocab_size=512, seq_len=128,
    # the padded expert buffers and XLA attention these hand counts are written for
    # (grouped experts: test_moe_grouped; fused attention: test_tpu_plans)
    attention="xla", moe_matmul="dense")
LAYOUTS = [("ep", {"expert": 4}), ("fsdp_ep", {"expert": 2, "data": 2}),
           ("ep_tp", {"expert": 2, "model": 2}), ("fsdp", {"data": 4})]
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}


def _array_bytes(type_text):
    return sum(_BYTES[dt] * math.prod(int(x) for x in dims.split(",") if x)
               for dt, dims in re.findall(r"\b(\w+)\[([\d,]*)\]", type_text) if dt in _BYTES)


def _independent_local(text, spec):
    """Seconds of local work by this test's own reading of the HLO: every instruction's
    estimated cycles times how often its computation runs, at the clock; an instruction
    whose estimate is the compiler's unknown (>= 2**62) by the bytes of its result and
    operands (looked up where they are defined) at the HBM bandwidth."""
    mult = computation_multiplicity(text)
    cycles, nbytes, unknown, comp, defs = 0, 0, [], None, {}
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head:
            comp, defs = head.group(1), {}
            continue
        d = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+[a-z][\w\-]*\((.*)$", line)
        if d is None:
            continue
        defs[d.group(1)] = d.group(2)
        m = re.search(r'"estimated_cycles":"(\d+)"', line)
        if m is None or not mult.get(comp) or "tpu_custom_call" in line:
            continue
        if int(m.group(1)) < 2 ** 62:
            cycles += int(m.group(1)) * mult[comp]
            continue
        operands = re.findall(r"%([\w.\-]+)", d.group(3).split(")")[0])
        nbytes += (_array_bytes(d.group(2)) + sum(_array_bytes(defs[o]) for o in operands)) \
            * mult[comp]
        unknown.append(d.group(1))
    return cycles / spec.clock_hz + nbytes / spec.hbm_bandwidth, unknown


@pytest.fixture(scope="module", params=[None, 1.25], ids=["dropless", "capacity"])
def moe_plans(request, cache_dir, monkeypatch_module):
    monkeypatch_module.setenv("WORKBENCH_CACHE", str(cache_dir))
    cfg = MOE.replace(capacity_factor=request.param)
    return cfg, {rules: wb.plan(cfg, mesh=wb.abstract_mesh("v5p-8", **axes), rules=rules,
                                batch=8, seq=128, progress=False)
                 for rules, axes in LAYOUTS}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@needs_tpu
@pytest.mark.tpu
@pytest.mark.slow
def test_moe_plans_on_tpu_time_unknown_instructions_by_their_roofline(moe_plans):
    cfg, plans = moe_plans
    spec = hardware_spec("TPU v5p")
    for rules, p in plans.items():
        assert p.source == "tpu-compiler", rules
        pred = p.predicted
        b = pred.breakdown
        local, unknown = _independent_local(p.compiled.as_text(), spec)
        assert unknown, f"{rules}: the compiler knew every instruction's cycles this time"
        # the cycles-based local work, raised to the roofline where it undercuts it
        assert b["local"] == pytest.approx(max(local, b["roofline_local"]), rel=1e-9), rules
        assert "marks unknown" in pred.sources["local"] and unknown[0] in pred.sources["local"]
        # physical bounds: no faster than the roofline of its own FLOPs and bytes, an MFU
        # a real run can reach, the compiler's own estimate shown only when it has one
        assert b["roofline_local"] <= pred.step_seconds <= 1e3 * b["no_overlap_step"]
        assert pred.step_seconds < 1.0, (rules, pred.step_seconds)   # was 1.05e10 s
        assert 0 < pred.mfu <= MFU_CEILING and pred.implausible == (), rules
        assert pred.compiler_seconds is None or pred.compiler_seconds >= 0
        assert pred.mfu == pytest.approx(p.model_flops / (pred.step_seconds * 4
                                                          * spec.peak_flops))
        assert not [w for w in p.warnings if w.kind == "implausible_prediction"]


@needs_tpu
@pytest.mark.tpu
@pytest.mark.slow
def test_moe_plans_on_tpu_move_tokens_as_the_hand_count_says(moe_plans):
    cfg, plans = moe_plans
    for rules, p in plans.items():
        hand = moe_collectives(cfg, p.rules, p.mesh, 8, 128)
        found = [c for c in p.collectives if c.kind == "all-to-all"]
        if "expert" not in p.mesh.axis_names:   # fsdp: every device holds every expert
            assert not hand and not [c for c in found if "expert" in c.axes], rules
            continue
        assert [c.count for c in hand] == [4 * cfg.n_layers], rules
        assert sum(c.count for c in found) == 4 * cfg.n_layers, rules
        assert all(c.axes == ("expert",) for c in found), rules


def _table(mesh):
    """The mesh's hardware entry alone, no calibration."""
    return effective_spec(mesh_info(mesh), calibration=False)


def test_a_prediction_above_the_published_mfu_envelope_is_flagged():
    """The physical bounds on a prediction built by hand: model FLOPs larger than the
    step's own FLOPs give an MFU above any published run; a negative compiler estimate is
    not shown; a sane one passes."""
    mesh = wb.abstract_mesh("v5p-8", data=4)
    spec = hardware_spec("TPU v5p")
    flops = spec.peak_flops * 1e-3            # 1 ms of math per device at peak
    ok = predict(StepCost(flops=flops, bytes_accessed=0.0, collectives=[], mesh=mesh,
                          model_flops=0.5 * 4 * flops, compiler_seconds=-4.0), _table(mesh))
    assert ok.implausible == () and ok.mfu == pytest.approx(0.5)
    assert ok.compiler_seconds is None and "-4.0" in ok.sources["compiler_seconds"]
    bad = predict(StepCost(flops=flops, bytes_accessed=0.0, collectives=[], mesh=mesh,
                           model_flops=0.95 * 4 * flops), _table(mesh))
    assert bad.mfu == pytest.approx(0.95)
    assert len(bad.implausible) == 1 and "MFU 95%" in bad.implausible[0]
    assert "IMPLAUSIBLE" in str(bad) and bad.to_dict()["implausible"] == list(bad.implausible)
    # the compiler's cycles faster than peak: raised to the roofline, and said
    fast = predict(StepCost(flops=flops, bytes_accessed=0.0, collectives=[], mesh=mesh,
                            compute_seconds=1e-4, compute_source="cycles"), _table(mesh))
    assert fast.breakdown["local"] == pytest.approx(1e-3) and fast.implausible == ()
    assert "raised to the roofline" in fast.sources["local"]
    # cycles a thousand times the roofline: an estimate the compiler could not make
    slow = predict(StepCost(flops=flops, bytes_accessed=0.0, collectives=[], mesh=mesh,
                            compute_seconds=10.0, compute_source="cycles"), _table(mesh))
    assert slow.implausible and "could not make" in slow.implausible[0]


def test_search_never_ranks_a_plan_with_an_implausible_prediction(monkeypatch):
    """wb.search over a small MoE on an abstract v5p slice (formulas only): the analytic
    best, made implausible, drops out of the ranking, says why, and another row is best;
    when every row is implausible, ``best`` raises and says so."""
    from workbench.planning import _handle as handle, _report as report

    real = report.predict_plan   # the one predictor: as each plan is made, and Plan.predict
    res = wb.search(MOE, hardware="v5p-8", batch=8, seq=128, top_k=0, progress=False)
    first = res.best_row["layout"]

    def flagged(rep, spec, **kw):
        pred = real(rep, spec, **kw)
        if rep.name == first or flag_all:
            return type(pred)(**{**pred.__dict__, "implausible": ("MFU 97% ...",)})
        return pred

    monkeypatch.setattr(report, "predict_plan", flagged)
    monkeypatch.setattr(handle, "predict_plan", flagged)
    flag_all = False
    res2 = wb.search(MOE, hardware="v5p-8", batch=8, seq=128, top_k=0, progress=False)
    row = next(r for r in res2.rows if r["layout"] == first)
    assert row["rank"] is None and row["implausible"] and "implausible" in row["note"]
    assert res2.best_row["layout"] != first and res2.best_row["implausible"] is False
    assert row not in res2.pareto
    flag_all = True
    res3 = wb.search(MOE, hardware="v5p-8", batch=8, seq=128, top_k=0, progress=False)
    with pytest.raises(ValueError, match="none has a plausible prediction"):
        res3.best
