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
idle, and what other processes took is "others" (``workbench.train._host_load.HostLoad``).

One accounting, one file: the record types (``OpTime``, ``MeasuredCollective``,
``StepProfile``) and ``read_trace``'s terms that add up to the step; the trace's events are
``_trace_events``, the shared cores ``_shared_cores``.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench._compiled.graph import HloGraph
from workbench._compiled.hlo import KINDS, Collective, parse_collectives
from workbench.perf._shared_cores import host_cores, shared_time
from workbench.perf._trace_events import OpEvent, op_events

__all__ = ["MeasuredCollective", "OpTime", "StepProfile", "read_trace", "trace_files"]

CATEGORIES = ("compute", "memory", "collectives", "other")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_MATMUL_TARGET = re.compile(r"gemm|matmul|cublas|dot|conv", re.I)
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


def _module_name(hlo_text: str) -> str:
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    if m is None:
        raise ValueError("the HLO text has no 'HloModule <name>' header: pass the compiled "
                         "step's compiled.as_text()")
    return m.group(1)


def _executions(events: Sequence[OpEvent], steps: int | None,
                executions_per_step: int) -> dict[int, list[list[OpEvent]]]:
    """Per device, its executions of the program (each a list of events) in time order;
    on a GPU, consecutive graph launches grouped into ``steps x executions_per_step``
    executions when the launches found are a multiple of that (see :func:`read_trace`)."""
    by_exe: dict[tuple[int, Any], list[OpEvent]] = defaultdict(list)
    for ev in events:
        by_exe[(ev.device, ev.execution)].append(ev)
    devices = sorted({d for d, _ in by_exe})
    per_device: dict[int, list[list[OpEvent]]] = {
        d: sorted((evs for (dd, _), evs in by_exe.items() if dd == d),
                  key=lambda evs: min(e.start for e in evs)) for d in devices}
    want = steps * executions_per_step if steps else None
    for d, runs in per_device.items():   # several graph launches per execution (GPU)
        if want and len(runs) > want and len(runs) % want == 0:
            g = len(runs) // want
            per_device[d] = [[e for r in runs[i * g:(i + 1) * g] for e in r]
                             for i in range(want)]
    return per_device


def _tally(runs: Sequence[Sequence[OpEvent]], kinds: dict[str, tuple[str, str]]
           ) -> tuple[dict[str, float], dict[str, list[float]], float]:
    """``(self seconds per category, [self seconds, events, wait] per op name, covered
    seconds)`` summed over the executions ``runs`` (covered: the union of each one's op
    intervals)."""
    cats = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    union = 0.0
    for evs in runs:
        union += _union([(e.start, e.end) for e in evs])
        for e in evs:
            cats[kinds.get(e.name, (_kernel_category(e.name), "?"))[0]] += e.self_time
            per_op[e.name][0] += e.self_time
            per_op[e.name][1] += 1
            per_op[e.name][2] += e.wait
    return cats, per_op, union


def _op_times(per_op: dict[str, list[float]], kinds: dict[str, tuple[str, str]],
              graph: HloGraph, scale: float) -> list[OpTime]:
    """Each op's time per device and step (``scale``), slowest first, with its JAX op and
    source line from the HLO metadata."""
    ops = []
    for name, (secs, count, _) in per_op.items():
        ins = graph.instructions.get(name)
        ops.append(OpTime(name=name, category=kinds.get(name, (_kernel_category(name), "?"))[0],
                          opcode=kinds.get(name, ("", "?"))[1], seconds=secs * scale,
                          count=count * scale, op=re.sub(r"^jit\([^)]*\)/", "", ins.op_name)
                          if ins else "", source=graph.source(ins) if ins else ""))
    return sorted(ops, key=lambda o: -o.seconds)


def _shared(traced: Sequence[OpEvent], kinds: dict[str, tuple[str, str]], cores: float,
            available: float | None, steps: int
            ) -> tuple[dict[str, float], dict[str, float], float]:
    """XLA:CPU's host accounting (``StepProfile.shared``): ``(seconds per category and
    idle/host/others per step, seconds per op name, step seconds)`` (:func:`shared_time`)."""
    available = min(cores, float(available or cores))
    cat_of = [kinds.get(e.name, ("memory", "?"))[0] for e in traced]
    by_name, idle, gap, others, window = shared_time(
        traced, [c == "collectives" for c in cat_of], cores, available)
    shared = dict.fromkeys(CATEGORIES, 0.0)
    for name, v in by_name.items():
        shared[kinds.get(name, ("memory", "?"))[0]] += v / steps
    shared["idle"], shared["host"] = idle / steps, gap / steps
    shared["others"] = others / steps
    return shared, by_name, window / steps


def _measured(collectives: Sequence[Collective], ops: Sequence[OpTime],
              waits: dict[str, float], kinds: dict[str, tuple[str, str]],
              by_name: dict[str, float] | None, steps: int) -> list[MeasuredCollective]:
    """Each compiled collective with the time of its events (start and done); collective
    kernels no HLO instruction names are apportioned among them (:func:`_apportion`)."""
    times = {o.name: o for o in ops}
    measured = []
    for c in collectives:
        names = [n for n in c.names] + [n.replace("-start", "-done") for n in c.names
                                        if "-start" in n]
        measured.append(MeasuredCollective(
            collective=c, seconds=sum(times[n].seconds for n in names if n in times),
            events=sum(times[n].count for n in names if n in times),
            wait=sum(waits.get(n, 0.0) for n in names),
            shared=sum(by_name.get(n, 0.0) for n in names) / steps
            if by_name is not None else None))
    unnamed = [o for o in ops if o.category == "collectives" and o.name not in kinds]
    return _apportion(measured, unnamed) if unnamed else measured


def read_trace(directory: str | Path, *, hlo_text: str, axis_names: Sequence[str],
               axis_sizes: Sequence[int], executions_per_step: int = 1,
               cores: float | None = None, available: float | None = None,
               steps: int | None = None) -> StepProfile:
    """Read the trace under ``directory`` into per-step time by category, collective and op.

    The accounting whose terms add up to the step (``step = compute + memory + collectives
    + other - concurrent + idle + host``, see the module docstring) is this function's, so
    that identity can be checked by reading; the parts that stand alone are helpers
    (``_executions``, ``_tally``, ``_op_times``, ``_shared``, ``_measured``).

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
        use of them (``workbench.train._host_load.HostLoad``) goes to ``shared["others"]``
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
    events = op_events(files, module)
    if not events:
        raise ValueError(f"the trace in {directory} has no op of module {module!r}: it was "
                         "captured while another program ran, or with another step")
    graph, kinds = _instruction_kinds(hlo_text)
    per_device = _executions(events, steps, executions_per_step)
    devices = sorted(per_device)
    n_exec = min(len(v) for v in per_device.values())
    steps = max(1, n_exec // executions_per_step)
    runs = [evs for d in devices for evs in per_device[d][:n_exec]]
    exec_span = sum(max(e.end for e in evs) - min(e.start for e in evs)
                    for evs in runs) / len(devices)
    # per device: the first execution's start to the last one's end (the host's gaps
    # between executions inside; the gap after the last one is not seen)
    window = sum(max(e.end for e in per_device[d][n_exec - 1])
                 - min(e.start for e in per_device[d][0]) for d in devices) / len(devices)
    step_s = window / steps
    scale = 1.0 / (len(devices) * steps)

    cats, per_op, union = _tally(runs, kinds)
    busy = sum(cats.values())
    cats = {k: v * scale for k, v in cats.items()}
    cats["concurrent"] = max(0.0, busy - union) * scale
    cats["idle"] = max(0.0, exec_span - union / len(devices)) / steps
    cats["host"] = max(0.0, step_s - exec_span / steps)
    ops = _op_times(per_op, kinds, graph, scale)

    traced = [e for evs in runs for e in evs]
    shared: dict[str, float] = {}
    by_name, shared_step = None, None
    if traced and all(e.host for e in traced):   # XLA:CPU: the devices share the cores
        cores = float(cores or host_cores())
        shared, by_name, shared_step = _shared(traced, kinds, cores, available, steps)
    else:
        cores = None
    waits = {name: w * scale for name, (_, _, w) in per_op.items()}
    measured = _measured(parse_collectives(hlo_text, axis_names, axis_sizes), ops, waits,
                         kinds, by_name, steps)
    return StepProfile(directory=str(directory), files=tuple(str(f) for f in files),
                       module=module, steps=steps, devices=len(devices), step_seconds=step_s,
                       execution_seconds=exec_span / steps, categories=cats,
                       collectives=tuple(measured), ops=tuple(ops), cores=cores,
                       shared=shared, shared_step_seconds=shared_step)
