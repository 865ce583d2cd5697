"""Ironwood (TPU7x) in the catalogue (issue 57, item 3): its numbers against Google's TPU7x
table, its slices against libtpu's own tpu7x topologies (the installed TPU compiler is the
reference for chips, cores and coordinates), a plan compiled by the TPU compiler for a tpu7x
slice, and the mesh widget's chips and their two cores.
"""
from __future__ import annotations

import collections
import pytest

import workbench as wb
from workbench.hardware import generation, hardware_presets, hardware_spec
from workbench.widgets._payload import mesh_payload

from _tpu import tpu

GIB = 1024**3
SPEC = hardware_spec("TPU7x")


def test_the_numbers_are_googles_per_chip_table_divided_over_two_cores() -> None:
    """Google's TPU7x table, per chip: 2307 TFLOP/s bf16, 4614 fp8, 192 GiB, 7380 GB/s HBM,
    1200 GB/s bidirectional ICI, 100 Gbit/s DCN, 2 TensorCores, 4 chips per VM."""
    assert SPEC is not None and SPEC.name == "TPU7x (Ironwood)"
    cores = SPEC.cores_per_chip
    assert cores == 2 and SPEC.chips_per_host == 4 and SPEC.topology_dims == 3
    assert SPEC.peak_flops * cores == 2307e12
    assert SPEC.fp8_flops * cores == 4614e12
    assert SPEC.memory_bytes * cores == 192 * GIB
    assert SPEC.hbm_bandwidth * cores == 7380e9
    assert SPEC.ici_link_bandwidth * 6 * 2 == 1200e9        # 6 torus links, 2 directions
    assert SPEC.dcn_bandwidth * 8 == 100e9                   # bits -> bytes
    for field in ("fp8_flops", "hbm_bandwidth", "ici_link_bandwidth", "dcn_bandwidth",
                  "clock_hz", "torus_wrap", "host_bandwidth"):
        assert SPEC.source_of(field) != "unknown", field
    assert "assumed" in SPEC.source_of("clock_hz").lower()
    assert "estimate" in SPEC.source_of("host_bandwidth")
    # v5p and v6e accept fp8 at their bf16 rate (the same table); A100 has no fp8
    assert hardware_spec("TPU v5p").fp8_flops == hardware_spec("TPU v5p").peak_flops
    assert hardware_spec("TPU v6 lite").fp8_flops == hardware_spec("TPU v6 lite").peak_flops
    assert hardware_spec("NVIDIA A100-SXM4-80GB").fp8_flops is None
    assert hardware_spec("NVIDIA H100 80GB HBM3").fp8_flops == 2 * 989e12 + 1e12


@pytest.mark.parametrize(("preset", "topology", "chips", "hosts"), [
    ("tpu7x-8", (2, 2, 1), 4, 1), ("tpu7x-16", (2, 2, 2), 8, 2), ("tpu7x-128", (4, 4, 4), 64, 16),
    ("tpu7x-256", (4, 4, 8), 128, 32)])
def test_slices_are_named_by_tensorcores(preset, topology, chips, hosts) -> None:
    """As MaxText and Google name them: the number counts TensorCores (tpu7x-128 is 4x4x4, 64
    chips), each a JAX device; 4 chips per host."""
    gen = generation(preset)
    assert gen is not None and gen.slices[preset] == topology and preset in hardware_presets()
    payload = mesh_payload(wb.abstract_mesh(preset, data=-1))
    assert payload["size"] == 2 * chips and payload["n_hosts"] == hosts
    assert max(payload["chips"]) + 1 == chips
    per_chip = collections.Counter(payload["chips"])
    assert set(per_chip.values()) == {2}
    assert sorted(payload["cores"]) == sorted([0, 1] * chips)
    for c in range(chips):       # the two devices of a chip share its coordinates
        devs = [i for i, k in enumerate(payload["chips"]) if k == c]
        assert payload["coords"][devs[0]] == payload["coords"][devs[1]]
        assert {payload["cores"][i] for i in devs} == {0, 1}


@tpu
@pytest.mark.parametrize("preset", ["tpu7x-8", "tpu7x-128"])
def test_the_slice_is_libtpus_own_topology(preset) -> None:
    """The abstract slice has exactly the chips libtpu's tpu7x topology has: the same device
    kind, the same multiset of chip coordinates, two devices per chip (cores 0 and 1)."""
    from workbench._sharding.topology import _topology_devices, topology_name

    name = topology_name(preset)
    devs = _topology_devices(name, 1)
    assert name == f"tpu7x:{'x'.join(map(str, generation(preset).slices[preset]))}"
    assert {d.device_kind for d in devs} == {"TPU7x"}
    assert hardware_spec(devs[0].device_kind) is SPEC
    ours = collections.Counter(tuple(c) for c in mesh_payload(
        wb.abstract_mesh(preset, data=-1))["coords"])
    theirs = collections.Counter(tuple(d.coords) for d in devs)
    assert ours == theirs
    assert collections.Counter(d.core_on_chip for d in devs) == {0: len(devs) // 2,
                                                                 1: len(devs) // 2}


@tpu
def test_a_tpu7x_plan_is_compiled_by_the_tpu_compiler() -> None:
    """tiny on tpu7x-8 (4 chips, 8 TensorCores): compiled by libtpu for tpu7x:2x2x1, memory
    against the 96 GiB of one TensorCore, MFU against its bf16 peak."""
    cfg = wb.models.GPTConfig.preset("tiny")
    plan = wb.plan(cfg, mesh=wb.abstract_mesh("tpu7x-8", data=-1), batch=16, seq=128)
    text = str(plan)
    assert "compiled by the TPU compiler" in text and "tpu7x:2x2x1" in text, text
    assert plan.fits and plan.memory["limit"] == 96 * GIB
    assert 0 < plan.memory["total"] < GIB
    assert plan.source == "tpu-compiler"


def test_the_mesh_widget_draws_chips_and_their_cores(tmp_path) -> None:
    """The header counts chips and cores, each cell names its core, and 'chip' colours the
    two cores of a chip alike (the JS, run in node)."""
    from test_widgets_js import render

    payload = mesh_payload(wb.abstract_mesh("tpu7x-16", data=-1))
    rep = render(tmp_path, "mesh", {"payload": payload, "color_by": "chip", "rows": ""})
    assert "8 chips × 2 cores (each core a device)" in rep["text"], rep["text"]
    assert len(rep["devices"]) == 16
    by_chip = collections.defaultdict(set)
    for cell, chip in zip(rep["devices"], payload["chips"]):
        by_chip[chip].add(cell["style:background"])
    assert all(len(c) == 1 for c in by_chip.values()) and len(set.union(*by_chip.values())) == 8
    # one device per chip: no core numbers, no chip colouring
    single = mesh_payload(wb.abstract_mesh("v5p-16", data=-1))
    assert single["cores"] is None and single["chips"] == list(range(8))
