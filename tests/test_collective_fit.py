"""The collective model (issue 48 item 2): alpha x messages + bytes / beta per collective
kind and link, its parts read from a collective's group and shapes, and its fit to
profiles (``workbench.perf.fit_collectives``, ``wb.calibrate``) checked against synthetic
profiles made here with known latencies and bandwidths."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import workbench as wb
from workbench.hardware import HardwareSpec
from workbench.perf import fit_collectives
from workbench._compiled.hlo import Collective
from workbench.perf._collective_time import calibrated_time, collective_seconds, ring_steps
from workbench.perf._profile import ProfileReport, Term
from workbench.perf._trace import StepProfile

SPEC = HardwareSpec(name="CPU (synthetic)", peak_flops=1e11, memory_bytes=0, source="test",
                    platform="cpu", chips_per_host=4, hbm_bandwidth=1e10,
                    nvlink_bandwidth=2e9, network_bandwidth=5e8, collective_latency=2e-5,
                    network_latency=1e-5)
#: the truth the synthetic profiles are made from: (alpha s/message, beta B/s) per kind@link
TRUE = {"all-reduce@memory": (5e-5, 1.2e9), "all-gather@memory": (3e-5, 3e9),
        "all-reduce@tcp": (2e-4, 2.5e8), "reduce-scatter@tcp": (1.5e-4, 4e8)}


def _part(link: str, messages: float, nbytes: float) -> dict:
    alpha, beta = SPEC.link(link)
    return {"link": link, "messages": messages, "bytes": nbytes, "latency": alpha,
            "bandwidth": beta}


def _row(kind: str, count: int, parts: list[dict], truth: dict = TRUE) -> dict:
    """One merged collective of a profile, its measured time made from ``truth``."""
    measured = count * sum(truth[f"{kind}@{p['link']}"][0] * p["messages"]
                           + p["bytes"] / truth[f"{kind}@{p['link']}"][1] for p in parts)
    predicted = count * sum(p["latency"] * p["messages"] + p["bytes"] / p["bandwidth"]
                            for p in parts)
    return {"kind": kind, "axes": ["data"], "bytes": int(parts[0]["bytes"]), "count": count,
            "latencies": float(count), "predicted": predicted, "parts": parts,
            "measured": measured}


def _report(rows: list[dict], name: str = "synthetic") -> ProfileReport:
    """A ProfileReport as ``profile_report`` makes it, of a step whose compute, memory and
    collectives are the given times (nothing hidden, nothing idle)."""
    comm = sum(r["measured"] for r in rows)
    step = 0.010 + 0.004 + comm
    measured = StepProfile(directory=f"/synthetic/{name}", files=(), module="jit_step", steps=1,
                           devices=8, step_seconds=step, execution_seconds=step,
                           categories={"compute": 0.01, "memory": 0.004, "collectives": comm,
                                       "other": 0.0, "concurrent": 0.0, "idle": 0.0,
                                       "host": 0.0}, collectives=(), ops=())
    colls = [{"kind": r["kind"], "axes": r["axes"], "group_size": 4, "bytes": r["bytes"],
              "count": r["count"], "links": "", "bandwidth": 1.0, "seconds": r["predicted"],
              "overlap": 0.0, "formula": "", "source": "", "latencies": r["latencies"],
              "exposed": False, "parts": r["parts"]} for r in rows]
    pred_step = 0.008 + 0.005 + sum(r["predicted"] for r in rows)
    prediction = {"step_seconds": pred_step, "sources": {"local": "compute + memory"},
                  "breakdown": {"compute": 0.008, "memory": 0.005, "local": 0.013,
                                "communication": pred_step - 0.013,
                                "communication_total": pred_step - 0.013,
                                "host_transfers": 0.0, "collectives": colls}}
    terms = (Term(name="compute", predicted=0.008, measured=0.01),
             Term(name="memory", predicted=0.005, measured=0.004),
             *[Term(name=f"{r['kind']} over data", predicted=r["predicted"],
                    measured=r["measured"], kind=r["kind"], axes=("data",), count=r["count"])
               for r in rows],
             Term(name="overlap (hidden)", predicted=0.0, measured=0.0),
             Term(name="idle + host", predicted=0.0, measured=0.0),
             Term(name="step", predicted=pred_step, measured=step))
    return ProfileReport(terms=terms, prediction=prediction, measured=measured,
                         directory=measured.directory, plan_name=name,
                         mesh={"data": 4, "model": 2}, device_kind=SPEC.name, processes=2,
                         collective_rows=tuple(rows))


def _layouts() -> list[ProfileReport]:
    """Two layouts of a 2-process mesh: one all-reduces gradients within and across
    processes (arrays of several sizes); the other gathers within a process and
    reduce-scatters across, with other sizes and group shares."""
    a = [_row("all-reduce", 2, [_part("memory", 6.0, 3e6), _part("tcp", 12.0, 1e6)]),
         _row("all-reduce", 4, [_part("memory", 1.0, 2e4), _part("tcp", 2.0, 1e4)]),
         _row("all-reduce", 1, [_part("memory", 3.0, 8e5)]),
         _row("all-gather", 8, [_part("memory", 1.0, 4e5)])]
    b = [_row("all-gather", 3, [_part("memory", 4.0, 1e5)]),
         _row("all-gather", 2, [_part("memory", 2.0, 2e6)]),
         _row("reduce-scatter", 2, [_part("tcp", 1.0, 3e6)]),
         _row("reduce-scatter", 6, [_part("tcp", 5.0, 2e5)]),
         _row("all-reduce", 2, [_part("tcp", 4.0, 5e5)])]
    return [_report(a, "layout a"), _report(b, "layout b")]


def test_fit_recovers_known_latency_and_bandwidth_from_two_layouts():
    fits = fit_collectives(_layouts())
    assert set(fits) == set(TRUE)
    for key, (alpha, beta) in TRUE.items():
        f = fits[key]
        assert f["fitted"] == ["latency", "bandwidth"] and not f["kept"], key
        assert f["latency"] == pytest.approx(alpha, rel=1e-6), key
        assert f["bandwidth"] == pytest.approx(beta, rel=1e-6), key
        assert f["scale"] == pytest.approx(SPEC.link(f["link"])[1] / beta, rel=1e-6)


def test_calibrate_stores_the_fit_and_predictions_use_it(tmp_path, monkeypatch):
    """wb.calibrate fits the same from several layouts at once; the file round-trips and a
    collective of a third layout is timed alpha x messages + bytes / beta on each link."""
    monkeypatch.setenv("WORKBENCH_CALIBRATION", str(tmp_path))
    cal = wb.calibrate(_layouts(), spec=SPEC)
    again = wb.hardware.Calibration.from_dict(json.loads(next(tmp_path.iterdir()).read_text()))
    assert again.collectives == cal.collectives
    mesh = wb.make_mesh(data=4, model=2)
    c = Collective(kind="all-reduce", axes=("data",), aligned=True, group_size=4, bytes=4000,
                   wire_bytes=6000.0, count=3, shapes=("f32[500]", "f32[500]"))
    t = collective_seconds(c, mesh, SPEC)
    (part,) = t.parts                       # one process: the in-process link only
    assert part["link"] == "memory" and part["bytes"] == pytest.approx(2 * 3 / 4 * 4000)
    assert part["messages"] == pytest.approx(2 * (4 + 1) / (8 + 1))   # arrays x group share
    alpha, beta = TRUE["all-reduce@memory"]
    assert calibrated_time(t, cal, SPEC.collective_latency).seconds == pytest.approx(
        3 * (alpha * part["messages"] + part["bytes"] / beta), rel=1e-6)


def test_one_layout_fits_what_it_identifies_and_keeps_the_table_for_the_rest():
    """One layout whose gathers all carry 1 message per 100 kB: alpha and beta are not
    told apart, so alpha keeps the table's value (said in ``kept``) and beta is fitted;
    the all-reduces of other sizes are fitted in full."""
    truth = dict(TRUE) | {"all-gather@memory": (SPEC.collective_latency, 3e9)}
    rows = [_row("all-gather", k, [_part("memory", m, m * 1e5)], truth)
            for k, m in ((2, 1.0), (4, 3.0), (1, 7.0))]
    rows += [_row("all-reduce", 2, [_part("memory", 6.0, 3e6)], truth),
             _row("all-reduce", 5, [_part("memory", 1.0, 2e4)], truth)]
    fits = wb.calibrate(_report(rows), spec=SPEC, save=False).collectives
    ag = fits["all-gather@memory"]
    assert ag["fitted"] == ["bandwidth"] and "latency" in ag["kept"]
    assert ag["latency"] == SPEC.collective_latency
    assert ag["bandwidth"] == pytest.approx(3e9, rel=1e-6)
    ar = fits["all-reduce@memory"]
    assert ar["fitted"] == ["latency", "bandwidth"]
    assert (ar["latency"], ar["bandwidth"]) == pytest.approx(TRUE["all-reduce@memory"], rel=1e-6)


def test_parts_of_a_two_process_collective_by_hand():
    """2 processes x 4 devices (gloo): an all-reduce over data (4 devices, 2 per process)
    is one ring over its 4 gloo ranks on TCP loopback (a process's own devices talk gloo
    too), a message per array and ring step; on one process the same group is the
    in-process rendezvous."""
    from workbench._sharding.mesh import mesh_info

    # device d = 2 i_data + i_model in process d // 4, as jax.make_mesh lays 2 x 4 out
    info = dataclasses.replace(mesh_info(wb.make_mesh(data=4, model=2)),
                               process_index=np.arange(8).reshape(4, 2) // 4)
    c = Collective(kind="all-reduce", axes=("data",), aligned=True, group_size=4, bytes=8000,
                   wire_bytes=0.0, count=3, shapes=("f32[1000]", "f32[1000]"))
    t = collective_seconds(c, info, SPEC)
    (part,) = t.parts
    assert part["link"] == "tcp" and "gloo" in t.links
    assert part["bytes"] == pytest.approx(2 * 3 / 4 * 8000)        # 2 (n-1)/n b, n = 4
    assert part["messages"] == 2 * ring_steps("all-reduce", 4) == 12
    assert t.seconds == pytest.approx(3 * (1e-5 * 12 + 12000 / 5e8))
    pair = dataclasses.replace(c, axes=("model",), group_size=2)   # inside a process
    assert collective_seconds(pair, info, SPEC).parts[0]["link"] == "tcp"
    (one,) = collective_seconds(c, wb.make_mesh(data=4, model=2), SPEC).parts
    assert one["link"] == "memory"


def test_accelerator_links_carry_the_catalogues_latencies():
    """GPU: NVLink, NCCL's per-step figure; TPU: ICI messages counted per ring step, no
    latency in the table (none published) until a calibration fits one."""
    tpu = wb.hardware.hardware_spec("TPU v5p")
    assert tpu.link("ici") == (0.0, 9e10) and tpu.source_of("ici_latency") == "unknown"
    gpu = wb.hardware.hardware_spec("H100")
    assert gpu.link("nvlink")[0] == 3.4e-6 and "tuning.cc" in gpu.source_of("nvlink_latency")
    mesh = wb.abstract_mesh("v5p-16", data=8)
    c = Collective(kind="all-gather", axes=("data",), aligned=True, group_size=8,
                   bytes=1 << 20, wire_bytes=0.0, count=2, shapes=("bf16[512,1024]",))
    (part,) = collective_seconds(c, mesh, tpu).parts
    assert part["link"] == "ici" and part["messages"] == ring_steps("all-gather", 8) == 7


def test_an_old_calibration_file_still_applies():
    """A calibration stored before the alpha-beta model (kind -> latency, scale) scales a
    collective's time as it did."""
    old = wb.hardware.Calibration.from_dict({
        "device_kind": SPEC.name, "compute_factor": 1.0, "memory_factor": 1.0,
        "matmul_flops": 1e11, "hbm_bandwidth": 1e10, "overlap": None,
        "collectives": {"all-reduce": {"latency": 1e-4, "scale": 2.0, "bandwidth": 1e9}},
        "provenance": [{"directory": "/old", "date": "2026-01-01"}]})
    c = Collective(kind="all-reduce", axes=("data",), aligned=True, group_size=8, bytes=4000,
                   wire_bytes=0.0, count=1, shapes=("f32[1000]",))
    t = collective_seconds(c, wb.make_mesh(data=8), SPEC)
    bw = t.seconds - SPEC.collective_latency * t.latencies
    assert calibrated_time(t, old, SPEC.collective_latency).seconds == pytest.approx(
        1e-4 * t.latencies + 2.0 * bw)


def test_bad_input_is_named():
    good, other = _layouts()
    silent = dataclasses.replace(good, collective_rows=(), plan_name="one device")
    with pytest.raises(ValueError, match=r"reports \(one device\) has no collective"):
        fit_collectives(silent)
    with pytest.raises(ValueError, match=r"reports\[1\] \(one device\) has no collective"):
        fit_collectives([good, silent])
    rows = list(other.collective_rows)
    rows[2] = rows[2] | {"measured": -1e-3}
    negative = dataclasses.replace(other, collective_rows=tuple(rows))
    with pytest.raises(ValueError, match=r"reports\[1\] .*reduce-scatter .* = -0.001, not a "
                                         "finite time"):
        wb.calibrate([good, negative], save=False)
    with pytest.raises(ValueError, match=r"reports\[0\] .*term 'compute' = nan"):
        fit_collectives([dataclasses.replace(good, terms=(
            Term(name="compute", predicted=0.1, measured=float("nan")), *good.terms[1:]))])
    with pytest.raises(TypeError, match=r"reports\[1\]=\{.*is a dict, not a ProfileReport"):
        fit_collectives([good, {"kind": "all-reduce"}])
    with pytest.raises(TypeError, match=r"reports='fsdp' is a str"):
        fit_collectives("fsdp")
    with pytest.raises(ValueError, match="reports=\\[\\] is empty"):
        fit_collectives([])
