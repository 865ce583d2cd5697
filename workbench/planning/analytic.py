"""Analytic plan estimates: memory per device, compute split and collectives from layouts.

Used beside the compiled numbers, and alone for meshes larger than the machine. Every
number here is an estimate by formula; the formulas are in the docstrings.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from workbench.planning.hlo import Collective, _wire
from workbench.layouts import Layout
from workbench.mesh import MeshInfo
from workbench.models.config import GPTConfig
from workbench.rules import Rules


def axes_size(mesh: MeshInfo, axes: Sequence[str]) -> int:
    """Product of the sizes of ``axes``."""
    return math.prod(mesh.shape[a] for a in axes)


def rule_axes(rules: Rules, logical: str) -> tuple[str, ...]:
    """Mesh axes of one logical name (empty when unmapped or None)."""
    value = rules.get(logical)
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def batch_axes(rules: Rules, mesh: MeshInfo) -> tuple[str, ...]:
    """Mesh axes (size > 1) that split the batch or the sequence."""
    axes = rule_axes(rules, "batch") + rule_axes(rules, "seq")
    return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def weight_axes(layouts: Mapping[str, Layout]) -> set[str]:
    """Mesh axes that shard at least one parameter."""
    return {a for lay in layouts.values() for axes in lay.spec for a in axes}


def compute_split(rules: Rules, mesh: MeshInfo, param_layouts: Mapping[str, Layout]) -> int:
    """Into how many parts the step's compute is divided: the product of the mesh axes
    that split the batch/sequence or shard some weight. The rest repeat the same work."""
    used = set(batch_axes(rules, mesh)) | weight_axes(param_layouts)
    return axes_size(mesh, [a for a in mesh.axis_names if a in used])


def per_device(layouts: Mapping[str, Layout]) -> int:
    """Bytes each device allocates for these tensors (padded blocks, as XLA allocates)."""
    return int(sum(lay.padded_bytes_per_device for lay in layouts.values()))


def activation_bytes(cfg: GPTConfig, batch: int, seq: int, rules: Rules,
                     mesh: MeshInfo) -> int:
    """Activations kept for the backward pass of ``GPT(cfg)``, per device (estimate).

    Per token and layer, in the compute dtype, without remat:
    ``6D + 3NH + 4KH + N·T (attention probabilities) + 4F`` (norm inputs/outputs, residuals,
    q/k/v before and after RoPE, attention output, SwiGLU gate, up, product, down output);
    heads, kv_heads and mlp terms divided by their mesh shards, tokens by the batch and
    seq shards. ``remat="dots"`` keeps ``2D + NH + 2KH + N·T + 2F``; ``"full"`` keeps the
    block input ``D`` per layer plus one layer's full set. The float32 logits, their
    softmax and gradient add ``3·4·V/shards(vocab)`` per token.
    """
    b = np.dtype(cfg.dtype).itemsize
    shard = lambda name: axes_size(mesh, rule_axes(rules, name))
    tokens = batch * seq / (shard("batch") * shard("seq"))
    d, f = cfg.d_model, cfg.d_ff / shard("mlp")
    nh = cfg.n_heads * cfg.head_dim / shard("heads")
    kh = cfg.n_kv_heads * cfg.head_dim / shard("kv_heads")
    probs = cfg.n_heads / shard("heads") * seq
    full = 6 * d + 3 * nh + 4 * kh + probs + 4 * f
    if cfg.remat == "none":
        per_layer_total = full * cfg.n_layers
    elif cfg.remat == "dots":
        per_layer_total = (2 * d + nh + 2 * kh + probs + 2 * f) * cfg.n_layers
    else:
        per_layer_total = d * cfg.n_layers + full
    logits = 3 * 4 * cfg.vocab_size / shard("vocab")
    return int(tokens * (per_layer_total * b + logits))


def analytic_memory(param_layouts: Mapping[str, Layout], opt_layouts: Mapping[str, Layout],
                    batch_layouts: Mapping[str, Layout], activations: int | None,
                    limit: int | None) -> dict[str, int | None]:
    """Per-device bytes: params, optimizer, batch, gradients (= params' shards), temp
    (gradients + activations), total and limit."""
    params, opt = per_device(param_layouts), per_device(opt_layouts)
    batch = per_device(batch_layouts)
    grads = params
    temp = grads + (activations or 0)
    return {"params": params, "optimizer": opt, "batch": batch, "gradients": grads,
            "activations": activations, "temp": temp, "total": params + opt + batch + temp,
            "limit": limit}


def hbm_bytes(memory: Mapping[str, int | None], param_layouts: Mapping[str, Layout],
              rules: Rules, mesh: MeshInfo) -> int:
    """HBM bytes read + written per device in one step (estimate, for the roofline).

    ``W`` = the weights as the matmuls use them (each parameter's shard times the batch
    axes that shard it: FSDP gathers them): read in the forward and in the backward
    (input gradient) and their gradient written once, ``3W``; the optimizer reads
    parameters, gradients and its state and writes parameters and state,
    ``2 params + gradients + 2 optimizer``; saved activations are written in the forward
    and read in the backward, ``2 activations``; the batch is read once.
    """
    bat = set(batch_axes(rules, mesh))
    gathered = 0
    for lay in param_layouts.values():
        fsdp = [a for axes in lay.spec for a in axes if a in bat]
        gathered += lay.padded_bytes_per_device * axes_size(mesh, fsdp)
    get = lambda k: int(memory.get(k) or 0)
    return int(3 * gathered + 2 * get("params") + get("gradients") + 2 * get("optimizer")
               + 2 * get("activations") + get("batch"))


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
        fsdp = tuple(a for a in mesh.axis_names if a in bat and a in sharded)
        dp = tuple(a for a in mesh.axis_names if a in bat and a not in sharded)
        shard = lay.padded_bytes_per_device
        if fsdp:
            full = shard * axes_size(mesh, fsdp)
            gathered = [s * (axes_size(mesh, fsdp) if any(a in fsdp for a in axes) else 1)
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
        act = int(np.dtype(cfg.dtype).itemsize * math.prod(act_shape))
        shp = _shape_str(np.dtype(cfg.dtype), act_shape)
        for logical, what in (("heads", "attention output"), ("mlp", "MLP output")):
            axes = tuple(a for a in rule_axes(rules, logical)
                         if a not in bat and mesh.shape.get(a, 1) > 1)
            if axes:
                out.append(_record("all-reduce", axes, mesh, act, 2 * cfg.n_layers, shp,
                                   f"tensor-parallel {what}, forward and backward"))
        axes = tuple(a for a in rule_axes(rules, "vocab")
                     if a not in bat and mesh.shape.get(a, 1) > 1)
        if axes:
            out.append(_record("all-reduce", axes, mesh, act, 2, shp,
                               "vocab-sharded embedding lookup, forward and backward"))
    return _merge(out)
