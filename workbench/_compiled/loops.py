"""How often each computation of an HLO module runs (loops, trip counts), and the TPU compiler's
cycle estimates summed over those runs."""
from __future__ import annotations

import dataclasses
import re

from workbench._compiled.text import DEFINES, array_bytes, computations

_WHILE_BODY = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")


_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)(.*)$", re.M)


_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


_BOUND = re.compile(r"\bcompare\(|calls=%?[\w.\-]*compare")


_INT_CONSTANT = re.compile(r"=\s*s(?:32|64)\[\][^=]*\bconstant\((-?\d+)\)")


def loop_trip_counts(hlo_text: str) -> dict[str, int]:
    """``{while body computation: trip count}`` of the module's while loops (a scan over
    layers lowers to one): XLA's ``known_trip_count`` where the backend writes it, else
    the loop condition's comparison with its one integer constant (``i < 32``) less the
    counter's start where the loop's initial tuple gives it as a constant: the TPU
    compiler peels a scan's first iteration into the caller and starts the loop at 1
    (``i`` from 1 while ``i < 32``: 31 trips). A loop whose bound is not a constant is
    left out."""
    comps = computations(hlo_text)
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
    comps = computations(hlo_text)
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
    for name, lines in computations(hlo_text).items():
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
    for comp, lines in computations(hlo_text).items():
        hits = [ln for ln in lines if (m := _CYCLES.search(ln)) is not None
                and int(m.group(1)) >= UNKNOWN_CYCLES and mult.get(comp)]
        if not hits:
            continue
        types = {m.group(1): ln.split("=", 1)[1] for ln in lines
                 if (m := DEFINES.match(ln)) is not None}
        for line in hits:
            head = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+[a-z][\w\-]*\("
                            r"([^)]*)\)", line)
            if head is None:
                continue
            name, rtype, args = head.groups()
            nbytes = array_bytes(rtype, "", False)[0]
            for arg in re.findall(r"%?([\w.\-]+)", args):
                typed = _TYPE_OF.match(types.get(arg, ""))
                nbytes += array_bytes(typed.group(1), "", False)[0] if typed else 0
            out.append(Unestimated(name=name, computation=comp, bytes=nbytes,
                                   count=mult[comp]))
    return out


def loop_computations(hlo_text: str) -> set[str]:
    """While bodies and every computation they call, at any depth."""
    callees: dict[str, set[str]] = {}
    for name, lines in computations(hlo_text).items():
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
