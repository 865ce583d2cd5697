"""Devices: inventory against jax.devices(), peak table, measured CPU peak, simulate_devices."""
import subprocess
import sys

import jax

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
