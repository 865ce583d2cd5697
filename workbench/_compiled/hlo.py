"""Collectives of a compiled step, read from its HLO text, with the mesh axes they run over
(replica groups: ``groups``), how often they run (``loops``) and what they move (``graph``).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from workbench._compiled.graph import (
    HloGraph,
    Instr,
    described_by,
    module_graph,
    param_path,
    short_op,
)
from workbench._compiled.groups import groups_to_axes, pairs_axes, parse_replica_groups
from workbench._compiled.loops import computation_multiplicity, loop_computations
from workbench._compiled.text import COMPUTATION, DEFINES, array_bytes, computations

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<suffix>-start)?\((?P<rest>.*)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One kind of collective in the compiled step (instructions of the same kind, axes,
    shape and group size merged).

    Attributes:
        kind: all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute.
        axes: mesh axes the groups span (empty if every group is a single device).
        aligned: True when every group is exactly the devices along ``axes`` (a sub-mesh).
        group_size: devices per group.
        bytes: bytes of the result per device per instruction (summed over a tuple).
        wire_bytes: bytes each device sends per instruction, ring model:
            all-reduce 2(n-1)/n·b, all-gather/all-to-all (n-1)/n·b, reduce-scatter (n-1)·b.
        count: how many such instructions the step runs.
        shapes: result array shapes (``'f32[64,128]'``).
        in_loop: inside a while loop body (a scan over layers); ``count`` is per step:
            the instructions in the body times the loop's trip count.
        names: HLO instruction names.
        overlapped: the compiled program runs it asynchronously (an async start/done
            pair, or inside the TPU compiler's async collective fusion), so independent
            compute can run beside it; False: it blocks the program until done.
        sources: the user source lines (``"_layers.py:101 in MLP.__call__"``) of the JAX ops
            these instructions were made for, from the HLO op metadata.
        ops: their JAX op names (``"jvp(btd,df->btf)/dot_general"``).
        tensors: what they move: a parameter (``"params.blocks.0.mlp.up"``) when the
            operand is one, else the op that produced the data.
        rule: the rule that made the compiler insert them, where derivable
            (``"embed -> data (FSDP: weights are gathered before use)"``).
    """

    kind: str
    axes: tuple[str, ...]
    aligned: bool
    group_size: int
    bytes: int
    wire_bytes: float
    count: int
    shapes: tuple[str, ...]
    in_loop: bool = False
    names: tuple[str, ...] = ()
    overlapped: bool = False
    sources: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()
    rule: str | None = None

    @property
    def total_bytes(self) -> int:
        """``bytes × count``."""
        return self.bytes * self.count

    @property
    def total_wire_bytes(self) -> float:
        """``wire_bytes × count``: what each device sends for these per step."""
        return self.wire_bytes * self.count

    def to_dict(self) -> dict:
        """JSON-friendly (tuples become lists), with the per-step totals."""
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {**d, "total_bytes": self.total_bytes, "total_wire_bytes": self.total_wire_bytes}


# -- replica group formats ------------------------------------------------------------------


# -- HLO text ------------------------------------------------------------------------------


def _wire(kind: str, nbytes: int, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n * nbytes, "all-gather": (n - 1) / n * nbytes,
            "reduce-scatter": (n - 1) * nbytes, "all-to-all": (n - 1) / n * nbytes,
            "collective-permute": float(nbytes)}[kind]


_ASYNC_CALL = re.compile(r"^\s*(?:ROOT\s+)?%?(?:async-collective-start[\w.\-]*\s*=.*?|.*?"
                         r"\basync-start\(.*?)calls=%?([\w.\-]+)", re.M)
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


def _async_computations(hlo_text: str) -> set[str]:
    """Computations whose collectives run asynchronously: those an async start calls, and
    the TPU compiler's ``async_collective_fusion`` computations (the overlap flags)."""
    comps = set(_ASYNC_CALL.findall(hlo_text))
    comps |= {c for c in computations(hlo_text) if c.startswith("async_collective_fusion")}
    return comps


_FUSION_CALL = re.compile(r"\bfusion\(.*?\bcalls=%?([\w.\-]+)")


def _clone_channels(hlo_text: str) -> set[tuple[str, str]]:
    """(kind, channel_id) whose instructions in fusion computations are clones of one
    collective: the TPU compiler's async collective fusion repeats a collective, with its
    ``channel_id``, in the computations its start, steps and done fusions call (one each).
    A channel that two instructions of one computation share is not an instruction's id
    (XLA:CPU, and shard_map's all-to-alls and permutes on TPU, give every such collective
    ``channel_id=1``): those are distinct instructions wherever they are."""
    fused = set(_FUSION_CALL.findall(hlo_text))
    where: dict[tuple[str, str], list[str]] = {}
    for name, lines in computations(hlo_text).items():
        for line in lines:
            m = _INSTR.match(line)
            channel = _CHANNEL.search(line) if m else None
            if channel is not None:
                where.setdefault((m.group("kind"), channel.group(1)), []).append(name)
    return {key for key, comps in where.items()
            if len(comps) > 1 and len(set(comps)) == len(comps) and set(comps) <= fused}


def _channels_in(hlo_text: str, names: set[str]) -> set[tuple[str, str]]:
    """(kind, channel_id) of the collectives inside the computations ``names``."""
    out: set[tuple[str, str]] = set()
    for name, lines in computations(hlo_text).items():
        if name not in names:
            continue
        for line in lines:
            m = _INSTR.match(line)
            channel = _CHANNEL.search(line) if m else None
            if channel is not None:
                out.add((m.group("kind"), channel.group(1)))
    return out


def parse_collectives(hlo_text: str, axis_names: Sequence[str],
                      axis_sizes: Sequence[int]) -> list[Collective]:
    """All collectives in an optimized HLO module, merged by (kind, axes, shapes, group size,
    overlapped), largest total traffic first.

    ``count`` is per step: each instruction times the runs of its computation
    (:func:`computation_multiplicity`: a loop body, or a fusion inside one, runs trip-count
    times). An instruction cloned into several fusion computations (the TPU compiler's
    async collective fusion repeats one collective, with its ``channel_id``, in the
    computations of its start, steps and done) counts once (:func:`_clone_channels`);
    instructions that merely share a ``channel_id`` (XLA:CPU, shard_map's collectives) each
    count. A tuple-shaped instruction (the compiler's combined all-reduces, a variadic
    all-to-all) counts once, its ``bytes`` summed over the arrays it carries.
    """
    loops = loop_computations(hlo_text)
    runs = computation_multiplicity(hlo_text)
    asyncs = _async_computations(hlo_text)
    clones = _clone_channels(hlo_text)
    seen: dict[tuple[str, str], str] = {}   # (kind, channel) of a clone -> its computation
    async_channels = _channels_in(hlo_text, asyncs)
    graph = module_graph(hlo_text)
    merged: dict[tuple, dict] = {}
    computation = ""
    for line in hlo_text.splitlines():
        head = COMPUTATION.match(line)
        if head and not line[:1].isspace():
            computation = head.group(1)
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        kind, attrs = m.group("kind"), m.group("rest")
        channel = _CHANNEL.search(attrs)
        if channel is not None and (kind, channel.group(1)) in clones:
            if seen.setdefault((kind, channel.group(1)), computation) != computation:
                continue
        overlapped = bool(m.group("suffix")) or computation in asyncs or (
            channel is not None and (kind, channel.group(1)) in async_channels)
        nbytes, shapes = array_bytes(m.group("type"), kind, bool(m.group("suffix")))
        axes, aligned, size = _axes_of(kind, attrs, axis_names, axis_sizes)
        key = (kind, axes, aligned, size, shapes, computation in loops, overlapped)
        rec = merged.setdefault(key, {"count": 0, "bytes": nbytes, "names": [],
                                      "sources": {}, "ops": {}, "tensors": {}})
        rec["count"] += runs.get(computation, 1) or 1
        rec["names"].append(m.group("name"))
        ins = graph.instructions.get(m.group("name"))
        if ins is not None:
            _describe(rec, graph, ins)
    out = [Collective(kind=k[0], axes=k[1], aligned=k[2], group_size=k[3], bytes=r["bytes"],
                      wire_bytes=_wire(k[0], r["bytes"], k[3]), count=r["count"],
                      shapes=k[4], in_loop=k[5], names=tuple(r["names"]), overlapped=k[6],
                      sources=tuple(r["sources"]), ops=tuple(r["ops"]),
                      tensors=tuple(r["tensors"]))
           for k, r in merged.items()]
    return sorted(out, key=lambda c: -c.total_wire_bytes)


def _axes_of(kind: str, attrs: str, axis_names: Sequence[str], axis_sizes: Sequence[int]
             ) -> tuple[tuple[str, ...], bool, int]:
    """``(mesh axes, aligned, group size)`` of one collective from its attributes: a
    permute's source-target pairs, any other's replica groups (none: every device)."""
    if kind == "collective-permute":
        axes, size = pairs_axes(attrs, axis_names, axis_sizes)
        return axes, True, size
    n = math.prod(axis_sizes)
    groups = parse_replica_groups(attrs, n) or [list(range(n))]
    axes, aligned = groups_to_axes(groups, axis_names, axis_sizes)
    return axes, aligned, len(groups[0])


def _describe(rec: dict[str, Any], graph: HloGraph, ins: Instr) -> None:
    """Adds to a merged collective's record what instruction ``ins`` is for: the source
    line and JAX ops of the op that describes it (:func:`described_by`), and the tensor it
    moves."""
    meta = described_by(graph, ins)
    src = graph.source(meta)
    if src:
        rec["sources"][src] = None
    for part in short_op(meta.op_name).strip("()").split(":"):
        if part:
            rec["ops"][short_op(part)] = None
    rec["tensors"][graph.moved_tensor(ins)] = None


# -- op metadata: source lines, operands, users ---------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reshard:
    """A collective the compiler inserted to change an activation's layout between two
    ops (not a parameter's gather nor a gradient's reduction).

    Attributes:
        kind, axes, shape: the collective, the mesh axes it spans, its result type.
        name: its HLO instruction.
        bytes: bytes of its result per device.
        producer, producer_source: the op whose result is resharded and its source line.
        consumer, consumer_source: the op that needed the other layout and its line.
    """

    kind: str
    axes: tuple[str, ...]
    shape: str
    name: str
    bytes: int
    producer: str
    producer_source: str
    consumer: str
    consumer_source: str


def parse_reshards(hlo_text: str, axis_names: Sequence[str],
                   axis_sizes: Sequence[int]) -> list[Reshard]:
    """Layout changes of activations in an optimized HLO module: all-to-all and
    collective-permute, and all-gathers whose operand is no parameter or batch entry."""
    graph = module_graph(hlo_text)
    n = math.prod(axis_sizes)
    lines: dict[str, str] = {}   # instruction name -> its line (first definition)
    for ln in hlo_text.splitlines():
        m = DEFINES.match(ln)
        if m:
            lines.setdefault(m.group(1), ln)
    out = []
    for ins in graph.instructions.values():
        kind = ins.op.removesuffix("-start")
        if kind not in ("all-gather", "all-to-all", "collective-permute"):
            continue
        moved = graph.moved_tensor(ins)
        prod = graph.producer(ins)
        if moved.startswith(("params.", "opt_state.", "batch.")) or (
                prod is not None and param_path(prod.op_name)):
            continue
        line = lines.get(ins.name, "")
        if kind == "collective-permute":
            axes, _ = pairs_axes(line, axis_names, axis_sizes)
        else:
            groups = parse_replica_groups(line, n) or [list(range(n))]
            axes, _ = groups_to_axes(groups, axis_names, axis_sizes)
        cons = graph.consumer(ins)
        out.append(Reshard(
            kind=kind, axes=axes, shape=ins.type.strip("()").split("{")[0], name=ins.name,
            bytes=array_bytes(ins.type, kind, ins.op.endswith("-start"))[0],
            producer=short_op(prod.op_name) if prod is not None and prod.op_name else
            (prod.op if prod is not None else "?"),
            producer_source=graph.source(prod) if prod is not None else "",
            consumer=short_op(cons.op_name) if cons is not None and cons.op_name else
            (cons.op if cons is not None else "?"),
            consumer_source=graph.source(cons) if cons is not None else ""))
    return out


