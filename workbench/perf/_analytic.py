"""Analytic plan estimates: memory per device and the compute split, from layouts (the
collectives by formula are ``_analytic_collectives``).

Used beside the compiled numbers, and alone for meshes larger than the machine. Every
number here is an estimate by formula; the formulas are in the docstrings.

One idea, one file: memory per device by formula (weights, optimizer state, activations,
XLA's temporaries term by term) and the per-device sizes those formulas share; the
collectives by formula are ``_analytic_collectives``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workbench._sharding.layouts import Layout
from workbench._sharding.mesh import MeshInfo
from workbench._sharding.rules import Rules
from workbench.models import _attention_choice as attention_choice
from workbench.models._config import GPTConfig
from workbench.models._remat import resolve_remat

__all__ = ["SCANNED_NONE_SAVED", "TPU_SCRATCH_BYTES", "TRAFFIC", "activation_bytes",
           "analytic_memory", "axes_size", "batch_axes", "compute_split", "fsdp_axes",
           "hbm_bytes", "moe_padding_flops", "moe_slots_per_token", "per_device",
           "pipeline_stage_activations", "temp_breakdown", "weight_axes"]


def axes_size(mesh: MeshInfo, axes: Sequence[str]) -> int:
    """Product of the sizes of ``axes``."""
    return math.prod(mesh.shape[a] for a in axes)


def batch_axes(rules: Rules, mesh: MeshInfo) -> tuple[str, ...]:
    """Mesh axes (size > 1) that split the batch or the sequence."""
    return rules.axes("batch", mesh.shape) + rules.axes("seq", mesh.shape)


def fsdp_axes(lay: Layout, bat: set[str] | Sequence[str]) -> tuple[str, ...]:
    """Batch axes that shard ``lay`` as FSDP (gathered before use): every batch axis in its
    spec except on a dim whose logical axis is ``experts`` (expert parallelism keeps those
    shards where they are and moves the tokens instead)."""
    logical = lay.logical_axes or (None,) * len(lay.spec)
    return tuple(a for axes, lg in zip(lay.spec, logical) if lg != "experts"
                 for a in axes if a in bat)


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


# -- temporaries: what XLA's temp holds at its peak ---------------------------------------
#
# Per token and layer, the tensors a GPT block keeps for its backward pass: bytes per
# element of the D-sized (d_model), F-sized (d_ff), NH-sized (query heads x head_dim) and
# KH-sized (kv heads x head_dim) tensors, each dimension divided by the mesh axes that
# shard it; plus the attention scores (``heads x T`` per token: a float32 copy, since
# ``jax.nn.dot_product_attention`` computes them in float32, and the probabilities in the
# compute dtype) and the logits (``V`` per token: on an accelerator the logits and their
# gradient in the compute dtype, since the loss (workbench.models._xent) keeps no float32
# copy; the TPU compiler even fuses 16-bit ones away at some sizes, so this is an upper
# bound there. XLA:CPU keeps a float32 copy too). ``b`` is the compute dtype's size.
#
# Calibrated against the compilers' buffer assignments (docs/predictions.md, "Calibration"):
# with a 16-bit compute dtype the TPU compiler keeps 3 D-sized (norm outputs, the attention
# and MLP outputs), 3 F-sized (gate, up, their product), 2 NH-sized (q after RoPE, the
# attention output) and 2 KH-sized (k after RoPE, v) tensors per layer; XLA:CPU also keeps
# SiLU's two intermediates (5 F-sized). In float32 the TPU compiler keeps some matmul
# operands in bfloat16 (the MXU's default precision) and only the float32 scores: its
# coefficients are the mean of two compiles (small, fsdp and tp), each within 9%.
_LAYER_KEYS = ("D", "F", "NH", "KH", "scores", "logits")


def _bytes_per_element(kind: str, b: int, remat: str) -> dict[str, float]:
    """Bytes kept per element of each per-token tensor class (``_LAYER_KEYS``)."""
    if kind == "cpu" and remat == "none":   # XLA:CPU also keeps SiLU's intermediates
        return dict(zip(_LAYER_KEYS, (3 * b, 5 * b, 2 * b, 2 * b, 4 + b, 4 + b)))
    policy = resolve_remat(remat)
    if remat not in ("none", "dots", "full"):   # named policies: what stays on the device
        if policy.base == "dots_with_no_batch_dims_saveable":
            remat = "dots"
        elif policy.offload_dots:   # every projection on the host: the block input stays
            remat = "full"
        else:
            kept = set(policy.saved)  # (offloaded names live in host memory)
            host = set(policy.offloaded)
            return dict(zip(_LAYER_KEYS, (
                b * ("decoder_layer_input" not in host) + b * ("out_proj" in kept),
                b * (("mlpwi_0" in kept) + ("mlpwi_1" in kept)),
                b * (("query_proj" in kept) + ("context" in kept)),
                b * (("key_proj" in kept) + ("value_proj" in kept)), 0, 2 * b)))
    if remat == "dots":  # matmul outputs without batch dimensions: q, k, v, o, gate, up, down
        return dict(zip(_LAYER_KEYS, (2 * b, 2 * b, b, 2 * b, 0, 2 * b)))
    if remat == "full":  # the block input
        return dict(zip(_LAYER_KEYS, (b, 0, 0, 0, 0, 2 * b)))
    if b == 4:
        return dict(zip(_LAYER_KEYS, (9, 9, 4, 3, 4, 5)))
    return dict(zip(_LAYER_KEYS, (3 * b, 3 * b, 2 * b, 2 * b, 4 + b, 2 * b)))


def _fused_attention(cfg: GPTConfig, mesh: MeshInfo, seq: int, rules: Any = None,
                     batch: int = 1) -> bool:
    """Whether ``cfg.attention`` runs a fused kernel on ``mesh``'s platform (and, for
    ``"auto"`` with ``rules``, on this layout)."""
    impl = getattr(cfg, "attention", "xla")
    problem = attention_choice.splash_layout_problem(
        (batch, seq, cfg.n_heads, cfg.head_dim), cfg.n_kv_heads, rules=rules,
        mesh=mesh) if impl == "auto" and rules is not None else None
    try:
        r = attention_choice.resolve(impl, mesh.platform, seq=seq,
                                     block_sizes=getattr(cfg, "attention_block_sizes", None),
                                     head_dim=cfg.head_dim, layout_problem=problem,
                                     dtype=getattr(cfg, "dtype", None))
    except ValueError:
        return False
    return r.impl != "xla"


#: On-chip scratch (VMEM, memory space 1) the TPU compiler reports inside
#: ``memory_analysis().temp_size_in_bytes``: 47-50 MiB in every v5p program above a toy size.
TPU_SCRATCH_BYTES = 48 * 2**20

#: Saved activations of scanned layers (``GPTConfig.scan_layers``) without remat on an
#: accelerator, over the per-layer coefficients above (which unrolled programs match:
#: small, TPU, within 3%): the scan's backward reads its residuals from buffers stacked
#: over the layers, which the compiler cannot fuse away. Fitted on one TPU compile (the
#: 7B on v5p-128, fsdp_tp data=32 model=2, batch 128 x 4096, libtpu 0.0.42: 85.1 GiB of
#: activations against the formula's 37.3 GiB, of which 36.1 GiB saved:
#: ``(85.1 - 1.1) / 36.1``); checked on the compiler's verdicts it was not fitted on
#: (tests/test_formula_refit.py).
SCANNED_NONE_SAVED = 2.325


def _kind(mesh: MeshInfo) -> str:
    """"cpu" for XLA:CPU, else "accelerator" (calibrated on the TPU compiler; GPU assumed
    alike)."""
    return "cpu" if mesh.platform == "cpu" else "accelerator"


def compute_dtype(cfg: GPTConfig, mesh: MeshInfo) -> np.dtype:
    """The dtype ``cfg``'s activations take on ``mesh``'s platform (``dtype="auto"``:
    bfloat16 on GPU/TPU, float32 on CPU; ``GPTConfig.compute_dtype``)."""
    return np.dtype(cfg.compute_dtype(mesh.platform))


def ceil_div(n: int, d: int) -> int:
    """``ceil(n / d)`` in integers (``d`` at least 1)."""
    return -(-int(n) // max(1, int(d)))


def _gpt_weights(cfg: GPTConfig) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...],
                                                int]]:
    """(name, shape, logical axes, copies) of ``GPT(cfg)``'s parameters (one block's
    tensors with ``copies = n_layers``), as in ``workbench.models._gpt``."""
    d, f, n, k, h, v = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    L, ly = cfg.n_layers, "layers"   # the blocks' layers axis (sharded by pipeline stages)
    out = [("embed", (v, d), ("vocab", "embed"), 1),
           ("final_norm", (d,), ("embed",), 1),
           ("q", (L, d, n, h), (ly, "embed", "heads", "head_dim"), 1),
           ("k", (L, d, k, h), (ly, "embed", "kv_heads", "head_dim"), 1),
           ("v", (L, d, k, h), (ly, "embed", "kv_heads", "head_dim"), 1),
           ("o", (L, n, h, d), (ly, "heads", "head_dim", "embed"), 1),
           ("norms", (L, d), (ly, "embed"), 2)]
    if cfg.n_experts:   # router, routed experts (memory counts every one), shared experts
        e, fe = cfg.n_experts, cfg.moe_d_ff
        ex = (ly, "experts")
        out += [("router", (L, d, e), (ly, "embed", None), 1),
                ("expert_gate", (L, e, d, fe), (*ex, "embed", "expert_mlp"), 1),
                ("expert_up", (L, e, d, fe), (*ex, "embed", "expert_mlp"), 1),
                ("expert_down", (L, e, fe, d), (*ex, "expert_mlp", "embed"), 1)]
        f = cfg.n_shared_experts * fe
    if f:
        out += [("gate", (L, d, f), (ly, "embed", "mlp"), 1),
                ("up", (L, d, f), (ly, "embed", "mlp"), 1),
                ("down", (L, f, d), (ly, "mlp", "embed"), 1)]
    if not cfg.tie_embeddings:
        out.append(("lm_head", (d, v), ("embed", "vocab"), 1))
    return out


def _weight_bytes(cfg: GPTConfig, rules: Rules, mesh: MeshInfo, itemsize: int,
                  skip_axes: set[str]) -> dict[str, int]:
    """Bytes per device of each weight (all layers), divided by the mesh axes its logical
    axes map to except ``skip_axes`` (the batch axes: what an FSDP gather makes whole)."""
    out: dict[str, int] = {}
    for name, shape, logical, copies in _gpt_weights(cfg):
        used: set[str] = set()
        elems = 1
        for dim, lg in zip(shape, logical):
            axes = [a for a in (rules.axes(lg) if lg else ())
                    if a in mesh.shape and a not in used]
            used.update(axes)
            skip = skip_axes if lg != "experts" else set()   # expert shards stay put
            elems *= ceil_div(dim, axes_size(mesh, [a for a in axes if a not in skip]))
        out[name] = elems * itemsize * copies
    return out


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Per-device sizes :func:`temp_breakdown`'s terms are counted in (``b``: the compute
    dtype's bytes; ``tokens``: batch x seq over their shards; ``span``: the attention
    scores' width; ``f``: the MLP's width, for a mixture of experts ``slots`` expert
    widths plus the shared experts' ``shared``; heads, kv heads and vocab over their
    shards)."""

    kind: str
    b: int
    tokens: int
    span: int
    d: int
    f: int
    shared: int
    slots: float
    heads: int
    nh: int
    kh: int
    vocab: int


def _sizes(cfg: GPTConfig, batch: int, seq: int, rules: Rules, mesh: MeshInfo) -> _Sizes:
    """The per-device sizes of ``cfg``'s tensors for one step (see :class:`_Sizes`)."""
    kind = _kind(mesh)
    shard = lambda name: axes_size(mesh, [a for a in rules.axes(name) if a in mesh.shape])
    tokens = ceil_div(batch, shard("batch")) * ceil_div(seq, shard("seq"))
    # attention span: ring attention (context parallelism) scores one T/n block at a time
    span = ceil_div(seq, shard("seq")) \
        if getattr(cfg, "context_attention", "") == "ring" else seq
    if kind == "accelerator" and _fused_attention(cfg, mesh, seq, rules, batch):
        span = 0   # a fused kernel (splash, cuDNN) never holds the T x T scores
    f = ceil_div(cfg.d_ff, shard("mlp"))
    heads = ceil_div(cfg.n_heads, shard("heads"))
    s, shared = 0.0, 0
    if cfg.n_experts:   # MoE: F-sized tensors per slot, slots = E * capacity / group
        ea = [a for a in rules.axes("experts") if a in mesh.shape]
        s = moe_slots_per_token(cfg, tokens * (axes_size(mesh, ea)
                                               if cfg.moe_dispatch == "all_gather" else 1),
                                expert_shards=axes_size(mesh, ea))
        shared = ceil_div(cfg.n_shared_experts * cfg.moe_d_ff, shard("mlp"))
        f = int(s * ceil_div(cfg.moe_d_ff, shard("expert_mlp"))) + shared
    return _Sizes(kind=kind, b=compute_dtype(cfg, mesh).itemsize, tokens=tokens, span=span,
                  d=cfg.d_model, f=f, shared=shared, slots=s, heads=heads,
                  nh=heads * cfg.head_dim,
                  kh=ceil_div(cfg.n_kv_heads, shard("kv_heads")) * cfg.head_dim,
                  vocab=ceil_div(cfg.vocab_size, shard("vocab")))


def _per_token(cfg: GPTConfig, z: _Sizes, remat: str) -> float:
    """Bytes one layer keeps per token under ``remat``: ``cD·D + cF·F + cN·NH + cK·KH +
    cS·heads·T`` (``_bytes_per_element``), plus, for a mixture of experts where the
    policy keeps the MLP's tensors, each slot's D-sized input ``b·slots·D``, the token's
    ``k`` picked outputs in float32 ``4·k·D`` (the combine's operand) and the router's
    float32 logits, probabilities and one-hot counts ``12·E`` (remat="full": none)."""
    c = _bytes_per_element(z.kind, z.b, remat)
    moe = (z.b * z.slots * z.d + 4 * cfg.experts_per_token * z.d + 3 * 4 * cfg.n_experts) \
        if cfg.n_experts and c["F"] else 0
    return c["D"] * z.d + c["F"] * z.f + c["NH"] * z.nh + c["KH"] * z.kh \
        + c["scores"] * z.heads * z.span + moe


def _saved(cfg: GPTConfig, z: _Sizes, remat: str) -> tuple[int, int]:
    """``(saved, stacked)``: the activations kept for the backward pass, all layers
    (:func:`_per_token` by platform, dtype and ``remat``; ``T`` the attention span: the
    sequence, or one ``T/n`` block for ring attention over a context axis of size ``n``).
    Scanned layers without remat on an accelerator keep ``SCANNED_NONE_SAVED`` times that
    set (the loop's stacked residuals); ``stacked`` is the part above it, included in
    ``saved``."""
    saved = int(z.tokens * _per_token(cfg, z, remat)) * cfg.n_layers
    stacked = int(saved * (SCANNED_NONE_SAVED - 1)) if z.kind == "accelerator" \
        and remat == "none" and getattr(cfg, "scan_layers", False) else 0
    return saved + stacked, stacked


def _transient(cfg: GPTConfig, z: _Sizes, remat: str) -> tuple[int, int, int]:
    """``(backward, softmax, expert_grads)`` of the last layer's backward pass.

    ``backward``: its recomputed set under remat, else the gradients of its MLP
    activations and output, ``cF·F + b·D`` per token. ``softmax`` (accelerator): the
    gradients of the attention scores and probabilities, ``heads·T·(4 + b)``.
    ``expert_grads``: under remat, a mixture of experts holds, while its MLP's backward
    runs (before the attention's, so in place of the softmax's gradients when larger),
    the gradients of the recomputed expert slots' F-sized tensors, ``cF·slots·expert_d_ff``
    (dropless, ``slots = E``: these dominate the step). This is what remat needs at least:
    where HBM is to spare the TPU compiler recomputes several layers ahead and uses more
    (1b, remat="full", 2048 tokens per sequence on v5p-16: 13.4 GiB of temp for ~7.8)."""
    none = _bytes_per_element(z.kind, z.b, "none")
    backward = int(z.tokens * _per_token(cfg, z, "none")) if remat != "none" else \
        int(z.tokens * (none["F"] * z.f + z.b * z.d))
    softmax = int(z.tokens * z.heads * z.span * (4 + z.b)) if z.kind == "accelerator" else 0
    expert_grads = int(z.tokens * none["F"] * (z.f - z.shared)) \
        if remat != "none" and cfg.n_experts else 0
    return backward, softmax, expert_grads


def _weight_terms(cfg: GPTConfig, rules: Rules, mesh: MeshInfo, z: _Sizes) -> dict[str, int]:
    """The weights' and gradients' terms: ``gathered``, ``embedding_grads``, ``gradients``,
    ``reduction`` and ``layer_grads``.

    ``gathered``: FSDP gather buffers (weights sharded over a batch axis). The TPU compiler
    gathers each layer's weights just before use, in the matmul dtype: the output
    projection plus two layers (one in use, one prefetched). XLA:CPU gathers every layer
    once and keeps it for the backward pass: all block weights, in the parameter dtype.
    ``embedding_grads`` (CPU): the output projection's gradient and the embedding's
    scatter-add buffer (with FSDP: the gathered table), whole over the batch axes.
    ``reduction``: XLA:CPU all-reduces every gradient replicated over a batch axis at once
    and holds the unreduced and the reduced copy (a tied embedding's two partial gradients
    count twice): ``2 x`` those gradients plus the other gradient shards; on an
    accelerator the reduction runs layer by layer beside the backward pass: the gradient
    shards (``gradients``). ``layer_grads`` (accelerator, FSDP): one layer's whole weight
    gradient in the parameter dtype before its reduce-scatter (a mixture of experts holds
    it with its slots' gradients: every expert's, E times a dense MLP's)."""
    pbytes = np.dtype(cfg.param_dtype).itemsize
    bat = set(batch_axes(rules, mesh))
    shards = _weight_bytes(cfg, rules, mesh, pbytes, set())
    whole = _weight_bytes(cfg, rules, mesh, pbytes, bat)
    fsdp = {k for k, full in whole.items() if full != shards[k]}
    out_proj = "embed" if cfg.tie_embeddings else "lm_head"
    blocks = sum(v for k, v in whole.items()
                 if k in fsdp and k not in ("embed", "lm_head", "final_norm"))
    out = {"gathered": 0, "embedding_grads": 0, "gradients": sum(shards.values()),
           "layer_grads": 0}
    if z.kind == "cpu":
        reduced = sum(v for k, v in whole.items() if k not in fsdp)
        if cfg.tie_embeddings and "embed" not in fsdp:
            reduced += whole["embed"]
        return {**out, "gathered": blocks, "embedding_grads": 2 * whole[out_proj],
                "reduction": 2 * reduced + sum(v for k, v in shards.items() if k in fsdp)}
    if fsdp:
        mm = min(z.b, 2) if mesh.platform == "tpu" else z.b   # the MXU takes bfloat16 operands
        per_layer = blocks * mm // (pbytes * cfg.n_layers)
        out["gathered"] = (whole[out_proj] * mm // pbytes if out_proj in fsdp else 0) \
            + 2 * per_layer
        out["layer_grads"] = blocks // cfg.n_layers
    return {**out, "reduction": out["gradients"]}


def temp_breakdown(cfg: GPTConfig, batch: int, seq: int, rules: Rules,
                   mesh: MeshInfo) -> dict[str, int | str]:
    """What holds XLA's temporary memory at its peak, per device (estimate, bytes).

    Two phases can be the peak: the end of the forward pass (everything kept for the
    backward pass) and the gradient reduction. ``temp = max(forward_peak,
    reduction_peak)``; ``phase`` says which. ``forward_peak = saved + max(logits,
    transient) + gathered + embedding_grads + scratch``: the last layer's backward pass
    (``transient``) runs once the logits are freed. Each term's formula is in the helper
    that counts it: :func:`_saved` (``saved``, ``stacked``), :func:`_transient`,
    :func:`_weight_terms` (``gathered``, ``embedding_grads``, ``gradients`` and the
    ``reduction_peak``, plus the scratch on an accelerator); sizes per device as in
    :class:`_Sizes`. ``logits``: the logits and their gradient in the compute dtype (a
    float32 copy too on XLA:CPU), ``cL·V`` per token of one ``1/loss_chunks`` slice of the
    tokens. ``scratch`` (TPU): on-chip scratch the compiler counts in temp
    (``TPU_SCRATCH_BYTES``). XLA:CPU schedules every rematerialisation right after the
    forward pass, so remat does not lower its peak as much.

    Calibrated against the CPU and TPU compilers' buffer assignments; the ratios over a
    matrix of presets, strategies and meshes are in BENCHMARKS.md and the method in
    docs/predictions.md ("Calibration"). GPUs use the accelerator (TPU) coefficients,
    unchecked.
    """
    z = _sizes(cfg, batch, seq, rules, mesh)
    # XLA:CPU honours remat too since JAX 0.12 (0.10's kept the whole set), and keeps the
    # same set under "full" as under "dots" (compiled temp equal within 0.2%: tiny and small,
    # fsdp_tp on 8 CPU devices)
    remat = "dots" if z.kind == "cpu" and cfg.remat == "full" else cfg.remat
    saved, stacked = _saved(cfg, z, remat)
    transient, softmax, expert_grads = _transient(cfg, z, remat)
    # loss_chunks: one slice of the sequence's logits at a time (step.chunked_token_losses)
    logits = int(ceil_div(z.tokens, max(1, getattr(cfg, "loss_chunks", 1))) * z.vocab
                 * _bytes_per_element(z.kind, z.b, "none")["logits"])
    scratch = TPU_SCRATCH_BYTES if mesh.platform == "tpu" else 0
    w = _weight_terms(cfg, rules, mesh, z)
    if expert_grads:   # a recomputed MoE layer's MLP backward runs before its softmax's
        expert_grads += w["layer_grads"]
    transient += max(expert_grads, softmax) if expert_grads else softmax
    forward = saved + max(logits, transient) + w["gathered"] + w["embedding_grads"] + scratch
    reduction = w["reduction"] + (scratch if z.kind == "accelerator" else 0)
    return {"saved": saved, "stacked": stacked, "transient": transient, "logits": logits,
            "gathered": w["gathered"], "embedding_grads": w["embedding_grads"],
            "scratch": scratch, "forward_peak": forward, "reduction_peak": reduction,
            "gradients": w["gradients"], "temp": max(forward, reduction),
            "phase": "forward" if forward >= reduction else "reduction", "model": z.kind}


def moe_slots_per_token(cfg: GPTConfig, group: int, expert_shards: int = 1) -> float:
    """Expert slots per token of a group of ``group`` tokens, ``E * capacity / group``:
    ``E`` when dropless (every expert has room for the whole group), about
    ``capacity_factor * k`` otherwise. Each slot holds a D-sized input and output and the
    expert's F-sized hidden tensors, so MoE activations scale with it. Grouped matmuls
    (``GPTConfig.moe_matmul_resolved == "grouped"``) hold rows, not slots: ``k`` per
    token, and over ``expert_shards`` devices ``n`` on the expert axes, the rows a device's
    peers could owe its experts, ``min(n*k, E)`` per token of its own
    (``workbench.models._moe_grouped.group_grouped``)."""
    from workbench.models._moe_choice import capacity

    if cfg.moe_matmul_resolved == "grouped":
        return float(min(max(1, expert_shards) * cfg.experts_per_token, cfg.n_experts))
    return cfg.n_experts * capacity(cfg, max(1, int(group))) / max(1, int(group))


def moe_padding_flops(cfg: GPTConfig, batch: int, seq: int, rules: Rules,
                      mesh: MeshInfo) -> float:
    """FLOPs the experts spend on empty slots in one training step, all devices: the
    routed SwiGLU runs on ``slots`` rows per token (:func:`moe_slots_per_token`: ``E``
    dropless, about ``capacity_factor·k`` with a capacity) where ``k`` carry a token, so
    the hardware does ``slots / k`` times the routed experts' model FLOPs
    (``2·3·D·Fe·k`` per token and layer, ``workbench._flops``), three times for training
    and once more for the gate and up projections remat recomputes
    (``flops.remat_recompute``). 0 for a dense model, and for grouped matmuls
    (``moe_matmul="grouped"``: the ragged matmuls run on the routed rows only)."""
    if not cfg.n_experts or cfg.moe_matmul_resolved == "grouped":
        return 0.0
    from workbench._flops import remat_recompute

    ea = [a for a in rules.axes("experts") if a in mesh.shape]
    shard = lambda name: axes_size(mesh, [a for a in rules.axes(name) if a in mesh.shape])
    group = ceil_div(batch, shard("batch")) * ceil_div(seq, shard("seq")) \
        * (axes_size(mesh, ea) if cfg.moe_dispatch == "all_gather" else 1)
    k = cfg.experts_per_token
    empty = max(0.0, moe_slots_per_token(cfg, group) - k)
    forward = 2 * 3 * cfg.d_model * cfg.moe_d_ff * empty * batch * seq * cfg.n_layers
    zero = dict.fromkeys(("qkv", "attention", "out_proj", "logits"), 0.0)
    return 3 * forward + remat_recompute(cfg, {**zero, "mlp": forward})


def activation_bytes(cfg: GPTConfig, batch: int, seq: int, rules: Rules,
                     mesh: MeshInfo) -> int:
    """Temporaries of one train step of ``GPT(cfg)`` besides the gradient shards, per
    device (estimate): ``temp_breakdown(...)["temp"] - gradients``, the same split the
    compiled plan reports (XLA's temp minus the gradient shards).

    At the forward pass's end this is the activations kept for the backward pass, the
    float32 logits and FSDP gather buffers; when the gradient reduction is the peak, its
    buffers. Formulas and their calibration: :func:`temp_breakdown`.
    """
    t = temp_breakdown(cfg, batch, seq, rules, mesh)
    return int(t["temp"]) - int(t["gradients"])


def analytic_memory(param_layouts: Mapping[str, Layout], opt_layouts: Mapping[str, Layout],
                    batch_layouts: Mapping[str, Layout], activations: int | None,
                    limit: int | None) -> dict[str, int | None]:
    """Per-device bytes: params, optimizer, batch, gradients (= params' shards; a LoRA
    model's adapters' only), temp
    (gradients + ``activations``: the rest of the temporaries, see
    :func:`activation_bytes`), total and limit."""
    params, opt = per_device(param_layouts), per_device(opt_layouts)
    batch = per_device(batch_layouts)
    # LoRA (workbench.models._lora): only the adapters (paths through a "lora" entry) have
    # gradients; the frozen base has none
    adapters = {k: v for k, v in param_layouts.items() if "lora" in k.split(".")}
    grads = per_device(adapters) if adapters else params
    temp = grads + (activations or 0)
    return {"params": params, "optimizer": opt, "batch": batch, "gradients": grads,
            "activations": activations, "temp": temp, "total": params + opt + batch + temp,
            "limit": limit}


#: HBM traffic per step in units of what it moves, fitted to the TPU compiler's
#: ``cost_analysis()["bytes accessed"]`` (GPT "small" in bfloat16 on a v5p-16 slice: fsdp,
#: tp, fsdp_tp without remat, with "dots" and "full", and dp at 8 x 128 tokens):
#: ``activations`` per byte of the no-remat forward-end set (saved activations + logits:
#: written and read in the forward pass, their gradients in the backward pass, the
#: fusions' intermediates and the softmax passes); ``dots`` / ``full`` added by the
#: recomputation; ``weights`` per byte of the weights as the matmuls use them (the
#: float32 read, its bfloat16 copy read by the forward, input-gradient and
#: weight-gradient matmuls, the weight gradients and their reduction).
TRAFFIC = {"activations": 7.7, "dots": 1.1, "full": 1.6, "weights": 17.0}


def hbm_bytes(memory: Mapping[str, int | None], param_layouts: Mapping[str, Layout],
              rules: Rules, mesh: MeshInfo, *, cfg: GPTConfig | None = None,
              batch: int | None = None, seq: int | None = None) -> int:
    """HBM bytes read + written per device in one step (estimate, for the roofline).

    ``W`` = the weights as the matmuls use them (each parameter's shard times the batch
    axes that shard it: FSDP gathers them). The optimizer reads parameters, gradients and
    its state and writes parameters and state, ``2 params + gradients + 2 optimizer``;
    the batch is read once.

    With the model (``cfg``, ``batch``, ``seq``): ``TRAFFIC["weights"]·W`` and
    ``(TRAFFIC["activations"] + TRAFFIC[remat])·A`` where ``A`` is the forward-end set
    without remat (``temp_breakdown``'s saved activations + logits; remat keeps less but
    moves as much, and recomputes). Calibrated against the TPU compiler (``TRAFFIC``);
    docs/predictions.md, "Calibration". Without it (a model factory): ``3W`` (weights read
    by the forward and backward matmuls, gradient written) and ``2 activations``.
    """
    bat = set(batch_axes(rules, mesh))
    gathered = 0
    for lay in param_layouts.values():
        gathered += lay.padded_bytes_per_device * axes_size(mesh, fsdp_axes(lay, bat))
    get = lambda k: int(memory.get(k) or 0)
    update = 2 * get("params") + get("gradients") + 2 * get("optimizer") + get("batch")
    if cfg is None or batch is None:
        return int(3 * gathered + update + 2 * get("activations"))
    t = temp_breakdown(cfg.replace(remat="none"), batch, int(seq or cfg.seq_len), rules, mesh)
    per_byte = TRAFFIC["activations"] + TRAFFIC.get(cfg.remat, 0.0)
    return int(TRAFFIC["weights"] * gathered + update
               + per_byte * (int(t["saved"]) - int(t["stacked"]) + int(t["logits"])))


def pipeline_stage_activations(cfg: GPTConfig, batch: int, seq: int, rules: Rules,
                               mesh: MeshInfo, in_flight: Sequence[int], chunks: int
                               ) -> list[int]:
    """Per pipeline stage, :func:`activation_bytes` with the stage's saved activations:
    ``saved x (in-flight chunks / chunks) / stages`` (a stage holds ``n_layers / stages``
    layers; GPipe and circular keep every chunk, ``chunks = repeats x microbatches``, 1F1B
    at most ``stages - s`` at stage ``s``), plus what every stage holds whole (logits of
    the batch, the last layer's backward, gather buffers of its own layers).

    Args:
        in_flight: per stage, chunks whose activations are held at the peak
            (``pipeline.in_flight`` of the schedule's timeline).
        chunks: ``repeats x microbatches``, the chunks a stage works through.
    """
    t = temp_breakdown(cfg, batch, seq, rules, mesh)
    stages = len(in_flight)
    out = []
    for n in in_flight:
        saved = int(int(t["saved"]) * n / (chunks * stages))
        forward = int(t["forward_peak"]) - int(t["saved"]) + saved
        out.append(max(forward, int(t["reduction_peak"])) - int(t["gradients"]))
    return out


