"""The CPU entry, measured at runtime: matmul peak, memory bandwidth, psum bandwidth and
latency between simulated devices, TCP loopback between processes; cached per machine."""
from __future__ import annotations

import json
import math
import os
import platform as _platform
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from workbench._cache import cache_root, doubted, read_cached
from workbench.hardware._catalogue import HardwareSpec
from workbench.hardware._libtpu import backends_started as _backends_started

__all__ = ["cpu_spec", "measured_cpu_collective_bandwidth", "measured_cpu_collective_latency",
           "measured_cpu_memory_bandwidth", "measured_cpu_peak", "measured_loopback_bandwidth",
           "measured_loopback_latency",
           "psum_seconds"]


def _cache_dir() -> Path:
    return cache_root()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def measured_cpu_peak(*, refresh: bool = False, size: int = 1024) -> float:
    """The host's measured matmul FLOP/s (float32), cached per machine.

    A ``size``-cubed float32 matmul on one CPU device is timed (median of 5 after a
    warm-up); XLA's CPU matmul uses every core, so this is the whole host's peak. The
    result is cached in ``~/.cache/workbench/cpu_peak.json`` keyed by host, CPU model,
    core count and JAX version.
    """
    key = f"{_platform.node()}|{_cpu_name()}|{os.cpu_count()}|{jax.__version__}|{size}"
    path = _cache_dir() / "cpu_peak.json"
    cached = None if refresh else _cache_get(path, key)
    if cached is not None:
        return cached
    import numpy as np

    dev = jax.devices("cpu")[0]
    a = jax.device_put(np.ones((size, size), np.float32), dev)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        took.append(time.perf_counter() - t0)
    # the median: a clean-clone CI run once read one timing of ~3 us (8e14 FLOP/s on 2
    # cores, impossible), which the best of 5 made the host's cached peak
    peak = 2 * size**3 / float(np.median(took))
    _cache_put(path, key, peak)
    return peak


def measured_cpu_memory_bandwidth(*, refresh: bool = False, mib: int = 64) -> float:
    """The host's measured memory bandwidth in bytes/s (read + write), cached per machine.

    A ``mib``-MiB float32 array is copied into another with numpy (best of 5 after a
    warm-up); a copy reads and writes every byte, so bandwidth = 2 x size / time. One
    thread: a lower bound for what several simulated devices share.
    """
    import numpy as np

    key = f"mem|{_platform.node()}|{_cpu_name()}|{os.cpu_count()}|{mib}"
    path = _cache_dir() / "cpu_peak.json"
    cached = None if refresh else _cache_get(path, key)
    if cached is not None:
        return cached
    src = np.ones(mib * 2**18, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    bandwidth = 2 * src.nbytes / best
    _cache_put(path, key, bandwidth)
    return bandwidth


#: Bytes a measurement file may hold (a few hundred per entry).
_MAX_FILE = 1 << 20


def _plausible(key: str, value: Any) -> bool:
    """A measurement a machine can give: a finite number, a latency between 1 ns and a
    minute, a rate (FLOP/s, bytes/s) between 1 and 1e16."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        return False
    low, high = (1e-9, 60.0) if "latency|" in key else (1.0, 1e16)
    return low <= value <= high


def _read_measurements(path: Path) -> tuple[dict[str, Any], str]:
    """The measurements in ``path`` (safe reader), or ``({}, why)`` when not believed."""
    raw, why = read_cached(path, inside=path.parent, max_bytes=_MAX_FILE)
    if raw is None:
        return {}, why
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return {}, f"it is not JSON ({str(e)[:80]})"
    if not isinstance(data, dict):
        return {}, f"it holds a JSON {type(data).__name__}, not an object of measurements"
    return data, ""


def _cache_get(path: Path, key: str) -> float | None:
    """The cached measurement ``key`` in ``path``, or None: none there, or one not believed
    (then a ``CacheWarning`` names the file; the caller measures again and replaces it)."""
    data, why = _read_measurements(path)
    if not why and key in data and not _plausible(key, data[key]):
        why = f"its {key!r} is {str(data[key])[:40]!r}, not a measurement this machine gives"
    if why:
        doubted(path, why, "measured again and the file replaced")
        return None
    return float(data[key]) if key in data else None


def _cache_put(path: Path, key: str, value: float) -> None:
    """Stores ``value`` under ``key`` beside the file's other believable measurements
    (a temporary file renamed over it; a full or read-only cache, or a directory at its
    place, only costs the next process a measurement)."""
    data, _ = _read_measurements(path)
    data = {k: v for k, v in data.items() if _plausible(k, v)}
    data[key] = value
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _cached(key: str) -> float | None:
    return _cache_get(_cache_dir() / "cpu_peak.json", key)


def measured_cpu_collective_bandwidth(*, refresh: bool = False, mib: int = 8) -> float | None:
    """Bytes/s one simulated CPU device sends in an all-reduce among this process's CPU
    devices, measured and cached per machine and device count; None with one device.

    A jitted ``psum`` of ``mib`` MiB per device over every local CPU device is timed (best
    of 5 after a warm-up) and turned into a link bandwidth with the ring formula that
    ``workbench.perf._predict`` applies to it: ``W = 2 (n-1)/n x bytes / time``. XLA:CPU
    runs it through host memory on the cores the devices share, so this includes that
    sharing (and, in a ``jax.distributed`` process on CPU, gloo's in-process path).
    """
    devs = jax.local_devices(backend="cpu")
    n = len(devs)
    if n < 2:
        return None
    key = f"psum|{_platform.node()}|{_cpu_name()}|{os.cpu_count()}|{jax.__version__}|{n}|{mib}"
    cached = None if refresh else _cached(key)
    if cached is not None:
        return cached
    per = mib * 2**18
    bandwidth = 2 * (n - 1) / n * per * 4 / psum_seconds(_local_mesh(devs), per, 5)
    _cache_put(_cache_dir() / "cpu_peak.json", key, bandwidth)
    return bandwidth


def psum_seconds(mesh: Any, per_device: int, repeats: int) -> float:
    """Best time of a jitted psum of ``per_device`` float32 values per device over every
    device of ``mesh`` (all its axes; in a multi-process mesh every process must call it)."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    axes = tuple(mesh.axis_names)
    spec = PartitionSpec(axes)
    x = jax.make_array_from_callback(
        (mesh.size, per_device), NamedSharding(mesh, spec),
        lambda idx: np.ones((mesh.size, per_device), np.float32)[idx])
    psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, axes), mesh=mesh,
                                 in_specs=spec, out_specs=spec))
    psum(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        psum(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def _local_mesh(devs: list[Any]) -> Any:
    import numpy as np

    return jax.sharding.Mesh(np.array(devs), ("d",))


def measured_cpu_collective_latency(*, refresh: bool = False) -> float | None:
    """Seconds of one collective among this process's CPU devices with (almost) no data:
    a jitted psum of one float32 per device, best of 20 after a warm-up, cached per
    machine and device count; None with one device. XLA:CPU pays it per collective
    instruction (a rendezvous of the device threads), whatever the size."""
    devs = jax.local_devices(backend="cpu")
    if len(devs) < 2:
        return None
    key = f"psum-latency|{_platform.node()}|{_cpu_name()}|{os.cpu_count()}|{jax.__version__}" \
          f"|{len(devs)}"
    cached = None if refresh else _cached(key)
    if cached is not None:
        return cached
    latency = psum_seconds(_local_mesh(devs), 1, 20)
    _cache_put(_cache_dir() / "cpu_peak.json", key, latency)
    return latency


def measured_loopback_bandwidth(*, refresh: bool = False, mib: int = 64) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1 (what gloo uses between CPU processes on
    one host), measured and cached per machine.

    A sender thread writes ``mib`` MiB through a loopback socket to a receiver in this
    process (best of 3 after a warm-up). Both ends share the host's cores, as two worker
    processes on one machine do.
    """
    import socket
    import threading

    key = f"tcp|{_platform.node()}|{_cpu_name()}|{os.cpu_count()}|{mib}"
    cached = None if refresh else _cached(key)
    if cached is not None:
        return cached
    payload = b"\0" * (1 << 20)

    def once() -> float:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        total = mib << 20

        def send() -> None:
            for _ in range(mib):
                client.sendall(payload)

        t0 = time.perf_counter()
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = 0
        while got < total:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        sender.join()
        took = time.perf_counter() - t0
        for s in (client, conn, server):
            s.close()
        return got / took

    once()
    bandwidth = max(once() for _ in range(3))
    _cache_put(_cache_dir() / "cpu_peak.json", key, bandwidth)
    return bandwidth


def measured_loopback_latency(*, refresh: bool = False, trips: int = 200) -> float:
    """Seconds of one small message over TCP loopback (127.0.0.1), one way: half the median
    round trip of a 1-byte ping-pong between two threads of this process (``trips`` after
    a warm-up), cached per machine. What gloo pays per message between CPU processes on
    one host, before bandwidth (the collective model's alpha of the "tcp" link)."""
    import socket
    import threading

    import numpy as np

    key = f"tcp-latency|{_platform.node()}|{_cpu_name()}|{os.cpu_count()}"
    cached = None if refresh else _cached(key)
    if cached is not None:
        return cached
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    for s in (client, conn):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def echo() -> None:
        for _ in range(trips + 20):
            conn.sendall(conn.recv(1))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    took = []
    for _ in range(trips + 20):
        t0 = time.perf_counter()
        client.sendall(b"x")
        client.recv(1)
        took.append(time.perf_counter() - t0)
    thread.join()
    for s in (client, conn, server):
        s.close()
    latency = float(np.median(took[20:])) / 2
    _cache_put(_cache_dir() / "cpu_peak.json", key, latency)
    return latency


def cpu_spec(n_devices: int | None = None) -> HardwareSpec:
    """A hardware entry for this host's (simulated) CPU devices, measured at runtime.

    Peak FLOP/s and memory bandwidth are measured for the whole host and shared by
    ``n_devices`` devices (default: the local CPU devices when JAX has started, else 1).
    The collective bandwidth between simulated devices of one process is a measured
    all-reduce (``measured_cpu_collective_bandwidth``; before JAX has started, or with one
    local device, the estimate half the memory bandwidth); between processes (gloo on
    loopback) the measured TCP loopback bandwidth shared by each process's devices
    (``measured_loopback_bandwidth``).
    """
    started = _backends_started()
    n = n_devices or (max(1, jax.local_device_count("cpu")) if started else 1)
    peak, mem = measured_cpu_peak(), measured_cpu_memory_bandwidth()
    local = max(1, jax.local_device_count("cpu")) if started else 1
    psum = measured_cpu_collective_bandwidth() if started and local > 1 else None
    latency = measured_cpu_collective_latency() if started and local > 1 else None
    tcp = measured_loopback_bandwidth()
    tcp_latency = measured_loopback_latency()
    if psum is not None:
        link, link_src = psum, (f"measured: psum of 8 MiB per device over {local} local "
                                f"devices, ring formula ({psum / 1e9:.2f} GB/s per device)")
    else:
        link, link_src = mem / 2 / n, ("estimate: half the measured memory bandwidth (a "
                                       f"collective copies through host memory), shared by {n}")
    return HardwareSpec(
        name=f"CPU ({_cpu_name()})", peak_flops=peak / n, memory_bytes=0, platform="cpu",
        source=f"measured: float32 1024^3 matmul ({peak / 1e9:.1f} GFLOP/s per host), "
               f"shared by {n} device(s)",
        chips_per_host=n, hbm_bandwidth=mem / n, nvlink_bandwidth=link,
        network_bandwidth=tcp / local, collective_latency=latency, network_latency=tcp_latency,
        sources={"hbm_bandwidth": f"measured: numpy copy ({mem / 1e9:.1f} GB/s per host), "
                                  f"shared by {n} device(s)",
                 "nvlink_bandwidth": link_src,
                 "collective_latency": (f"measured: psum of one float32 per device over {local}"
                                        f" local devices ({latency * 1e3:.3f} ms)"
                                        if latency is not None else "none"),
                 "network_latency": f"measured: half the median round trip of a 1-byte "
                                    f"TCP ping-pong over 127.0.0.1 ({tcp_latency * 1e6:.1f} us)",
                 "network_bandwidth": f"measured: one TCP stream over 127.0.0.1 "
                                      f"({tcp / 1e9:.2f} GB/s), shared by the {local} "
                                      "device(s) of each process (gloo between processes)"})


