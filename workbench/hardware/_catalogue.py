"""The hardware catalogue: one entry per device generation with everything Workbench knows
about it: published numbers (peak FLOP/s, memory, HBM / ICI / DCN / NVLink / InfiniBand
bandwidths, the host link, TensorCore clock), each value beside its source; the ``device_kind`` JAX
reports; libtpu's topology name; and the mesh presets (TPU slices, GPU servers) that
``wb.abstract_mesh``, the TPU compiler target (``workbench._sharding.topology``) and ``wb.search``
read. Adding a generation is adding one ``Generation`` to ``GENERATIONS``. The CPU entry is
measured at runtime instead (``workbench.hardware.cpu_spec``).

One table, one file: most of its lines are ``GENERATIONS`` itself, each value beside its
source, read through the two small types and three lookups above and below it.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

__all__ = ["GENERATIONS", "LINKS", "Generation", "HardwareSpec", "generation", "hardware_presets",
           "hardware_spec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """Published numbers for one device kind, per JAX device.

    Attributes:
      name: short name ("TPU v5p", "H100 SXM").
      peak_flops: dense bf16 FLOP/s per JAX device (a TPU v2/v3/TPU7x device is one core).
      fp8_flops: dense fp8 FLOP/s per JAX device where the chip multiplies fp8 natively
        (TPU7x, H100/H200, B200); equal to ``peak_flops`` where fp8 is accepted but runs at
        the bf16 rate (v5p and v6e: Google's TPU7x table gives both generations the same
        figure for both); None where fp8 matmuls are not supported (A100, v2-v5e).
      memory_bytes: HBM per JAX device.
      source: where the numbers come from.
      platform: "tpu" or "gpu".
      cores_per_chip: JAX devices per chip (2 on TPU v2/v3 and TPU7x, else 1).
      chips_per_host: chips attached to one host in the usual VM/server shape.
      topology_dims: 2 (v2/v3/v5e/v6e tori) or 3 (v4/v5p/TPU7x).
      hbm_bandwidth: HBM bytes/s per JAX device.
      ici_link_bandwidth: TPU inter-chip link bytes/s, one direction, per link; a chip
        has two links (+ and -) along each torus dimension.
      torus_wrap: when a TPU slice's dimension wraps around: "cube" (v4/v5p: every
        dimension of a slice made of whole 4x4x4 cubes) or "16" (v5e/v6e: a dimension
        of 16 chips, the full pod side).
      dcn_bandwidth: data-center network egress bytes/s per chip (across TPU slices).
      nvlink_bandwidth: GPU NVLink bytes/s per GPU, one direction (through NVSwitch).
      network_bandwidth: GPU scale-out (InfiniBand) bytes/s per GPU, one direction.
      host_bandwidth: the host link (PCIe) bytes/s per chip, each direction (PCIe is full
        duplex): what activations offloaded to host memory cross twice per step
        (``workbench.perf._host``); None where no figure is published.
        (For the CPU entry, ``nvlink_bandwidth`` is the in-process copy bandwidth.)
      clock_hz: TPU TensorCore clock (cycles/s): converts the TPU compiler's per-instruction
        ``estimated_cycles`` into seconds (``workbench._compiled.loops.compiler_cycles``).
      collective_latency: seconds each collective instruction costs whatever its size
        (measured for the CPU entry, where XLA:CPU synchronises the device threads; None
        in the published tables: bandwidth-only).
      ici_latency, dcn_latency, nvlink_latency, pcie_latency, network_latency: seconds
        per message (one step of a ring) over that link, whatever its size: the
        collective model's alpha (``workbench.perf._predict``: alpha x messages + bytes /
        bandwidth); a calibration fitted to profiles overrides them per collective kind.
        For the CPU entry ``network_latency`` is TCP loopback's (gloo between processes,
        measured) and ``collective_latency`` the in-process rendezvous (measured).
      sources: the source of each bandwidth value, by field name.
    """

    name: str
    peak_flops: float
    memory_bytes: int
    source: str
    platform: str
    cores_per_chip: int = 1
    chips_per_host: int = 4
    topology_dims: int = 2
    hbm_bandwidth: float | None = None
    ici_link_bandwidth: float | None = None
    torus_wrap: str | None = None
    dcn_bandwidth: float | None = None
    nvlink_bandwidth: float | None = None
    network_bandwidth: float | None = None
    host_bandwidth: float | None = None
    fp8_flops: float | None = None
    collective_latency: float | None = None
    ici_latency: float | None = None
    dcn_latency: float | None = None
    nvlink_latency: float | None = None
    pcie_latency: float | None = None
    network_latency: float | None = None
    clock_hz: float | None = None
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def link(self, name: str) -> tuple[float, float]:
        """``(alpha seconds per message, beta bytes/s)`` of a link by name (``LINKS``);
        0 where the table has no figure."""
        bandwidth, latency = LINKS[name]
        return float(getattr(self, latency) or 0.0), float(getattr(self, bandwidth) or 0.0)

    def source_of(self, field: str) -> str:
        """Where the value of ``field`` comes from ("unknown" when the table has none)."""
        if field in ("peak_flops", "memory_bytes"):
            return self.source
        return self.sources.get(field, "unknown")


#: The links a collective runs over, by name -> (its bandwidth field, its latency field):
#: TPU slices ICI inside, DCN across; GPU servers NVLink (or PCIe) inside, the scale-out
#: network (InfiniBand) across; simulated CPU devices "memory" inside a process (XLA:CPU's
#: rendezvous of the device threads; the entry's measured psum bandwidth) and TCP
#: loopback across processes (gloo).
LINKS: dict[str, tuple[str, str]] = {
    "ici": ("ici_link_bandwidth", "ici_latency"), "dcn": ("dcn_bandwidth", "dcn_latency"),
    "nvlink": ("nvlink_bandwidth", "nvlink_latency"), "pcie": ("host_bandwidth", "pcie_latency"),
    "infiniband": ("network_bandwidth", "network_latency"),
    "memory": ("nvlink_bandwidth", "collective_latency"),
    "tcp": ("network_bandwidth", "network_latency")}

GIB = 1024**3
_GB = 1000**3
_GBPS = 1e9 / 8  # bytes/s in one Gbit/s
_TPU_DOC = "Google Cloud TPU system architecture docs"
_BOOK = "How to Scale Your Model (jax-ml scaling book), part 2 'How to think about TPUs'"
#: The scaling book's PCIe figures (part 2, after its ICI table): "PCIe bandwidth is
#: typically around 1.5e10 bytes / second per chip", with the footnote "Trillium (TPU v6e)
#: has 32GB/s, about 2x higher than v5". Google publishes no per-generation PCIe figure
#: (the v6e page says only "connects to the host through a PCIe Gen5 interface"); these
#: are read as each direction, as PCIe links are full duplex (x8 Gen4 and Gen5 links give
#: 16 and 32 GB/s each way).
_PCIE_TPU = (1.5e10, f"{_BOOK}: PCIe 'typically around 1.5e10 bytes / second per chip' "
             "(read as each direction; no per-generation figure published)")
_TPU7X_DOC = "Google Cloud TPU docs, 'TPU7x (Ironwood)' system architecture table"
_PCIE_V6E = (3.2e10, f"{_BOOK}: 'Trillium (TPU v6e) has 32GB/s' of PCIe per chip (read as "
             f"each direction); {_TPU_DOC} (v6e): 'connects to the host through a PCIe "
             "Gen5 interface'")


def _clock(peak: float, cores: int, mxus: int, side: int) -> tuple[float, str]:
    """The TensorCore clock that gives ``peak``: ``cores x mxus`` systolic arrays of
    ``side x side`` multiply-adds (2 FLOPs) per cycle each."""
    hz = peak / (cores * mxus * side * side * 2)
    return hz, (f"derived: {peak / 1e12:g} TFLOP/s / ({cores} TensorCore(s) x {mxus} MXUs x "
                f"{side}x{side} x 2 FLOPs per cycle) = {hz / 1e9:.3g} GHz ({_BOOK}: MXU "
                "counts and sizes); a matmul's estimated cycles at this clock stay within "
                "its FLOPs at peak (tests/test_fit_and_speed.py)")


def _clock_tpu7x() -> tuple[float, str]:
    """TPU7x's TensorCore clock: Google publishes neither it nor the MXU count, so 4 MXUs of
    256x256 per TensorCore (v6e's) are assumed; the TPU compiler's own cycle estimate agrees."""
    hz, why = _clock(2307e12, 2, 4, 256)
    return hz, (f"{why}. Assumed: 4 MXUs of 256x256 per TensorCore (v6e's; Google publishes "
                "no TPU7x MXU count): libtpu 0.0.42's cycle estimate for one 8192^3 bf16 "
                "matmul on one tpu7x device is 422k FLOPs per cycle, above the 262k that 2 "
                "such MXUs could do and 80% of 4 MXUs' 524k (v6e: 70%, v5p: 90% of theirs)")


#: Per-message latencies (the collective model's alpha), by platform. NCCL's own cost
#: model charges each step of a ring (Simple protocol) a hardware latency per link type.
#: Google publishes no ICI or DCN figure: TPU entries have none (bandwidth-only) until a
#: calibration fits one (``wb.calibrate``: alpha per kind and link).
_NCCL = "NCCL src/graph/tuning.cc (ncclTopoTuneModel, hwLat): per ring step, Simple protocol"
_LATENCIES: dict[str, dict[str, tuple[float, str]]] = {
    "gpu": {"nvlink_latency": (3.4e-6, f"{_NCCL}: NVLink 3.4 us"),
            "pcie_latency": (5.7e-6, f"{_NCCL}: PCI 5.7 us"),
            "network_latency": (9.6e-6, f"{_NCCL}: network 9.6 us")}}


def _spec(links: Mapping[str, tuple[Any, str]] | None = None, **fields: Any) -> HardwareSpec:
    """A ``HardwareSpec`` whose sourced values (``links``: ``{field: (value, source)}``,
    and the platform's per-message latencies) are stored beside their sources."""
    links = {**_LATENCIES.get(fields.get("platform", ""), {}), **(links or {})}
    return HardwareSpec(**fields, **{k: v for k, (v, _) in links.items()},
                        sources={k: src for k, (_, src) in links.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
    """One device generation (or variant) in the catalogue.

    Attributes:
      name: the short name presets use ("v5p", "v5e", "H100"); unique.
      pattern: regular expression matched against a lower-cased JAX ``device_kind``
        ("TPU v5 lite", "NVIDIA H100 80GB HBM3"); the first entry that matches wins.
      spec: the published numbers, with their sources.
      device_kind: what JAX reports as ``device_kind`` for this generation (abstract
        meshes of its presets carry it).
      libtpu: libtpu's generation name in topology names ("v5p" in "v5p:4x4x8"); None
        for hardware the TPU compiler does not target.
      libtpu_options: extra ``jax.experimental.topologies.get_topology_desc`` arguments
        (v4: ``chip_config_name="megacore"``, one JAX device per chip as on a v4 VM).
      slices: TPU slice presets, ``{"v5p-256": (4, 4, 8)}``: name -> physical chip
        topology. In v2/v3/v4/v5p names the number counts TensorCores (2 per chip); in
        v5e/v6e names it counts chips (Google's slice tables).
      single_host_chips: slices of at most this many chips are one host (v5e/v6e VMs of up
        to 8 chips); larger ones attach ``spec.chips_per_host`` chips per host.
      servers: GPU server presets: numbers of hosts of ``spec.chips_per_host`` GPUs
        ("8xH100", "2x8xH100" for ``(1, 2)``).
    """

    name: str
    pattern: str
    spec: HardwareSpec
    device_kind: str
    libtpu: str | None = None
    libtpu_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    slices: Mapping[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    single_host_chips: int = 0
    servers: tuple[int, ...] = ()

    @property
    def presets(self) -> tuple[str, ...]:
        """Every mesh preset of this generation: TPU slices, then GPU servers."""
        per = self.spec.chips_per_host
        return tuple(self.slices) + tuple(
            f"{h}x{per}x{self.name}" if h > 1 else f"{per}x{self.name}" for h in self.servers)

    def topology_name(self, preset: str) -> str:
        """libtpu's topology name of one of this generation's slices ("v5e-16" ->
        "v5e:4x4": 2D tori name two dimensions)."""
        dims = self.slices[preset][: self.spec.topology_dims]
        return f"{self.libtpu}:{'x'.join(map(str, dims))}"


def _slices(gen: str, sizes: Mapping[int, tuple[int, int, int]]) -> dict[str, tuple[int, ...]]:
    return {f"{gen}-{n}": topo for n, topo in sizes.items()}


# Order matters: the first pattern that matches a JAX device_kind wins.
_CUBES = {8: (2, 2, 1), 16: (2, 2, 2), 32: (2, 2, 4), 64: (2, 4, 4), 128: (4, 4, 4),
          256: (4, 4, 8), 512: (4, 8, 8), 1024: (8, 8, 8), 2048: (8, 8, 16), 4096: (8, 16, 16)}
_PLANES = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1), 16: (4, 4, 1), 32: (4, 8, 1),
           64: (8, 8, 1), 128: (8, 16, 1), 256: (16, 16, 1)}
_NVLINK_A100 = (300e9, "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions), so "
                "300 GB/s one way")
_PCIE4 = (32e9, "NVIDIA A100 datasheet: PCIe Gen4 64 GB/s (both directions), so 32 GB/s "
          "one way")
_PCIE5_H100 = (64e9, "NVIDIA H100 datasheet: PCIe Gen5 128 GB/s (both directions), so 64 "
               "GB/s one way")
_IB_A100 = (200 * _GBPS, "NVIDIA DGX A100 datasheet: one 200 Gbit/s HDR InfiniBand port per "
            "GPU")

#: Blackwell pages (NVIDIA's own datasheet pages are not in the stored corpus this was
#: looked up in; these quote them): per-GPU tables, MLPerf system descriptions, a wiki.
_B200_BOOK = "glennklockwood.com/garden/processors/B200"
_GB200_BOOK = _B200_BOOK
_B200_MLPERF = ("MLPerf Inference v6.0 system description mlcommons/inference_results_v6.0 "
                "closed/Nebius/systems/nebius_b200_n1.json")
_GB200_MLPERF = ("MLPerf Inference v6.1 system description mlcommons/inference_results_v6.1 "
                 "closed/Crusoe/systems/GB200-NVL72_GB200-186GB_aarch64x16_Dynamo.json")
_GB200_WIKI = "aiwiki.ai/wiki/nvidia_gb200_nvl72"

GENERATIONS: tuple[Generation, ...] = (
    Generation(
        name="v2", pattern=r"v2", device_kind="TPU v2", libtpu="v2",
        slices={"v2-8": (2, 2, 1)},
        spec=_spec(name="TPU v2", peak_flops=45e12 / 2, memory_bytes=8 * GIB,
                   source=f"{_TPU_DOC}: 45 TFLOP/s bf16 and 16 GiB per chip, 2 cores",
                   platform="tpu", cores_per_chip=2, links={
                       "hbm_bandwidth": (700e9 / 2, f"{_TPU_DOC}: 700 GB/s HBM per chip, "
                                         "2 cores")})),
    Generation(
        name="v3", pattern=r"v3", device_kind="TPU v3", libtpu="v3",
        slices={"v3-8": (2, 2, 1), "v3-32": (4, 4, 1)},
        spec=_spec(name="TPU v3", peak_flops=123e12 / 2, memory_bytes=16 * GIB,
                   source=f"{_TPU_DOC}: 123 TFLOP/s bf16 and 32 GiB per chip, 2 cores",
                   platform="tpu", cores_per_chip=2, links={
                       "hbm_bandwidth": (900e9 / 2, f"{_BOOK}: 9.0e11 B/s HBM per chip, 2 "
                                         "cores"),
                       "ici_link_bandwidth": (1e11, f"{_BOOK}: 1e11 B/s one-way per ICI link"),
                       "torus_wrap": ("16", "full 32x32 pod; assumed like v5e: a side of 16+ "
                                      "wraps")})),
    Generation(
        name="v4", pattern=r"v4", device_kind="TPU v4", libtpu="v4",
        libtpu_options={"chip_config_name": "megacore"}, slices=_slices("v4", _CUBES),
        spec=_spec(name="TPU v4", peak_flops=275e12, memory_bytes=32 * GIB,
                   source=f"{_TPU_DOC}: 275 TFLOP/s bf16, 32 GiB per chip (megacore)",
                   platform="tpu", topology_dims=3, links={
                       "clock_hz": _clock(275e12, 2, 4, 128),
                       "hbm_bandwidth": (1.2e12, f"{_BOOK}: 1.2e12 B/s HBM per chip"),
                       "ici_link_bandwidth": (4.5e10, f"{_BOOK}: 4.5e10 B/s one-way per ICI "
                                              "link"),
                       "torus_wrap": ("cube", f"{_TPU_DOC}: slices of whole 4x4x4 cubes are "
                                      "tori"),
                       "dcn_bandwidth": (50 * _GBPS, "estimate: 200 Gbit/s per 4-chip host "
                                         "(ct4p VM), like v5p"),
                       "host_bandwidth": _PCIE_TPU})),
    Generation(
        name="v5p", pattern=r"v5p|v5$", device_kind="TPU v5p", libtpu="v5p",
        slices={**_slices("v5p", _CUBES), "v5p-8192": (16, 16, 16)},
        spec=_spec(name="TPU v5p", peak_flops=459e12, memory_bytes=95 * GIB,
                   source=f"{_TPU_DOC}: 459 TFLOP/s bf16, 95 GiB per chip (megacore)",
                   platform="tpu", topology_dims=3, links={
                       "clock_hz": _clock(459e12, 2, 4, 128),
                       "hbm_bandwidth": (2.765e12, f"{_TPU_DOC}: 2765 GB/s HBM per chip"),
                       "ici_link_bandwidth": (9e10, f"{_BOOK}: 9e10 B/s one-way per ICI link"),
                       "torus_wrap": ("cube", f"{_TPU_DOC}: slices of whole 4x4x4 cubes are "
                                      "tori"),
                       "dcn_bandwidth": (50 * _GBPS, f"{_TPU_DOC}: 200 Gbit/s per "
                                         "ct5p-hightpu-4t VM, 50 Gbit/s per chip"),
                       "host_bandwidth": _PCIE_TPU,
                       "fp8_flops": (459e12, f"{_TPU7X_DOC}: v5p 459 TFLOP/s fp8 per chip, the "
                                     "bf16 figure (fp8 runs at the bf16 rate)")})),
    Generation(
        name="v5e", pattern=r"v5 ?lite|v5e", device_kind="TPU v5 lite", libtpu="v5e",
        slices=_slices("v5e", _PLANES), single_host_chips=8,
        spec=_spec(name="TPU v5e", peak_flops=197e12, memory_bytes=16 * GIB,
                   source=f"{_TPU_DOC}: 197 TFLOP/s bf16, 16 GiB per chip", platform="tpu",
                   links={
                       "clock_hz": _clock(197e12, 1, 4, 128),
                       "hbm_bandwidth": (8.1e11, f"{_BOOK}: 8.1e11 B/s HBM per chip"),
                       "ici_link_bandwidth": (4.5e10, f"{_BOOK}: 4.5e10 B/s one-way per ICI "
                                              "link"),
                       "torus_wrap": ("16", f"{_TPU_DOC}: the 16x16 pod is a 2D torus"),
                       "dcn_bandwidth": (50 * _GBPS, f"{_TPU_DOC}: 50 Gbit/s DCN per v5e "
                                         "chip"),
                       "host_bandwidth": _PCIE_TPU})),
    Generation(
        name="v6e", pattern=r"v6 ?lite|v6e", device_kind="TPU v6 lite", libtpu="v6e",
        slices=_slices("v6e", _PLANES), single_host_chips=8,
        spec=_spec(name="TPU v6e", peak_flops=918e12, memory_bytes=32 * GIB,
                   source=f"{_TPU_DOC}: 918 TFLOP/s bf16, 32 GiB per chip", platform="tpu",
                   links={
                       "clock_hz": _clock(918e12, 1, 4, 256),
                       "hbm_bandwidth": (1.64e12, f"{_TPU_DOC}: 1640 GB/s HBM per chip"),
                       "ici_link_bandwidth": (9e10, f"{_BOOK}: 9e10 B/s one-way per ICI link"),
                       "torus_wrap": ("16", f"{_TPU_DOC}: the 16x16 pod is a 2D torus"),
                       "dcn_bandwidth": (100 * _GBPS, f"{_TPU_DOC}: 100 Gbit/s DCN per v6e "
                                         "chip"),
                       "host_bandwidth": _PCIE_V6E,
                       "fp8_flops": (918e12, f"{_TPU7X_DOC}: v6e 918 TFLOP/s fp8 per chip, the "
                                     "bf16 figure (fp8 runs at the bf16 rate)")})),
    Generation(
        name="tpu7x", pattern=r"tpu ?7x|ironwood|v7x", device_kind="TPU7x", libtpu="tpu7x",
        slices=_slices("tpu7x", _CUBES),
        spec=_spec(name="TPU7x (Ironwood)", peak_flops=2307e12 / 2, memory_bytes=192 * GIB // 2,
                   source=f"{_TPU7X_DOC}: 2307 TFLOP/s bf16 and 192 GiB HBM per chip, 2 "
                   "TensorCores per chip (each a JAX device: libtpu's tpu7x topologies list 2 "
                   "devices per chip)", platform="tpu", cores_per_chip=2, topology_dims=3,
                   links={
                       "fp8_flops": (4614e12 / 2, f"{_TPU7X_DOC}: 4614 TFLOP/s fp8 per chip, 2 "
                                     "TensorCores"),
                       "clock_hz": _clock_tpu7x(),
                       "hbm_bandwidth": (7380e9 / 2, f"{_TPU7X_DOC}: 7380 GB/s HBM per chip, 2 "
                                         "TensorCores"),
                       "ici_link_bandwidth": (1e11, f"derived: {_TPU7X_DOC}: 1200 GB/s "
                                              "bidirectional ICI per chip, over the 6 links of a "
                                              "3D torus (x, y, z, each + and -), 2 directions: "
                                              "1e11 B/s one way per link (v5p's 1200 GB/s gives "
                                              "the scaling book's 9e10 the same way)"),
                       "torus_wrap": ("cube", f"{_TPU7X_DOC}: 'shares many similarities with TPU "
                                      "v5p' (4x4x4 cubes joined by optical switches); assumed: "
                                      "slices of whole cubes are tori, as on v5p"),
                       "dcn_bandwidth": (100 * _GBPS, f"{_TPU7X_DOC}: 100 Gbit/s DCN per chip"),
                       "host_bandwidth": (_PCIE_V6E[0], "estimate: as v6e (PCIe Gen5, 32 GB/s "
                                          "each way per chip); Google publishes no TPU7x host "
                                          "link figure")})),
    Generation(
        name="A100", pattern=r"a100.*80", device_kind="NVIDIA A100-SXM4-80GB", servers=(1, 2, 4),
        spec=_spec(name="A100 80GB", peak_flops=312e12, memory_bytes=80 * _GB,
                   source="NVIDIA A100 datasheet: 312 TFLOP/s dense bf16", platform="gpu",
                   chips_per_host=8, links={
                       "hbm_bandwidth": (2.039e12, "NVIDIA A100 datasheet: 2039 GB/s (SXM "
                                         "80GB)"),
                       "nvlink_bandwidth": _NVLINK_A100, "network_bandwidth": _IB_A100,
                       "host_bandwidth": _PCIE4})),
    Generation(
        name="A100 40GB", pattern=r"a100", device_kind="NVIDIA A100-SXM4-40GB",
        spec=_spec(name="A100 40GB", peak_flops=312e12, memory_bytes=40 * _GB,
                   source="NVIDIA A100 datasheet: 312 TFLOP/s dense bf16", platform="gpu",
                   chips_per_host=8, links={
                       "hbm_bandwidth": (1.555e12, "NVIDIA A100 datasheet: 1555 GB/s (40GB)"),
                       "nvlink_bandwidth": _NVLINK_A100, "network_bandwidth": _IB_A100,
                       "host_bandwidth": _PCIE4})),
    Generation(
        name="H100 NVL", pattern=r"h100.*nvl", device_kind="NVIDIA H100 NVL",
        spec=_spec(name="H100 NVL", peak_flops=835e12, memory_bytes=94 * _GB,
                   source="NVIDIA H100 datasheet: 1671 TFLOP/s bf16 with sparsity, so 835 "
                   "dense", platform="gpu", chips_per_host=8, links={
                       "hbm_bandwidth": (3.9e12, "NVIDIA H100 datasheet: 3.9 TB/s (NVL)"),
                       "nvlink_bandwidth": (300e9, "NVIDIA H100 datasheet: NVLink 600 GB/s "
                                            "(both directions), so 300 GB/s one way"),
                       "host_bandwidth": _PCIE5_H100,
                       "fp8_flops": (1670e12, "NVIDIA H100 datasheet: 3341 TFLOP/s fp8 with "
                                     "sparsity (NVL), so 1670 dense")})),
    Generation(
        name="H100 PCIe", pattern=r"h100.*pcie", device_kind="NVIDIA H100 PCIe",
        spec=_spec(name="H100 PCIe", peak_flops=756e12, memory_bytes=80 * _GB,
                   source="NVIDIA H100 datasheet: 1513 TFLOP/s bf16 with sparsity, so 756 "
                   "dense", platform="gpu", chips_per_host=8, links={
                       "hbm_bandwidth": (2.0e12, "NVIDIA H100 datasheet: 2 TB/s (PCIe)"),
                       "nvlink_bandwidth": (300e9, "NVIDIA H100 datasheet: NVLink bridge 600 "
                                            "GB/s (both directions), so 300 GB/s one way"),
                       "host_bandwidth": _PCIE5_H100,
                       "fp8_flops": (1513e12, "NVIDIA H100 datasheet: 3026 TFLOP/s fp8 with "
                                     "sparsity (PCIe), so 1513 dense")})),
    Generation(
        name="H100", pattern=r"h100", device_kind="NVIDIA H100 80GB HBM3", servers=(1, 2, 4),
        spec=_spec(name="H100 SXM", peak_flops=989e12, memory_bytes=80 * _GB,
                   source="NVIDIA H100 datasheet: 1979 TFLOP/s bf16 with sparsity, so 989 "
                   "dense", platform="gpu", chips_per_host=8, links={
                       "hbm_bandwidth": (3.35e12, "NVIDIA H100 datasheet: 3.35 TB/s (SXM)"),
                       "nvlink_bandwidth": (450e9, "NVIDIA H100 datasheet: NVLink 900 GB/s "
                                            "(both directions), so 450 GB/s one way"),
                       "network_bandwidth": (400 * _GBPS, "NVIDIA DGX H100 datasheet: one 400 "
                                             "Gbit/s NDR InfiniBand port per GPU"),
                       "host_bandwidth": _PCIE5_H100,
                       "fp8_flops": (1979e12, "NVIDIA H100 datasheet: 3958 TFLOP/s fp8 with "
                                     "sparsity (SXM), so 1979 dense")})),
    Generation(
        name="H200", pattern=r"h200", device_kind="NVIDIA H200", servers=(1, 2, 4),
        spec=_spec(name="H200", peak_flops=989e12, memory_bytes=141 * _GB,
                   source="NVIDIA H200 datasheet: 1979 TFLOP/s bf16 with sparsity, so 989 "
                   "dense; 141 GB HBM3e", platform="gpu", chips_per_host=8, links={
                       "hbm_bandwidth": (4.8e12, "NVIDIA H200 datasheet: 4.8 TB/s"),
                       "nvlink_bandwidth": (450e9, "NVIDIA H200 datasheet: NVLink 900 GB/s "
                                            "(both directions), so 450 GB/s one way"),
                       "network_bandwidth": (400 * _GBPS, "NVIDIA DGX H200 datasheet: one 400 "
                                             "Gbit/s InfiniBand port per GPU"),
                       "host_bandwidth": (64e9, "NVIDIA H200 datasheet: PCIe Gen5 128 GB/s "
                                          "(both directions), so 64 GB/s one way"),
                       "fp8_flops": (1979e12, "NVIDIA H200 datasheet: 3958 TFLOP/s fp8 with "
                                     "sparsity, so 1979 dense")})),
    Generation(
        name="GB200", pattern=r"gb200", device_kind="NVIDIA GB200", servers=(1,),
        spec=_spec(name="GB200", peak_flops=2500e12, memory_bytes=186 * _GB,
                   source=f"{_GB200_BOOK}: 'the GB200 variant of B200 when configured to 1,200 "
                   "W': BF16 2500 TFLOP/s dense (5000 sparse) per GPU (verda.com/blog/"
                   "gb300-nvl72-architecture lists 2.25 PFLOP/s); 186 GB HBM3e per GPU: "
                   f"{_GB200_MLPERF} ('accelerator_memory_capacity': '186 GB'), and "
                   f"{_GB200_WIKI}: NVIDIA's 'about 13.4 TB' per 72 GPUs", platform="gpu",
                   chips_per_host=4, links={
                       "hbm_bandwidth": (8e12, f"{_GB200_BOOK} (B200): '8 TB/s (max)' per GPU "
                                         "(verda.com/blog/gb300-nvl72-architecture lists 7.7 "
                                         "TB/s for GB200)"),
                       "nvlink_bandwidth": (900e9, "verda.com/blog/gb300-nvl72-architecture: "
                                            "'fifth-generation NVLink with 1.8 TB/s total "
                                            "bandwidth (900 GB/s unidirectional)'; "
                                            f"{_GB200_WIKI}: 1.8 TB/s per GPU"),
                       "fp8_flops": (5000e12, f"{_GB200_BOOK}: FP8 5000 TFLOP/s dense (10000 "
                                     f"sparse) per GPU; {_GB200_WIKI}: NVIDIA's 720 PFLOP/s "
                                     "FP8 per 72-GPU rack (sparse), 5 dense per GPU")})),
    Generation(
        name="B200", pattern=r"b200", device_kind="NVIDIA B200", servers=(1, 2, 4),
        spec=_spec(name="B200", peak_flops=2250e12, memory_bytes=180 * _GB,
                   source="NVIDIA DGX B200 datasheet: 72 PFLOP/s fp8 training per 8 GPUs, so "
                   "2.25 PFLOP/s dense bf16 per GPU; 180 GB; the same figures per GPU in "
                   f"{_B200_BOOK} (HGX B200 at 1,000 W: BF16 2250 dense) and {_B200_MLPERF} "
                   "('NVIDIA B200-SXM-180GB')", platform="gpu", chips_per_host=8,
                   links={
                       "hbm_bandwidth": (8e12, "NVIDIA DGX B200 datasheet: 64 TB/s HBM3e per "
                                         f"8 GPUs; {_B200_BOOK}: '8 TB/s (max)' (pytorch/ao "
                                         "pull 4002 reads 7.67 TB/s from the driver's 7680-bit "
                                         "bus at 3996 MHz)"),
                       "nvlink_bandwidth": (900e9, "NVIDIA DGX B200 datasheet: NVLink 5, 1.8 "
                                            "TB/s per GPU (both directions), so 900 GB/s one "
                                            f"way; {_B200_MLPERF}: '18x 5th Gen NVLink, 14.4 "
                                            "TB/s aggregated bandwidth' per 8 GPUs"),
                       "network_bandwidth": (400 * _GBPS, "NVIDIA DGX B200 datasheet: one 400 "
                                             "Gbit/s ConnectX-7 port per GPU"),
                       "fp8_flops": (4.5e15, "NVIDIA DGX B200 datasheet: 72 PFLOP/s fp8 "
                                     "training per 8 GPUs (with sparsity), so 4.5 PFLOP/s "
                                     f"dense per GPU; {_B200_BOOK}: FP8 4500 dense")})),
)


def hardware_spec(device_kind: str) -> HardwareSpec | None:
    """The published numbers for a JAX ``device_kind`` (or a short name), or None."""
    kind = device_kind.lower().strip()
    for gen in GENERATIONS:
        if re.search(gen.pattern, kind):
            return gen.spec
    return None


def generation(name: str) -> Generation | None:
    """The catalogue entry of a generation name ("v5p", "H100", case-insensitive) or of
    one of its presets ("v5p-256", "2x8xH100"), or None."""
    key = name.strip()
    server = re.fullmatch(r"(?:\d+x)?\d+x(.+)", key, re.IGNORECASE)   # "8xH100", "2x8xH100"
    for gen in GENERATIONS:
        if key.lower() == gen.name.lower() or key in gen.slices or (
                server and gen.servers and server.group(1).lower() == gen.name.lower()):
            return gen
    return None


def hardware_presets() -> tuple[str, ...]:
    """Every mesh preset in the catalogue: TPU slices, then GPU servers."""
    return tuple(p for gen in GENERATIONS for p in gen.slices) + tuple(
        p for gen in GENERATIONS for p in gen.presets[len(gen.slices):])
