"""The activations of a plan's step (``plan.activations``) and why each collective runs
(``explain_collectives``): shapes, shardings and bytes per device of the tensors the
model constrains (``workbench._sharding.rules.constrain``), the attention scores and the logits.

Activations come from tracing the step's loss with the plan's rules active: every
``constrain(x, logical_axes, name=...)`` call is recorded with the ``PartitionSpec`` it
asks JAX for (the ``sharding_constraint`` equations of the jaxpr carry the same), and the
attention scores are found in the jaxpr as the products whose last two dims are the
sequence (inside ``jax.nn.dot_product_attention`` or a penzai ``NamedEinsum``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from workbench._sharding.layouts import format_bytes
from workbench.perf._analytic import batch_axes
from workbench._compiled.hlo import Collective
from workbench._sharding.rules import Rules, recording

__all__ = ["Activation", "CollectiveLayouts", "collective_layouts", "explain_collectives",
           "trace_activations"]

#: Per-layer activation names of Workbench's GPT, in call order within a block.
LAYER_NAMES = ("q", "k", "v", "attn_out", "residual", "mlp_hidden")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Activation:
    """One activation tensor of the step's forward pass.

    Attributes:
        name: ``constrain``'s name (``"mlp_hidden"``, ``"logits"``) or ``"attn_scores"``.
        layer: the block it belongs to (None: outside the blocks, or a scanned block run
            ``count`` times).
        shape, dtype: global shape and dtype.
        logical: logical axes (None where the dim has no name).
        spec: mesh axes per dim (``()`` replicated; None: left to the compiler).
        bytes: global bytes.
        bytes_per_device: the bytes of one shard (the largest, if uneven).
        count: how many times the step computes it (scanned layers: the layer count).
        source: where: ``"constrain"`` (a named constraint: JAX is told this layout) or
            ``"jaxpr"`` (found in the traced program: layout of the dims named by the
            rules, the rest as XLA propagates it).
    """

    name: str
    layer: int | None
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    spec: tuple[tuple[str, ...] | None, ...]
    bytes: int
    bytes_per_device: int
    count: int = 1
    source: str = "constrain"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly record."""
        return {"name": self.name, "layer": self.layer, "shape": list(self.shape),
                "dtype": self.dtype, "logical": list(self.logical),
                "spec": [None if s is None else list(s) for s in self.spec],
                "bytes": self.bytes, "bytes_per_device": self.bytes_per_device,
                "count": self.count, "source": self.source}

    def __str__(self) -> str:
        where = "" if self.layer is None else f"[{self.layer}]"
        spec = ", ".join("?" if s is None else ("None" if not s else "+".join(s))
                         for s in self.spec)
        return (f"{self.name}{where} {self.dtype}{list(self.shape)} P({spec}) "
                f"{format_bytes(self.bytes_per_device)}/device")


def _spec_axes(spec: PartitionSpec, rank: int) -> tuple[tuple[str, ...] | None, ...]:
    out: list[tuple[str, ...] | None] = []
    for i in range(rank):
        s = spec[i] if i < len(spec) else None
        if s is PartitionSpec.UNCONSTRAINED:
            out.append(None)
        elif s is None:
            out.append(())
        else:
            out.append((s,) if isinstance(s, str) else tuple(s))
    return tuple(out)


def _per_device(shape: Sequence[int], spec: Sequence[tuple[str, ...] | None],
                sizes: Mapping[str, int], itemsize: int) -> int:
    n = itemsize
    for d, axes in zip(shape, spec, strict=True):
        k = math.prod(sizes[a] for a in axes) if axes else 1
        n *= -(-d // k)
    return int(n)


def trace_activations(graphdef: Any, loss_fn: Any, params: Any,
                      batch: Mapping[str, jax.ShapeDtypeStruct], rules: Rules, mesh: Any, *,
                      scanned_layers: int | None = None) -> list[Activation]:
    """Trace ``loss_fn(merge(graphdef, params), batch)`` with ``rules`` active on
    ``mesh`` and list the constrained activations and the attention scores.

    Args:
        graphdef, params: the model (abstract params are enough).
        loss_fn: ``(model, batch) -> loss``.
        batch: ShapeDtypeStructs of the global batch.
        rules, mesh: the plan's rules and (abstract or concrete) mesh.
        scanned_layers: the layer count of a model whose blocks run in a ``lax.scan``
            (their activations are traced once and computed that many times).
    """
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)) \
        if hasattr(mesh, "axis_sizes") else dict(mesh.shape)

    def loss(p: Any, b: Any) -> Any:
        with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)), \
                rules.activate(mesh):
            return loss_fn(nnx.merge(graphdef, p), b)

    with recording() as rec:
        jaxpr = jax.make_jaxpr(loss)(params, dict(batch))
    seen: dict[str, int] = {}
    totals = {name: sum(r[0] == name for r in rec) for name, *_ in rec}
    out: list[Activation] = []
    for name, logical, x, spec, *how in rec:  # how: ("jaxpr",) for a record-only entry
        i = seen.get(name, 0)
        seen[name] = i + 1
        per_layer = totals[name] > 1 or name in LAYER_NAMES
        if name == "residual":        # two per block: after attention, after the MLP
            layer = i // 2 if scanned_layers is None else None
        else:
            layer = (i if per_layer else None) if scanned_layers is None else None
        if scanned_layers is not None and name not in LAYER_NAMES:
            layer = None
        shape = tuple(int(d) for d in x.shape)
        axes = _spec_axes(spec, len(shape))
        itemsize = np.dtype(x.dtype).itemsize
        out.append(Activation(
            name=name, layer=layer, shape=shape, dtype=str(np.dtype(x.dtype)),
            logical=tuple(logical), spec=axes, bytes=int(math.prod(shape)) * itemsize,
            bytes_per_device=_per_device(shape, [a or () for a in axes], sizes, itemsize),
            count=scanned_layers if scanned_layers is not None and name in LAYER_NAMES
            else 1, source=how[0] if how else "constrain"))
    out.extend(_scores(jaxpr, out, batch, rules, sizes, scanned_layers))
    order = {n: k for k, n in enumerate(("embedded", *LAYER_NAMES, "attn_scores"))}
    return sorted(out, key=lambda a: (a.layer is not None, a.layer or 0,
                                      order.get(a.name, 99) if a.name != "logits" else 100))


def _eqns(jaxpr: Any) -> list[Any]:
    """Every equation of ``jaxpr`` and its sub-jaxprs (pjit, remat, scan, cond)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(_eqns(inner))
    return out


def _scores(closed: Any, acts: list[Activation], batch: Mapping[str, Any], rules: Rules,
            sizes: Mapping[str, int], scanned_layers: int | None) -> list[Activation]:
    """Attention scores: forward ``dot_general`` results with two dims of the sequence
    length (queries x keys). Sharded like the queries on their batch and heads
    dims where a ``q`` activation was constrained, else by the batch rule on dim 0."""
    seqs = {int(v.shape[1]) for v in batch.values() if len(v.shape) >= 2}
    queries = [a for a in acts if a.name == "q"]
    found: list[Activation] = []
    for eqn in _eqns(closed.jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        aval = eqn.outvars[0].aval
        shape = tuple(int(d) for d in aval.shape)
        if len(shape) < 4 or not any(sum(d == t for d in shape) >= 2 for t in seqs):
            continue
        q = queries[len(found)] if len(found) < len(queries) else None
        if q is not None and len(q.shape) == 4 and len(shape) == 4:
            # q (B, T, N, H) -> scores (B, N, T, T)
            spec: tuple[tuple[str, ...] | None, ...] = (q.spec[0], q.spec[2], q.spec[1], ())
            logical = (q.logical[0], q.logical[2], q.logical[1], None)
        elif (q is not None and len(q.shape) == 4 and len(shape) == 5
              and shape[0] == q.shape[0] and shape[1] * shape[3] == q.shape[2]):
            # grouped-query attention: (B, K, T, G, S), the heads split into K groups of G
            spec = (q.spec[0], q.spec[2], q.spec[1], (), ())
            logical = (q.logical[0], q.logical[2], q.logical[1], None, None)
        else:
            b = rules.axes("batch")
            spec = (b, *([None] * (len(shape) - 1)))
            logical = ("batch", *([None] * (len(shape) - 1)))
        itemsize = np.dtype(aval.dtype).itemsize
        found.append(Activation(
            name="attn_scores", layer=None if scanned_layers is not None else len(found),
            shape=shape, dtype=str(np.dtype(aval.dtype)), logical=logical, spec=spec,
            bytes=int(math.prod(shape)) * itemsize,
            bytes_per_device=_per_device(shape, [a or () for a in spec], sizes, itemsize),
            count=scanned_layers or 1, source="jaxpr"))
    return found


def explain_collectives(collectives: Sequence[Collective], logical: Mapping[str, Any],
                        layouts: Mapping[str, Any], rules: Rules,
                        mesh: Any) -> list[Collective]:
    """Each collective with the rule that made the compiler insert it, where derivable:

    - a parameter's all-gather over a batch axis: the logical dim the rules shard there
      (``"embed -> data (FSDP: the weight is gathered before it is used)"``);
    - a reduction in the backward pass over batch axes: the batch rule (gradients summed
      over the data-parallel shards);
    - a reduction over an axis that shards weights only: tensor parallelism (partial sums
      of a matmul whose contracted dim is sharded), naming the logical axes mapped there.
    """
    bat = set(batch_axes(rules, mesh))
    out = []
    for c in collectives:
        out.append(dataclasses.replace(c, rule=_rule(c, logical, layouts, rules, bat)))
    return out


def _rule(c: Collective, logical: Mapping[str, Any], layouts: Mapping[str, Any],
          rules: Rules, bat: set[str]) -> str | None:
    axes = set(c.axes)
    if not axes:
        return None
    fmt = "+".join(c.axes)
    params = [t for t in c.tensors if t.startswith("params.")]
    for t in params:
        lay = layouts.get(t)
        names = logical.get(t[len("params."):])
        if lay is None or names is None:
            continue
        dims = [names[d] for d, s in enumerate(lay.spec) if set(s) & axes and names[d]]
        if dims:
            why = ("FSDP: the weight is gathered before it is used" if axes <= bat
                   else "the weight is sharded there and gathered before it is used")
            return f"{', '.join(dims)} -> {fmt} ({why})"
    backward = any(o.startswith("transpose(") for o in c.ops)
    if c.kind in ("all-reduce", "reduce-scatter") and axes <= bat:
        what = "gradients" if backward else "values"
        return (f"batch -> {fmt} (data parallel: {what} are summed over the batch shards)")
    if c.kind in ("all-reduce", "reduce-scatter"):
        names = [k for k, v in rules.items() if v is not None and
                 set((v,) if isinstance(v, str) else v) & axes and k not in ("batch", "seq")]
        return (f"{'/'.join(names) or '?'} -> {fmt} (tensor parallel: partial sums of a "
                f"matmul whose contracted dim is sharded)")
    if not params:
        return (f"no rule: two ops want this tensor laid out differently over {fmt}, so the "
                "compiler reshards it (see the 'reshard' lint)")
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveLayouts:
    """What one collective instruction does to its tensor's layout (``collective_layouts``).

    Attributes:
        before, after: ``Layout`` of the tensor on the plan's mesh before and after it.
        note: what changes (``"gathered over 'data' along dim 0"``).
        instruction: the HLO instruction drawn.
    """

    before: Any
    after: Any
    note: str
    instruction: str


def _dims(type_text: str) -> tuple[int, ...]:
    import re

    m = re.search(r"[a-z]+\d*\[([\d,]*)\]", type_text)
    return tuple(int(x) for x in m.group(1).split(",") if x) if m else ()


def collective_layouts(plan: Any, index: int) -> CollectiveLayouts:
    """The layouts before and after ``plan.collectives[index]`` (its first instruction).

    A parameter's gather is drawn on its own layout (the rules' spec, then without the
    gathered axes); any other tensor on the shape the instruction works on, sharded only
    by the collective's own axes (the other mesh axes as the compiler left them are not
    in the instruction).
    """
    from workbench._sharding.layouts import layout
    from workbench._compiled.graph import HloGraph

    c = plan.collectives[index]
    axes = tuple(c.axes)
    mesh = plan.mesh
    param = next((t for t in c.tensors if t in plan.layouts), None)
    dtype = (c.shapes[0].split("[")[0] if c.shapes else "f32")
    dtype = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32"}.get(
        dtype, "float32")
    spec_axes = axes[0] if len(axes) == 1 else axes
    if param is not None and c.kind == "all-gather":
        lay = plan.layouts[param]
        after = tuple(tuple(a for a in s if a not in axes) for s in lay.spec)
        after = tuple(None if not s else s[0] if len(s) == 1 else s for s in after)
        return CollectiveLayouts(
            before=lay, after=layout(lay.shape, after, mesh,
                                     dtype=lay.dtype, name=f"{param} (gathered)"),
            note=f"{param} gathered over {'+'.join(axes)}", instruction=c.names[0])
    ins = None
    if plan.compiled is not None and c.names:
        graph = HloGraph.parse(plan.compiled.as_text())
        ins = graph.instructions.get(c.names[0])
        operand = graph.instructions.get(ins.operands[0]) if ins and ins.operands else None
    out_dims = _dims(ins.type) if ins is not None else _dims(c.shapes[0]) if c.shapes else ()
    in_dims = _dims(operand.type) if ins is not None and operand is not None else out_dims
    rank = len(out_dims)
    none = (None,) * rank
    m = mesh
    if c.kind == "all-gather" and len(in_dims) == rank:
        d = next((i for i in range(rank) if out_dims[i] != in_dims[i]), 0)
        before = tuple(spec_axes if i == d else None for i in range(rank))
        shape, after, note = out_dims, none, f"gathered over {'+'.join(axes)} along dim {d}"
    elif c.kind == "reduce-scatter" and len(in_dims) == rank:
        d = next((i for i in range(rank) if out_dims[i] != in_dims[i]), 0)
        shape, before = in_dims, none
        after = tuple(spec_axes if i == d else None for i in range(rank))
        note = (f"partial sums on every device of {'+'.join(axes)}, summed and scattered "
                f"along dim {d}")
    elif c.kind == "all-to-all" and len(in_dims) == rank:
        grow = next((i for i in range(rank) if out_dims[i] > in_dims[i]), 0)
        shrink = next((i for i in range(rank) if out_dims[i] < in_dims[i]), 0)
        shape = tuple(max(a, b) for a, b in zip(in_dims, out_dims, strict=True))
        before = tuple(spec_axes if i == grow else None for i in range(rank))
        after = tuple(spec_axes if i == shrink else None for i in range(rank))
        note = f"resharded over {'+'.join(axes)}: dim {grow} gathered, dim {shrink} split"
    else:
        shape, before, after = out_dims, none, none
        note = ("partial sums on every device, the full sum on every device after"
                if c.kind == "all-reduce" else f"values moved between devices along "
                f"{'+'.join(axes) or '-'}")
    name = c.tensors[0] if c.tensors else c.kind
    return CollectiveLayouts(
        before=layout(shape, before, m, dtype=dtype, name=f"{name} (before {c.kind})"),
        after=layout(shape, after, m, dtype=dtype, name=f"{name} (after {c.kind})"),
        note=note, instruction=c.names[0] if c.names else "")
