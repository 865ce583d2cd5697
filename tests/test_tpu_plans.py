"""Plans for TPU slices you do not have, compiled by the TPU compiler on this machine, checked
against the same step compiled directly with JAX's topology API; where the numbers come
from (plan.source), the compile cache, Ctrl-C, and the out-of-memory verdict."""
import gzip
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import workbench as wb
from workbench.planning._flags import compile_options
from workbench._sharding.mesh import mesh_info
from workbench._optimizer import DEFAULT_STEPS, AdamW
from workbench.models import GPTConfig
from workbench.planning import _compile as plan_compile
from workbench._compiled.hlo import parse_collectives
from workbench._sharding.rules import Rules
from workbench._step import jit_train_step, make_train_step
from workbench._train_state import abstract_batch, abstract_train_state, model_factory
from workbench._sharding.topology import tpu_compiler_available

pytestmark = [
    pytest.mark.tpu,                 # every test compiles for an abstract TPU slice
    pytest.mark.usefixtures("wb_cache"),
    pytest.mark.skipif(not tpu_compiler_available(),
                       reason="the TPU compiler (libtpu) is not installed: "
                              "pip install 'workbench[tpu-compile]'"),
]

TINY = GPTConfig.preset("tiny")
AXES = {"data": 2, "model": 2}


def _reference(cfg, topology, rules_name, batch, seq, axes=AXES):
    """The same train step, compiled straight from JAX's topology API (no workbench mesh
    or planner code): devices from ``get_topology_desc``, laid out in their order."""
    from jax.experimental import topologies

    devs = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = Mesh(np.array(devs).reshape(tuple(axes.values())), tuple(axes),
                axis_types=(AxisType.Auto,) * len(axes))
    rules = Rules.preset(rules_name, mesh_info(mesh))
    opt = AdamW().build(DEFAULT_STEPS)   # wb.plan's default optimizer (the Trainer's)
    cfg = cfg.resolved("tpu")   # dtype "auto" as on a TPU (bfloat16), as wb.plan does
    st = abstract_train_state(model_factory(cfg), opt, rules, mesh, strict=False)
    ex = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("inputs", "targets")}
    b = abstract_batch(ex, rules, mesh)
    step = make_train_step(st.graphdef, opt, rules=rules, mesh=mesh)
    jitted = jit_train_step(step, st.shardings, {k: v.sharding for k, v in b.items()},
                            compiler_options=compile_options("tpu", device=topology))   # wb.plan's default
    return jitted.lower(st.state, b).compile()


@pytest.fixture(scope="module")
def tpu_plan():
    return wb.plan(TINY, mesh=wb.abstract_mesh("v5e-4", **AXES), rules="fsdp_tp", batch=8,
                   seq=64, progress=False)


def test_tpu_plan_matches_the_step_compiled_directly(tpu_plan):
    assert tpu_plan.source == "tpu-compiler" and not tpu_plan.report.is_estimate
    assert "v5e:2x2" in tpu_plan.source_reason
    ref = _reference(TINY, "v5e:2x2", "fsdp_tp", 8, 64)
    ma = ref.memory_analysis()
    mem = tpu_plan.memory
    assert mem["arguments"] == ma.argument_size_in_bytes
    assert mem["outputs"] == ma.output_size_in_bytes
    assert mem["aliased"] == ma.alias_size_in_bytes
    assert mem["temp"] == ma.temp_size_in_bytes
    assert mem["total"] == (ma.argument_size_in_bytes + ma.output_size_in_bytes
                            - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
    assert tpu_plan.report.cost["flops"] == ref.cost_analysis()["flops"]
    assert tpu_plan.report.compiled_flops_per_device == ref.cost_analysis()["flops"]

    text = tpu_plan.compiled.as_text()
    assert re.search(r"\{1,0:T\(\d+,128\)", text), "TPU tiled layouts in the HLO"
    found = re.findall(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.+?\s(all-reduce|all-gather|"
                       r"reduce-scatter|all-to-all|collective-permute)(?:-start)?\((.*)$",
                       text, flags=re.M)
    # async collective fusion repeats one collective (one channel_id) in several
    # computations: count each channel once
    channels = [(k, re.search(r"channel_id=(\d+)", rest)) for k, rest in found]
    found = [k for k, _ in dict.fromkeys(
        (k, m.group(1) if m else i) for i, (k, m) in enumerate(channels))]
    by_kind = {k: sum(c.count for c in tpu_plan.collectives if c.kind == k) for k in set(found)}
    assert found and by_kind == {k: found.count(k) for k in set(found)}
    assert {c.kind for c in tpu_plan.collectives} == set(found)


def test_tpu_plan_predicts_with_the_tpu_table_and_shows_the_compiler_estimate(tpu_plan):
    pred = tpu_plan.predicted
    cost = tpu_plan.report.cost
    spec = wb.hardware.hardware_spec("TPU v5 lite")
    # the roofline terms are the compiler's per-device counts over the table's numbers
    assert pred.breakdown["compute"] == pytest.approx(cost["flops"] / spec.peak_flops)
    assert pred.breakdown["memory"] == pytest.approx(cost["bytes accessed"] / spec.hbm_bandwidth)
    assert pred.compiler_seconds == cost["optimal_seconds"] > 0
    assert pred.mfu == pytest.approx(tpu_plan.model_flops / (pred.step_seconds * 4
                                                             * spec.peak_flops))
    assert pred.sources["flops"] == "tpu-compiler cost analysis"
    text = str(tpu_plan)
    assert "source: tpu-compiler" in text and "TPU compiler's estimate" in text
    d = json.loads(json.dumps(tpu_plan.report.to_dict()))
    assert d["source"] == "tpu-compiler"
    assert d["predicted"]["step_seconds"] == pytest.approx(pred.step_seconds)
    row = wb.compare([tpu_plan]).rows[0]
    assert row["source"] == "tpu-compiler" and row["step_seconds"] == pred.step_seconds


def test_every_source_is_named():
    cpu = wb.plan(TINY, mesh=wb.make_mesh(data=4, model=2), rules="fsdp", batch=8, seq=32,
                  progress=False)
    assert cpu.source == "cpu-compiler" and "CPU" in cpu.source_reason
    off = wb.plan(TINY, mesh=wb.abstract_mesh("v5e-4", **AXES), rules="fsdp", batch=8, seq=32,
                  compile=False, progress=False)
    assert off.source == "estimate" and off.report.is_estimate and off.compiled is None
    gpu = wb.plan(TINY, mesh=wb.abstract_mesh("8xH100", data=8), rules="fsdp", batch=8, seq=32,
                  progress=False)
    assert gpu.source == "estimate" and "not a TPU slice" in gpu.source_reason
    with pytest.raises(ValueError, match="compile=True cannot compile .*not a TPU slice"):
        wb.plan(TINY, mesh=wb.abstract_mesh("8xH100", data=8), rules="fsdp", batch=8, seq=32,
                compile=True)
    with pytest.raises(TypeError, match="compile='yes' must be True or False"):
        wb.plan(TINY, mesh=wb.abstract_mesh("v5e-4", **AXES), batch=8, compile="yes")


def test_a_layout_the_tpu_compiler_cannot_take_is_an_estimate_with_the_lint():
    # tiny has 2 kv heads; model=4 cannot split them
    p = wb.plan(TINY, mesh=wb.abstract_mesh("v5e-8", data=2, model=4), rules="fsdp_tp",
                batch=8, seq=32, progress=False)
    assert p.source == "estimate" and "not divisible" in p.source_reason, p.source_reason
    assert any(w.kind == "uneven" for w in p.warnings)


def test_missing_tpu_compiler_falls_back_and_says_so_once(monkeypatch, capsys):
    import workbench._sharding.topology as topology

    monkeypatch.setattr(topology, "tpu_compiler_available", lambda: False)
    monkeypatch.setattr("workbench.planning._measure._SAID", set())
    mesh = wb.abstract_mesh("v5p-8", **AXES)
    first = wb.plan(TINY, mesh=mesh, rules="fsdp", batch=8, seq=32)
    second = wb.plan(TINY, mesh=mesh, rules="tp", batch=8, seq=32)
    assert first.source == second.source == "estimate"
    assert "not installed" in first.source_reason
    err = capsys.readouterr().err
    assert err.count("not installed") == 1


def test_same_plan_again_is_served_from_the_cache(tpu_plan):
    again = wb.plan(TINY, mesh=wb.abstract_mesh("v5e-4", **AXES), rules="fsdp_tp", batch=8,
                    seq=64, progress=False)
    assert again.report.compile_cached and again.report.compile_seconds == 0.0
    assert again.compiled is tpu_plan.compiled
    assert again.memory == tpu_plan.memory


def _checkout_free(hlo: str) -> str:
    """``hlo`` without its debug information: the source tables at its end (file and function
    names, file locations, stack frames), each op's ``stack_frame_id`` into them, and source
    positions. The cache key is the program without debug information, so an edit that only
    moves a traced line, renames a module (``planning/planner.py`` ->
    ``planning/_planner.py``) or a traced helper keeps the committed plan: its ops, shapes,
    layouts and op names are the same, and they are what is compared."""
    hlo = hlo.split("\nFileNames\n", 1)[0]
    hlo = re.sub(r"\s*\bstack_frame_id=\d+", "", hlo)
    return re.sub(r"\b(end_)?(line|column)=\d+", "", hlo)


@pytest.mark.multiprocess
def test_plan_cache_on_disk_serves_a_new_process_and_the_committed_plans_are_the_compilers(
        tmp_path, monkeypatch):
    """A second process gets the plan from the disk cache, equal to a fresh compile; a
    corrupt entry is recompiled and replaced, never fatal. The cache here starts empty, so
    the first process compiles: its entry is byte for byte (memory, cost analysis and
    optimised HLO) the one tests/tpu_plans holds for the same program (conftest.TPU_PLANS),
    which the other tests read back instead of compiling."""
    from conftest import TPU_PLANS

    cache = tmp_path / "cache"
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache))
    code = ("import json, workbench as wb\n"
            "p = wb.plan(wb.models.GPTConfig.preset('tiny'), mesh=wb.abstract_mesh('v5e-4', "
            "data=4), rules='fsdp', batch=8, seq=32, progress=False)\n"
            "print(json.dumps([p.report.compile_cached, p.memory, p.report.cost.get('flops'), "
            "len(p.collectives)]))\n")

    def run():
        out = subprocess.run([sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run()
    assert first[0] is False                  # compiled in this test
    entries = list((cache / "plans").glob("*.json.gz"))
    assert len(entries) == 1
    (entry,) = entries
    committed = TPU_PLANS / entry.name
    assert os.environ.get("WORKBENCH_TEST_TPU_PLANS") == "0" or committed.is_file(), (
        f"tests/tpu_plans has no plan for this program ({entry.name}): the lowered step, "
        "the compile options or a version changed since it was made; run `make tpu-plans`")
    if committed.is_file():           # not in `make tpu-plans`, which makes the folder
        compiled, stored = (json.loads(gzip.decompress(f.read_bytes()))
                            for f in (entry, committed))
        for key in ("memory", "cost", "versions"):
            assert compiled[key] == stored[key], key
        # the HLO's op metadata names the traced files where the entry was made
        assert _checkout_free(compiled["hlo"]) == _checkout_free(stored["hlo"])
    second = run()
    assert second[0] is True and second[1:] == first[1:]
    entry.write_bytes(b"not gzip")
    third = run()
    assert third[0] is False and third[1:] == first[1:]


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not in a virtual environment")
def test_a_plan_with_a_kernel_has_one_cache_key_wherever_jax_is_installed(tmp_path):
    """The splash kernel's bytecode names the files that traced it (JAX's install): the same
    plan from a virtual environment reached by another path (a symlink: another checkout,
    CI's clone) has another raw program text but the same cache key, so its plan on disk
    (and tests/tpu_plans) serves it."""
    code = ("import hashlib, json, workbench as wb\n"
            "from workbench.models import GPTConfig\n"
            "from workbench.planning import _compile as pc, _measure as measure\n"
            "out = []\n"
            "def record(lowered, devices, **kw):\n"
            "    out.append([pc.fingerprint(lowered, devices, kw.get('options')),\n"
            "                hashlib.sha256(lowered.as_text().encode()).hexdigest()])\n"
            "    raise KeyboardInterrupt\n"
            "measure.compile_lowered = record\n"
            "cfg = GPTConfig.preset('tiny', seq_len=2048, attention='splash')\n"
            "try:\n"
            "    wb.plan(cfg, mesh=wb.abstract_mesh('v5e-4', data=-1), rules='fsdp', batch=4,\n"
            "            progress=False)\n"
            "except KeyboardInterrupt:\n"
            "    pass\n"
            "print(json.dumps(out))\n")
    elsewhere = tmp_path / "venv"
    elsewhere.symlink_to(sys.prefix)
    python = elsewhere / pathlib.Path(sys.executable).relative_to(sys.prefix)

    def keys(exe):
        out = subprocess.run([str(exe), "-c", code], capture_output=True, text=True,
                             timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    ((here, raw_here),), ((there, raw_there),) = keys(sys.executable), keys(python)
    assert raw_here != raw_there      # the kernel's bytecode holds the install's paths
    assert here == there


def test_ctrl_c_while_compiling_returns_at_once_and_the_compile_is_kept(tmp_path, monkeypatch):
    # a plan cache of its own (its plan in no other test's), so the step is compiled here
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    cfg = TINY.replace(n_layers=1)
    mesh = wb.abstract_mesh("v5e-4", **AXES)
    main = threading.main_thread().ident
    lines = []

    def status(text):
        lines.append(text)
        # the compile has started: Ctrl-C now, as a notebook's interrupt would
        threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT)).start()
        return lines.append

    real = plan_compile.compile_lowered

    def with_interrupt(*args, **kwargs):
        return real(*args, **{**kwargs, "status": status})

    plan_compile.clear_cache()
    from workbench.planning import _measure as planner
    planner.compile_lowered = with_interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            wb.plan(cfg, mesh=mesh, rules="fsdp", batch=8, seq=64)
    finally:
        planner.compile_lowered = real
    assert any("interrupted" in line for line in lines)
    p = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=8, seq=64, progress=False)
    assert p.source == "tpu-compiler" and p.report.compile_cached   # the background compile's result


def test_a_step_the_tpu_compiler_cannot_fit_is_a_plan_that_says_by_how_much():
    mesh = wb.abstract_mesh("v5e-4", data=4)
    big = TINY.replace(vocab_size=32768, d_model=1024, n_heads=16, n_kv_heads=16, d_ff=4096,
                       n_layers=2, dtype="float32")   # (in bfloat16 it fits: 15.3 of 16 GiB)
    p = wb.plan(big, mesh=mesh, rules="dp", batch=256, seq=2048, progress=False)
    assert p.fits is False and p.source == "estimate"
    assert "rejected this step" in p.source_reason and "does not fit" in p.source_reason
    # the compiler's own number, as it reports it when the step is compiled directly
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as err:
        _reference(big, "v5e:2x2", "dp", 256, 2048, axes={"data": 4})
    need = re.search(r"HLO temporaries \(([\d.]+)G\)", str(err.value)).group(1)
    # the message prints GiB to 2 decimals: 0.01 is its rounding, not a model's error
    assert p.memory["compiler_required_temp"] / 1024 ** 3 == pytest.approx(float(need), abs=0.01)
    assert p.memory["temp"] == p.memory["compiler_required_temp"]
    assert p.memory["total"] > p.memory["limit"]
    (lint,) = [w for w in p.warnings if w.kind == "memory"]
    assert "over" in lint.message and "largest: activations" in lint.message


def test_multislice_plan_compiles_with_dcn_collectives():
    mesh = wb.abstract_mesh("v5e-4", data=-1, model=2, dcn={"data": 2})
    p = wb.plan(TINY, mesh=mesh, rules="fsdp", batch=16, seq=32, progress=False)
    assert p.source == "tpu-compiler" and "2 slices" in p.source_reason
    assert {d.slice_index for d in p.shardings.step.mesh.devices.flat} == {0, 1}
    over_data = [c for c in p.collectives if "data" in c.axes]
    assert over_data
    links = [t.links for t in p.predicted.breakdown["collectives"] if "data" in t.axes]
    assert any("dcn" in link for link in links)


def test_plan_widget_shows_source_and_prediction(tpu_plan, tmp_path):
    from workbench.widgets import _assets
    from workbench.widgets._plan_view import plan_payload

    payload = plan_payload(tpu_plan)
    assert payload["source"] == "tpu-compiler"
    assert json.loads(json.dumps(payload)) == payload
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    harness = pathlib.Path(__file__).parent / "widgets_js" / "render.mjs"
    (tmp_path / "plan.mjs").write_text(_assets.esm("plan"))
    (tmp_path / "state.json").write_text(json.dumps({"payload": payload}))
    out = subprocess.run([node, str(harness), str(tmp_path / "plan.mjs"),
                          str(tmp_path / "state.json")], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert "TPU compiler ·" in rep["text"] and "TPU compiler's own estimate" in rep["text"]
    # compute, HBM traffic, communication, and the local work by the compiler's cycles
    assert rep["classes"]["wb-pred-row"] == 4
    assert "local work (TPU compiler's cycles)" in rep["text"]
    # how sure it is: no reference rows of v5e to give a band, and the widget says so
    assert payload["predicted"]["band"]["low"] is None
    assert rep["classes"]["wb-pred-noband"] == 1
    assert "no band: uncalibrated, and no reference rows for TPU v5e" in rep["text"]
    assert rep["handlers_left"] == 0


def test_collectives_inside_a_scanned_loop_count_once_per_iteration():
    """A psum inside a 5-step lax.scan runs 5 times per call: the parser multiplies the
    loop body's instructions by the trip count read from the loop condition."""
    from jax.sharding import PartitionSpec as P

    from workbench._compiled.loops import loop_trip_counts

    mesh = wb.make_mesh(data=8)

    def body(carry, _):
        return carry + jax.lax.psum(carry, "data"), None

    @jax.jit
    def f(x):
        g = jax.shard_map(lambda v: jax.lax.scan(body, v, None, length=5)[0], mesh=mesh,
                          in_specs=P("data"), out_specs=P("data"))
        return g(x)

    text = f.lower(jax.ShapeDtypeStruct((8, 128), jnp.float32)).compile().as_text()
    trips = loop_trip_counts(text)
    assert list(trips.values()) == [5]
    (c,) = [c for c in parse_collectives(text, ("data",), (8,)) if c.kind == "all-reduce"]
    assert c.in_loop and c.count == 5 and c.axes == ("data",)


def test_scanned_layers_plan_counts_loop_collectives_and_predicts_from_the_analytic_flops():
    """With scan_layers the program loops over the blocks: the collectives in the loop body
    count once per layer (reference: the unrolled plan's tensor-parallel all-reduces; XLA
    gathers the stacked FSDP weights differently, so those are not compared)
    and XLA's one-body cost analysis is not used for the prediction."""
    cfg = TINY.replace(n_layers=4)
    mesh = wb.abstract_mesh("v5e-4", **AXES)
    unrolled = wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=8, seq=64, progress=False)
    scanned = wb.plan(cfg.replace(scan_layers=True), mesh=mesh, rules="fsdp_tp", batch=8,
                      seq=64, progress=False)
    assert scanned.source == unrolled.source == "tpu-compiler"
    assert list(scanned.report.loops.values()) and set(scanned.report.loops.values()) == {4}
    assert not unrolled.report.loops and unrolled.report.compiled_flops_per_device is not None
    assert scanned.report.compiled_flops_per_device is None
    assert scanned.predicted.sources["flops"].startswith("analytic: the compiled program loops")
    assert scanned.predicted.compiler_seconds is None
    in_loop = [c for c in scanned.collectives if c.in_loop]
    assert in_loop and all(c.count % 4 == 0 for c in in_loop)

    def tp_bytes(p):  # the per-layer tensor-parallel all-reduces of activations
        return sum(c.total_wire_bytes for c in p.collectives
                   if c.kind == "all-reduce" and c.axes == ("model",))

    assert tp_bytes(scanned) == tp_bytes(unrolled) > 0
