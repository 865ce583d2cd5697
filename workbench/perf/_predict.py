"""Predicted step time and MFU: a roofline over FLOPs, HBM bytes and collectives.

Formulas and their sources are in docs/predictions.md. In short, per device and step:

    compute   = FLOPs / peak FLOP/s
    memory    = bytes accessed / HBM bandwidth
    local     = max(compute, memory)                 (the roofline: they overlap; on
                                                      CPU compute + memory: shared cores;
                                                      calibrated, compute + memory: each is
                                                      then the time measured in its kernels)
                or, for a TPU-compiled plan, the TPU compiler's own cycle estimates of
                every fusion it scheduled (x loop trip counts) at the chip's clock, plus
                the Pallas kernels' FLOPs at the efficiency those cycles give the step's
                other FLOPs (``compute_seconds``)
    comm      = sum of collective times (ring formulas below, per mesh axis bandwidth)
    exposed   = the collectives on the critical path (``exposed_axes``: tensor-parallel
                traffic, whose result the next matmul waits for)
    host      = the offloaded activations' trips to host memory and back that the compute
                scheduled beside them does not hide (``workbench.perf._host``: read from the
                compiled HLO, timed at the chip's host-link bandwidth)
    step      = local + exposed + (comm - exposed) - overlap * min(local, comm - exposed)
                + host

Ring formulas (n devices in the group, b bytes of the result per device, W bytes/s each
device can send in one direction summed over the links the ring uses):
all-gather (n-1)/n b/W, reduce-scatter (n-1) b/W, all-reduce 2 (n-1)/n b/W,
all-to-all (n-1)/n b/W on a switch and n b/(4W) on a torus ring, collective-permute b/W.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from workbench.hardware._calibration import Calibration
from workbench._validate import check_float
from workbench.hardware._catalogue import LINKS, HardwareSpec
from workbench.hardware._effective import EffectiveSpec
from workbench._sharding.mesh import MeshInfo, mesh_info
from workbench.perf._band import Band, prediction_band
from workbench.perf._bounds import implausible
from workbench._compiled.hlo import Collective
from workbench.perf._cost import StepCost
from workbench.perf._host import HostTime

__all__ = ["CollectiveTime", "Prediction", "collective_seconds", "part_seconds", "predict",
           "ring_steps"]

BOUNDS = ("compute", "memory", "communication")
#: A calibration's collective entry of the latency + bandwidth model (``kind@link``:
#: alpha seconds per message, beta bytes/s), as ``wb.calibrate`` fits it.
ALPHA_BETA = "alpha-beta"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveTime:
    """One collective of the step, timed.

    Attributes:
      kind: all-gather, reduce-scatter, all-reduce, all-to-all or collective-permute.
      axes: mesh axes its groups span.
      group_size: devices per group.
      bytes: result bytes per device per instruction.
      count: instructions per step.
      links: the links it runs over ("ici x2 (torus) on 1 dim", "dcn", "nvlink", ...).
      bandwidth: bytes/s one device sends over those links (one direction).
      seconds: time per step (all ``count`` instructions).
      overlap: fraction of ``seconds`` assumed hidden behind compute.
      formula: the formula used, with its numbers.
      source: where the bandwidth comes from.
      latencies: the latencies it pays per step, in units of the hardware entry's
        collective latency: ``count``, or on XLA:CPU ``count`` x the arrays each
        instruction carries (each array of a tuple-shaped collective is its own rendezvous
        of the device threads) x the group's share (see ``collective_seconds``).
      exposed: on the critical path, never hidden behind compute (``exposed_axes``, or
        run synchronously by the compiled program).
      parts: per link it crosses (inside a slice or host, then across them), what one
        instruction costs there: ``{"link", "messages", "bytes", "latency", "bandwidth"}``,
        timed ``latency x messages + bytes / bandwidth`` (alpha and beta: the table's, or a
        calibration's fitted per kind and link).
    """

    kind: str
    axes: tuple[str, ...]
    group_size: int
    bytes: float
    count: int
    links: str
    bandwidth: float
    seconds: float
    overlap: float
    formula: str
    source: str
    latencies: float = 0.0
    exposed: bool = False
    parts: tuple[dict[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """A predicted step: time, MFU, throughput, what bounds it, and why.

    Attributes:
      step_seconds: predicted time of one step.
      mfu: model FLOPs / (step x devices x peak); None without model FLOPs. The peak is
        the chip's bf16 (dense) one, also for a step with fp8 matmuls.
      mfu_fp8: model FLOPs / (step x devices x the chip's fp8 peak), for a step with fp8
        matmuls (``StepCost.fp8_flops``) on a chip whose table has an fp8 peak: the
        other convention (MaxText's Ironwood fp8 rows quote TFLOP/s against the bf16
        peak, fp8 datasheets against the fp8 one); None otherwise.
      tokens_per_s: tokens per step / step time; None without tokens.
      bound: "compute", "memory" or "communication": the largest term.
      breakdown: seconds per term: "compute", "memory", "communication" (after overlap),
        "communication_total" (before), "host_transfers" (the offloaded activations'
        host-link time not hidden behind compute; 0 without offload), "host_link" (the
        host link's busy time per step), "no_overlap_step" (upper bound), the bytes per
        step "host_bytes_to_host" and "host_bytes_to_device", and "collectives": a
        tuple of ``CollectiveTime``.
      sources: where each number comes from, by name ("flops", "bytes", "peak_flops",
        "hbm_bandwidth", "overlap", "mfu", "compiler_seconds").
      compiler_seconds: the TPU compiler's own estimate (``optimal_seconds`` of its cost
        analysis) where the plan was TPU-compiled, shown beside ours; else None (also when
        the compiler's number is negative: its "unknown").
      implausible: why the prediction breaks a physical bound
        (``workbench.perf._bounds``: below its own roofline, MFU above the published
        envelope, ...); empty when it holds. ``wb.search`` never ranks such a plan.
      band: how sure it is (``workbench.perf._band.Band``): the factors of the step time
        the measured step has been seen in, from the calibration's residuals or the
        reference rows of the chip's generation, or why there is no band; None only in a
        prediction made without one.
    """

    step_seconds: float
    mfu: float | None
    tokens_per_s: float | None
    bound: str
    breakdown: dict[str, Any]
    sources: dict[str, str]
    compiler_seconds: float | None = None
    implausible: tuple[str, ...] = ()
    band: Band | None = None
    mfu_fp8: float | None = None

    def mfu_text(self) -> str:
        """``"MFU 41.2%"``, or with fp8 matmuls ``"MFU 41.2% of the bf16 peak, 20.6% of the
        fp8 peak"``; "" without MFU."""
        return mfu_text(self.mfu, self.mfu_fp8)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (run.json, the plan widget, the lab dashboard)."""
        b = self.breakdown
        return {"step_seconds": self.step_seconds, "mfu": self.mfu, "mfu_fp8": self.mfu_fp8,
                "tokens_per_s": self.tokens_per_s, "bound": self.bound,
                "compiler_seconds": self.compiler_seconds, "sources": dict(self.sources),
                "implausible": list(self.implausible),
                "band": self.band.to_dict() if self.band is not None else None,
                "breakdown": {k: v for k, v in b.items() if k != "collectives"}
                | {"collectives": [dataclasses.asdict(c) | {"axes": list(c.axes),
                                                           "parts": [dict(p) for p in c.parts]}
                                   for c in b["collectives"]]}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prediction:
        """The prediction of ``to_dict()``'s data (after a JSON round trip): equal to the
        one written.

        Raises:
          ValueError: ``d`` is not a prediction's ``to_dict()``.
        """
        try:
            b = dict(d["breakdown"])
            b["collectives"] = tuple(CollectiveTime(**c | {
                "axes": tuple(c["axes"]), "parts": tuple(dict(p) for p in c["parts"])})
                for c in b["collectives"])
            band = None if d["band"] is None else Band(
                **{k: v for k, v in d["band"].items() if k not in ("summary", "rows")},
                rows=tuple(dict(r) for r in d["band"]["rows"]))
            return cls(step_seconds=d["step_seconds"], mfu=d["mfu"], mfu_fp8=d["mfu_fp8"],
                       tokens_per_s=d["tokens_per_s"], bound=d["bound"], breakdown=b,
                       sources=dict(d["sources"]), compiler_seconds=d["compiler_seconds"],
                       implausible=tuple(d["implausible"]), band=band)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"Prediction.from_dict: not a prediction's to_dict() "
                             f"({type(e).__name__}: {e}); write one with "
                             "prediction.to_dict()") from None

    def __str__(self) -> str:
        b = self.breakdown
        lines = [f"predicted step {self.step_seconds * 1e3:.3g} ms ({self.bound}-bound)"
                 + (f", {self.mfu_text()}" if self.mfu is not None else "")
                 + (f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else ""),
                 *([f"  {self.band.describe(self.step_seconds)}"]
                   if self.band is not None else []),
                 f"  compute {b['compute'] * 1e3:.3g} ms, HBM {b['memory'] * 1e3:.3g} ms, "
                 f"communication {b['communication_total'] * 1e3:.3g} ms "
                 f"({b['communication'] * 1e3:.3g} ms not overlapped)"]
        if b.get("host_link"):
            lines.append(f"  host transfers {b['host_transfers'] * 1e3:.3g} ms not hidden, of "
                         f"{b['host_link'] * 1e3:.3g} ms on the host link "
                         f"({b['host_bytes_to_host'] / 1e9:.3g} GB to host, "
                         f"{b['host_bytes_to_device'] / 1e9:.3g} GB back)")
        if b.get("roofline_local") is not None and b["local"] != b["roofline_local"]:
            lines.insert(1, f"  local work {b['local'] * 1e3:.3g} ms by the compiler's "
                            f"estimates (roofline {b['roofline_local'] * 1e3:.3g} ms)")
        lines += [f"  {c.kind} over {','.join(c.axes) or '-'} x{c.count}: {c.seconds * 1e3:.3g}"
                  f" ms at {c.bandwidth / 1e9:.3g} GB/s ({c.links})" for c in b["collectives"]]
        if self.compiler_seconds is not None:
            lines.append(f"  TPU compiler's estimate: {self.compiler_seconds * 1e3:.3g} ms")
        lines += [f"  IMPLAUSIBLE: {why}" for why in self.implausible]
        return "\n".join(lines)


# -- links --------------------------------------------------------------------------------

def _wraps(spec: HardwareSpec, dim_size: int, slice_dims: Sequence[int]) -> bool:
    if spec.torus_wrap == "cube":
        return all(d % 4 == 0 for d in slice_dims)
    if spec.torus_wrap == "16":
        return dim_size >= 16
    return False


def _group_index(info: MeshInfo, axes: Sequence[str]) -> tuple:
    """Index of the group through device 0 that spans ``axes``."""
    return tuple(slice(None) if n in axes else 0 for n in info.axis_names)


def _ici_bandwidth(info: MeshInfo, spec: HardwareSpec, axes: Sequence[str]) -> tuple[float, str, bool]:
    """(bytes/s one device sends, description, torus?) for a group inside one slice."""
    link = spec.ici_link_bandwidth or 0.0
    if info.coords is None:  # no physical layout: one torus dimension per mesh axis
        return 2 * link * len(axes), f"ici x2 per axis on {len(axes)} axis (assumed)", True
    slice_dims = tuple(int(x) + 1 for x in info.coords.reshape(-1, 3).max(axis=0))
    group = info.coords[_group_index(info, axes)].reshape(-1, 3)
    total, parts, torus = 0.0, [], True
    for d in range(3):
        extent = len(np.unique(group[:, d]))
        if extent < 2:
            continue
        wrap = extent == slice_dims[d] and _wraps(spec, extent, slice_dims)
        total += (2 if wrap else 1) * link
        parts.append(f"dim {d}: {extent} chips, {'torus x2' if wrap else 'line x1'}")
        torus &= wrap
    if total == 0.0:  # the group shares chips (cores of one chip): on-chip
        return float(spec.hbm_bandwidth or link), "on chip", True
    return total, "ici " + "; ".join(parts), torus


def _hosts_in_group(info: MeshInfo, axes: Sequence[str]) -> int:
    if info.process_index is None:
        return 1
    return int(len(np.unique(info.process_index[_group_index(info, axes)])))


def _ring_seconds(kind: str, nbytes: float, n: int, bandwidth: float, torus: bool) -> float:
    if n <= 1 or nbytes == 0:
        return 0.0
    if kind == "all-gather":
        return (n - 1) / n * nbytes / bandwidth
    if kind == "reduce-scatter":
        return (n - 1) * nbytes / bandwidth
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes / bandwidth
    if kind == "all-to-all":
        # on a torus ring each byte travels n/4 hops on average (scaling book, part 3);
        # through a switch it is sent once.
        return nbytes * n / (4 * bandwidth) if torus else (n - 1) / n * nbytes / bandwidth
    if kind == "collective-permute":
        return nbytes / bandwidth
    raise ValueError(f"unknown collective kind {kind!r}")


#: Messages (ring steps) each device sends per instruction over a ring of n: NCCL's cost
#: model's steps (src/graph/tuning.cc: all-reduce 2(n-1), all-gather and reduce-scatter
#: n-1); all-to-all n-1 (one message to each peer); collective-permute 1.
def ring_steps(kind: str, n: int) -> float:
    """Messages one device sends in a ``kind`` over a ring of ``n`` participants."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1)
    if kind == "collective-permute":
        return 1.0
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return float(n - 1)
    raise ValueError(f"unknown collective kind {kind!r}")


def _part(link: str, messages: float, wire: float, spec: HardwareSpec,
          bandwidth: float) -> dict[str, Any]:
    """One link's share of a collective: its messages and bytes per instruction, and the
    table's alpha (seconds per message) and beta (bytes/s) for it."""
    alpha, _ = spec.link(link)
    return {"link": link, "messages": float(messages), "bytes": float(wire),
            "latency": alpha, "bandwidth": float(bandwidth)}


def part_seconds(part: dict[str, Any], latency: float | None = None,
                 bandwidth: float | None = None) -> float:
    """alpha x messages + bytes / beta of one part (per instruction), with the part's own
    alpha and beta unless given."""
    alpha = part["latency"] if latency is None else latency
    beta = part["bandwidth"] if bandwidth is None else bandwidth
    return alpha * part["messages"] + (part["bytes"] / beta if part["bytes"] and beta else 0.0)


def _links_of(c: Collective, info: Any, spec: HardwareSpec) -> tuple[Any, ...]:
    """The links collective ``c`` crosses on ``spec``: ``(outer, bw_in, links, torus, src,
    link_in, link_out, bw_out, out_name, out_src)``: how many slices (TPU, over DCN) or hosts
    (GPU, CPU) its group spans, then the link inside a slice/host (its bandwidth, name for
    the text, whether a torus, its source, its kind in the latency table), then the link
    across them (its kind, bandwidth, name and source)."""
    if spec.platform == "tpu":
        dcn = info.dcn_axis_sizes or (1,) * len(info.axis_names)
        outer = math.prod(d for a, d in zip(info.axis_names, dcn) if a in c.axes) or 1
        bw_in, links, torus = _ici_bandwidth(info, spec, c.axes)
        return (outer, bw_in, links, torus, spec.source_of("ici_link_bandwidth"), "ici", "dcn",
                spec.dcn_bandwidth or 0.0, "dcn", spec.source_of("dcn_bandwidth"))
    outer = _hosts_in_group(info, c.axes) if c.axes else 1
    bw_in = float(spec.nvlink_bandwidth or spec.hbm_bandwidth or 0.0)
    cpu = spec.platform == "cpu"
    links = "loopback copy" if cpu else "nvlink"
    link_in, link_out = ("memory", "tcp") if cpu else ("nvlink", "infiniband")
    if not cpu and not spec.nvlink_bandwidth and spec.host_bandwidth:
        bw_in, links, link_in = float(spec.host_bandwidth), "pcie", "pcie"
    return (outer, bw_in, links, False, spec.source_of("nvlink_bandwidth"), link_in, link_out,
            spec.network_bandwidth or 0.0, "infiniband", spec.source_of("network_bandwidth"))


def collective_seconds(c: Collective, mesh: Any, spec: HardwareSpec) -> CollectiveTime:
    """Time of one merged collective of a compiled step on ``mesh`` with ``spec``'s links.

    Per link it crosses: ``alpha(link) x messages + bytes / beta(link)`` (the parts of
    ``CollectiveTime.parts``, which a calibration refits per kind and link). Within one
    slice (TPU) or one host (GPU, CPU) a ring over the group's links; across slices or
    hosts, hierarchically: the ring inside the slice/host on the full bytes, then a ring
    over slices/hosts on the bytes left per device (1/n_inner of them for reductions and
    gathers), over DCN, InfiniBand or (CPU processes, gloo) TCP loopback. Messages are the
    ring's steps (``ring_steps``), per array on XLA:CPU (each array of a tuple-shaped
    collective is its own exchange); bytes are the ring formula's.
    """
    info = mesh_info(mesh)
    n, b = max(1, c.group_size), float(c.bytes)
    (outer, bw_in, links, torus, src, link_in, link_out, bw_out, out_name,
     out_src) = _links_of(c, info, spec)
    inner = max(1, n // outer)
    if (inner > 1 and bw_in <= 0) or (outer > 1 and bw_out <= 0):
        missing = "link" if inner > 1 and bw_in <= 0 else out_name
        raise ValueError(f"{spec.name} has no {missing} bandwidth in the hardware table; "
                         f"cannot time a {c.kind} over {c.axes}")
    # reduce-scatter's result is 1/outer of what the ring inside a slice/host produces
    b_in = b * outer if c.kind == "reduce-scatter" else b
    shrink = inner if c.kind in ("all-reduce", "all-gather") else 1
    buffers = max(1, len(c.shapes)) if spec.platform == "cpu" else 1
    local = max(1, info.size // info.n_hosts)
    parts = []
    if spec.platform == "cpu" and info.n_hosts > 1 and n > 1:
        # XLA:CPU in a multi-process job runs every collective through gloo, whose ranks
        # are the devices: even a process's own devices talk over TCP loopback. One ring
        # over the group, a message per array and step.
        parts.append(_part("tcp", buffers * ring_steps(c.kind, n),
                           _ring_seconds(c.kind, b, n, 1.0, False), spec,
                           float(spec.network_bandwidth or 0.0)))
    elif inner > 1:
        if spec.platform == "cpu":
            # XLA:CPU rendezvouses the device threads once per array of a tuple-shaped
            # collective (no ring), and a group of g of the N devices of a process (the
            # latency is measured over all N) costs about (g + 1) / (N + 1) of that: per
            # array, psums on 8 simulated devices (2 cores) took 0.061, 0.093, 0.169 ms
            # for groups of 2, 4, 8 (0.36, 0.55, 1 against 0.33, 0.56, 1)
            msgs = buffers * (min(inner, local) + 1) / (local + 1)
        else:
            msgs = ring_steps(c.kind, inner)
        parts.append(_part(link_in, msgs, _ring_seconds(c.kind, b_in, inner, 1.0, torus),
                           spec, bw_in))
    if outer > 1 and not (parts and parts[0]["link"] == "tcp"):
        parts.append(_part(link_out, buffers * ring_steps(c.kind, outer),
                           _ring_seconds(c.kind, b / shrink, outer, 1.0, False), spec, bw_out))
    formula = f"{c.kind} ring, n={inner}, {b_in:.4g} B at {bw_in:.4g} B/s"
    if parts and parts[0]["link"] == "tcp":
        links = f"gloo over TCP loopback ({n} ranks in {outer} processes)"
        formula = (f"{c.kind} ring over {n} gloo ranks, {parts[0]['bytes']:.4g} B at "
                   f"{parts[0]['bandwidth']:.4g} B/s")
        src, bw_in, inner = spec.source_of("network_bandwidth"), parts[0]["bandwidth"], n
    elif outer > 1:
        links = f"{links}; {out_name} across {outer}"
        formula += f"; then n={outer}, {b / shrink:.4g} B at {bw_out:.4g} B/s ({out_name})"
        src = f"{src}; {out_src}"
    for p in parts:
        if p["latency"]:
            formula += f"; + {p['latency']:.3g} s x {p['messages']:.3g} messages ({p['link']})"
            src = f"{src}; {spec.source_of(LINKS[p['link']][1])}"
    if buffers > 1 and any(p["latency"] for p in parts):
        formula += f" ({buffers} arrays per instruction)"
    seconds = sum(part_seconds(p) for p in parts) * c.count
    # in units of the in-process latency (what calibrations stored before parts existed)
    units = parts[0]["messages"] if parts and parts[0]["link"] == link_in else (
        1.0 if n > 1 else 0.0)
    return CollectiveTime(kind=c.kind, axes=tuple(c.axes), group_size=n, bytes=b,
                          count=c.count, links=links, bandwidth=bw_in if inner > 1 else bw_out,
                          seconds=seconds, overlap=0.0, formula=formula, source=src,
                          latencies=units * c.count, parts=tuple(parts))


# -- the roofline ---------------------------------------------------------------------------

def _default_overlap(platform: str) -> tuple[float, str]:
    if platform == "cpu":
        return 0.0, "assumed 0: XLA:CPU runs collectives synchronously"
    return 1.0, ("assumed 1: XLA's latency-hiding scheduler runs collectives asynchronously "
                 "beside independent compute (a lower bound on step time; "
                 "'no_overlap_step' is the upper bound)")


def _local_seconds(t_compute: float, t_memory: float, *, additive: bool,
                   compute_seconds: float | None, compute_source: str) -> tuple[float, float, str]:
    """``(roofline, local, source)``: the roofline's local work (compute and memory added
    where they take turns, else the larger), and the local work the step uses: the
    compiler's own timing where given, never faster than the roofline (the source says
    when it was raised)."""
    t_roofline = t_compute + t_memory if additive else max(t_compute, t_memory)
    t_local = t_roofline if compute_seconds is None else float(compute_seconds)
    if compute_seconds is not None and t_local < t_roofline:   # faster than peak: impossible
        t_local, compute_source = t_roofline, compute_source + (
            f"; raised to the roofline ({t_roofline:.4g} s): the cycle estimates "
            f"({float(compute_seconds):.4g} s) are faster than the chip's peak")
    return t_roofline, t_local, compute_source


def _host_terms(host: HostTime | None) -> dict[str, float]:
    """The breakdown's host-transfer terms (zeros where nothing moves to host memory);
    ``host_link_total``: both directions' bytes at the link's bandwidth, none hidden."""
    if host is None:
        return {"host_transfers": 0.0, "host_link": 0.0, "host_bytes_to_host": 0.0,
                "host_bytes_to_device": 0.0, "host_link_total": 0.0}
    return {"host_transfers": host.exposed_seconds, "host_link": host.link_seconds,
            "host_bytes_to_host": host.to_host_bytes,
            "host_bytes_to_device": host.to_device_bytes,
            "host_link_total": (host.to_host_bytes + host.to_device_bytes) / host.bandwidth}


def predict(cost: StepCost, spec: EffectiveSpec, *, overlap: float | None = None
            ) -> Prediction:
    """Predict one training step's time, MFU and throughput (a roofline) of ``cost`` on
    ``spec``'s hardware.

    Args:
      cost: the step's numbers per device (``StepCost``: FLOPs, HBM bytes, collectives,
        the mesh, and where each comes from); ``perf.predict_plan`` makes it from a plan.
      spec: the ``EffectiveSpec`` to predict with (``wb.hardware.effective_spec(mesh,
        ...)``: the catalogue's entry or the CPU measured here, then a calibration, as the
        caller chose). ``predict`` never reads a stored calibration.
      overlap: fraction (0..1) of the shorter of local work and communication assumed
        hidden; default the calibration's measured one, else by platform (0 on CPU, 1 on
        TPU/GPU), said in ``sources``.

    Raises:
      TypeError: ``cost`` is not a ``StepCost`` or ``spec`` not an ``EffectiveSpec``.
      ValueError: ``overlap`` outside [0, 1], or the hardware table lacks a number the
        step needs (HBM bandwidth, a link's bandwidth).

    Example::

        ca = compiled.cost_analysis()
        cost = StepCost(flops=ca["flops"], bytes_accessed=ca["bytes accessed"],
                        collectives=parse_collectives(compiled.as_text(), names, sizes),
                        mesh=info, tokens_per_step=batch * seq, model_flops=model_flops)
        p = predict(cost, effective_spec(info, calibration=False))
    """
    if not isinstance(cost, StepCost):
        raise TypeError(f"predict: cost={cost!r:.80} is a {type(cost).__name__}, not a "
                        "StepCost; give perf.StepCost(flops=..., bytes_accessed=..., "
                        "mesh=...), or predict a plan with perf.predict_plan(plan.report, spec)")
    if not isinstance(spec, EffectiveSpec):
        raise TypeError(f"predict: spec={spec!r:.80} is a {type(spec).__name__}, not an "
                        "EffectiveSpec; give wb.hardware.effective_spec(mesh) (or "
                        "effective_spec(mesh, hardware='TPU v5p', calibration=False))")
    if overlap is not None:
        overlap = check_float(overlap, "overlap", minimum=0.0, where="predict: ")
    return _roofline(cost, spec, overlap)


def _roofline(cost: StepCost, eff: EffectiveSpec, overlap: float | None) -> Prediction:
    """``predict``'s roofline, its arguments checked."""
    flops, fp8_flops = cost.flops, cost.fp8_flops
    compute_seconds, host = cost.compute_seconds, cost.host
    # spec: the entry with the achieved FLOP/s and bandwidth a profile measured, if any
    spec, cal = eff.spec, eff.calibration
    if not spec.hbm_bandwidth:
        raise ValueError(f"{spec.name} has no HBM bandwidth in the hardware table")
    t_compute = compute_seconds_at_peak(flops, fp8_flops, spec)
    t_memory = cost.bytes_accessed / spec.hbm_bandwidth
    overlap, overlap_src = _overlap(overlap, cal, spec.platform)
    times, crit = _collective_times(cost, eff)
    cpu = spec.platform == "cpu"
    # XLA:CPU's devices share the host's cores: math and memory traffic take turns. A
    # calibration's factors turn the terms into the time a profile measured in matmul
    # kernels and in memory-bound fusions, which a device's stream runs one after the other
    # (the GPU and TPU traces' overlap is 0): calibrated terms add up as well.
    t_roofline, t_local, compute_source = _local_seconds(
        t_compute, t_memory, additive=cpu or bool(cal), compute_seconds=compute_seconds,
        compute_source=cost.compute_source)
    compiler_seconds, compiler_note = _compiler_estimate(cost.compiler_seconds)
    t_comm = sum(t.seconds for t in times)
    t_exposed = sum(t.seconds for t, c in zip(times, crit) if c)
    t_free = t_comm - t_exposed
    hidden = overlap * min(t_local, t_free)
    t_host = host.exposed_seconds if host is not None else 0.0
    step = t_local + t_comm - hidden + t_host
    frac = hidden / t_free if t_free else 0.0
    times = [dataclasses.replace(t, overlap=0.0 if c else frac, exposed=c)
             for t, c in zip(times, crit)]
    terms = {"compute": t_compute, "memory": t_memory, "communication": t_comm - hidden}
    bound = max(BOUNDS, key=lambda k: terms[k])
    if compute_seconds is not None:   # the compiler's schedule of math and HBM traffic
        bound = "communication" if t_comm - hidden > t_local else \
            ("compute" if t_compute >= t_memory else "memory")
    mfu, mfu_fp8 = _mfus(cost, step, spec)
    # the envelope holds MFU against the peak the step's own matmuls run at (fp8 and bf16
    # FLOPs blended as t_compute times them): the bf16-peak MFU of an fp8 step can pass 80%
    blended = mfu * spec.peak_flops * t_compute / flops if mfu is not None and flops > 0 \
        else mfu
    flagged = implausible(step=step, roofline=t_roofline, local=t_local, mfu=blended,
                          compiler_local=compute_seconds is not None)
    host_terms = _host_terms(host)
    host_link_total = host_terms.pop("host_link_total")
    return Prediction(
        step_seconds=step, mfu=mfu,
        tokens_per_s=cost.tokens_per_step / step if cost.tokens_per_step and step > 0
        else None,
        bound=bound,
        breakdown={**terms, "local": t_local, "roofline_local": t_roofline,
                   "communication_total": t_comm, **host_terms,
                   "no_overlap_step": t_local + t_comm + host_link_total,
                   "collectives": tuple(times)},
        sources=_sources(cost, eff, local=compute_source if compute_seconds is not None
                         else _local_source(cpu, bool(cal)),
                         overlap=_overlap_source(overlap_src, cost.exposed_axes if t_exposed
                                                 else (), cost.sync_exposed),
                         compiler=("TPU compiler cost analysis (optimal_seconds)"
                                   if compiler_seconds is not None else "none") + compiler_note,
                         flagged=flagged),
        compiler_seconds=compiler_seconds, implausible=flagged, mfu_fp8=mfu_fp8,
        band=prediction_band(eff, compiler_timed=compute_seconds is not None))


def _mfus(cost: StepCost, step: float, spec: HardwareSpec) -> tuple[float | None,
                                                                    float | None]:
    """MFU against the bf16 peak, and against the fp8 peak for a step with fp8 matmuls on
    a chip whose table has one; None without model FLOPs."""
    if cost.model_flops is None or step <= 0:
        return None, None
    devices = cost.mesh.size
    mfu = cost.model_flops / (step * devices * spec.peak_flops)
    fp8 = cost.model_flops / (step * devices * spec.fp8_flops) \
        if cost.fp8_flops > 0 and spec.fp8_flops else None
    return mfu, fp8


def _collective_times(cost: StepCost, eff: EffectiveSpec
                      ) -> tuple[list[CollectiveTime], list[bool]]:
    """Each collective of ``cost`` timed on ``eff``'s links (calibrated where it has a
    calibration), and whether it is on the critical path: over ``exposed_axes`` only, or
    run synchronously by a program that says (``sync_exposed``)."""
    times = [collective_seconds(c, cost.mesh, eff.spec) for c in cost.collectives]
    if eff.calibration:
        times = [_calibrated(t, eff.calibration, eff.table_latency) for t in times]
    crit = [(bool(t.axes) and set(t.axes) <= set(cost.exposed_axes))
            or (cost.sync_exposed and not c.overlapped)
            for t, c in zip(times, cost.collectives)]
    return times, crit


def _compiler_estimate(seconds: float | None) -> tuple[float | None, str]:
    """The TPU compiler's estimate to show, or None and why not (negative or NaN: the
    compiler's "unknown")."""
    if seconds is not None and not seconds >= 0:
        return None, f"; its optimal_seconds was {seconds!r} (the compiler's 'unknown'): " \
                     "not shown"
    return seconds, ""


def _sources(cost: StepCost, eff: EffectiveSpec, *, local: str, overlap: str, compiler: str,
             flagged: tuple[str, ...]) -> dict[str, str]:
    """Where each number of the prediction comes from, by name."""
    spec = eff.spec
    return {"flops": cost.flops_source, "bytes": cost.bytes_source,
            "peak_flops": spec.source + _fp8_source(cost.flops, cost.fp8_flops, spec),
            "hbm_bandwidth": spec.source_of("hbm_bandwidth"), "local": local,
            "overlap": overlap,
            "mfu": "model FLOPs / (step time x devices x peak FLOP/s per device)",
            "host_transfers": _host_source(cost.host, cost.host_source),
            "compiler_seconds": compiler,
            "bounds": "; ".join(flagged) if flagged else (
                "within the physical bounds (workbench.perf._bounds): not below "
                "its own roofline, MFU at most the published envelope")} | (
        {"calibration": eff.calibration.source} if eff.calibration else {})


def compute_seconds_at_peak(flops: float, fp8_flops: float, spec: HardwareSpec) -> float:
    """Seconds of ``flops`` at the chip's peak: ``fp8_flops`` of them (at most ``flops``)
    at the fp8 peak (the bf16 one where the table has none), the rest at ``peak_flops``."""
    f8 = min(max(float(fp8_flops), 0.0), flops)
    return (flops - f8) / spec.peak_flops + f8 / (spec.fp8_flops or spec.peak_flops)


def mfu_text(mfu: float | None, mfu_fp8: float | None) -> str:
    """MFU as the views write it: against the bf16 peak, and the fp8 peak beside it when
    the step has fp8 matmuls (``Prediction.mfu_fp8``, the run's ``mfu_fp8``)."""
    if mfu is None:
        return ""
    if mfu_fp8 is None:
        return f"MFU {mfu:.1%}"
    return f"MFU {mfu:.1%} of the bf16 peak, {mfu_fp8:.1%} of the fp8 peak"


def _fp8_source(flops: float, fp8_flops: float, spec: HardwareSpec) -> str:
    if fp8_flops <= 0:
        return ""
    peak = spec.fp8_flops or spec.peak_flops
    why = spec.source_of("fp8_flops") if spec.fp8_flops else \
        "no fp8 peak in the table: the bf16 one"
    return (f"; {min(fp8_flops, flops) / flops:.0%} of the FLOPs in fp8 matmuls at "
            f"{peak / 1e12:.4g} TFLOP/s ({why})")


def _host_source(host: HostTime | None, why: str) -> str:
    """Where the host-transfer term comes from."""
    if host is None:
        return why or "none: the compiled step moves nothing to host memory"
    return (f"the compiled HLO's transfers to and from host memory (S(5)): "
            f"{host.transfers} instructions, {host.asynchronous} asynchronous; "
            f"{host.formula}; host-link bandwidth: {host.source}")


def _overlap(overlap: float | None, cal: Calibration | None, platform: str
             ) -> tuple[float, str]:
    """The overlap fraction and its source: given, a calibration's measured one, or the
    platform's default."""
    if overlap is None and cal and cal.overlap is not None:
        overlap, source = cal.overlap, f"{cal.source}: measured overlap"
    elif overlap is None:
        overlap, source = _default_overlap(platform)
    else:
        source = "given"
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    return overlap, source


def _local_source(cpu: bool, calibrated: bool) -> str:
    """Why the local work is the sum or the max of compute and memory."""
    if cpu:
        return ("compute + memory: simulated CPU devices share the host's cores, so math and "
                "memory traffic do not overlap")
    if calibrated:
        return ("compute + memory: calibrated, each the time a profile measured in its kind "
                "of kernel, which the device runs one after the other")
    return "max(compute, memory): the roofline (HBM traffic overlaps math)"


def _overlap_source(source: str, exposed_axes: Sequence[str], sync_exposed: bool) -> str:
    """The overlap's source, and which collectives are never hidden (``exposed_axes``:
    those on the critical path that the step has)."""
    return source + (
        f"; collectives over {', '.join(exposed_axes)} only are on the critical path "
        "(tensor parallel: the next matmul waits for them), never hidden"
        if exposed_axes else "") + (
        "; collectives the compiled program runs synchronously (no async start or async "
        "collective fusion in its HLO) block it: never hidden" if sync_exposed else "")


def _calibrated(t: CollectiveTime, cal: Any, table_latency: float) -> CollectiveTime:
    """``t`` at the latency and bandwidth a profile measured for its kind and links: per
    part, the calibration's fitted alpha and beta of ``kind@link`` where it has them (the
    table's elsewhere); a calibration stored before parts existed scales the whole."""
    fits = {k: f for k, f in cal.collectives.items() if f.get("model") == ALPHA_BETA}
    if fits and t.parts:
        parts, used = [], []
        for p in t.parts:
            f = fits.get(f"{t.kind}@{p['link']}")
            if f is not None:
                p = p | {"latency": f["latency"], "bandwidth": f["bandwidth"]}
                used.append(p["link"])
            parts.append(p)
        if not used:
            return t
        return dataclasses.replace(
            t, seconds=sum(part_seconds(p) for p in parts) * t.count, parts=tuple(parts),
            formula=f"{t.formula}; calibrated alpha and beta on {', '.join(used)}",
            source=cal.source)
    network = "dcn across" in t.links or "infiniband across" in t.links
    seconds, found = cal.collective_seconds(t.kind, network, t.seconds,
                                            t.latencies or t.count, table_latency)
    if not found:
        return t
    return dataclasses.replace(t, seconds=seconds, formula=f"{t.formula}; calibrated",
                               source=cal.source)
