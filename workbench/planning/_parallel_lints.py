"""The lints of a model's own parallelism, known before anything is traced: context
parallelism (the sequence sharded over mesh axes) and mixtures of experts (the experts
sharded), decided by the config, the rules and the mesh alone. ``wb.plan`` gathers them
first (``StepInputs.early_lints``): on real devices an error among them raises before the
step is built. The lints of the built step are in ``planning._lints``."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from workbench.perf._analytic import axes_size, batch_axes
from workbench.perf._attention_cost import kv_bytes_per_device
from workbench._sharding.layouts import format_bytes
from workbench._sharding.mesh import MeshInfo
from workbench._sharding.rules import EXPERT_AXIS_NAMES, Rules
from workbench.planning._lints import Lint, axes_text

__all__ = ["context_parallel", "moe"]


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
    path = axes_text(axes)
    if seq % parts:
        ok = max(parts, seq - seq % parts)
        return [Lint(
            kind="context_uneven", severity="error", path=path, value=float(seq % parts),
            message=(f"sequence length {seq} is not divisible by the context axis {path} of "
                     f"size {n}" + (f" (x2 zig-zag chunks = {parts})" if zigzag else "")
                     + ": every device must hold an equal slice of each sequence"),
            fix=(f"use seq={ok} or {ok + parts}, a context axis that divides {seq}"
                 + (", or context_zigzag=False" if zigzag and seq % n == 0 else "")))]
    slow = [(a, why) for a in axes if (why := _crosses_slow_links(mesh, a))]
    out = _ring_over_slow_links(slow, n) if variant == "ring" else []
    if cfg is not None and hasattr(cfg, "n_kv_heads"):
        out.append(_context_kv(cfg, rules, mesh, axes, batch=batch, seq=seq))
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


def _ring_over_slow_links(slow: list[tuple[str, str]], n: int) -> list[Lint]:
    """A warning when ring attention's context axis crosses slow links (``slow``: each
    such axis and why)."""
    if not slow:
        return []
    a, why = slow[0]
    return [Lint(
        kind="ring_slow_links", severity="warning", path=a, value=float(n - 1),
        message=(f"ring attention passes K/V blocks around context axis {a!r} in {n - 1} "
                 f"dependent collective permutes per layer (and {n} more in the backward "
                 f"pass), but {why}: each step waits on the slowest link"),
        fix=(f"put the context axis inside a slice/host (mesh axis order: make {a!r} "
             f"minor, data/fsdp over DCN), or use context_attention='allgather' (one "
             "collective per layer)"))]


def _context_kv(cfg: Any, rules: Rules, mesh: MeshInfo, axes: tuple[str, ...], *,
                batch: int, seq: int) -> Lint:
    """The K/V bytes each device receives and holds per layer under context parallelism
    over ``axes`` (info)."""
    n, path = axes_size(mesh, axes), axes_text(axes)
    zigzag = bool(getattr(cfg, "context_zigzag", False))
    variant = getattr(cfg, "context_attention", "allgather")
    bsh = axes_size(mesh, [a for a in rules.axes("batch")
                           if mesh.shape.get(a, 1) > 1 and a not in axes])
    hsh = axes_size(mesh, [a for a in rules.axes("kv_heads") if mesh.shape.get(a, 1) > 1])
    kv = kv_bytes_per_device(
        batch=batch, seq=seq, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        itemsize=int(np.dtype(cfg.compute_dtype(mesh.platform)).itemsize), size=n,
        variant=variant, batch_shards=bsh if batch % bsh == 0 else 1,
        head_shards=hsh if cfg.n_kv_heads % hsh == 0 else 1)
    how = ("all-gathered: every device holds the whole sequence's K/V"
           if variant == "allgather" else
           "ring: a device holds its own K/V block and the one in flight")
    return Lint(
        kind="context_kv", severity="info", path=path, value=float(kv["received"]),
        message=(f"context parallelism over {path} ({n} devices, {variant}"
                 + (", zig-zag" if zigzag else "") + f"): per layer each device receives "
                 f"{format_bytes(kv['received'])} of K/V in the forward pass ({n - 1} "
                 f"blocks of {format_bytes(kv['block'])}) and holds "
                 f"{format_bytes(kv['held'])} ({how})"),
        fix=("nothing to fix" if variant == "ring" or zigzag else
             "for long sequences, context_attention='ring' holds 2 blocks instead of "
             f"{n}; context_zigzag=True balances causal work"))


def moe(cfg: Any, rules: Rules, mesh: MeshInfo, batch: int, seq: int) -> list[Lint]:
    """Mixture-of-experts layouts: experts the expert axes do not divide (error), an expert
    axis that shards the experts but not the tokens, or the tokens but not the experts
    (warnings), and capacity overflow: a capacity below the balanced share drops tokens
    even when routing is perfectly balanced (warning), else how much imbalance it absorbs
    (info). Hand counts of :mod:`workbench.models._moe`."""
    if cfg is None or not getattr(cfg, "n_experts", 0):
        return []
    e = cfg.n_experts
    ea = tuple(a for a in rules.axes("experts") if a in mesh.shape)
    n = axes_size(mesh, ea)
    if e % n:
        fits = [d for d in range(1, e + 1) if e % d == 0 and d <= math.prod(mesh.axis_sizes)]
        return [Lint(
            kind="moe_experts_uneven", severity="error", path=axes_text(ea), value=float(e % n),
            message=(f"n_experts={e} is not divisible by the expert mesh axes {axes_text(ea)} "
                     f"(size {n}): each device must hold a whole number of experts"),
            fix=f"use an expert axis of size in {fits}, or n_experts a multiple of {n}")]
    out = _experts_vs_batch(cfg, rules, mesh, ea)
    if cfg.capacity_factor is not None:
        shards = axes_size(mesh, [a for a in rules.axes("batch") + rules.axes("seq")
                                  if a in mesh.shape])
        group = max(1, batch * seq // max(1, shards))
        if cfg.moe_dispatch == "all_gather" and ea:
            group *= n
        out.append(_capacity(cfg, group))
    return out


def _experts_vs_batch(cfg: Any, rules: Rules, mesh: MeshInfo,
                      ea: tuple[str, ...]) -> list[Lint]:
    """Warnings for an expert axis ``ea`` that shards the experts but not the batch, and a
    batch axis named like an expert axis that shards the tokens but not the experts."""
    out = []
    tokens = set(batch_axes(rules, mesh))
    lost = [a for a in ea if mesh.shape[a] > 1 and a not in tokens]
    if lost:
        out.append(Lint(
            kind="moe_expert_batch", severity="warning", path=axes_text(lost),
            value=float(axes_size(mesh, lost)),
            message=(f"the experts are sharded over {axes_text(lost)} but the batch is not: "
                     f"the {axes_size(mesh, lost)} devices along it hold the same tokens, so "
                     f"attention and the router repeat the same work and the all-to-all "
                     f"moves duplicate tokens"),
            fix=(f"add {axes_text(lost)} to the batch rule (Rules.preset('ep' or "
                 f"'fsdp_ep') does)")))
    idle = [a for a in rules.axes("batch") if a in EXPERT_AXIS_NAMES and
            mesh.shape.get(a, 1) > 1 and a not in ea]
    if idle:
        out.append(Lint(
            kind="moe_expert_batch", severity="warning", path=axes_text(idle),
            value=float(axes_size(mesh, idle)),
            message=(f"mesh axis {axes_text(idle)} shards the batch but not the experts: every "
                     f"device along it holds all {cfg.n_experts} experts "
                     f"({cfg.n_params / 1e9:.3g}B parameters in all), acting as plain data "
                     "parallelism"),
            fix=f"map experts={idle[0]!r} (Rules.preset('ep' or 'fsdp_ep'))"))
    return out


def _capacity(cfg: Any, group: int) -> Lint:
    """The expert capacity for routing groups of ``group`` tokens against the balanced
    share: a warning below it (tokens dropped even when balanced), else info."""
    from workbench.models._moe_choice import capacity

    cap = capacity(cfg, group)
    share = group * cfg.experts_per_token / cfg.n_experts
    if cap < share:
        return Lint(
            kind="moe_capacity", severity="warning", path="capacity_factor",
            value=float(1 - cap / share),
            message=(f"capacity {cap} slots per expert for groups of {group} tokens is "
                     f"below the balanced share {share:.1f} (capacity_factor="
                     f"{cfg.capacity_factor}): at least {1 - cap / share:.0%} of the "
                     f"assignments are dropped even with perfectly balanced routing"),
            fix="raise capacity_factor to >= 1 (1.25 is common), or None for dropless")
    return Lint(
        kind="moe_capacity", severity="info", path="capacity_factor",
        value=float(cap / share),
        message=(f"capacity {cap} slots per expert per group of {group} tokens "
                 f"({cap / share:.2f}x the balanced share {share:.1f}): an expert "
                 f"drops what it receives beyond that (see moe_dropped in the "
                 f"metrics)"),
        fix="capacity_factor=None routes dropless (more memory, no drops)")
