"""A ``jax.profiler`` trace of train steps, read into time per step by category and per op.

The trace (``*.xplane.pb``, an XSpace) is read with the profiler's own reader,
``jax.profiler.ProfileData`` (XLA's XSpace bindings shipped with jaxlib). XLA tags every
op it runs with its HLO instruction (``hlo_op``), module (``hlo_module``) and device
(``device_ordinal``): XLA:CPU on the host plane's threads (one event per thunk; the thunk
executor runs independent ops of one device side by side on the pool's threads), TPUs (and
GPUs in some JAX versions) on each device plane's "XLA Ops" line, NVIDIA GPUs through
CUPTI on the device plane's stream lines: one event per kernel, named after the fusion XLA
emitted (``loop_add_fusion_49``, ``gemm_fusion_dot_532``) or the library kernel it called
(cuBLAS ``nvjet_*``/``*gemm*``: counted as compute), tagged with ``hlo_module`` and, inside
a CUDA graph (XLA's command buffers), one ``correlation_id`` per launch of the graph.
The instruction names are looked up in the compiled step's HLO text (``compiled.as_text()``,
what the Trainer ran) for what each op is: a collective (kind, bytes, mesh axes:
:func:`workbench._compiled.hlo.parse_collectives`),
a matmul (a dot or convolution, or a fusion/custom call containing one: "compute"), or
any other op (elementwise, reductions, copies, data movement: "memory"); and for the user
source line of its JAX op (the HLO metadata).

Per device and step the accounting is exact: ``step = compute + memory + collectives +
other - concurrent + idle + host``, where ``concurrent`` is op time that ran beside other
ops of the same device, ``idle`` the time inside the step's execution that no op covered,
and ``host`` the time between executions (data loading, dispatch, metrics).

XLA:CPU's simulated devices have no timeline of their own: their ops run on one pool of
threads (here 8 Eigen + 8 client threads for 8 devices) over the host's cores, so an op's
duration is wall time shared with the ops of every other device (on 2 cores, 4.5-6.3 ops
were running at once on average in the bench_profile steps), and how much it is stretched
depends on the layout. The trace is then also read as *the host's* time
(``StepProfile.shared``, what a CPU prediction models: the devices take turns on the
host's cores): at each instant the cores other processes left are split evenly among the
running non-collective ops, one op on at most one core, and each op is charged its core
time / the host's cores; what they leave unused while a collective is in progress goes to
those collectives (time the host spent on, or waiting in, communication), the rest is
idle, and what other processes took is "others" (``workbench.train._profile.HostLoad``).
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from workbench._compiled.graph import HloGraph
from workbench._compiled.hlo import KINDS, Collective, parse_collectives

__all__ = ["MeasuredCollective", "OpTime", "StepProfile", "host_core_ids", "host_cores",
           "read_trace", "trace_files"]

CATEGORIES = ("compute", "memory", "collectives", "other")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_MATMUL_TARGET = re.compile(r"gemm|matmul|cublas|dot|conv", re.I)
_WAIT = "Wait: pending_threads"   # XLA:CPU's rendezvous, waiting for the group's devices
#: library kernels (cuBLAS, cuDNN, CUTLASS, NCCL) that are no HLO instruction's name
_KERNEL_KIND = ((re.compile(r"nccl", re.I), "collectives"),
                (re.compile(r"nvjet|gemm|cutlass|xmma|wgmma|hmma|cublas|cudnn", re.I), "compute"))


def _kernel_category(name: str) -> str:
    """The category of a GPU library kernel by its name ("memory" when unknown)."""
    return next((cat for pat, cat in _KERNEL_KIND if pat.search(name)), "memory")


#: the HLO collective a library kernel's name says it runs (letters only, lower case:
#: ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` -> "allreduce...")
_LIBRARY_COLLECTIVE = (("allreduce", "all-reduce"), ("allgather", "all-gather"),
                       ("reducescatter", "reduce-scatter"), ("alltoall", "all-to-all"),
                       ("sendrecv", "collective-permute"), ("send", "collective-permute"),
                       ("recv", "collective-permute"), ("broadcast", "collective-broadcast"))


def _library_collective(name: str) -> str | None:
    """The HLO collective kind a library kernel (NCCL) runs, by its name; None if unsaid."""
    letters = re.sub(r"[^a-z]", "", name.lower())
    return next((kind for key, kind in _LIBRARY_COLLECTIVE if key in letters), None)


def _apportion(measured: list[MeasuredCollective], unnamed: Sequence[OpTime]
               ) -> list[MeasuredCollective]:
    """Adds the time of collective kernels with no HLO name to the collectives they ran
    for: those of the kind the kernel's name says that no named event was matched to (or,
    for a kernel whose name says no kind, every such collective), split by their bytes."""
    out = list(measured)
    for op in unnamed:
        kind = _library_collective(op.name)
        free = [i for i, m in enumerate(out) if m.seconds == m.apportioned]
        targets = [i for i in free if kind is None or out[i].kind == kind]
        if not targets:
            continue   # only in the "collectives" category: no row to put it on
        weights = [float(max(out[i].collective.total_bytes, 0)) for i in targets]
        total = sum(weights)
        for i, w in zip(targets, weights):
            share = w / total if total > 0 else 1.0 / len(targets)
            m = out[i]
            out[i] = dataclasses.replace(m, seconds=m.seconds + share * op.seconds,
                                         events=m.events + share * op.count,
                                         apportioned=m.apportioned + share * op.seconds)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpTime:
    """One HLO instruction's measured time.

    Attributes:
      name: the HLO instruction (``"ynn_fusion.78"``, ``"all-gather.5"``).
      category: "compute" (matmuls), "memory" (other fusions and ops), "collectives" or
        "other" (control flow: while, call, conditional).
      opcode: its HLO opcode (``"fusion"``, ``"all-reduce"``).
      seconds: self time per step, averaged over devices.
      count: times it ran per step on one device (loop bodies run trip-count times).
      op: the JAX op it was made for (``"jvp(btd,dnh->btnh)/dot_general"``).
      source: the user source line (``"_gpt.py:101 in MLP.__call__"``), from HLO metadata.
    """

    name: str
    category: str
    opcode: str
    seconds: float
    count: float
    op: str
    source: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredCollective:
    """The measured time of one merged collective of the step (``hlo.Collective``).

    Attributes:
      collective: the compiled step's record (kind, axes, bytes, count, names).
      seconds: time per step on one device, averaged over devices (all its instructions).
      events: op events per step and device that were matched to it.
      wait: of ``seconds``, the time spent waiting for the group's other devices to
        arrive (XLA:CPU's rendezvous; 0 where the trace does not say).
      shared: the host's time per step charged to it (``StepProfile.shared``: the cores
        local work left unused while it ran); None when the devices have their own
        timelines.
      apportioned: of ``seconds``, the time of library kernels that carry no HLO
        instruction's name (NCCL's on GPUs), shared among the step's collectives of the
        kind the kernel names (``ncclDevKernel_AllReduce_...``: all-reduce) by their bytes;
        exact where the step has one collective of that kind.
    """

    collective: Collective
    seconds: float
    events: float
    wait: float = 0.0
    shared: float | None = None
    apportioned: float = 0.0

    @property
    def kind(self) -> str:
        return self.collective.kind

    @property
    def axes(self) -> tuple[str, ...]:
        return self.collective.axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepProfile:
    """Measured time of the profiled steps, per step and device (averaged over devices).

    Attributes:
      directory: the trace directory (``run_dir/profiles/<step>``).
      files: the ``.xplane.pb`` files read.
      module: the HLO module profiled (``"jit_train_step"``).
      steps: executions of the module per device in the trace.
      devices: devices seen.
      step_seconds: wall time per step: from the first execution's first op to the last
        execution's last op, per device, divided by the steps, averaged over devices.
      execution_seconds: time per step from an execution's first op to its last.
      categories: seconds per step: "compute", "memory", "collectives", "other" (op self
        time, summed), "concurrent" (op time that ran beside other ops of the device,
        to subtract), "idle" (no op running inside an execution), "host" (between
        executions: data, dispatch, the host's work).
      collectives: measured time of each collective of the compiled step.
      ops: every op's time, largest first.
      cores: the host cores the devices shared (XLA:CPU), None when each device has its
        own timeline (GPU, TPU).
      shared: XLA:CPU only: the host's time per step by category ("compute", "memory",
        "collectives", "other", "idle": cores unused with no collective in progress,
        "host": no op of any device running, "others": the cores other processes took);
        they sum to ``shared_step_seconds``.
      shared_step_seconds: the traced window (first op of any device to last) / steps.
    """

    directory: str
    files: tuple[str, ...]
    module: str
    steps: int
    devices: int
    step_seconds: float
    execution_seconds: float
    categories: dict[str, float]
    collectives: tuple[MeasuredCollective, ...]
    ops: tuple[OpTime, ...]
    cores: float | None = None
    shared: dict[str, float] = dataclasses.field(default_factory=dict)
    shared_step_seconds: float | None = None

    def top(self, k: int = 10) -> list[OpTime]:
        """The ``k`` ops that took longest (self time per step)."""
        return list(self.ops[:k])

    def accounted(self) -> float:
        """``compute + memory + collectives + other - concurrent + idle + host``: equals
        ``step_seconds`` (the identity the tests check)."""
        c = self.categories
        return sum(c[k] for k in CATEGORIES) - c["concurrent"] + c["idle"] + c["host"]

    def table(self, k: int = 10) -> str:
        """Per-category and top-``k`` op times as text."""
        c = self.categories
        lines = [f"{self.steps} steps of {self.module} on {self.devices} device(s): "
                 f"{self.step_seconds * 1e3:.3g} ms/step"]
        lines += [f"  {name:<12} {c[name] * 1e3:9.3f} ms" for name in
                  (*CATEGORIES, "concurrent", "idle", "host")]
        if self.shared:
            lines.append(f"  the host's time ({self.cores:g} cores shared by the devices): "
                         + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.shared.items()))
        lines.append(f"  top {k} ops (self time per step):")
        lines += [f"    {o.seconds * 1e3:8.3f} ms  {o.category:<11} {o.name:<28} "
                  f"{o.source or o.op}" for o in self.top(k)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def trace_files(directory: str | Path) -> list[Path]:
    """The XSpace files ``jax.profiler`` wrote under ``directory``
    (``plugins/profile/<time>/<host>.xplane.pb``), newest session last."""
    return sorted(Path(directory).glob("plugins/profile/*/*.xplane.pb"))


# -- what each HLO instruction is -----------------------------------------------------------

def _instruction_kinds(hlo_text: str) -> tuple[HloGraph, dict[str, tuple[str, str]]]:
    """``{instruction: (category, opcode)}`` from the module text."""
    graph = HloGraph.parse(hlo_text)
    calls: dict[str, list[str]] = {}
    targets: dict[str, str] = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if m is None:
            continue
        calls[m.group(1)] = _CALLS.findall(line)
        t = _TARGET.search(line)
        if t:
            targets[m.group(1)] = t.group(1)
    ops_in: dict[str, set[str]] = defaultdict(set)
    members: dict[str, list[str]] = defaultdict(list)
    for ins in graph.instructions.values():
        ops_in[ins.computation].add(ins.op)
        members[ins.computation].append(ins.name)
        if ins.name in targets and _MATMUL_TARGET.search(targets[ins.name]):
            ops_in[ins.computation].add("dot")

    def has_dot(comp: str, depth: int = 0) -> bool:
        if depth > 8:
            return False
        if ops_in[comp] & {"dot", "convolution"}:
            return True
        return any(has_dot(c, depth + 1) for name in members[comp]
                   for c in calls.get(name, ()))

    memo: dict[str, bool] = {}
    kinds: dict[str, tuple[str, str]] = {}
    for ins in graph.instructions.values():
        op = ins.op
        base = op.removesuffix("-start").removesuffix("-done")
        if base in KINDS or op.startswith("async-collective") or (
                op in ("async-start", "async-done") and "collective" in ins.name):
            kinds[ins.name] = ("collectives", op)
        elif op in ("dot", "convolution") or (
                op == "custom-call" and _MATMUL_TARGET.search(targets.get(ins.name, ""))):
            kinds[ins.name] = ("compute", op)
        elif op == "fusion":
            comp = (calls.get(ins.name) or [""])[0]
            if comp not in memo:
                memo[comp] = has_dot(comp)
            kinds[ins.name] = ("compute" if memo[comp] else "memory", op)
        elif op in ("while", "call", "conditional"):
            kinds[ins.name] = ("other", op)
        else:
            kinds[ins.name] = ("memory", op)
    return graph, kinds


# -- events ---------------------------------------------------------------------------------

@dataclasses.dataclass
class _Event:
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


def _stream_events(plane: Any, module: str, p_index: int) -> list[_Event]:
    """Kernel events of ``module`` on a GPU plane's CUPTI stream lines (no "XLA Modules"
    line). An execution is one launch of the step's CUDA graph (its ``correlation_id``);
    kernels launched one by one start a new execution where the program's first kernel
    runs again."""
    out: list[_Event] = []
    for line in plane.lines:
        for e in line.events:
            stats = dict(e.stats)
            if stats.get("hlo_module") != module:
                continue
            op = str(stats.get("hlo_op", ""))
            name = e.name if not op or op.startswith("command_buffer") else op
            start = float(e.start_ns) * 1e-9
            graph = stats.get("correlation_id") if "cuda_graph_id" in stats else None
            out.append(_Event(name, p_index, graph, start,
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


def _events(files: Sequence[Path], module: str) -> list[_Event]:
    """Op events of ``module`` with their self time (nested events on one thread line,
    a loop's body inside its while, are subtracted from their parent).

    Host plane (XLA:CPU): events carrying ``hlo_op`` of ``module``; the execution is the
    event's ``run_id``. Device planes (GPU, TPU): the "XLA Ops" line; the execution is the
    "XLA Modules" event of ``module`` that contains the op.
    """
    from jax.profiler import ProfileData

    out: list[_Event] = []
    for f in files:
        data = ProfileData.from_file(str(f))
        for p_index, plane in enumerate(data.planes):
            device_plane = plane.name.startswith("/device:") and "CUSTOM" not in plane.name
            if device_plane and not any(ln.name in ("XLA Modules", "XLA Ops")
                                        for ln in plane.lines):
                out += _stream_events(plane, module, p_index)
                continue
            runs = _module_runs(plane, module) if device_plane else []
            for line in plane.lines:
                if device_plane and line.name != "XLA Ops":
                    continue
                stack: list[_Event] = []
                for e in line.events:
                    stats = dict(e.stats)
                    start = float(e.start_ns) * 1e-9
                    if device_plane:
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
                    ev = _Event(name, dev, exe, start, start + float(e.duration_ns) * 1e-9,
                                host=not device_plane)
                    ev.self_time = ev.end - ev.start
                    while stack and stack[-1].end <= ev.start:
                        stack.pop()
                    if stack and ev.end <= stack[-1].end + 1e-12:
                        stack[-1].self_time -= ev.end - ev.start
                        stack[-1].children.append((ev.start, ev.end))
                    stack.append(ev)
                    out.append(ev)
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def _shared_time(events: Sequence[_Event], collective: Sequence[bool], cores: float,
                 available: float) -> tuple[dict[str, float], float, float, float, float]:
    """The host's time of XLA:CPU ops whose devices share ``cores``: ``(seconds per op
    name, idle, host, others, window)`` over the window from the first op to the last,
    with ``sum(per op) + idle + host + others == window``.

    At each instant the running non-collective ops split the ``available`` cores (those
    other processes left) evenly, one op on at most one core, and each op is charged its
    core time / ``cores``: the time it would take with the cores to itself. Cores they
    leave unused go to the collectives in progress, else to ``idle``; ``host`` is time no
    op runs at all; ``others`` the (``cores - available``) / ``cores`` other processes
    took. An op's nested ops (a loop body in its while) are its own, not its parent's.
    """
    segs: list[tuple[float, float, str, bool]] = []
    for ev, coll in zip(events, collective):
        cur = ev.start
        for s, e in sorted(ev.children):
            if s > cur:
                segs.append((cur, s, ev.name, coll))
            cur = max(cur, e)
        if ev.end > cur:
            segs.append((cur, ev.end, ev.name, coll))
    if not segs:
        return {}, 0.0, 0.0, 0.0, 0.0
    starts = np.array([x[0] for x in segs])
    ends = np.array([x[1] for x in segs])
    is_coll = np.array([x[3] for x in segs])
    pts = np.unique(np.concatenate([starts, ends]))
    i0, i1 = np.searchsorted(pts, starts), np.searchsorted(pts, ends)
    running = np.zeros((2, len(pts)))
    for row, mask in ((0, ~is_coll), (1, is_coll)):
        np.add.at(running[row], i0[mask], 1.0)
        np.add.at(running[row], i1[mask], -1.0)
    local, comm = np.cumsum(running, axis=1)[:, :-1].round()
    dt = np.diff(pts)
    used = np.minimum(local, available)
    rate_local = np.where(local > 0, used / np.maximum(local, 1.0), 0.0) / cores
    rate_comm = np.where(comm > 0, (available - used) / np.maximum(comm, 1.0), 0.0) / cores
    idle = float(np.sum(np.where((comm == 0) & (local > 0), (available - used) / cores, 0.0)
                        * dt))
    host = float(np.sum(np.where((comm == 0) & (local == 0), dt * available / cores, 0.0)))
    others = float(np.sum(dt)) * (cores - available) / cores
    cum_local = np.concatenate([[0.0], np.cumsum(rate_local * dt)])
    cum_comm = np.concatenate([[0.0], np.cumsum(rate_comm * dt)])
    share = np.where(is_coll, cum_comm[i1] - cum_comm[i0], cum_local[i1] - cum_local[i0])
    out: dict[str, float] = defaultdict(float)
    for (_, _, name, _), v in zip(segs, share):
        out[name] += float(v)
    return dict(out), idle, host, others, float(pts[-1] - pts[0])


def host_core_ids() -> list[int] | None:
    """The cores this process may run on (its CPU affinity), or None where the OS does not
    say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def host_cores() -> int:
    """How many cores this process may run on, what its simulated devices share."""
    ids = host_core_ids()
    return len(ids) if ids else os.cpu_count() or 1


def _module_name(hlo_text: str) -> str:
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    if m is None:
        raise ValueError("the HLO text has no 'HloModule <name>' header: pass the compiled "
                         "step's compiled.as_text()")
    return m.group(1)


def read_trace(directory: str | Path, *, hlo_text: str, axis_names: Sequence[str],
               axis_sizes: Sequence[int], executions_per_step: int = 1,
               cores: float | None = None, available: float | None = None,
               steps: int | None = None) -> StepProfile:
    """Read the trace under ``directory`` into per-step time by category, collective and op.

    One function of about 100 lines, on purpose: it is one accounting whose terms must add
    up to the step (``step = compute + memory + collectives + other - concurrent + idle +
    host``, see the module docstring), kept together so that identity can be checked by
    reading; the parts that stand alone are helpers (``_events``, ``_shared_time``,
    ``_apportion``).

    Args:
      directory: where ``jax.profiler`` wrote the trace (``Trainer.profile``'s
        ``run_dir/profiles/<step>``).
      hlo_text: the compiled step's ``compiled.as_text()`` (its ops are looked up in it).
      axis_names, axis_sizes: the mesh's axes, for the collectives' axes.
      executions_per_step: executions of the step program per step (gradient
        accumulation runs it once per micro-batch).
      cores: for an XLA:CPU trace, the host cores this process's devices shared
        (default ``host_cores()``; ``profile_step`` divides them among the processes
        running on the host): the ``shared`` accounting. Ignored for device traces.
      available: of ``cores``, those the traced steps had on average: other processes'
        use of them (``workbench.train._profile.HostLoad``) goes to ``shared["others"]``
        (default: all of them).
      steps: the steps traced, when the caller knows them. On a GPU one step can launch
        several CUDA graphs (XLA's command buffers: a scanned model's loop body is one,
        launched once per layer and pass), each a launch of its own in the trace; when the
        launches found are a multiple of ``steps x executions_per_step``, consecutive
        launches are grouped into that many executions (every step launches the same
        sequence). Default: one launch is one execution.

    Raises:
      FileNotFoundError: no ``.xplane.pb`` under ``directory``.
      ValueError: the trace has no execution of the step's module.
    """
    files = trace_files(directory)
    if not files:
        raise FileNotFoundError(f"no jax.profiler trace (plugins/profile/*/*.xplane.pb) under "
                                f"{directory}; capture one with trainer.profile(steps=N)")
    module = _module_name(hlo_text)
    events = _events(files, module)
    if not events:
        raise ValueError(f"the trace in {directory} has no op of module {module!r}: it was "
                         "captured while another program ran, or with another step")
    graph, kinds = _instruction_kinds(hlo_text)
    collectives = parse_collectives(hlo_text, axis_names, axis_sizes)

    by_exe: dict[tuple[int, Any], list[_Event]] = defaultdict(list)
    for ev in events:
        by_exe[(ev.device, ev.execution)].append(ev)
    devices = sorted({d for d, _ in by_exe})
    per_device: dict[int, list[list[_Event]]] = {
        d: sorted((evs for (dd, _), evs in by_exe.items() if dd == d),
                  key=lambda evs: min(e.start for e in evs)) for d in devices}
    want = steps * executions_per_step if steps else None
    for d, runs in per_device.items():   # several graph launches per execution (GPU)
        if want and len(runs) > want and len(runs) % want == 0:
            g = len(runs) // want
            per_device[d] = [[e for r in runs[i * g:(i + 1) * g] for e in r]
                             for i in range(want)]
    n_exec = min(len(v) for v in per_device.values())
    steps = max(1, n_exec // executions_per_step)
    exec_span = sum(max(e.end for e in per_device[d][k]) - min(e.start for e in per_device[d][k])
                    for d in devices for k in range(n_exec)) / len(devices)
    # per device: the first execution's start to the last one's end (the host's gaps
    # between executions inside; the gap after the last one is not seen)
    window = sum(max(e.end for e in per_device[d][n_exec - 1])
                 - min(e.start for e in per_device[d][0]) for d in devices) / len(devices)
    step_s = window / steps
    scale = 1.0 / (len(devices) * steps)

    cats = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    union = 0.0
    for d in devices:
        for evs in per_device[d][:n_exec]:
            union += _union([(e.start, e.end) for e in evs])
            for e in evs:
                cat = kinds.get(e.name, (_kernel_category(e.name), "?"))[0]
                cats[cat] += e.self_time
                per_op[e.name][0] += e.self_time
                per_op[e.name][1] += 1
                per_op[e.name][2] += e.wait
    busy = sum(cats.values())
    cats = {k: v * scale for k, v in cats.items()}
    cats["concurrent"] = max(0.0, busy - union) * scale
    cats["idle"] = max(0.0, exec_span - union / len(devices)) / steps
    cats["host"] = max(0.0, step_s - exec_span / steps)

    ops = []
    waits = {name: w * scale for name, (_, _, w) in per_op.items()}
    for name, (secs, count, _) in per_op.items():
        ins = graph.instructions.get(name)
        cat = kinds.get(name, (_kernel_category(name), "?"))[0]
        ops.append(OpTime(name=name, category=cat,
                          opcode=kinds.get(name, ("", "?"))[1], seconds=secs * scale,
                          count=count * scale, op=re.sub(r"^jit\([^)]*\)/", "", ins.op_name)
                          if ins else "", source=graph.source(ins) if ins else ""))
    ops.sort(key=lambda o: -o.seconds)
    times = {o.name: o for o in ops}

    shared: dict[str, float] = {}
    by_name: dict[str, float] = {}
    shared_step = None
    traced = [e for d in devices for evs in per_device[d][:n_exec] for e in evs]
    if traced and all(e.host for e in traced):   # XLA:CPU: the devices share the cores
        cores = float(cores or host_cores())
        available = min(cores, float(available or cores))
        cat_of = [kinds.get(e.name, ("memory", "?"))[0] for e in traced]
        by_name, idle, gap, others, window = _shared_time(
            traced, [c == "collectives" for c in cat_of], cores, available)
        shared = dict.fromkeys(CATEGORIES, 0.0)
        for name, v in by_name.items():
            shared[kinds.get(name, ("memory", "?"))[0]] += v / steps
        shared["idle"], shared["host"] = idle / steps, gap / steps
        shared["others"] = others / steps
        shared_step = window / steps
    else:
        cores = None

    measured = []
    for c in collectives:
        names = [n for n in c.names] + [n.replace("-start", "-done") for n in c.names
                                        if "-start" in n]
        measured.append(MeasuredCollective(
            collective=c, seconds=sum(times[n].seconds for n in names if n in times),
            events=sum(times[n].count for n in names if n in times),
            wait=sum(waits.get(n, 0.0) for n in names),
            shared=sum(by_name.get(n, 0.0) for n in names) / steps if shared else None))
    unnamed = [o for o in ops if o.category == "collectives" and o.name not in kinds]
    if unnamed:
        measured = _apportion(measured, unnamed)
    return StepProfile(directory=str(directory), files=tuple(str(f) for f in files),
                       module=module, steps=steps, devices=len(devices), step_seconds=step_s,
                       execution_seconds=exec_span / steps, categories=cats,
                       collectives=tuple(measured), ops=tuple(ops), cores=cores,
                       shared=shared, shared_step_seconds=shared_step)
