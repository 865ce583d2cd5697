"""Host offload: what a compiled step moves between device memory and host memory, and
how long that takes beside the step's compute.

A remat policy that offloads activations (``save_and_offload_only_these_names``,
``offload_dot_with_no_batch_dims``: JAX's ``pinned_host`` memory kind) compiles, with the
TPU compiler, into asynchronous DMAs whose host side lives in memory space 5 (``S(5)``
in a layout: ``bf16[4,8192,4096]{...S(5)}``). What libtpu 0.0.42 emits:

- ``copy-start`` / ``copy-done``: a whole array. ``copy-start``'s shape is ``(destination,
  source, u32[] context)``: a destination in ``S(5)`` goes to the host, a source in
  ``S(5)`` comes back to the device;
- ``dynamic-update-slice-start`` / ``-done``: one layer's slice written into a stacked
  ``S(5)`` buffer (a scan over layers, forward): to the host, the update's bytes;
- ``dynamic-slice-start`` / ``-done``: one layer's slice read back from it (backward): to
  the device, the result's bytes;
- the buffers themselves: ``custom-call(), custom_call_target="AllocateBuffer"`` in S(5)
  (no traffic).

Any other instruction whose result is in ``S(5)`` and that is not one of those, a
``bitcast``/``get-tuple-element``/``tuple``/parameter, is counted as a synchronous
transfer of its result (none seen so far; the count says if there are).

Timing (:func:`host_seconds`): the module is scheduled (``is_scheduled=true``), so each
computation lists its instructions in the order they run. Walking that order, the
compute advances a clock by the TPU compiler's own ``estimated_cycles`` of each
instruction (the clock the local-work term uses; a while loop advances it by its body's
cycles x trip count; a Pallas kernel by the seconds the prediction gives each kernel
call), and the host link carries each direction (PCIe is full duplex) at the chip's
host-link bandwidth (``HardwareSpec.host_bandwidth``), shared equally by the transfers in
flight (DMAs run concurrently; the compiler waits for the small ones first): a start
adds its bytes, its done waits until they have crossed. The waits are the *exposed* host-transfer time:
what the compute scheduled between a start and its done does not hide. A computation
with transfers (a scanned layer's body) is walked once and counted as often as it runs
(``computation_multiplicity``).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

from workbench._compiled.loops import UNKNOWN_CYCLES, computation_multiplicity, loop_trip_counts
from workbench._compiled.text import DTYPE_BYTES, computations
from workbench.perf._host_link import walk

__all__ = ["HostTime", "HostTraffic", "HostTransfer", "host_seconds", "host_traffic"]

HOST_SPACE = "S(5)"
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
                   r"(?P<op>[a-z][\w\-]*)\((?P<args>.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\](\{[^}]*\})?")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_STARTS = ("copy-start", "dynamic-update-slice-start", "dynamic-slice-start")
_DONES = ("copy-done", "dynamic-update-slice-done", "dynamic-slice-done")
#: Instructions whose S(5) result moves nothing (views, buffers, plumbing).
_NO_TRAFFIC = ("bitcast", "get-tuple-element", "tuple", "parameter", "custom-call",
               "while", "call", "conditional", "copy-done", "dynamic-update-slice-done",
               "dynamic-slice-done", "constant", "opt-barrier")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostTransfer:
    """One instruction of the compiled step that moves bytes between device and host.

    Attributes:
      name: the HLO instruction (``copy-start.4``, ``dynamic-slice-start.2``).
      computation: the computation it is in.
      op: its opcode.
      direction: ``"to_host"`` or ``"to_device"``.
      bytes: bytes it moves each time it runs (the logical array: dtype x shape).
      count: times it runs per step (``computation_multiplicity``: a scanned layer's
        body runs once per layer).
      asynchronous: a start with a done later in the schedule (the compute scheduled in
        between can hide it); False: the program waits for it where it stands.
      shape: the array moved (``bf16[1,128,64]``).
    """

    name: str
    computation: str
    op: str
    direction: str
    bytes: int
    count: int
    asynchronous: bool
    shape: str

    @property
    def total_bytes(self) -> int:
        """Bytes per step (``bytes x count``)."""
        return self.bytes * self.count


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostTraffic:
    """What one step moves between device and host memory, and the schedule around it.

    Attributes:
      transfers: every ``HostTransfer``.
      schedule: ``{computation: {"count": runs per step, "events": [...]}}`` for each
        computation with a transfer, its instructions in schedule order reduced to events:
        ``["c", cycles, kernels]`` (compute: the compiler's cycle estimates, and Pallas
        kernel calls), ``["s", name, direction, bytes]`` (a start), ``["d", name]`` (its
        done), ``["x", direction, bytes]`` (a synchronous transfer). JSON-friendly:
        ``host_seconds`` times it for any bandwidth.
      kernel_calls: Pallas kernel calls per step (the prediction's kernel time is spread
        over them evenly: ``host_seconds(kernel_seconds=)``).
    """

    transfers: tuple[HostTransfer, ...] = ()
    schedule: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    kernel_calls: int = 0

    @property
    def to_host_bytes(self) -> int:
        """Bytes per step from device to host memory."""
        return sum(t.total_bytes for t in self.transfers if t.direction == "to_host")

    @property
    def to_device_bytes(self) -> int:
        """Bytes per step from host back to device memory."""
        return sum(t.total_bytes for t in self.transfers if t.direction == "to_device")

    def __bool__(self) -> bool:
        return bool(self.transfers)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``from_dict`` reads it back)."""
        return {"transfers": [dataclasses.asdict(t) for t in self.transfers],
                "schedule": {k: dict(v) for k, v in self.schedule.items()},
                "kernel_calls": self.kernel_calls}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> HostTraffic:
        """The ``HostTraffic`` of ``to_dict()``'s data (an empty one for None)."""
        if not data:
            return cls()
        return cls(transfers=tuple(HostTransfer(**t) for t in data.get("transfers", ())),
                   schedule={k: {"count": int(v["count"]), "events": [list(e) for e in
                                                                      v["events"]]}
                             for k, v in data.get("schedule", {}).items()},
                   kernel_calls=int(data.get("kernel_calls", 0)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostTime:
    """A step's host transfers, timed.

    Attributes:
      to_host_bytes, to_device_bytes: bytes per step each way.
      bandwidth: host-link bytes/s per chip, each direction.
      link_seconds: the busier direction's bytes at that bandwidth: the link's time per step.
      exposed_seconds: the part of it the compute scheduled beside the transfers does not
        hide (the waits of their dones): added to the step.
      hidden_seconds: ``link_seconds - exposed_seconds`` (at least 0).
      transfers, asynchronous: instructions that move bytes, and how many are async.
      formula: how it was computed, with its numbers.
      source: where the bandwidth comes from.
    """

    to_host_bytes: float
    to_device_bytes: float
    bandwidth: float
    link_seconds: float
    exposed_seconds: float
    hidden_seconds: float
    transfers: int
    asynchronous: int
    formula: str
    source: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- reading the HLO ------------------------------------------------------------------------

def _elements(type_text: str) -> list[str]:
    """The top-level elements of a (possibly tuple) HLO type, comments dropped."""
    text = re.sub(r"/\*.*?\*/", "", type_text).strip()
    if not text.startswith("("):
        return [text]
    text, out, depth, cur = text[1:-1], [], 0, ""
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _array(element: str) -> tuple[int, str, bool] | None:
    """(bytes, "dtype[dims]", in host memory?) of one array type, or None."""
    m = _ARRAY.search(element)
    if m is None or m.group(1) not in DTYPE_BYTES:
        return None
    dims = [int(x) for x in m.group(2).split(",") if x]
    nbytes = int(DTYPE_BYTES[m.group(1)] * math.prod(dims))
    return nbytes, f"{m.group(1)}[{m.group(2)}]", HOST_SPACE in (m.group(3) or "")


def _start_transfer(op: str, type_text: str) -> tuple[str, int, str] | None:
    """(direction, bytes, shape) of an async start that moves bytes to or from S(5)."""
    parts = _elements(type_text)
    if op == "copy-start" and len(parts) >= 2:
        dst, src = _array(parts[0]), _array(parts[1])
        if dst and src and dst[2] != src[2]:
            return ("to_host", dst[0], dst[1]) if dst[2] else ("to_device", src[0], src[1])
    elif op == "dynamic-update-slice-start" and len(parts) >= 2:
        operands = _elements(parts[0])
        buf, out = _array(operands[0]) if operands else None, _array(parts[1])
        update = _array(operands[1]) if len(operands) > 1 else None
        if out and out[2] and update and not update[2]:
            return "to_host", update[0], update[1]
        if buf and buf[2] is False and update and update[2]:
            return "to_device", update[0], update[1]
    elif op == "dynamic-slice-start" and len(parts) >= 2:
        operands = _elements(parts[0])
        src, out = _array(operands[0]) if operands else None, _array(parts[1])
        if src and out and src[2] and not out[2]:
            return "to_device", out[0], out[1]
        if src and out and out[2] and not src[2]:
            return "to_host", out[0], out[1]
    return None


def _nested_cycles(comps: Mapping[str, list[str]], name: str, trips: Mapping[str, int],
                   memo: dict[str, tuple[int, int]], depth: int = 0) -> tuple[int, int]:
    """(cycles, Pallas kernel calls) of one run of computation ``name``: its instructions'
    estimates, while loops' bodies x trip count, and calls' computations."""
    if name in memo or depth > 64:
        return memo.get(name, (0, 0))
    cycles = kernels = 0
    for line in comps.get(name, ()):
        c, k = _line_cost(comps, line, trips, memo, depth)
        cycles, kernels = cycles + c, kernels + k
    memo[name] = (cycles, kernels)
    return cycles, kernels


def _line_cost(comps: Mapping[str, list[str]], line: str, trips: Mapping[str, int],
               memo: dict[str, tuple[int, int]], depth: int) -> tuple[int, int]:
    """(cycles, Pallas kernel calls) of one scheduled instruction."""
    if "tpu_custom_call" in line or "pallas_call" in line:
        return 0, 1
    m = _CYCLES.search(line)
    if m and int(m.group(1)) < UNKNOWN_CYCLES:
        return int(m.group(1)), 0
    head = _LINE.match(line)
    op = head.group("op") if head else ""
    if op == "while" and (body := _WHILE_BODY.search(line)):
        c, k = _nested_cycles(comps, body.group(1), trips, memo, depth + 1)
        n = trips.get(body.group(1), 1)
        return c * n, k * n
    if op == "call" and (callee := _CALLS.search(line)):
        return _nested_cycles(comps, callee.group(1), trips, memo, depth + 1)
    return 0, 0


def host_traffic(hlo_text: str) -> HostTraffic:
    """The host transfers of a compiled step (see the module's docstring), with the
    schedule ``host_seconds`` needs to time them; empty when nothing is in ``S(5)``."""
    if HOST_SPACE not in hlo_text:
        return HostTraffic()
    comps = computations(hlo_text)
    mult = computation_multiplicity(hlo_text)
    trips = loop_trip_counts(hlo_text)
    memo: dict[str, tuple[int, int]] = {}
    transfers: list[HostTransfer] = []
    schedule: dict[str, Any] = {}
    for comp, lines in comps.items():
        if not mult.get(comp) or not any(HOST_SPACE in ln for ln in lines):
            continue
        events, found, moves = _schedule_of(comp, lines, comps, trips, memo, mult[comp])
        transfers += found
        if moves:
            schedule[comp] = {"count": mult[comp], "events": events}
    kernels = sum(mult.get(comp, 0) for comp, lines in comps.items() for ln in lines
                  if "tpu_custom_call" in ln and _LINE.match(ln))
    return HostTraffic(transfers=tuple(transfers), schedule=schedule, kernel_calls=kernels)


def _schedule_of(comp: str, lines: Sequence[str], comps: Mapping[str, list[str]],
                 trips: Mapping[str, int], memo: dict[str, tuple[int, int]], count: int
                 ) -> tuple[list[list[Any]], list[HostTransfer], bool]:
    """One computation's schedule: its transfer events in order (:func:`_line_event`), the
    compiler's cycles and Pallas kernel calls between them as ``["c", cycles, kernels]``;
    its transfers (each run ``count`` times per step); whether it moves anything."""
    events: list[list[Any]] = []
    started: dict[str, tuple[str, int, str, str]] = {}
    done_of: set[str] = set()
    transfers: list[HostTransfer] = []
    cost = [0, 0]   # since the last event: cycles, kernel calls
    for line in lines:
        head = _LINE.match(line)
        if head is None:
            continue
        found = _line_event(head, started)
        if found is None:
            c, k = _line_cost(comps, line, trips, memo, 0)
            cost = [cost[0] + c, cost[1] + k]
            continue
        event, what = found
        if cost != [0, 0]:
            events.append(["c", *cost])
        cost = [0, 0]
        events.append(event)
        if event[0] == "s":
            started[event[1]] = what
        elif event[0] == "d":
            done_of.add(event[1])
        else:
            transfers.append(HostTransfer(
                name=head.group("name"), computation=comp, op=head.group("op"),
                direction="to_host", bytes=what[0], count=count, asynchronous=False,
                shape=what[1]))
    if cost != [0, 0]:
        events.append(["c", *cost])
    for name, (direction, nbytes, shape, op) in started.items():
        transfers.append(HostTransfer(
            name=name, computation=comp, op=op, direction=direction, bytes=nbytes,
            count=count, asynchronous=name in done_of, shape=shape))
    return events, transfers, bool(started) or any(e[0] == "x" for e in events)


def _line_event(head: re.Match[str], started: Mapping[str, Any]
                ) -> tuple[list[Any], Any] | None:
    """The host-transfer event of one instruction, None where it computes: ``["s", name,
    direction, bytes]`` an async start to or from S(5) (with its ``(direction, bytes,
    shape, op)``), ``["d", name]`` the done of one started, ``["x", "to_host", bytes]``
    any other instruction whose result is in S(5) (with its ``(bytes, shape)``)."""
    name, type_text, op = head.group("name"), head.group("type"), head.group("op")
    if op in _STARTS and HOST_SPACE in type_text:
        moved = _start_transfer(op, type_text)
        if moved is not None:
            return ["s", name, moved[0], moved[1]], (*moved, op)
    if op in _DONES:
        operand = re.match(r"\s*%?([\w.\-]+)", head.group("args"))
        if operand and operand.group(1) in started:
            return ["d", operand.group(1)], None
    if op not in _NO_TRAFFIC and op not in _STARTS:
        arr = _array(_elements(type_text)[0])
        operands = re.findall(r"%([\w.\-]+)", head.group("args").split("),")[0])
        if arr is not None and arr[2] and operands:
            return ["x", "to_host", arr[0]], (arr[0], arr[1])
    return None


# -- timing ---------------------------------------------------------------------------------

def host_seconds(traffic: HostTraffic, *, bandwidth: float, clock_hz: float,
                 kernel_seconds: float = 0.0, source: str = "") -> HostTime:
    """Time ``traffic`` on a host link of ``bandwidth`` bytes/s each direction.

    Args:
      traffic: ``host_traffic`` of the compiled step.
      bandwidth: host-link (PCIe) bytes/s per chip, one direction.
      clock_hz: the chip's clock, to turn the compiler's cycle estimates into seconds.
      kernel_seconds: seconds per Pallas kernel call (the compiler gives kernels no
        cycles; the prediction times them from their FLOPs): the compute they add beside
        the transfers.
      source: where ``bandwidth`` comes from.

    Returns:
      A ``HostTime``: the link's busy time per step and the exposed part, the waits a
      walk of the schedule finds (see the module's docstring).
    """
    if bandwidth <= 0 or clock_hz <= 0:
        raise ValueError(f"host_seconds needs a positive bandwidth and clock, got "
                         f"{bandwidth!r} B/s and {clock_hz!r} Hz")
    exposed = 0.0
    for entry in traffic.schedule.values():
        exposed += entry["count"] * walk(entry["events"], bandwidth, clock_hz,
                                          kernel_seconds)
    up, down = float(traffic.to_host_bytes), float(traffic.to_device_bytes)
    link = max(up, down) / bandwidth
    n_async = sum(1 for t in traffic.transfers if t.asynchronous)
    formula = (f"{up:.4g} B to host and {down:.4g} B back per step at {bandwidth:.4g} B/s "
               f"each way = {up / bandwidth:.4g} s / {down / bandwidth:.4g} s; "
               f"exposed {exposed:.4g} s: the waits at the transfers' dones when the "
               f"schedule's compute (the compiler's cycle estimates at "
               f"{clock_hz / 1e9:.3g} GHz" + (f", + {kernel_seconds:.3g} s per Pallas "
                                               "kernel call" if kernel_seconds else "")
               + ") runs beside the host link, its transfers in flight sharing each direction")
    return HostTime(to_host_bytes=up, to_device_bytes=down, bandwidth=bandwidth,
                    link_seconds=link, exposed_seconds=exposed,
                    hidden_seconds=max(0.0, link - exposed),
                    transfers=len(traffic.transfers), asynchronous=n_async,
                    formula=formula, source=source)


