"""Collectives by formula: what a step's layouts make each device send (FSDP gathers, gradient
reductions, tensor-parallel sums, MoE all-to-alls, ring attention and pipeline permutes).

Used beside the compiled step's collectives, and alone for meshes larger than the machine;
the formulas are in the docstrings."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from workbench._compiled.hlo import Collective, _wire
from workbench._sharding.layouts import Layout
from workbench._sharding.mesh import MeshInfo
from workbench._sharding.rules import Rules
from workbench.models._config import GPTConfig
from workbench.perf._analytic import axes_size, batch_axes, ceil_div, compute_dtype, fsdp_axes

__all__ = ["analytic_collectives", "context_collectives", "moe_collectives", "pipeline_permutes"]


def _merge(records: list[Collective]) -> list[Collective]:
    merged: dict[tuple, Collective] = {}
    for r in records:
        key = (r.kind, r.axes, r.shapes)
        if key in merged:
            old = merged[key]
            r = Collective(kind=r.kind, axes=r.axes, aligned=True, group_size=r.group_size,
                           bytes=r.bytes, wire_bytes=r.wire_bytes, count=old.count + r.count,
                           shapes=r.shapes, names=old.names + r.names)
        merged[key] = r
    return sorted(merged.values(), key=lambda c: -c.total_wire_bytes)


def _record(kind: str, axes: tuple[str, ...], mesh: MeshInfo, nbytes: int, count: int,
            shape: str, why: str) -> Collective:
    n = axes_size(mesh, axes)
    return Collective(kind=kind, axes=axes, aligned=True, group_size=n, bytes=int(nbytes),
                      wire_bytes=_wire(kind, int(nbytes), n), count=count, shapes=(shape,),
                      names=(f"estimate: {why}",))


def _shape_str(dtype: np.dtype, shape: Sequence[int]) -> str:
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32"}
    return f"{short.get(np.dtype(dtype).name, np.dtype(dtype).name)}[{','.join(map(str, shape))}]"


def analytic_collectives(param_layouts: Mapping[str, Layout], rules: Rules, mesh: MeshInfo,
                         cfg: GPTConfig | None, batch: int, seq: int) -> list[Collective]:
    """Collectives one step needs, by formula from the layouts (estimates).

    - weights sharded over a batch axis (FSDP): all-gather before the forward and again
      in the backward (2 per step), reduce-scatter of the gradient (1);
    - weights replicated over a batch axis (DP): all-reduce of the gradient (1);
    - GPT with heads / mlp sharded over a non-batch axis (TP): per layer one all-reduce of
      the (B/batch shards, T, D) activation after attention and one after the MLP, each
      again in the backward pass; a vocab-sharded embedding adds one of each.
    """
    bat = set(batch_axes(rules, mesh))
    out: list[Collective] = []
    for name, lay in param_layouts.items():
        sharded = {a for axes in lay.spec for a in axes}
        fsdp = tuple(a for a in mesh.axis_names if a in fsdp_axes(lay, bat))
        dp = tuple(a for a in mesh.axis_names if a in bat and a not in sharded)
        shard = lay.padded_bytes_per_device
        if fsdp:
            full = shard * axes_size(mesh, fsdp)
            gathered = [s * axes_size(mesh, [a for a in axes if a in fsdp])
                        for s, axes in zip(lay.shard_shape, lay.spec)]
            out.append(_record("all-gather", fsdp, mesh, full, 2,
                               _shape_str(lay.dtype, gathered), f"FSDP gather of {name}"))
            out.append(_record("reduce-scatter", fsdp, mesh, shard, 1,
                               _shape_str(lay.dtype, lay.shard_shape), f"grad of {name}"))
        if dp:
            out.append(_record("all-reduce", dp, mesh, shard, 1,
                               _shape_str(lay.dtype, lay.shard_shape), f"grad of {name}"))
    if cfg is not None:
        tok_shards = axes_size(mesh, batch_axes(rules, mesh))
        act_shape = (max(1, batch // tok_shards), seq, cfg.d_model)
        dt = compute_dtype(cfg, mesh)
        act = int(dt.itemsize * math.prod(act_shape))
        shp = _shape_str(dt, act_shape)
        for logical, what in (("heads", "attention output"), ("mlp", "MLP output")):
            axes = tuple(a for a in rules.axes(logical)
                         if a not in bat and mesh.shape.get(a, 1) > 1)
            if axes:
                out.append(_record("all-reduce", axes, mesh, act, 2 * cfg.n_layers, shp,
                                   f"tensor-parallel {what}, forward and backward"))
        axes = tuple(a for a in rules.axes("vocab")
                     if a not in bat and mesh.shape.get(a, 1) > 1)
        if axes:
            out.append(_record("all-reduce", axes, mesh, act, 2, shp,
                               "vocab-sharded embedding lookup, forward and backward"))
        out += moe_collectives(cfg, rules, mesh, batch, seq)
        out += context_collectives(cfg, rules, mesh, batch, seq)
    return _merge(out)


def moe_collectives(cfg: GPTConfig, rules: Rules, mesh: MeshInfo, batch: int,
                    seq: int) -> list[Collective]:
    """Hand count of the MoE token dispatch's collectives per step (per device).

    With ``G`` tokens per device (batch x seq over the axes that shard them), ``n``
    devices on the expert axes, capacity ``C`` (:func:`workbench.models._moe_choice.capacity`)
    and a compute dtype of ``b`` bytes, per MoE layer:

    - ``all_to_all``: 4 all-to-alls (dispatch and return, forward and backward) of the
      ``(E, C, D)`` buffer, ``E·C·D·b`` bytes each;
    - ``all_gather``: 2 all-gathers of the group's tokens, ``n·G·D·b`` (forward, and the
      backward of the reduce-scatter) and 2 reduce-scatters to ``G·D·b`` (forward, and the
      backward of the gather); the routes' small gathers are left out.

    With grouped matmuls (``moe_matmul="grouped"``) the all-to-alls carry ``n`` blocks of
    ``S = G·min(k, E/n)`` rows instead of the ``(E, C, D)`` buffer, ``n·S·D·b`` bytes,
    and one more per layer (forward only) carries the ``(n, E/n)`` int32 row counts.
    """
    from workbench.models._moe_choice import capacity

    ea = rules.axes("experts", mesh.shape)
    if not cfg.n_experts or not ea:
        return []
    n = axes_size(mesh, ea)
    shards = axes_size(mesh, [a for a in rules.axes("batch") + rules.axes("seq")
                              if a in mesh.shape])
    g, d, e = max(1, batch * seq // shards), cfg.d_model, cfg.n_experts
    dt = compute_dtype(cfg, mesh)
    layers = cfg.n_layers
    if cfg.moe_dispatch == "all_gather":
        return [_record("all-gather", ea, mesh, n * g * d * dt.itemsize, 2 * layers,
                        _shape_str(dt, (n * g, d)), "MoE token all-gather, fwd + bwd"),
                _record("reduce-scatter", ea, mesh, g * d * dt.itemsize, 2 * layers,
                        _shape_str(dt, (g, d)), "MoE output reduce-scatter, fwd + bwd")]
    if cfg.moe_matmul_resolved == "grouped":
        rows = n * g * min(cfg.experts_per_token, e // n)
        return [_record("all-to-all", ea, mesh, rows * d * dt.itemsize, 4 * layers,
                        _shape_str(dt, (n, rows // n, d)),
                        "MoE routed rows (grouped) dispatch + return, fwd + bwd"),
                _record("all-to-all", ea, mesh, n * (e // n) * 4, layers,
                        _shape_str(np.dtype("int32"), (n, e // n)),
                        "MoE rows per expert (grouped), fwd")]
    c = capacity(cfg, g)
    return [_record("all-to-all", ea, mesh, e * c * d * dt.itemsize, 4 * layers,
                    _shape_str(dt, (e, c, d)), "MoE dispatch + return, fwd + bwd")]


def _context_axes(rules: Rules, mesh: MeshInfo, logical: str, ctx: tuple[str, ...]
                  ) -> tuple[str, ...]:
    """Mesh axes (size > 1) of ``logical`` other than the context axes ``ctx``."""
    return tuple(a for a in rules.axes(logical)
                 if a not in ctx and mesh.shape.get(a, 1) > 1)


def _context_block_split(cfg: GPTConfig, rules: Rules, mesh: MeshInfo, batch: int,
                         ctx: tuple[str, ...]) -> tuple[int, int]:
    """``(local batch rows, kv head shards)`` of a K/V block, from the shard_map's specs
    as ``context.attend`` picks them: the batch axes where they divide the batch, the
    heads' axes where they are the kv heads' too, apart from the batch's, and divide
    both head counts."""
    bat = _context_axes(rules, mesh, "batch", ctx)
    if batch % axes_size(mesh, bat):
        bat = ()
    hd = _context_axes(rules, mesh, "heads", ctx)
    heads = axes_size(mesh, hd)
    if hd != _context_axes(rules, mesh, "kv_heads", ctx) or set(hd) & set(bat) \
            or cfg.n_heads % heads or cfg.n_kv_heads % heads:
        heads = 1
    return batch // axes_size(mesh, bat), heads


def context_collectives(cfg: GPTConfig, rules: Rules, mesh: MeshInfo, batch: int,
                        seq: int) -> list[Collective]:
    """Hand count of context parallelism's collectives per step (per device), as
    :mod:`workbench.models._context` issues them (``n`` devices on the context axes, ``L``
    layers, a K/V block ``(B/b, T/n, K/h, H)``: the local batch rows and kv heads).

    - ``ring``: forward, ``n - 1`` ring steps each permuting K and V (``2(n-1)`` per
      layer; causal block skipping and zig-zag change the compute, not the permutes);
      backward, ``n - 1`` steps permuting K/V stacked ``(2, B/b, T/n, K/h, H)`` plus dK
      and dV (float32), then dK and dV home (``n - 1`` stacked, ``2n`` float32 per layer);
      a rematerialised layer (``remat != "none"``) reruns the forward ring in the
      backward (another ``2(n-1)``).
    - ``allgather``: 2 all-gathers of K and V ``(B/b, T, K/h, H)`` per layer (again in the
      backward under remat) and their transposes, 2 reduce-scatters of dK/dV.
    - ``context_zigzag``: the residual stream reordered after the embedding and before
      the output head, 2 permutes of ``(B/b, T/2n, D)`` each, and their transposes in the
      backward: 8 per step (4 with ``n = 2``, where one permute of each keeps its chunks
      home).

    XLA may merge a recomputed permute with the forward's (unscanned layers under a
    remat policy that saves some dots): the compiled count is then lower.
    """
    from workbench.models import _context as context_parallel

    ctx = tuple(a for a in context_parallel.seq_axes(rules, mesh.shape)
                if mesh.shape.get(a, 1) > 1)
    n = axes_size(mesh, ctx)
    if n <= 1:
        return []
    b, heads = _context_block_split(cfg, rules, mesh, batch, ctx)
    dt, f32 = compute_dtype(cfg, mesh), np.dtype(np.float32)
    block = (b, seq // n, cfg.n_kv_heads // heads, cfg.head_dim)
    size = lambda shape, d: int(math.prod(shape)) * d.itemsize
    L, rerun = cfg.n_layers, 2 if cfg.remat != "none" else 1
    out = []
    if cfg.context_attention == "ring":
        stacked = (2, *block)
        out += [_record("collective-permute", ctx, mesh, size(block, dt),
                        2 * (n - 1) * L * rerun, _shape_str(dt, block),
                        "ring attention: K and V blocks, forward"
                        + (" (rerun in the backward by remat)" if rerun > 1 else "")),
                _record("collective-permute", ctx, mesh, size(stacked, dt), (n - 1) * L,
                        _shape_str(dt, stacked), "ring attention: K/V stacked, backward"),
                _record("collective-permute", ctx, mesh, size(block, f32), 2 * n * L,
                        _shape_str(f32, block), "ring attention: dK and dV, backward")]
    else:
        full = (b, seq, *block[2:])
        out += [_record("all-gather", ctx, mesh, size(full, dt), 2 * L * rerun,
                        _shape_str(dt, full), "context all-gather of K and V, forward"
                        + (" (again in the backward by remat)" if rerun > 1 else "")),
                _record("reduce-scatter", ctx, mesh, size(block, dt), 2 * L,
                        _shape_str(dt, block), "context reduce-scatter of dK and dV")]
    if cfg.context_zigzag:
        half = (b, seq // (2 * n), cfg.d_model)
        out.append(_record("collective-permute", ctx, mesh, size(half, dt),
                           2 * _zigzag_permutes(n), _shape_str(dt, half),
                           "zig-zag reorder of the residual stream (2 chunks, to and from "
                           "zig-zag order), forward and backward"))
    return out


def _zigzag_permutes(n: int) -> int:
    """Permutes of the two zig-zag reorders that move data (``context._reorder``'s four
    permutations, less those that keep every chunk home, which XLA drops: with ``n = 2``
    the first half of each shard stays)."""
    home = lambda c: c if c < n else 2 * n - 1 - c       # device of chunk c, zig-zag
    even_src = [e if e % 2 == 0 else 2 * n - 1 - e for e in range(n)]
    odd_src = [2 * n - 1 - e if e % 2 == 0 else e for e in range(n)]
    perms = ([home(2 * d) for d in range(n)], [home(2 * d + 1) for d in range(n)],
             [even_src[d] // 2 for d in range(n)], [odd_src[d] // 2 for d in range(n)])
    return sum(p != list(range(n)) for p in perms)


def pipeline_permutes(cfg: GPTConfig, batch: int, seq: int, rules: Rules, mesh: MeshInfo,
                      iterations: int, microbatches: int) -> list[Collective]:
    """The pipeline's collective permutes (estimate): each loop iteration shifts every
    stage's micro-batch activation ``(batch / M, T, D)`` (its shard) to the next stage,
    forward and again backward: ``2 x iterations`` permutes over the ``stage`` axis."""
    shard = lambda name: axes_size(mesh, [a for a in rules.axes(name) if a in mesh.shape])
    shape = (ceil_div(batch // microbatches, shard("batch")), ceil_div(seq, shard("seq")),
             cfg.d_model)
    dt = compute_dtype(cfg, mesh)
    nbytes = int(np.prod(shape)) * dt.itemsize
    return [_record("collective-permute", ("stage",), mesh, nbytes, 2 * iterations,
                    _shape_str(dt, shape),
                    "pipeline: micro-batch activations to the next stage, forward and backward")]
