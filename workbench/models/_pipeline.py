"""Pipeline parallelism in SPMD: stacked layers split into stages on the ``stage`` mesh axis.

The blocks of ``GPTConfig(scan_layers=True)`` hold parameters of shape ``(L, ...)`` on the
logical ``layers`` axis; the rules map it to the ``stage`` mesh axis, so device row ``s``
holds layers ``[s L/S, (s+1) L/S)``. The batch is cut into ``M`` micro-batches that flow
through a shifting state buffer of shape ``(S, micro-batch, T, D)`` (one slot per stage,
the stage dim sharded on ``stage``): every iteration each stage applies its layers to its
slot (a ``vmap`` over stages whose ``spmd_axis_name`` is ``stage``), then the buffer is
rolled by one stage (``jnp.roll`` on the sharded dim compiles to a collective-permute).
``jax.grad`` of the loop runs the iterations backwards: all forwards, then all backwards
(GPipe). This is MaxText's and praxis' layout, written for GSPMD without ``shard_map``.

Mixture-of-experts blocks train too: the router statistics each layer returns (see
:mod:`workbench.models._moe`) leave the loop as outputs, one per stage and iteration; the
slots of real micro-batches are picked out (the bubble's are never read) and returned per
micro-batch and layer, for the model to merge into the statistics of the whole batch
(:func:`workbench.models._moe_stats.merge_microbatches`).

Schedules:

- ``gpipe``: ``M + S - 1`` iterations, stage ``s`` busy for micro-batch ``t - s``.
- ``circular`` (``repeats=R``): each stage holds ``R`` chunks of ``L/(S R)`` layers, a
  micro-batch goes round the ring ``R`` times; ``R M + S - 1`` iterations of ``1/R`` the
  work, so the bubble shrinks ``R``-fold. Needs ``M >= S`` (a micro-batch leaving the last
  stage re-enters the first one ``M`` iterations after it first entered).
- ``1f1b``: same bubble as GPipe, fewer activations in flight (at most ``S - s`` at stage
  ``s``). Planned and drawn (:func:`workbench.models._schedule.timeline`), not trained: the
  backward of one micro-batch must run between forwards of later ones, and ``jax.grad`` of
  a loop runs every backward after every forward; 1F1B in SPMD needs a hand-written
  per-stage VJP loop.

API (``Pipeline`` and its timeline live in :mod:`workbench.models._schedule`, pure Python;
this module runs the stages)::

    pipe = Pipeline(microbatches=8, schedule="circular", repeats=2)
    pipe.bubble_fraction(stages=4)          # (S-1) / (R M + S - 1)
    pipe.on(stages=4)                       # the timeline: workbench.models._schedule
    with activate(pipe, stages=4):          # inside the traced step (workbench._step does it)
        logits = model(tokens)              # blocks run through run_pipeline
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench._sharding import tracing
from workbench.models._schedule import SCHEDULES, TRAINABLE_SCHEDULES, Pipeline
from workbench._sharding.rules import STAGE_AXIS
from workbench._sharding.rules import active as active_rules

__all__ = ["SCHEDULES", "STAGE_AXIS", "TRAINABLE_SCHEDULES", "Pipeline", "activate", "active",
           "check_pipeline", "check_rules", "run_pipeline", "stages_of"]


def stages_of(mesh: Any) -> int:
    """Size of the ``stage`` axis of a Mesh / AbstractMesh / MeshInfo (1 without one)."""
    return int(dict(mesh.shape).get(STAGE_AXIS, 1))


def check_rules(pipe: Pipeline | None, rules: Any, mesh: Any) -> None:
    """Raise unless ``rules`` pipeline the ``layers`` axis over the mesh's ``stage`` axis
    and shard nothing else over it (before anything is traced)."""
    if pipe is None:
        return
    names = tuple(mesh.axis_names)
    if STAGE_AXIS not in names:
        raise ValueError(
            f"pipeline={pipe.to_dict()} needs a {STAGE_AXIS!r} mesh axis (its size is the "
            f"number of stages); mesh axes are {names}. Add one, e.g. mesh={{'stage': 4, "
            f"'data': -1}}, or pass pipeline=None")
    layers = rules.get("layers")
    if layers != STAGE_AXIS:
        raise ValueError(
            f"rules map 'layers' to {layers!r}, but pipeline stages split the layers over the "
            f"{STAGE_AXIS!r} mesh axis: use rules.replace(layers={STAGE_AXIS!r}) (the presets "
            f"do this when the mesh has a {STAGE_AXIS!r} axis)")
    for logical, axes in rules.items():
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if logical != "layers" and STAGE_AXIS in axes:
            raise ValueError(
                f"rules shard {logical!r} over {axes!r}, but the {STAGE_AXIS!r} axis holds "
                f"pipeline stages (layers) only: map {logical!r} to other mesh axes, e.g. "
                f"rules.replace({logical}={tuple(a for a in axes if a != STAGE_AXIS) or None!r})")


def check_pipeline(pipe: Pipeline, *, n_layers: int, stages: int, batch: int | None = None,
                   batch_shards: int = 1, train: bool = True) -> None:
    """Raise a ValueError naming the value, the constraint and the fix (before compiling).

    Args:
        n_layers: the model's layers.
        stages: size of the ``stage`` mesh axis.
        batch: global batch per step (None: not checked).
        batch_shards: devices the batch dim of a micro-batch is split over.
        train: also refuse schedules that are only planned ("1f1b").
    """
    if n_layers % (stages * pipe.repeats):
        per = stages * pipe.repeats
        raise ValueError(
            f"n_layers={n_layers} is not divisible by stages x repeats = {stages} x "
            f"{pipe.repeats} = {per}: each stage holds repeats chunks of equal depth. Use "
            f"n_layers a multiple of {per} (e.g. {per * max(1, round(n_layers / per))}), or a "
            f"stage axis / repeats whose product divides {n_layers}")
    if pipe.schedule == "circular" and pipe.repeats > 1 and pipe.microbatches < stages:
        raise ValueError(
            f"circular schedule with microbatches={pipe.microbatches} < stages={stages}: a "
            f"micro-batch re-enters stage 0 M iterations after it entered, before it left "
            f"the last stage. Use microbatches >= {stages}")
    if train and pipe.schedule not in TRAINABLE_SCHEDULES:
        raise ValueError(
            f"schedule={pipe.schedule!r} is planned and drawn but not trained: jax.grad of "
            f"the pipeline loop runs every backward after every forward, so 1F1B's "
            f"interleaving needs a hand-written backward. Train with schedule='gpipe' (same "
            f"bubble) or 'circular'")
    if batch is not None:
        if batch % pipe.microbatches:
            raise ValueError(
                f"batch={batch} is not divisible by microbatches={pipe.microbatches}; use a "
                f"batch that is a multiple of {pipe.microbatches} or microbatches dividing "
                f"{batch}")
        micro = batch // pipe.microbatches
        if micro % batch_shards:
            raise ValueError(
                f"a micro-batch of batch/microbatches = {batch}/{pipe.microbatches} = {micro} "
                f"sequences does not split over the {batch_shards} devices of the batch axes; "
                f"use a batch that is a multiple of {pipe.microbatches * batch_shards} or "
                f"fewer micro-batches")


# ------------------------------------------------------------------ the traced pipeline
@contextlib.contextmanager
def activate(pipe: Pipeline, stages: int) -> Iterator[Pipeline]:
    """While tracing inside this block, GPT's stacked blocks run through the pipeline
    (``workbench._sharding.tracing.scoped(pipeline=pipe, stages=stages)``)."""
    with tracing.scoped(pipeline=pipe, stages=int(stages)):
        yield pipe


def active() -> tuple[Pipeline, int] | None:
    """The ``(pipeline, stages)`` set by :func:`activate`, or None."""
    ctx = tracing.current()
    return None if ctx.pipeline is None else (ctx.pipeline, ctx.stages)


def _constrain(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    ctx = active_rules()
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx[1], spec))


def _activation_spec(rank: int) -> tuple[Any, ...]:
    """Mesh axes of one micro-batch's ``(mb, T, D)`` under the active rules."""
    ctx = active_rules()
    if ctx is None:
        return (None,) * rank
    rules = ctx[0]
    axes = ("batch", "seq", *([None] * (rank - 2)))
    spec = rules.spec(axes, tensor="pipeline state", strict=False)
    return tuple(PartitionSpec.UNCONSTRAINED if a is not None and a not in rules else s
                 for a, s in zip(axes, spec, strict=True))


def _batch_shards() -> int:
    """Devices the batch is split over under the active rules (1 outside them)."""
    ctx = active_rules()
    if ctx is None:
        return 1
    sizes = dict(ctx[1].shape)
    return int(np.prod([sizes[a] for a in ctx[0].axes("batch")], dtype=int))


def _stage_weights(params: Any, state: Any, r_: int, s_: int, k_: int,
                   stage_axis: str | None) -> Any:
    """The stacked weights ``(L, ...) -> (R, S, K, ...)``: logical layer ``r S K + s K + k``
    runs on stage ``s`` in round ``r``; the stage dimension over ``stage_axis``, the rest
    as the weights' own annotations say."""
    specs = _param_specs(state)

    def split_layers(path: Any, w: jax.Array) -> jax.Array:
        w = w.reshape(r_, s_, k_, *w.shape[1:])
        rest = specs.get(_path(path), (None,) * (w.ndim - 3))
        return _constrain(w, PartitionSpec(None, stage_axis, None, *rest))
    return jax.tree_util.tree_map_with_path(split_layers, params)


def run_pipeline(run_block: Callable[[Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]],
                 blocks: nnx.Module, x: jax.Array, pipe: Pipeline, stages: int
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``x`` (B, T, D) through the stacked ``blocks`` pipelined over ``stages`` stages.

    The same function of ``x`` and the parameters as a scan over the layers in order.

    Args:
        run_block: ``(block, h) -> (h, stats)``, remat included (GPT's loop body);
            ``stats`` a dict of arrays (a MoE block's router statistics; ``{}`` when
            dense).
        blocks: one ``Block`` whose params stack ``L`` layers on a leading axis.
        x: the residual stream of the whole batch.
        pipe: micro-batches, schedule and repeats.
        stages: ``S``, the size of the ``stage`` mesh axis.

    Returns:
        ``(y, stats)``: ``y`` (B, T, D), and each entry of the blocks' ``stats`` with
        leading axes ``(M, L)``: micro-batch, then layer in layer order (bubble iterations
        left out), to be merged over micro-batches by the caller
        (:func:`workbench.models._moe_stats.merge_microbatches` gives the whole batch's).
    """
    graphdef, state = nnx.split(blocks)
    params = nnx.to_pure_dict(state)
    n_layers = jax.tree.leaves(params)[0].shape[0]
    check_pipeline(pipe, n_layers=n_layers, stages=stages, batch=x.shape[0],
                   batch_shards=_batch_shards())
    s_, r_, m_ = stages, pipe.repeats, pipe.microbatches
    stage_axis = STAGE_AXIS if active_rules() is not None else None
    w = _stage_weights(params, state, r_, s_, n_layers // (s_ * r_), stage_axis)

    batch, *feat = x.shape
    mb = batch // m_
    act = _activation_spec(x.ndim)
    # micro-batch m = sequences m, m + M, m + 2M, ...: each keeps the batch sharding.
    xs = jnp.swapaxes(x.reshape(mb, m_, *feat), 0, 1)                # (M, mb, T, D)
    xs = _constrain(xs, PartitionSpec(None, *act))
    state_spec = PartitionSpec(stage_axis, *act)

    def stage_fn(w_stage: Any, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        def body(h: jax.Array, layer: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
            return run_block(nnx.merge(graphdef, layer), h)   # stats: scan outputs
        return jax.lax.scan(body, h, w_stage)           # w: (K, ...); stats (K, ...)

    v_stage = jax.vmap(stage_fn, spmd_axis_name=stage_axis)
    take = jax.vmap(lambda a, r: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False),
                    in_axes=(1, 0), spmd_axis_name=stage_axis)
    stage_ids = jnp.arange(s_)
    first_stage = (stage_ids == 0).reshape(s_, *([1] * x.ndim))

    def iteration(carry: tuple[jax.Array, jax.Array], t: jax.Array
                  ) -> tuple[tuple[jax.Array, jax.Array], dict[str, jax.Array]]:
        out, buf = carry       # out: (S, mb, T, D) last outputs; buf: (M, mb, T, D)
        shifted = _constrain(jnp.roll(out, 1, axis=0), state_spec)   # collective-permute
        done = t - s_          # item that left the last stage in the previous iteration
        buf = jnp.where(done >= 0, jax.lax.dynamic_update_index_in_dim(
            buf, shifted[0], jnp.maximum(done, 0) % m_, 0), buf)
        first = jax.lax.dynamic_index_in_dim(buf, t % m_, 0, keepdims=False)
        inp = _constrain(jnp.where(first_stage, first[None], shifted), state_spec)
        if r_ == 1:
            w_t = jax.tree.map(lambda a: a[0], w)                     # (S, K, ...)
        else:
            rounds = jnp.clip((t - stage_ids) // m_, 0, r_ - 1)        # (S,)
            w_t = jax.tree.map(lambda a: take(a, rounds), w)
        out, stats = v_stage(w_t, inp)                                # stats (S, K, ...)
        return (_constrain(out, state_spec), buf), stats

    out0 = _constrain(jnp.zeros((s_, mb, *feat), x.dtype), state_spec)
    (out, buf), stats = jax.lax.scan(iteration, (out0, xs),
                                     jnp.arange(pipe.iterations(s_)))  # (R M + S - 1, S, K, ...)
    last = (r_ * m_ - 1) % m_                      # the final item left in the last iteration
    buf = jax.lax.dynamic_update_index_in_dim(buf, out[s_ - 1], last, 0)
    return jnp.swapaxes(buf, 0, 1).reshape(batch, *feat), _layer_stats(stats, pipe, s_)


def _layer_stats(stats: dict[str, jax.Array], pipe: Pipeline, stages: int
                 ) -> dict[str, jax.Array]:
    """Block outputs per iteration and stage ``(R M + S - 1, S, K, ...)`` -> per
    micro-batch and layer ``(M, L, ...)``, layers in layer order.

    Stage ``s`` works on item ``i = t - s`` in iteration ``t`` (micro-batch ``i % M`` in
    round ``i // M``) when ``0 <= i < R M``; the other slots are the bubble (garbage
    inputs) and are not read.
    """
    r_, m_, s_ = pipe.repeats, pipe.microbatches, stages
    r, s, m = np.meshgrid(np.arange(r_), np.arange(s_), np.arange(m_), indexing="ij")
    t = r * m_ + m + s                                               # (R, S, M) iterations
    picked = {k: jnp.moveaxis(v[t, s], 2, 0) for k, v in stats.items()}  # (M, R, S, K, ...)
    # layer r S K + s K + k: (R, S, K) in row-major order is layer order
    return {k: v.reshape(m_, -1, *v.shape[4:]) for k, v in picked.items()}


def _path(path: Any) -> str:
    """A parameter's path as one string (``workbench._sharding.pytrees.path_str``'s spelling)."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


def _param_specs(state: Any) -> dict[str, tuple[Any, ...]]:
    """Mesh axes of each stacked parameter's dims after ``layers`` (active rules)."""
    ctx = active_rules()
    if ctx is None:
        return {}
    rules = ctx[0]
    out: dict[str, tuple[Any, ...]] = {}
    for path, var in nnx.to_flat_state(state):
        axes = tuple(var.get_metadata().get("out_sharding") or (None,) * len(var.shape))
        out[_path(path)] = tuple(rules.spec(axes[1:], tensor=_path(path), strict=False))
    return out
