"""Layout lints of a plan: each names the tensor, says why it matters with numbers, and a fix."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workbench.perf._attention_cost import kv_bytes_per_device
from workbench._compiled.hlo import Collective, Reshard
from workbench.perf._analytic import (axes_size, batch_axes, fsdp_axes,
                                         weight_axes)
from workbench._sharding.layouts import Layout, format_bytes
from workbench._sharding.mesh import MeshInfo
from workbench._sharding.rules import EXPERT_AXIS_NAMES, Rules

SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lint:
    """One finding about a plan.

    Attributes:
        kind: ``uneven``, ``replicated``, ``redundant_compute``, ``fsdp_gather``,
            ``memory``, ``unmapped``, ``unannotated``, ``reshard`` (a layout conflict the
            compiler resolved by moving data), or for context parallelism
            ``context_uneven``, ``ring_slow_links``, ``context_kv``, or for mixtures of
            experts ``moe_experts_uneven``, ``moe_expert_batch``, ``moe_capacity``, or
            ``compile_retry`` (the TPU compiler failed without an option it then
            compiled with).
        severity: ``error`` (will not run / fit), ``warning`` (wastes memory or compute),
            ``info`` (a cost worth knowing).
        path: the tensor (or mesh axis / logical axis) it is about.
        message: what is wrong, with the numbers.
        fix: what to change.
        value: the key number (bytes or a ratio).
        paths: every tensor it applies to.
    """

    kind: str
    severity: str
    path: str
    message: str
    fix: str
    value: float | None = None
    paths: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"[{self.severity}] {self.kind}: {self.message}\n    fix: {self.fix}"

    def to_dict(self) -> dict:
        """JSON-friendly record."""
        return {**dataclasses.asdict(self), "paths": list(self.paths)}


def _fmt_axes(axes: Sequence[str]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def uneven(layouts: Mapping[str, Layout]) -> list[Lint]:
    """Dimensions not divisible by their mesh axes (XLA pads the edge blocks)."""
    groups: dict[tuple, list[Layout]] = {}
    for lay in layouts.values():
        for d in lay.uneven_dims:
            logical = lay.logical_axes[d] if lay.logical_axes else None
            groups.setdefault((d, lay.shape[d], lay.spec[d], logical), []).append(lay)
    out = []
    for (d, size, axes, logical), lays in groups.items():
        k = axes_size(lays[0].mesh, axes)
        c = -(-size // k)
        filled = -(-size // c)
        if filled < k:
            blocks = f"blocks of {c}: {k - filled} of {k} blocks are empty (pure padding)"
        else:
            blocks = f"blocks of {c}, the last holds {size - c * (k - 1)}"
        waste = sum(lay.padding_waste for lay in lays)
        many = f" (and {len(lays) - 1} more like it)" if len(lays) > 1 else ""
        what = f"logical {logical!r}, " if logical else ""
        target = f"map {logical!r} to None or to an axis whose size divides {size}" if logical \
            else "change the spec of that dim"
        out.append(Lint(
            kind="uneven", severity="warning", path=lays[0].name, value=float(waste),
            paths=tuple(lay.name for lay in lays),
            message=(f"dim {d} of {lays[0].name!r}{many} ({what}size {size}) is not divisible by "
                     f"mesh axes {_fmt_axes(axes)} (size {k}): {blocks}; padding wastes "
                     f"{format_bytes(waste)} over all devices"),
            fix=f"use a size divisible by {k} (e.g. {-(-size // k) * k}), or {target}"))
    return out


def replicated(layouts: Mapping[str, Layout], threshold: int) -> list[Lint]:
    """Parameters of at least ``threshold`` bytes replicated across some mesh axis."""
    groups: dict[tuple[str, ...], list[Layout]] = {}
    for lay in layouts.values():
        if lay.total_bytes < threshold:
            continue
        used = {a for axes in lay.spec for a in axes}
        rep = tuple(a for a, s in lay.mesh.shape.items() if s > 1 and a not in used)
        if rep:
            groups.setdefault(rep, []).append(lay)
    out = []
    for axes, lays in groups.items():
        k = axes_size(lays[0].mesh, axes)
        per_dev = sum(lay.padded_bytes_per_device for lay in lays)
        big = max(lays, key=lambda lay: lay.total_bytes)
        out.append(Lint(
            kind="replicated", severity="warning", path=big.name,
            value=float(per_dev * (k - 1) / k), paths=tuple(lay.name for lay in lays),
            message=(f"{len(lays)} parameter(s) of >= {format_bytes(threshold)} "
                     f"({format_bytes(per_dev)} per device) are replicated over mesh axes "
                     f"{_fmt_axes(axes)}: {k} devices hold identical copies, so "
                     f"{format_bytes(per_dev * (k - 1) / k)} per device is redundant; largest "
                     f"{big.name!r} ({format_bytes(big.total_bytes)})"),
            fix=(f"shard them over {_fmt_axes(axes)}: map 'embed' to {_fmt_axes(axes)} (FSDP, "
                 f"Rules.preset('fsdp' or 'fsdp_tp')) or heads/mlp/vocab to it (tensor "
                 f"parallel); raise replicated_threshold= to accept it")))
    return out


def redundant_compute(rules: Rules, mesh: MeshInfo,
                      param_layouts: Mapping[str, Layout]) -> list[Lint]:
    """Mesh axes that split neither the batch nor any weight: their devices repeat work."""
    used = set(batch_axes(rules, mesh)) | weight_axes(param_layouts)
    idle = [a for a, s in mesh.shape.items() if s > 1 and a not in used]
    if not idle:
        return []
    k = axes_size(mesh, idle)
    batch_now = rules.axes("batch")
    suggestion = tuple(batch_now) + tuple(idle)
    return [Lint(
        kind="redundant_compute", severity="warning", path=", ".join(idle), value=1.0 / k,
        message=(f"the batch is not sharded over mesh axes {_fmt_axes(idle)} ({k} devices) and "
                 f"no weight is sharded over them: those devices compute identical results; "
                 f"replicated compute factor 1/{k} = {1 / k:.3g}, so {1 - 1 / k:.0%} of the "
                 f"mesh's FLOPs repeat other devices' work"),
        fix=(f"add them to the batch rule (batch={_fmt_axes(suggestion)}), shard weights over "
             f"them (tensor parallel: heads/mlp='{idle[0]}'), or build a smaller mesh"))]


def fsdp_gathers(param_layouts: Mapping[str, Layout], rules: Rules, mesh: MeshInfo,
                 collectives: Sequence[Collective], compiled: bool) -> list[Lint]:
    """Weights sharded over a batch axis are all-gathered every step (FSDP): report bytes."""
    bat = set(batch_axes(rules, mesh))
    lays = [lay for lay in param_layouts.values() if fsdp_axes(lay, bat)]
    if not lays:
        return []
    axes = tuple(a for a in mesh.axis_names
                 if a in bat and any(a in fsdp_axes(lay, bat) for lay in lays))
    gathers = [c for c in collectives if c.kind == "all-gather" and set(c.axes) & set(axes)]
    received = sum(c.total_wire_bytes for c in gathers)
    n = sum(c.count for c in gathers)
    full = sum(lay.total_bytes for lay in lays)
    big = max(lays, key=lambda lay: lay.total_bytes)
    src = "compiled step" if compiled else "estimate"
    if compiled and not gathers:
        # XLA may keep the weights sharded and move activations instead (all-reduce or
        # reduce-scatter of partial products): say so rather than report "0 all-gathers".
        return [Lint(
            kind="fsdp_gather", severity="info", path=big.name, value=0.0,
            paths=tuple(lay.name for lay in lays),
            message=(f"{len(lays)} weight(s) ({format_bytes(full)} in total) are sharded over "
                     f"batch axes {_fmt_axes(axes)} (FSDP), but the compiled step gathers none "
                     "of them: XLA computes with the sharded weights and communicates "
                     "activations instead (see the collectives table)"),
            fix=("nothing to fix; with a larger batch per device XLA usually switches to "
                 "gathering the weights"))]
    return [Lint(
        kind="fsdp_gather", severity="info", path=big.name, value=float(received),
        paths=tuple(lay.name for lay in lays),
        message=(f"{len(lays)} weight(s) ({format_bytes(full)} in total) are sharded over batch "
                 f"axes {_fmt_axes(axes)} (FSDP) and gathered every step: {n} all-gather(s), "
                 f"{format_bytes(received)} received per device per step ({src}); largest "
                 f"{big.name!r}"),
        fix=("expected with FSDP; if communication dominates, raise the batch per device, or "
             "shard weights over fewer devices (FSDP inside a host or slice, data parallel "
             "across them)"))]


def over_memory(memory: Mapping[str, int | None], source: str, *,
                chunk_savings: Mapping[int, int] | None = None) -> list[Lint]:
    """Total bytes per device above the device's memory. ``chunk_savings``: for a GPT whose
    loss is not chunked, ``{loss_chunks: estimated bytes per device it saves}``
    (``analytic.temp_breakdown``); the fix names the smallest value that saves the
    excess, or the best one when it saves at least a quarter of it."""
    total, limit = memory.get("total"), memory.get("limit")
    if not total or not limit or total <= limit:
        return []
    chunk_fix = ""
    over = total - limit
    if chunk_savings:
        k = next((k for k, v in sorted(chunk_savings.items()) if v >= over), None)
        if k is None:
            k = max(chunk_savings, key=lambda c: (chunk_savings[c], -c))
        if chunk_savings[k] >= 0.25 * over:
            chunk_fix = (f"; GPTConfig(loss_chunks={k}) computes the loss over {k} slices "
                         f"of the sequence, holding 1/{k} of the float32 logits at a time: "
                         f"about {format_bytes(chunk_savings[k])} less per device")
    cats = {k: int(memory.get(k) or 0) for k in ("params", "optimizer", "gradients",
                                                   "activations", "batch")}
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in cats.items() if v)
    largest = max(cats, key=cats.get)
    return [Lint(
        kind="memory", severity="error", path="<device>", value=float(total - limit),
        message=(f"needs {format_bytes(total)} per device ({source}) but a device has "
                 f"{format_bytes(limit)}: {format_bytes(total - limit)} over "
                 f"({total / limit:.2f}x); largest: {largest} {format_bytes(cats[largest])} "
                 f"({parts})"),
        fix=("shard weights and optimizer state over more devices (fsdp / fsdp_tp), use "
             "remat='full', a smaller batch per device, or bfloat16 parameters" + chunk_fix))]


def unmapped(unmapped_names: Mapping[str, Sequence[str]]) -> list[Lint]:
    """Logical axes the rules do not mention (the plan replicated those dims)."""
    out = []
    for logical, tensors in sorted(unmapped_names.items()):
        out.append(Lint(
            kind="unmapped", severity="warning", path=logical, value=float(len(tensors)),
            paths=tuple(tensors),
            message=(f"logical axis {logical!r} has no rule: {len(tensors)} tensor(s) such as "
                     f"{tensors[0]!r} were planned with that dim replicated on every device"),
            fix=(f"add {logical}=<mesh axis> to the Rules to shard it, or {logical}=None to "
                 f"replicate it on purpose")))
    return out


def _crosses_slow_links(mesh: MeshInfo, axis: str) -> str | None:
    """Why ``axis`` spans slow links (DCN between slices, or several hosts), else None."""
    i = mesh.axis_names.index(axis)
    if mesh.dcn_axis_sizes and mesh.dcn_axis_sizes[i] > 1:
        return f"it spans {mesh.dcn_axis_sizes[i]} slices over DCN"
    procs = mesh.process_index
    if procs is not None and mesh.n_hosts > 1:
        rows = np.moveaxis(np.asarray(procs), i, -1).reshape(-1, mesh.axis_sizes[i])
        if any(len(set(r.tolist())) > 1 for r in rows):
            return "its devices sit on different hosts (processes), joined by the network"
    return None


def context_parallel(cfg: Any, rules: Rules, mesh: MeshInfo, seq: int,
                     batch: int) -> list[Lint]:
    """Context parallelism (``seq`` sharded over mesh axes): a sequence the context axes do
    not divide (error), ring attention over slow links (warning), and the K/V bytes each
    device receives per layer (info; hand count of :mod:`workbench.perf._attention_cost`)."""
    axes = rules.axes("seq", mesh.shape)
    if not axes:
        return []
    n = axes_size(mesh, axes)
    zigzag = bool(getattr(cfg, "context_zigzag", False))
    variant = getattr(cfg, "context_attention", "allgather")
    parts = n * (2 if zigzag else 1)
    path = _fmt_axes(axes)
    if seq % parts:
        ok = max(parts, seq - seq % parts)
        return [Lint(
            kind="context_uneven", severity="error", path=path, value=float(seq % parts),
            message=(f"sequence length {seq} is not divisible by the context axis {path} of "
                     f"size {n}" + (f" (x2 zig-zag chunks = {parts})" if zigzag else "")
                     + ": every device must hold an equal slice of each sequence"),
            fix=(f"use seq={ok} or {ok + parts}, a context axis that divides {seq}"
                 + (", or context_zigzag=False" if zigzag and seq % n == 0 else "")))]
    out = []
    slow = [(a, why) for a in axes if (why := _crosses_slow_links(mesh, a))]
    if variant == "ring" and slow:
        a, why = slow[0]
        out.append(Lint(
            kind="ring_slow_links", severity="warning", path=a, value=float(n - 1),
            message=(f"ring attention passes K/V blocks around context axis {a!r} in {n - 1} "
                     f"dependent collective permutes per layer (and {n} more in the backward "
                     f"pass), but {why}: each step waits on the slowest link"),
            fix=(f"put the context axis inside a slice/host (mesh axis order: make {a!r} "
                 f"minor, data/fsdp over DCN), or use context_attention='allgather' (one "
                 "collective per layer)")))
    if cfg is not None and hasattr(cfg, "n_kv_heads"):
        bsh = axes_size(mesh, [a for a in rules.axes("batch")
                               if mesh.shape.get(a, 1) > 1 and a not in axes])
        hsh = axes_size(mesh, [a for a in rules.axes("kv_heads")
                               if mesh.shape.get(a, 1) > 1])
        kv = kv_bytes_per_device(
            batch=batch, seq=seq, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
            itemsize=int(np.dtype(cfg.compute_dtype(mesh.platform)).itemsize), size=n,
            variant=variant,
            batch_shards=bsh if batch % bsh == 0 else 1,
            head_shards=hsh if cfg.n_kv_heads % hsh == 0 else 1)
        how = ("all-gathered: every device holds the whole sequence's K/V"
               if variant == "allgather" else
               "ring: a device holds its own K/V block and the one in flight")
        out.append(Lint(
            kind="context_kv", severity="info", path=path, value=float(kv["received"]),
            message=(f"context parallelism over {path} ({n} devices, {variant}"
                     + (", zig-zag" if zigzag else "") + f"): per layer each device receives "
                     f"{format_bytes(kv['received'])} of K/V in the forward pass ({n - 1} "
                     f"blocks of {format_bytes(kv['block'])}) and holds "
                     f"{format_bytes(kv['held'])} ({how})"),
            fix=("nothing to fix" if variant == "ring" or zigzag else
                 "for long sequences, context_attention='ring' holds 2 blocks instead of "
                 f"{n}; context_zigzag=True balances causal work")))
    return out


def moe(cfg: Any, rules: Rules, mesh: MeshInfo, batch: int, seq: int) -> list[Lint]:
    """Mixture-of-experts layouts: experts the expert axes do not divide (error), an expert
    axis that shards the experts but not the tokens, or the tokens but not the experts
    (warnings), and capacity overflow: a capacity below the balanced share drops tokens
    even when routing is perfectly balanced (warning), else how much imbalance it absorbs
    (info). Hand counts of :mod:`workbench.models._moe`."""
    from workbench.models._moe import capacity

    if cfg is None or not getattr(cfg, "n_experts", 0):
        return []
    e, k = cfg.n_experts, cfg.experts_per_token
    ea = tuple(a for a in rules.axes("experts") if a in mesh.shape)
    n = axes_size(mesh, ea)
    if e % n:
        fits = [d for d in range(1, e + 1) if e % d == 0 and d <= math.prod(mesh.axis_sizes)]
        return [Lint(
            kind="moe_experts_uneven", severity="error", path=_fmt_axes(ea), value=float(e % n),
            message=(f"n_experts={e} is not divisible by the expert mesh axes {_fmt_axes(ea)} "
                     f"(size {n}): each device must hold a whole number of experts"),
            fix=f"use an expert axis of size in {fits}, or n_experts a multiple of {n}")]
    out = []
    tokens = set(batch_axes(rules, mesh))
    big = tuple(a for a in ea if mesh.shape[a] > 1)
    lost = [a for a in big if a not in tokens]
    if lost:
        out.append(Lint(
            kind="moe_expert_batch", severity="warning", path=_fmt_axes(lost),
            value=float(axes_size(mesh, lost)),
            message=(f"the experts are sharded over {_fmt_axes(lost)} but the batch is not: "
                     f"the {axes_size(mesh, lost)} devices along it hold the same tokens, so "
                     f"attention and the router repeat the same work and the all-to-all "
                     f"moves duplicate tokens"),
            fix=(f"add {_fmt_axes(lost)} to the batch rule (Rules.preset('ep' or "
                 f"'fsdp_ep') does)")))
    idle = [a for a in rules.axes("batch") if a in EXPERT_AXIS_NAMES and
            mesh.shape.get(a, 1) > 1 and a not in ea]
    if idle:
        out.append(Lint(
            kind="moe_expert_batch", severity="warning", path=_fmt_axes(idle),
            value=float(axes_size(mesh, idle)),
            message=(f"mesh axis {_fmt_axes(idle)} shards the batch but not the experts: every "
                     f"device along it holds all {e} experts ({cfg.n_params / 1e9:.3g}B "
                     f"parameters in all), acting as plain data parallelism"),
            fix=f"map experts={idle[0]!r} (Rules.preset('ep' or 'fsdp_ep'))"))
    shards = axes_size(mesh, [a for a in rules.axes("batch") + rules.axes("seq")
                              if a in mesh.shape])
    group = max(1, batch * seq // max(1, shards))
    if cfg.moe_dispatch == "all_gather" and ea:
        group *= n
    if cfg.capacity_factor is not None:
        cap = capacity(cfg, group)
        share = group * k / e
        if cap < share:
            out.append(Lint(
                kind="moe_capacity", severity="warning", path="capacity_factor",
                value=float(1 - cap / share),
                message=(f"capacity {cap} slots per expert for groups of {group} tokens is "
                         f"below the balanced share {share:.1f} (capacity_factor="
                         f"{cfg.capacity_factor}): at least {1 - cap / share:.0%} of the "
                         f"assignments are dropped even with perfectly balanced routing"),
                fix="raise capacity_factor to >= 1 (1.25 is common), or None for dropless"))
        else:
            out.append(Lint(
                kind="moe_capacity", severity="info", path="capacity_factor",
                value=float(cap / share),
                message=(f"capacity {cap} slots per expert per group of {group} tokens "
                         f"({cap / share:.2f}x the balanced share {share:.1f}): an expert "
                         f"drops what it receives beyond that (see moe_dropped in the "
                         f"metrics)"),
                fix="capacity_factor=None routes dropless (more memory, no drops)"))
    return out


def unannotated(logical: Mapping[str, Sequence[str | None]],
                param_layouts: Mapping[str, Layout]) -> list[Lint]:
    """A model none of whose parameters carries a sharding annotation: all replicated."""
    params = {k[len("params."):] if k.startswith("params.") else k: v
              for k, v in logical.items() if k.startswith("params.")}
    if not param_layouts or any(a is not None for axes in params.values() for a in axes):
        return []
    lays = list(param_layouts.values())
    total = sum(lay.total_bytes for lay in lays)
    n = lays[0].mesh.size
    big = max(lays, key=lambda lay: lay.total_bytes)
    return [Lint(
        kind="unannotated", severity="warning", path=big.name, value=float(total),
        paths=tuple(lay.name for lay in lays),
        message=(f"no parameter of this model carries a sharding annotation: all "
                 f"{len(lays)} parameter(s) ({format_bytes(total)}) are replicated on each of "
                 f"the {n} devices, and their gradients are all-reduced every step; largest "
                 f"{big.name!r}"),
        fix=("annotate parameters with mesh or logical axes: nnx.Linear(..., kernel_init="
             "nnx.with_partitioning(init, (None, 'model'))) or nnx.Param(value, "
             "out_sharding=('embed', 'mlp')) with wb.Rules for the logical names"))]


def reshards(found: Sequence[Reshard], *, most: int = 6) -> list[Lint]:
    """Layout conflicts the compiler resolved by moving an activation between two ops:
    one lint per pair of source lines (producer, consumer), the ``most`` that move the
    most bytes, then one lint counting the rest."""
    groups: dict[tuple[str, str], list[Reshard]] = {}
    for r in found:
        groups.setdefault((r.producer_source or r.producer, r.consumer_source or r.consumer),
                          []).append(r)
    ranked = sorted(groups.values(), key=lambda rs: -sum(r.bytes for r in rs))
    out = []
    for rs in ranked[:most]:
        first = rs[0]
        kinds = ", ".join(sorted({f"{r.kind} over {'+'.join(r.axes) or '-'}" for r in rs}))
        moved = sum(r.bytes for r in rs)
        out.append(Lint(
            kind="reshard", severity="info", path=first.consumer_source or first.consumer,
            value=float(moved), paths=tuple(r.name for r in rs),
            message=(f"the compiler reshards {first.shape} between {first.producer!r} "
                     f"({first.producer_source or 'no source line'}) and {first.consumer!r} "
                     f"({first.consumer_source or 'no source line'}): {len(rs)} {kinds} "
                     f"({format_bytes(moved)} per device) inserted because the two ops want "
                     "different layouts"),
            fix=("constrain the tensor between them to the layout the consumer wants "
                 "(wb.models.constrain / jax.lax.with_sharding_constraint), or change the "
                 "rule that shards one of them differently")))
    rest = ranked[most:]
    if rest:
        n = sum(len(rs) for rs in rest)
        out.append(Lint(
            kind="reshard", severity="info", path="<more reshards>",
            value=float(sum(r.bytes for rs in rest for r in rs)),
            paths=tuple(r.name for rs in rest for r in rs),
            message=(f"{n} more reshard(s) between {len(rest)} other pair(s) of source lines, "
                     f"{format_bytes(sum(r.bytes for rs in rest for r in rs))} per device in "
                     "all (plan.reshards lists every one)"),
            fix="constrain the model's activations to the layouts their consumers want"))
    return out


def compile_retry(retried: str, options: Mapping[str, Any]) -> list[Lint]:
    """An info lint when the step compiled only with an option that avoids a compiler
    failure (``flags.RETRY_FLAGS``): ``retried`` says which and after what."""
    if not retried:
        return []
    return [Lint(kind="compile_retry", severity="info", path="compiler_options",
                 message=retried,
                 fix=f"nothing to do for the plan; a run of this step on TPU needs the same "
                     f"options ({dict(options)!r}: jax.jit's compiler_options, or "
                     "--name=value flags in LIBTPU_INIT_ARGS), or a smaller step (fewer "
                     "tokens per device, a capacity_factor)")]
