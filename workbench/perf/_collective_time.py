"""Time of one collective of a step (``collective_seconds``): per link it crosses, latency
x messages + bytes / bandwidth, the messages and bytes of a ring over the group.

Ring formulas (n devices in the group, b bytes of the result per device, W bytes/s each
device can send in one direction summed over the links the ring uses):
all-gather (n-1)/n b/W, reduce-scatter (n-1) b/W, all-reduce 2 (n-1)/n b/W,
all-to-all (n-1)/n b/W on a switch and n b/(4W) on a torus ring, collective-permute b/W.
A group that spans slices (TPU, over DCN) or hosts (GPU and CPU processes) runs the ring
inside each, then one across them on the bytes left per device. Each collective is timed
with the hardware table's links, or a calibration's fitted latency and bandwidth per kind
and link (``calibrated_time``); the roofline (``perf._predict``) adds them up. Formulas and
their sources: docs/predictions.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import numpy as np

from workbench.hardware._catalogue import LINKS, HardwareSpec
from workbench._sharding.mesh import MeshInfo, mesh_info
from workbench._compiled.hlo import Collective

__all__ = ["ALPHA_BETA", "CollectiveTime", "collective_seconds", "part_seconds", "ring_steps"]

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


def _wraps(spec: HardwareSpec, dim_size: int, slice_dims: Sequence[int]) -> bool:
    if spec.torus_wrap == "cube":
        return all(d % 4 == 0 for d in slice_dims)
    if spec.torus_wrap == "16":
        return dim_size >= 16
    return False


def _group_index(info: MeshInfo, axes: Sequence[str]) -> tuple:
    """Index of the group through device 0 that spans ``axes``."""
    return tuple(slice(None) if n in axes else 0 for n in info.axis_names)


def _ici_bandwidth(info: MeshInfo, spec: HardwareSpec, axes: Sequence[str]
                   ) -> tuple[float, str, bool]:
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


class _Links(NamedTuple):
    """The links a collective crosses: how many slices (TPU, over DCN) or hosts (GPU, CPU)
    its group spans (``outer``); the link inside a slice/host (its bandwidth, name for the
    text, whether a torus, its source, its kind in the latency table); the link across
    them (its kind, bandwidth, name and source)."""

    outer: int
    bw_in: float
    links: str
    torus: bool
    src: str
    link_in: str
    link_out: str
    bw_out: float
    out_name: str
    out_src: str


def _links_of(c: Collective, info: Any, spec: HardwareSpec) -> _Links:
    """The links collective ``c`` crosses on ``spec``."""
    if spec.platform == "tpu":
        dcn = info.dcn_axis_sizes or (1,) * len(info.axis_names)
        outer = math.prod(d for a, d in zip(info.axis_names, dcn) if a in c.axes) or 1
        bw_in, links, torus = _ici_bandwidth(info, spec, c.axes)
        return _Links(outer, bw_in, links, torus, spec.source_of("ici_link_bandwidth"), "ici",
                      "dcn", spec.dcn_bandwidth or 0.0, "dcn", spec.source_of("dcn_bandwidth"))
    outer = _hosts_in_group(info, c.axes) if c.axes else 1
    bw_in = float(spec.nvlink_bandwidth or spec.hbm_bandwidth or 0.0)
    cpu = spec.platform == "cpu"
    links = "loopback copy" if cpu else "nvlink"
    link_in, link_out = ("memory", "tcp") if cpu else ("nvlink", "infiniband")
    if not cpu and not spec.nvlink_bandwidth and spec.host_bandwidth:
        bw_in, links, link_in = float(spec.host_bandwidth), "pcie", "pcie"
    return _Links(outer, bw_in, links, False, spec.source_of("nvlink_bandwidth"), link_in,
                  link_out, spec.network_bandwidth or 0.0, "infiniband",
                  spec.source_of("network_bandwidth"))


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
    n = max(1, c.group_size)
    ln = _links_of(c, info, spec)
    inner = max(1, n // ln.outer)
    if (inner > 1 and ln.bw_in <= 0) or (ln.outer > 1 and ln.bw_out <= 0):
        missing = "link" if inner > 1 and ln.bw_in <= 0 else ln.out_name
        raise ValueError(f"{spec.name} has no {missing} bandwidth in the hardware table; "
                         f"cannot time a {c.kind} over {c.axes}")
    buffers = max(1, len(c.shapes)) if spec.platform == "cpu" else 1
    parts = _parts(c, info, spec, ln, inner, buffers)
    links, formula, src, bandwidth = _describe(c, spec, ln, parts, inner, buffers)
    seconds = sum(part_seconds(p) for p in parts) * c.count
    # in units of the in-process latency (what calibrations stored before parts existed)
    units = parts[0]["messages"] if parts and parts[0]["link"] == ln.link_in else (
        1.0 if n > 1 else 0.0)
    return CollectiveTime(kind=c.kind, axes=tuple(c.axes), group_size=n, bytes=float(c.bytes),
                          count=c.count, links=links, bandwidth=bandwidth,
                          seconds=seconds, overlap=0.0, formula=formula, source=src,
                          latencies=units * c.count, parts=tuple(parts))


def _shares(kind: str, nbytes: float, outer: int, inner: int) -> tuple[float, float]:
    """The bytes per device of the ring inside a slice/host and of the one across them:
    reduce-scatter's result is 1/outer of what the inner ring produces; all-reduce and
    all-gather leave 1/inner of the bytes for the outer ring."""
    b_in = nbytes * outer if kind == "reduce-scatter" else nbytes
    shrink = inner if kind in ("all-reduce", "all-gather") else 1
    return b_in, nbytes / shrink


def _parts(c: Collective, info: MeshInfo, spec: HardwareSpec, ln: _Links, inner: int,
           buffers: int) -> list[dict[str, Any]]:
    """One instruction's parts per link (``_part``): the ring inside a slice/host, then
    the one across them; on multi-process XLA:CPU one gloo ring over TCP instead."""
    n = max(1, c.group_size)
    b_in, b_out = _shares(c.kind, float(c.bytes), ln.outer, inner)
    parts = []
    if spec.platform == "cpu" and info.n_hosts > 1 and n > 1:
        # XLA:CPU in a multi-process job runs every collective through gloo, whose ranks
        # are the devices: even a process's own devices talk over TCP loopback. One ring
        # over the group, a message per array and step.
        return [_part("tcp", buffers * ring_steps(c.kind, n),
                      _ring_seconds(c.kind, float(c.bytes), n, 1.0, False), spec,
                      float(spec.network_bandwidth or 0.0))]
    if inner > 1:
        if spec.platform == "cpu":
            # XLA:CPU rendezvouses the device threads once per array of a tuple-shaped
            # collective (no ring), and a group of g of the N devices of a process (the
            # latency is measured over all N) costs about (g + 1) / (N + 1) of that: per
            # array, psums on 8 simulated devices (2 cores) took 0.061, 0.093, 0.169 ms
            # for groups of 2, 4, 8 (0.36, 0.55, 1 against 0.33, 0.56, 1)
            local = max(1, info.size // info.n_hosts)
            msgs = buffers * (min(inner, local) + 1) / (local + 1)
        else:
            msgs = ring_steps(c.kind, inner)
        parts.append(_part(ln.link_in, msgs, _ring_seconds(c.kind, b_in, inner, 1.0, ln.torus),
                           spec, ln.bw_in))
    if ln.outer > 1:
        parts.append(_part(ln.link_out, buffers * ring_steps(c.kind, ln.outer),
                           _ring_seconds(c.kind, b_out, ln.outer, 1.0, False), spec, ln.bw_out))
    return parts


def _describe(c: Collective, spec: HardwareSpec, ln: _Links, parts: list[dict[str, Any]],
              inner: int, buffers: int) -> tuple[str, str, str, float]:
    """``(links, formula, source, bandwidth)`` of the collective timed as ``parts``: the
    links' text, the formula with its numbers, where the numbers come from, and the
    bandwidth of the link its group spans first."""
    n = max(1, c.group_size)
    b_in, b_out = _shares(c.kind, float(c.bytes), ln.outer, inner)
    links, src, bw_in = ln.links, ln.src, ln.bw_in
    formula = f"{c.kind} ring, n={inner}, {b_in:.4g} B at {bw_in:.4g} B/s"
    if parts and parts[0]["link"] == "tcp":
        links = f"gloo over TCP loopback ({n} ranks in {ln.outer} processes)"
        formula = (f"{c.kind} ring over {n} gloo ranks, {parts[0]['bytes']:.4g} B at "
                   f"{parts[0]['bandwidth']:.4g} B/s")
        src, bw_in, inner = spec.source_of("network_bandwidth"), parts[0]["bandwidth"], n
    elif ln.outer > 1:
        links = f"{links}; {ln.out_name} across {ln.outer}"
        formula += (f"; then n={ln.outer}, {b_out:.4g} B at {ln.bw_out:.4g} B/s "
                    f"({ln.out_name})")
        src = f"{src}; {ln.out_src}"
    for p in parts:
        if p["latency"]:
            formula += f"; + {p['latency']:.3g} s x {p['messages']:.3g} messages ({p['link']})"
            src = f"{src}; {spec.source_of(LINKS[p['link']][1])}"
    if buffers > 1 and any(p["latency"] for p in parts):
        formula += f" ({buffers} arrays per instruction)"
    return links, formula, src, bw_in if inner > 1 else ln.bw_out


def calibrated_time(t: CollectiveTime, cal: Any, table_latency: float) -> CollectiveTime:
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
