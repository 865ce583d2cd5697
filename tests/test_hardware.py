"""Devices: inventory against jax.devices(), peak table, measured CPU peak, simulate_devices."""
import subprocess
import sys

import jax
import pytest

import workbench as wb
from workbench.hardware import hardware_spec, peak_flops


def test_inventory_matches_jax():
    inv = wb.devices()
    assert [d.id for d in inv] == [d.id for d in jax.devices()]
    assert all(d.platform == "cpu" and d.process_index == 0 for d in inv)
    assert "8 device(s)" in str(inv)


def test_peak_table_by_device_kind():
    # JAX device_kind strings as the runtimes report them.
    cases = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
             "TPU v3": 61.5e12, "TPU v2": 22.5e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA B200": 2250e12}
    for kind, flops in cases.items():
        value, source = peak_flops(kind)
        assert value == flops, kind
        assert source.startswith("table:")
    assert hardware_spec("cpu") is None


def test_cpu_peak_is_measured_and_shared():
    value, source = peak_flops(jax.devices()[0])
    assert source.startswith("measured") and "shared by 8" in source
    assert 1e8 < value < 1e13


def test_simulate_devices_in_fresh_process():
    code = ("import workbench as wb; wb.simulate_devices(4); import jax; "
            "assert len(jax.devices()) == 4; wb.simulate_devices(4)\n"
            "try:\n    wb.simulate_devices(2)\nexcept RuntimeError as e:\n"
            "    assert 'restart the kernel' in str(e).lower(); print('ok')")
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": "/tmp"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_cpu_device_flags_replace_only_the_count():
    from workbench._xla_flags import cpu_device_flags

    count = "--xla_force_host_platform_device_count"
    assert cpu_device_flags("", 4) == f"{count}=4"
    assert cpu_device_flags(f"--a=1  {count}=8 --b=2", 2) == f"--a=1 --b=2 {count}=2"
    assert cpu_device_flags(f"{count}=8 {count}=16", 3) == f"{count}=3"


def test_cpu_entry_is_measured_and_shared():
    from workbench.hardware import cpu_spec, measured_cpu_memory_bandwidth, measured_cpu_peak
    import jax

    jax.devices()                      # the backend is up: collectives can be measured
    spec = cpu_spec(8)
    assert spec.peak_flops == measured_cpu_peak() / 8
    assert spec.hbm_bandwidth == measured_cpu_memory_bandwidth() / 8
    assert 1e8 < spec.hbm_bandwidth * 8 < 1e13
    assert spec.source_of("hbm_bandwidth").startswith("measured")
    # tests run on 8 simulated devices: the in-process collective is measured, as is its
    # per-instruction latency (a psum of one float per device, the reference timing here)
    from workbench.hardware import measured_cpu_collective_bandwidth, measured_cpu_collective_latency

    assert spec.nvlink_bandwidth == measured_cpu_collective_bandwidth()
    assert spec.source_of("nvlink_bandwidth").startswith("measured")
    assert spec.collective_latency == measured_cpu_collective_latency() > 0
    assert spec.source_of("collective_latency").startswith("measured")


def test_a_new_generation_is_one_catalogue_entry(monkeypatch):
    """A generation added in one place (the catalogue) gives its presets to
    ``wb.abstract_mesh``, its numbers to plans and predictions, its larger presets to the
    search's advice, and (naming libtpu's chip) its target to the TPU compiler."""
    from workbench.hardware import _catalogue as catalogue
    from workbench.hardware._catalogue import GIB, Generation, HardwareSpec
    from workbench._sharding.mesh import HARDWARE_PRESETS
    from workbench._search.space import hardware as search_hardware, larger_presets
    from workbench._sharding.topology import topology_name, tpu_target

    spec = HardwareSpec(name="Zeta z1", peak_flops=100e12, memory_bytes=16 * GIB,
                        source="test entry", platform="tpu", topology_dims=2,
                        hbm_bandwidth=1e12, ici_link_bandwidth=5e10, torus_wrap="16",
                        sources={"hbm_bandwidth": "test", "ici_link_bandwidth": "test"})
    fake = Generation(name="z1", pattern=r"zeta z1", device_kind="Zeta z1", spec=spec,
                      libtpu="v5e", slices={"z1-4": (2, 2, 1), "z1-16": (4, 4, 1)},
                      single_host_chips=8)
    monkeypatch.setattr(catalogue, "GENERATIONS", (*catalogue.GENERATIONS, fake))
    import workbench._sharding.mesh

    assert "z1-16" in workbench._sharding.mesh.HARDWARE_PRESETS and "z1-16" not in HARDWARE_PRESETS
    assert hardware_spec("Zeta z1") is spec and peak_flops("Zeta z1")[0] == 100e12
    mesh = wb.abstract_mesh("z1-4", data=2, model=2)
    assert (mesh.size, mesh.device_kind, mesh.memory_per_device, mesh.peak_flops) == \
        (4, "Zeta z1", 16 * GIB, 100e12)
    assert mesh.n_hosts == 1 and wb.abstract_mesh("z1-16").size == 16
    assert topology_name("z1-16") == "v5e:4x4"
    assert larger_presets(search_hardware("z1-4")) == ["z1-16"]

    cfg = wb.models.GPTConfig.preset("tiny")
    p = wb.plan(cfg, mesh=mesh, batch=4, seq=32, compile=False, progress=False)
    assert p.memory["limit"] == 16 * GIB and p.source == "estimate"
    pred = p.predicted   # the roofline on the new entry's peak: compute = FLOPs / peak
    assert pred.breakdown["compute"] == pytest.approx(p.flops_per_device / 100e12, rel=1e-12)
    from workbench.hardware import libtpu_installed

    if libtpu_installed():   # the TPU compiler's target comes from the entry too
        t = tpu_target(mesh)
        assert t.mesh is not None and t.topology == "v5e:2x2", t.reason
