"""Layout lints of a plan: each names the tensor, says why it matters with numbers, and a fix.

``Lint`` is the record; the functions here read the step as built and compiled (its
layouts, memory, collectives, reshards). The lints of context parallelism and mixtures of
experts, which the config, rules and mesh decide before anything is traced, are in
``planning._parallel_lints``."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from workbench._compiled.hlo import Collective, Reshard
from workbench.perf._analytic import axes_size, batch_axes, fsdp_axes, weight_axes
from workbench._sharding.layouts import Layout, format_bytes
from workbench._sharding.mesh import MeshInfo
from workbench._sharding.rules import Rules

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


def axes_text(axes: Sequence[str]) -> str:
    """``'data'`` for one mesh axis, ``('data', 'model')`` for several."""
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
                     f"mesh axes {axes_text(axes)} (size {k}): {blocks}; padding wastes "
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
                     f"{axes_text(axes)}: {k} devices hold identical copies, so "
                     f"{format_bytes(per_dev * (k - 1) / k)} per device is redundant; largest "
                     f"{big.name!r} ({format_bytes(big.total_bytes)})"),
            fix=(f"shard them over {axes_text(axes)}: map 'embed' to {axes_text(axes)} (FSDP, "
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
        message=(f"the batch is not sharded over mesh axes {axes_text(idle)} ({k} devices) and "
                 f"no weight is sharded over them: those devices compute identical results; "
                 f"replicated compute factor 1/{k} = {1 / k:.3g}, so {1 - 1 / k:.0%} of the "
                 f"mesh's FLOPs repeat other devices' work"),
        fix=(f"add them to the batch rule (batch={axes_text(suggestion)}), shard weights over "
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
                     f"batch axes {axes_text(axes)} (FSDP), but the compiled step gathers none "
                     "of them: XLA computes with the sharded weights and communicates "
                     "activations instead (see the collectives table)"),
            fix=("nothing to fix; with a larger batch per device XLA usually switches to "
                 "gathering the weights"))]
    return [Lint(
        kind="fsdp_gather", severity="info", path=big.name, value=float(received),
        paths=tuple(lay.name for lay in lays),
        message=(f"{len(lays)} weight(s) ({format_bytes(full)} in total) are sharded over batch "
                 f"axes {axes_text(axes)} (FSDP) and gathered every step: {n} all-gather(s), "
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
