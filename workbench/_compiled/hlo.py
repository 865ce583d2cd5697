"""Collectives of a compiled step, read from its HLO text, with the mesh axes they run over.

JAX 0.10 prints replica groups in several formats; all are turned into explicit groups of
*logical* device ids (positions in the mesh's flat device order), then into mesh axes:

- explicit ``replica_groups={{0,1},{2,3}}`` (``{}`` means one group of every device);
- iota ``replica_groups=[2,4]<=[8]`` and ``[2,4]<=[4,2]T(1,0)`` (reshape, transpose, reshape);
- mesh ``replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``, optionally with
  ``device_ids=([4,2]T(1,0))`` giving the devices in that mesh's order;
- ``source_target_pairs={{0,1},{1,0}}`` for collective-permute.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<suffix>-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_WHILE_BODY = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")
_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)(.*)$", re.M)
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BOUND = re.compile(r"\bcompare\(|calls=%?[\w.\-]*compare")
_INT_CONSTANT = re.compile(r"=\s*s(?:32|64)\[\][^=]*\bconstant\((-?\d+)\)")


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

def _iota(spec: str) -> np.ndarray:
    """``'[2,4]<=[4,2]T(1,0)'`` or ``'[4,2]T(1,0)'`` or ``'[8]'`` -> array of device ids."""
    m = re.fullmatch(r"\s*(?:\[([\d,]*)\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", spec)
    if m is None:
        raise ValueError(f"cannot parse iota device list {spec!r}")
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    if m.group(1):
        ids = ids.reshape([int(x) for x in m.group(1).split(",")])
    return ids


def _braces(text: str) -> list[list[int]]:
    """``'{{0,1},{2,3}}'`` -> [[0, 1], [2, 3]]; ``'{}'`` -> []."""
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}",
                                                                             text[1:-1])]


def parse_replica_groups(attrs: str, n_devices: int) -> list[list[int]] | None:
    """Replica groups (logical device ids) of one instruction's attribute text, or None."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?"
                  r"\s*\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [a for a, _ in axes]
        sizes = [int(s) for _, s in axes]
        if m.group(2):
            dev = m.group(2).strip()
            ids = (_iota(dev).reshape(-1) if dev.startswith("[")
                   else np.array([int(x) for x in dev.split(",")]))
        else:
            ids = np.arange(math.prod(sizes))
        grid = ids.reshape(sizes)
        varying = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        fixed = [i for i in range(len(sizes)) if i not in varying]
        grid = grid.transpose(fixed + varying)
        return grid.reshape(-1, math.prod(sizes[i] for i in varying) if varying else 1).tolist()
    m = re.search(r"replica_groups=(\[[\d,]*\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m:
        ids = _iota(m.group(1))
        return ids.reshape(ids.shape[0] if ids.ndim > 1 else 1, -1).tolist()
    m = re.search(r"replica_groups=(\{(?:\{[\d,\s]*\},?\s*)*\})", attrs)
    if m:
        groups = _braces(m.group(1))
        return groups or [list(range(n_devices))]
    return None


def groups_to_axes(groups: Sequence[Sequence[int]], axis_names: Sequence[str],
                   axis_sizes: Sequence[int]) -> tuple[tuple[str, ...], bool]:
    """Mesh axes spanned by ``groups`` of logical ids, and whether each group is exactly the
    sub-mesh along those axes (ids are positions in the mesh's row-major order)."""
    n = math.prod(axis_sizes)
    varying: set[int] = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g, dtype=np.int64) % n, axis_sizes)).T
        varying |= {i for i in range(len(axis_sizes)) if len(np.unique(coords[:, i])) > 1}
    axes = tuple(axis_names[i] for i in sorted(varying))
    expected = math.prod(axis_sizes[i] for i in varying)
    aligned = all(len(set(g)) == expected for g in groups) and \
        sum(len(g) for g in groups) == n
    return axes, aligned


def _pairs_axes(attrs: str, axis_names: Sequence[str],
                axis_sizes: Sequence[int]) -> tuple[tuple[str, ...], int]:
    m = re.search(r"source_target_pairs=(\{(?:\{[\d,\s]*\},?\s*)*\})", attrs)
    pairs = [p for p in _braces(m.group(1)) if len(p) == 2 and p[0] != p[1]] if m else []
    varying: set[int] = set()
    for s, t in pairs:
        cs, ct = np.unravel_index(s, axis_sizes), np.unravel_index(t, axis_sizes)
        varying |= {i for i in range(len(axis_sizes)) if cs[i] != ct[i]}
    return tuple(axis_names[i] for i in sorted(varying)), 2 if pairs else 1


# -- HLO text ------------------------------------------------------------------------------

def _array_bytes(type_text: str, kind: str, is_start: bool) -> tuple[int, tuple[str, ...]]:
    arrays = [(dt, dims) for dt, dims in _ARRAY.findall(type_text) if dt in _DTYPE_BYTES]
    if is_start and kind in ("all-gather", "collective-permute"):
        arrays = [a for a in arrays if a[1]]               # drop u32[] sync contexts
        arrays = arrays[len(arrays) // 2:]                 # (operands..., outputs...)
    shapes = tuple(f"{dt}[{dims}]" for dt, dims in arrays)
    total = sum(_DTYPE_BYTES[dt] * math.prod(int(x) for x in dims.split(",") if x)
                for dt, dims in arrays)
    return int(total), shapes


def _wire(kind: str, nbytes: int, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n * nbytes, "all-gather": (n - 1) / n * nbytes,
            "reduce-scatter": (n - 1) * nbytes, "all-to-all": (n - 1) / n * nbytes,
            "collective-permute": float(nbytes)}[kind]


def _computations(hlo_text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line[:1].isspace():
            current = out.setdefault(head.group(1), [])
            continue
        if current is not None:
            current.append(line)
    return out


def loop_trip_counts(hlo_text: str) -> dict[str, int]:
    """``{while body computation: trip count}`` of the module's while loops (a scan over
    layers lowers to one): XLA's ``known_trip_count`` where the backend writes it, else
    the loop condition's comparison with its one integer constant (``i < 32``) less the
    counter's start where the loop's initial tuple gives it as a constant: the TPU
    compiler peels a scan's first iteration into the caller and starts the loop at 1
    (``i`` from 1 while ``i < 32``: 31 trips). A loop whose bound is not a constant is
    left out."""
    comps = _computations(hlo_text)
    starts = _loop_starts(comps)
    trips: dict[str, int] = {}
    for cond, body, attrs in _WHILE.findall(hlo_text):
        known = _KNOWN_TRIPS.search(attrs)
        if known:
            trips[body] = int(known.group(1))
            continue
        lines = comps.get(cond, [])
        consts = [int(c) for ln in lines for c in _INT_CONSTANT.findall(ln)]
        if len(consts) == 1 and any(_BOUND.search(ln) for ln in lines) and consts[0] > 0:
            start = starts.get(body, 0)
            trips[body] = consts[0] - start if 0 <= start < consts[0] else consts[0]
    return trips


_WHILE_OPERAND = re.compile(r"\bwhile\(%?([\w.\-]+)\).*?\bbody=%?([\w.\-]+)")
_DEF_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.+?\s+([a-z][\w\-]*)\((.*)$")


def _loop_starts(comps: dict[str, list[str]]) -> dict[str, int]:
    """``{while body: the loop counter's initial value}`` where the while's operand is a
    tuple whose first element is an integer constant (through ``copy``/``bitcast``)."""
    out: dict[str, int] = {}
    for lines in comps.values():
        whiles = [m.groups() for ln in lines if (m := _WHILE_OPERAND.search(ln))]
        if not whiles:
            continue
        defs = {m.group(1): (m.group(2), m.group(3)) for ln in lines
                if (m := _DEF_OP.match(ln))}
        for operand, body in whiles:
            op, args = defs.get(operand, ("", ""))
            first = re.match(r"\s*%?([\w.\-]+)", args) if op == "tuple" else None
            name = first.group(1) if first else None
            for _ in range(8):   # copies and bitcasts of the constant
                op, args = defs.get(name, ("", "")) if name else ("", "")
                if op == "constant":
                    value = re.match(r"\s*(-?\d+)\)", args)
                    if value:
                        out[body] = int(value.group(1))
                    break
                if op not in ("copy", "bitcast", "convert"):
                    break
                nxt = re.match(r"\s*%?([\w.\-]+)", args)
                name = nxt.group(1) if nxt else None
    return out


_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation"
                     r")=%?([\w.\-]+)|\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)


def computation_multiplicity(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs in one execution of the module: 1 for the
    entry, a while body's callers' count times its trip count (``loop_trip_counts``), a
    called computation its callers' count (summed over the instructions that call it)."""
    comps = _computations(hlo_text)
    trips = loop_trip_counts(hlo_text)
    callers: dict[str, list[tuple[str, int]]] = {}
    for name, lines in comps.items():
        for line in lines:
            for one, many in _CALLEE.findall(line):
                for callee in ([one] if one else re.findall(r"%?([\w.\-]+)", many)):
                    if callee in comps:
                        callers.setdefault(callee, []).append((name, trips.get(callee, 1)))
    entry = _ENTRY.search(hlo_text)
    memo: dict[str, int] = {entry.group(1): 1} if entry else {}

    def count(name: str, depth: int = 0) -> int:
        if name not in memo:
            memo[name] = 0 if depth > 64 else sum(
                count(c, depth + 1) * t for c, t in callers.get(name, ()))
        return memo[name]

    return {name: count(name) for name in comps}


def compiler_cycles(hlo_text: str) -> tuple[int, int]:
    """The TPU compiler's own cycle estimates (``estimated_cycles`` in the backend config of
    each fusion, copy and kernel it scheduled), summed over one step with loop trip counts:
    ``(cycles, instructions with an estimate)``. Collectives carry no estimate; Pallas
    kernels (``tpu_custom_call``) are left out, since the compiler does not model their
    insides (time them from their FLOPs); (0, 0) for programs of other compilers."""
    mult = computation_multiplicity(hlo_text)
    total = n = 0
    for name, lines in _computations(hlo_text).items():
        for line in lines:
            m = _CYCLES.search(line)
            if m and mult.get(name) and "pallas_call" not in line \
                    and "tpu_custom_call" not in line and int(m.group(1)) < UNKNOWN_CYCLES:
                total += int(m.group(1)) * mult[name]
                n += 1
    return total, n


#: The TPU compiler writes INT64_MAX (or UINT64_MAX) as ``estimated_cycles`` of an
#: instruction its cost model cannot time (``"cost_model_type":"COST_MODEL_TYPE_INVALID"``,
#: e.g. ``scatter_offload_custom_fusion`` in MoE backward passes): not a cycle count.
UNKNOWN_CYCLES = 2 ** 62
_TYPE_OF = re.compile(r"\s*(.+?)\s+[a-z][\w\-]*\(")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unestimated:
    """An instruction whose ``estimated_cycles`` the TPU compiler marks unknown.

    Attributes:
      name: the HLO instruction name (``scatter_offload_custom_fusion.6``).
      computation: the computation it is in.
      bytes: its operands' and result's bytes (what it reads and writes once).
      count: how often it runs per step (``computation_multiplicity``).
    """

    name: str
    computation: str
    bytes: int
    count: int


def unestimated_instructions(hlo_text: str) -> list[Unestimated]:
    """Instructions the TPU compiler left without a cycle estimate (``UNKNOWN_CYCLES``),
    with the bytes they read and write (operand types looked up in their computation) and
    how often they run per step; ``compiler_cycles`` leaves them out, the prediction times
    them by their roofline."""
    mult = computation_multiplicity(hlo_text)
    out = []
    for comp, lines in _computations(hlo_text).items():
        hits = [ln for ln in lines if (m := _CYCLES.search(ln)) is not None
                and int(m.group(1)) >= UNKNOWN_CYCLES and mult.get(comp)]
        if not hits:
            continue
        types = {m.group(1): ln.split("=", 1)[1] for ln in lines
                 if (m := _DEFINES.match(ln)) is not None}
        for line in hits:
            head = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+[a-z][\w\-]*\("
                            r"([^)]*)\)", line)
            if head is None:
                continue
            name, rtype, args = head.groups()
            nbytes = _array_bytes(rtype, "", False)[0]
            for arg in re.findall(r"%?([\w.\-]+)", args):
                typed = _TYPE_OF.match(types.get(arg, ""))
                nbytes += _array_bytes(typed.group(1), "", False)[0] if typed else 0
            out.append(Unestimated(name=name, computation=comp, bytes=nbytes,
                                   count=mult[comp]))
    return out


_ASYNC_CALL = re.compile(r"^\s*(?:ROOT\s+)?%?(?:async-collective-start[\w.\-]*\s*=.*?|.*?"
                         r"\basync-start\(.*?)calls=%?([\w.\-]+)", re.M)
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


def _async_computations(hlo_text: str) -> set[str]:
    """Computations whose collectives run asynchronously: those an async start calls, and
    the TPU compiler's ``async_collective_fusion`` computations (the overlap flags)."""
    comps = set(_ASYNC_CALL.findall(hlo_text))
    comps |= {c for c in _computations(hlo_text) if c.startswith("async_collective_fusion")}
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
    for name, lines in _computations(hlo_text).items():
        for line in lines:
            m = _INSTR.match(line)
            channel = _CHANNEL.search(line) if m else None
            if channel is not None:
                where.setdefault((m.group("kind"), channel.group(1)), []).append(name)
    return {key for key, comps in where.items()
            if len(comps) > 1 and len(set(comps)) == len(comps) and set(comps) <= fused}


def _loop_computations(hlo_text: str) -> set[str]:
    """While bodies and every computation they call, at any depth."""
    callees: dict[str, set[str]] = {}
    for name, lines in _computations(hlo_text).items():
        for line in lines:
            for one, many in _CALLEE.findall(line):
                callees.setdefault(name, set()).update(
                    [one] if one else re.findall(r"%?([\w.\-]+)", many))
    todo = list(set(_WHILE_BODY.findall(hlo_text)))
    out: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo += callees.get(name, ())
    return out


def _channels_in(hlo_text: str, computations: set[str]) -> set[tuple[str, str]]:
    """(kind, channel_id) of the collectives inside ``computations``."""
    out: set[tuple[str, str]] = set()
    for name, lines in _computations(hlo_text).items():
        if name not in computations:
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
    n = math.prod(axis_sizes)
    loops = _loop_computations(hlo_text)
    runs = computation_multiplicity(hlo_text)
    asyncs = _async_computations(hlo_text)
    clones = _clone_channels(hlo_text)
    seen: dict[tuple[str, str], str] = {}   # (kind, channel) of a clone -> its computation
    async_channels = _channels_in(hlo_text, asyncs)
    graph = _graph(hlo_text)
    merged: dict[tuple, dict] = {}
    computation = ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
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
        nbytes, shapes = _array_bytes(m.group("type"), kind, bool(m.group("suffix")))
        if kind == "collective-permute":
            axes, size = _pairs_axes(attrs, axis_names, axis_sizes)
            aligned = True
        else:
            groups = parse_replica_groups(attrs, n) or [list(range(n))]
            axes, aligned = groups_to_axes(groups, axis_names, axis_sizes)
            size = len(groups[0])
        key = (kind, axes, aligned, size, shapes, computation in loops, overlapped)
        rec = merged.setdefault(key, {"count": 0, "bytes": nbytes, "names": [],
                                      "sources": {}, "ops": {}, "tensors": {}})
        rec["count"] += runs.get(computation, 1) or 1
        rec["names"].append(m.group("name"))
        ins = graph.instructions.get(m.group("name"))
        if ins is not None:
            meta = _described_by(graph, ins)
            src = graph.source(meta)
            if src:
                rec["sources"][src] = None
            for part in _short_op(meta.op_name).strip("()").split(":"):
                if part:
                    rec["ops"][_short_op(part)] = None
            rec["tensors"][graph.moved_tensor(ins)] = None
    out = [Collective(kind=k[0], axes=k[1], aligned=k[2], group_size=k[3], bytes=r["bytes"],
                      wire_bytes=_wire(k[0], r["bytes"], k[3]), count=r["count"],
                      shapes=k[4], in_loop=k[5], names=tuple(r["names"]), overlapped=k[6],
                      sources=tuple(r["sources"]), ops=tuple(r["ops"]),
                      tensors=tuple(r["tensors"]))
           for k, r in merged.items()]
    return sorted(out, key=lambda c: -c.total_wire_bytes)


def _described_by(graph: HloGraph, ins: Instr) -> Instr:
    """The instruction whose metadata says what a collective is for: its own, or, where it
    has no source line (XLA since JAX 0.12 gives a parameter's gather the parameter's name
    and no stack), the op that uses what it moved (the matmul that needs the weight)."""
    if graph.source(ins):
        return ins
    todo, seen, first = [ins], {ins.name}, None
    for _ in range(6):                      # breadth first, through copies and layout fusions
        for cur in todo:
            if graph.source(cur):
                if cur.op in ("dot", "convolution") or "dot_general" in cur.op_name:
                    return cur              # the matmul that uses the weight
                first = first or cur
        todo = [graph.instructions[n] for cur in todo for n in graph.users.get(cur.name, [])
                if n in graph.instructions and n not in seen]
        seen.update(cur.name for cur in todo)
    return first or ins


# -- op metadata: source lines, operands, users ---------------------------------------------

_OP_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
                      r"(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)(?P<attrs>.*)$")
_META_OP = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_META_FRAME = re.compile(r"stack_frame_id=(\d+)")
_META_FILE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
#: Frames of these libraries (and Workbench's step plumbing) are not "the source line".
_LIBRARY = re.compile(r"/(jax|jaxlib|flax|optax|numpy|qwix)/|/workbench/((_sharding/|_)?rules|"
                      r"_?step|planning/_?planner|planning/_?activations|models/_fp8)\.py$|^<")
_PASS_THROUGH = {"bitcast", "copy", "reshape", "convert", "transpose", "get-tuple-element",
                 "broadcast", "slice", "dynamic-slice", "copy-start", "copy-done",
                 "all-gather-done", "all-reduce-done", "collective-permute-done",
                 "optimization-barrier"}


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: name, opcode, result type, operand names, op metadata."""

    name: str
    op: str
    type: str
    operands: tuple[str, ...]
    op_name: str
    frame: int | None
    file_line: tuple[str, int] | None
    computation: str


def _short_op(op_name: str) -> str:
    """``'jit(train_step)/jvp(btd,df->btf)/dot_general'`` -> ``'jvp(btd,df->btf)/dot_general'``."""
    return re.sub(r"^jit\([^)]*\)/", "", op_name)


def _param_path(op_name: str) -> str | None:
    """``"state.params['blocks'][0]['attn']['k']"`` -> ``'params.blocks.0.attn.k'``."""
    m = re.match(r"^state\.(params|opt_state)(.*)$", op_name.replace("\\'", "'"))
    if m is None:
        b = re.match(r"^batch\['([^']+)'\]$", op_name.replace("\\'", "'"))
        return f"batch.{b.group(1)}" if b else None
    parts = re.findall(r"\[(?:'([^']*)'|(\d+))\]|\.(\w+)", m.group(2))
    return ".".join([m.group(1)] + [a or b or c for a, b, c in parts])


@dataclasses.dataclass
class HloGraph:
    """Instructions of an optimized HLO module with their users and the module's stack
    frame tables (``FileNames``, ``FunctionNames``, ``FileLocations``, ``StackFrames``)."""

    instructions: dict[str, Instr]
    users: dict[str, list[str]]
    files: dict[int, str]
    functions: dict[int, str]
    locations: dict[int, tuple[int, int, int]]
    frames: dict[int, tuple[int, int]]

    @classmethod
    def parse(cls, hlo_text: str) -> HloGraph:
        """Read the module text (``compiled.as_text()``)."""
        tables: dict[str, dict[int, str]] = {}
        table = None
        instructions: dict[str, Instr] = {}
        users: dict[str, list[str]] = {}
        computation = ""
        for line in hlo_text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                table = tables.setdefault(line, {})
                continue
            if table is not None:
                row = _TABLE_ROW.match(line)
                if row:
                    table[int(row.group(1))] = row.group(2)
                    continue
                table = None
            head = _COMPUTATION.match(line)
            if head and not line[:1].isspace():
                computation = head.group(1)
                continue
            m = _OP_LINE.match(line)
            if m is None:
                continue
            operands = tuple(re.findall(r"%([\w.\-]+)", m.group("args")))
            attrs = m.group("attrs")
            meta_op = _META_OP.search(attrs)
            frame = _META_FRAME.search(attrs)
            file_line = _META_FILE.search(attrs)
            ins = Instr(name=m.group("name"), op=m.group("op"), type=m.group("type"),
                        operands=operands, op_name=meta_op.group(1) if meta_op else "",
                        frame=int(frame.group(1)) if frame else None,
                        file_line=(file_line.group(1), int(file_line.group(2)))
                        if file_line else None, computation=computation)
            instructions[ins.name] = ins
            for o in operands:
                users.setdefault(o, []).append(ins.name)

        def ints(text: str, key: str) -> int:
            m = re.search(rf"\b{key}=(\d+)", text)
            return int(m.group(1)) if m else 0

        return cls(
            instructions=instructions, users=users,
            files={k: v.strip('"') for k, v in tables.get("FileNames", {}).items()},
            functions={k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()},
            locations={k: (ints(v, "file_name_id"), ints(v, "function_name_id"),
                           ints(v, "line")) for k, v in tables.get("FileLocations", {}).items()},
            frames={k: (ints(v, "file_location_id"), ints(v, "parent_frame_id"))
                    for k, v in tables.get("StackFrames", {}).items()})

    def stack(self, ins: Instr) -> list[tuple[str, int, str]]:
        """``[(file, line, function), ...]`` innermost first, for ``ins``'s op."""
        out: list[tuple[str, int, str]] = []
        if ins.file_line is not None:
            out.append((ins.file_line[0], ins.file_line[1], ""))
        frame, seen = ins.frame, set()
        while frame and frame in self.frames and frame not in seen:
            seen.add(frame)
            loc, parent = self.frames[frame]
            if loc in self.locations:
                f, fn, line = self.locations[loc]
                out.append((self.files.get(f, "?"), line, self.functions.get(fn, "?")))
            if parent == frame:
                break
            frame = parent
        return out

    def source(self, ins: Instr) -> str:
        """The innermost frame outside JAX, Flax, optax and Workbench's step plumbing:
        ``'_layers.py:101 in MLP.__call__'`` (empty when the op has no metadata)."""
        for file, line, fn in self.stack(ins):
            if not _LIBRARY.search(file):
                return f"{file.rsplit('/', 1)[-1]}:{line}" + (f" in {fn}" if fn else "")
        return ""

    def source_location(self, ins: Instr) -> tuple[str, int] | None:
        """``(full file path, line)`` of :meth:`source`."""
        for file, line, _ in self.stack(ins):
            if not _LIBRARY.search(file):
                return file, line
        return None

    def producer(self, ins: Instr) -> Instr | None:
        """The instruction that made ``ins``'s first operand, looking through layout-only
        ops (bitcast, copy, reshape, ...); None for none."""
        cur = ins
        for _ in range(12):
            if not cur.operands:
                return None
            nxt = self.instructions.get(cur.operands[0])
            if nxt is None:
                return None
            if nxt.op not in _PASS_THROUGH:
                return nxt
            cur = nxt
        return None

    def consumer(self, ins: Instr) -> Instr | None:
        """The first instruction that uses ``ins``'s result, looking through layout-only
        ops; None for none."""
        cur = ins
        for _ in range(12):
            names = self.users.get(cur.name, [])
            if not names:
                return None
            nxt = self.instructions[names[0]]
            if nxt.op not in _PASS_THROUGH or nxt.op.endswith("-done"):
                if nxt.op.endswith("-done"):
                    cur = nxt
                    continue
                return nxt
            cur = nxt
        return None

    def moved_tensor(self, ins: Instr) -> str:
        """What a collective moves: the parameter or batch entry its operand is (through
        layout-only ops), else ``'<op> (file:line)'`` of the op that produced it."""
        cur = ins
        for _ in range(12):
            if not cur.operands:
                break
            nxt = self.instructions.get(cur.operands[0])
            if nxt is None:
                break
            path = _param_path(nxt.op_name)
            if path:
                return path
            if nxt.op == "parameter":
                break
            if nxt.op not in _PASS_THROUGH:
                src = self.source(nxt) or self.source(ins)
                what = _short_op(nxt.op_name or ins.op_name) or nxt.op
                return f"{what} ({src})" if src else what
            cur = nxt
        src = self.source(ins)
        return f"{_short_op(ins.op_name)} ({src})" if src else _short_op(ins.op_name)


@functools.lru_cache(maxsize=4)
def _graph(hlo_text: str) -> HloGraph:
    """``HloGraph.parse``, once per module text: a plan reads its collectives and its
    reshards from the same text (seconds of regex for a large step). Read-only."""
    return HloGraph.parse(hlo_text)


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


_DEFINES = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def parse_reshards(hlo_text: str, axis_names: Sequence[str],
                   axis_sizes: Sequence[int]) -> list[Reshard]:
    """Layout changes of activations in an optimized HLO module: all-to-all and
    collective-permute, and all-gathers whose operand is no parameter or batch entry."""
    graph = _graph(hlo_text)
    n = math.prod(axis_sizes)
    lines: dict[str, str] = {}   # instruction name -> its line (first definition)
    for ln in hlo_text.splitlines():
        m = _DEFINES.match(ln)
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
                prod is not None and _param_path(prod.op_name)):
            continue
        line = lines.get(ins.name, "")
        if kind == "collective-permute":
            axes, _ = _pairs_axes(line, axis_names, axis_sizes)
        else:
            groups = parse_replica_groups(line, n) or [list(range(n))]
            axes, _ = groups_to_axes(groups, axis_names, axis_sizes)
        cons = graph.consumer(ins)
        out.append(Reshard(
            kind=kind, axes=axes, shape=ins.type.strip("()").split("{")[0], name=ins.name,
            bytes=_array_bytes(ins.type, kind, ins.op.endswith("-start"))[0],
            producer=_short_op(prod.op_name) if prod is not None and prod.op_name else
            (prod.op if prod is not None else "?"),
            producer_source=graph.source(prod) if prod is not None else "",
            consumer=_short_op(cons.op_name) if cons is not None and cons.op_name else
            (cons.op if cons is not None else "?"),
            consumer_source=graph.source(cons) if cons is not None else ""))
    return out


def dot_dtypes(hlo_text: str) -> dict[tuple[str, str], int]:
    """The matmuls of an optimized HLO module by their operands' element types: each
    ``dot`` and ``convolution`` (fused ones included; the TPU compiler writes matmuls as
    convolutions), ``{("f8e4m3fn", "f8e4m3fn"): 14, ("bf16", "bf16"): 3, ...}``, counted
    once per instruction (a loop body's once). A Pallas kernel is a custom call: not here.

    Example::

        dot_dtypes(plan.compiled.as_text())   # fp8 projections: f8e4m3fn / f8e5m2 pairs
    """
    graph = _graph(hlo_text)
    out: dict[tuple[str, str], int] = {}
    for ins in graph.instructions.values():
        if ins.op not in ("dot", "convolution") or len(ins.operands) < 2:
            continue
        types = tuple(graph.instructions[o].type.split("[")[0].strip("(")
                      if o in graph.instructions else "?" for o in ins.operands[:2])
        out[types] = out.get(types, 0) + 1
    return out
