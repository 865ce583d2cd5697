"""The op events of one program in a ``jax.profiler`` trace, with their self time: XLA:CPU's
host threads, TPU (and some GPU) device planes' "XLA Ops" lines, and CUPTI's GPU stream lines
(the module docstring of ``_trace`` says what each carries)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_WAIT = "Wait: pending_threads"   # XLA:CPU's rendezvous, waiting for the group's devices


@dataclasses.dataclass
class OpEvent:
    name: str
    device: int
    execution: Any
    start: float   # seconds
    end: float
    self_time: float = 0.0
    wait: float = 0.0   # inside a collective: waiting for the other devices to arrive
    host: bool = False  # an XLA:CPU op on the host's threads (devices share its cores)
    children: list = dataclasses.field(default_factory=list)   # nested ops' (start, end)


def _module_runs(plane: Any, module: str) -> list[tuple[float, float]]:
    """(start, end) seconds of each execution of ``module`` on a device plane (its "XLA
    Modules" line: one event per execution, named ``jit_train_step(<program id>)``)."""
    runs = []
    for line in plane.lines:
        if line.name == "XLA Modules":
            for e in line.events:
                if e.name.split("(")[0] == module:
                    start = float(e.start_ns) * 1e-9
                    runs.append((start, start + float(e.duration_ns) * 1e-9))
    return sorted(runs)


def _stream_events(plane: Any, module: str, p_index: int) -> list[OpEvent]:
    """Kernel events of ``module`` on a GPU plane's CUPTI stream lines (no "XLA Modules"
    line). An execution is one launch of the step's CUDA graph (its ``correlation_id``);
    kernels launched one by one start a new execution where the program's first kernel
    runs again."""
    out: list[OpEvent] = []
    for line in plane.lines:
        for e in line.events:
            stats = dict(e.stats)
            if stats.get("hlo_module") != module:
                continue
            op = str(stats.get("hlo_op", ""))
            name = e.name if not op or op.startswith("command_buffer") else op
            start = float(e.start_ns) * 1e-9
            graph = stats.get("correlation_id") if "cuda_graph_id" in stats else None
            out.append(OpEvent(name, p_index, graph, start,
                              start + float(e.duration_ns) * 1e-9))
    out.sort(key=lambda ev: ev.start)
    if out and any(ev.execution is None for ev in out):
        first, k = out[0].name, -1
        for ev in out:
            k += ev.name == first
            ev.execution = ("launch", k)
    for ev in out:      # kernels of one stream do not nest: self time is the whole kernel
        ev.self_time = ev.end - ev.start
    return out


def op_events(files: Sequence[Path], module: str) -> list[OpEvent]:
    """Op events of ``module`` with their self time (nested events on one thread line,
    a loop's body inside its while, are subtracted from their parent).

    Host plane (XLA:CPU): events carrying ``hlo_op`` of ``module``; the execution is the
    event's ``run_id``. Device planes (GPU, TPU): the "XLA Ops" line; the execution is the
    "XLA Modules" event of ``module`` that contains the op.
    """
    from jax.profiler import ProfileData

    out: list[OpEvent] = []
    for f in files:
        data = ProfileData.from_file(str(f))
        for p_index, plane in enumerate(data.planes):
            device_plane = plane.name.startswith("/device:") and "CUSTOM" not in plane.name
            if device_plane and not any(ln.name in ("XLA Modules", "XLA Ops")
                                        for ln in plane.lines):
                out += _stream_events(plane, module, p_index)
                continue
            runs = _module_runs(plane, module) if device_plane else None
            for line in plane.lines:
                if not device_plane or line.name == "XLA Ops":
                    out += _line_events(line, module, p_index, runs)
    return out


def _line_events(line: Any, module: str, p_index: int,
                 runs: list[tuple[float, float]] | None) -> list[OpEvent]:
    """The op events of ``module`` on one thread line: a device plane's "XLA Ops" line
    (``runs``: the module's executions on that plane) or a host thread (``runs`` None);
    a nested event's time is taken from its parent's self time."""
    out: list[OpEvent] = []
    stack: list[OpEvent] = []
    for e in line.events:
        stats = dict(e.stats)
        start = float(e.start_ns) * 1e-9
        if runs is not None:
            run = next((i for i, (s, t) in enumerate(runs) if s <= start <= t), None)
            if run is None:
                continue   # an op of another program
            name, dev, exe = str(stats.get("hlo_op", e.name)), p_index, run
        else:
            if stats.get("hlo_module") != module or "hlo_op" not in stats:
                # XLA:CPU's rendezvous: a collective waiting for its peers
                if e.name.startswith(_WAIT) and stack and \
                        stack[-1].end >= start >= stack[-1].start:
                    stack[-1].wait += float(e.duration_ns) * 1e-9
                continue
            name, dev = str(stats["hlo_op"]), int(stats.get("device_ordinal", 0))
            exe = stats.get("run_id")
        ev = OpEvent(name, dev, exe, start, start + float(e.duration_ns) * 1e-9,
                     host=runs is None)
        ev.self_time = ev.end - ev.start
        while stack and stack[-1].end <= ev.start:
            stack.pop()
        if stack and ev.end <= stack[-1].end + 1e-12:
            stack[-1].self_time -= ev.end - ev.start
            stack[-1].children.append((ev.start, ev.end))
        stack.append(ev)
        out.append(ev)
    return out
