"""The one train step: the sharded init of the train state and the pure step that updates it.

The plan (:mod:`workbench.planning`) compiles exactly this step and the Trainer runs it;
the state it reads and writes, before anything is allocated, is
:mod:`workbench._train_state` (shapes, logical axes, shardings).

API::

    graphdef, state = init_state(factory, optimizer, rules, mesh, seed=0)
    #   jitted with out_shardings: each device only ever holds its own shards
    train_step = make_train_step(graphdef, optimizer, rules=rules, mesh=mesh)
    step = jax.jit(train_step, in_shardings=(shardings, batch_shardings(rules, mesh)),
                   out_shardings=(shardings, None), donate_argnums=0)
    state, metrics = step(state, batch)            # metrics: loss, grad_norm (scalars)
    model = nnx.merge(graphdef, state.params)      # an nnx.Module again, for eval/inspection

(``shardings = state_shardings(...)`` and ``batch_shardings`` from
:mod:`workbench._train_state`.) A batch is ``{"inputs": int32 (B, T), "targets": int32 (B,
T)}`` with an optional float ``"mask"`` (B, T); ``{"tokens": int32 (B, T+1)}`` is split
into the two. Gradient accumulation: wrap the optimizer in ``optax.MultiSteps`` before
calling these.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from workbench import _param_init as param_init
from workbench.models import GPT, GPTConfig, _moe_stats as moe_stats
from workbench.models._pipeline import Pipeline, check_rules, stages_of
from workbench.models._pipeline import activate as pipeline_context
from workbench.any_model._spec import model_loss
from workbench.models._xent import token_cross_entropy
from workbench.models import _lora as lora_adapters
from workbench._sharding.rules import Rules
from workbench._train_state import (ModelFactory, TrainState, abstract_state, model_factory,
                                    require_auto_axes, split_param_state)

__all__ = ["LossFn", "check_loss_chunks", "chunked_token_losses", "init_state", "jit_train_step",
           "lm_loss", "lm_loss_and_stats", "loss_and_stats", "make_train_step", "seed_params",
           "sharded_init"]

LossFn = Callable[[nnx.Module, Mapping[str, jax.Array]], jax.Array]


def init_state(cfg_or_factory: GPTConfig | ModelFactory,
               optimizer: optax.GradientTransformation, rules: Rules,
               mesh: jax.sharding.Mesh, *, seed: int = 0, strict: bool = True
               ) -> tuple[nnx.GraphDef, TrainState]:
    """Initialise parameters and optimizer state directly into their shards.

    The init function is jitted with ``out_shardings``, so XLA creates each shard on its
    device and no device ever holds the whole model.
    """
    graphdef, abstract = abstract_state(cfg_or_factory, optimizer, rules, mesh, strict=strict)
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    return graphdef, sharded_init(cfg_or_factory, optimizer, shardings)(jax.random.key(seed))


def sharded_init(cfg_or_factory: GPTConfig | ModelFactory,
                 optimizer: optax.GradientTransformation | None, shardings: Any
                 ) -> Callable[[jax.Array], Any]:
    """``jax.jit(key -> TrainState, out_shardings=shardings)``; with ``optimizer=None`` it
    returns only the params (and ``shardings`` is the params' tree)."""
    model_factory(cfg_or_factory)   # a TypeError now, not inside jit
    param_shardings = shardings if optimizer is None else shardings.params

    def _init(key: jax.Array) -> Any:
        params = seed_params(cfg_or_factory, param_shardings, key)
        if optimizer is None:
            return params
        tx = lora_adapters.for_params(optimizer, params)   # adapters only, when present
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params))

    return jax.jit(_init, out_shardings=shardings)


def seed_params(cfg_or_factory: GPTConfig | ModelFactory, shardings: Any, key: jax.Array
                ) -> Any:
    """The model's parameters from ``key`` (a pure dict), to call inside ``jax.jit`` with
    ``shardings`` (the params' NamedShardings) as out_shardings: the values of
    ``factory(nnx.Rngs(params=key))``, its normal weights drawn in one random expansion
    into their shards (:mod:`workbench._param_init`)."""
    with param_init.deferred():
        _, params = split_param_state(model_factory(cfg_or_factory)(nnx.Rngs(params=key)))
    return param_init.draw(params, shardings)


def lm_loss(model: nnx.Module, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (float32) of ``model(inputs)`` against ``targets``:
    over the tokens where ``mask`` is nonzero when the batch has one. Packed rows also
    carry ``segment_ids`` and ``positions`` (:mod:`workbench.data._packing`), given to
    the model."""
    return lm_loss_and_stats(model, batch)[0]


def lm_loss_and_stats(model: nnx.Module, batch: Mapping[str, jax.Array]
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`lm_loss` and the model's MoE router statistics, stacked over layers
    (``GPT.hidden_and_stats``; ``{}`` for a dense GPT or another model)."""
    if "tokens" in batch:
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]  # (B, T) each
    else:
        inputs, targets = batch["inputs"], batch["targets"]
    packed = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}  # packed rows
    if packed and not isinstance(model, GPT):
        raise ValueError(f"packed batches (segment_ids, positions) need a wb GPT; "
                         f"{type(model).__name__} takes tokens only: train it on unpacked data")
    stats: dict[str, jax.Array] = {}
    if isinstance(model, GPT):
        x, stats = model.hidden_and_stats(inputs, **packed)                # (B, T, D)
        if model.cfg.loss_chunks > 1:
            losses = _chunked_losses(model, x, targets, model.cfg.loss_chunks)   # (B, T)
        else:
            losses = token_cross_entropy(model.head(x), targets)           # (B, T)
    else:
        losses = token_cross_entropy(model(inputs), targets)               # (B, T)
    if "mask" in batch:
        mask = batch["mask"].astype(jnp.float32)
        return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0), stats
    return jnp.mean(losses), stats


def check_loss_chunks(chunks: int, seq: int) -> None:
    """Raise when ``GPTConfig.loss_chunks`` does not divide the sequence length."""
    if seq % chunks:
        raise ValueError(
            f"GPTConfig.loss_chunks={chunks} does not divide the sequence length {seq} (the "
            f"loss is computed over {chunks} equal slices of the sequence); choose a "
            f"divisor of {seq}, or loss_chunks=1")


def chunked_token_losses(model: GPT, inputs: jax.Array, targets: jax.Array, chunks: int
                         ) -> jax.Array:
    """Per-token cross-entropy ``(B, T)`` of ``model`` without ever holding the whole
    ``(B, T, V)`` logits (``GPTConfig.loss_chunks``; MaxText's vocabulary tiling).

    The output projection and the loss run in a ``jax.lax.scan`` over ``chunks`` slices of
    the sequence, each under ``jax.checkpoint``: the forward keeps only each slice's loss,
    and the backward recomputes one slice's logits at a time, so the float32 logits live
    ``1/chunks`` at a time for one extra logits matmul. Slice ``j`` takes positions
    ``t ≡ j (mod chunks)``, so a sequence axis sharded over a context-parallel mesh axis
    stays sharded the same way in every slice. Equal to the unchunked losses up to float
    rounding.
    """
    return _chunked_losses(model, model.hidden(inputs), targets, chunks)


def _chunked_losses(model: GPT, x: jax.Array, targets: jax.Array, chunks: int
                    ) -> jax.Array:
    """:func:`chunked_token_losses` of the hidden states ``x`` (B, T, D)."""
    b, t = targets.shape
    check_loss_chunks(chunks, t)
    xs = jnp.moveaxis(x.reshape(b, t // chunks, chunks, x.shape[-1]), 2, 0)
    ts = jnp.moveaxis(targets.reshape(b, t // chunks, chunks), 2, 0)   # (chunks, B, T/c)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def slice_losses(xc: jax.Array, tc: jax.Array) -> jax.Array:
        return token_cross_entropy(model.head(xc), tc)                 # (B, T/c)

    _, losses = jax.lax.scan(lambda carry, xt: (carry, slice_losses(*xt)), None, (xs, ts))
    return jnp.moveaxis(losses, 0, 2).reshape(b, t)                    # (B, T)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, *,
                    loss_fn: LossFn | None = None, rules: Rules | None = None,
                    mesh: jax.sharding.Mesh | None = None,
                    pipeline: Pipeline | Mapping[str, Any] | None = None
                    ) -> Callable[[TrainState, Mapping[str, jax.Array]],
                                  tuple[TrainState, dict[str, jax.Array]]]:
    """A pure ``train_step(state, batch) -> (state, {"loss", "grad_norm"})`` (not jitted).

    For a mixture-of-experts model the loss includes the router losses (``moe_router_loss``)
    and the metrics add ``moe_aux_loss``, ``moe_z_loss``, ``moe_entropy``, ``moe_dropped``
    and ``moe_tokens_per_expert`` (:func:`workbench.models._moe_stats.summarize`). With
    ``rules`` and ``mesh``, activations are constrained by their logical axes while the step
    is traced; with ``pipeline`` (``{"microbatches", "schedule", "repeats"}``) a scanned
    GPT's blocks run as stages over the ``stage`` axis (:mod:`workbench.models._pipeline`),
    the loss the same function of the batch. ``loss_fn`` None: the loss a
    ``wb.any_model.from_nnx`` model carries, else :func:`lm_loss`. A model that is not a GPT
    is traced with ``mesh`` as the context mesh (``jax.sharding.use_abstract_mesh``), so its
    own ``with_sharding_constraint(x, PartitionSpec(...))`` calls resolve.
    """
    pipe_ctx = _checked_context(pipeline, rules, mesh)

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
        ctx = rules.activate(mesh) if rules is not None and mesh is not None \
            else contextlib.nullcontext()
        probe = nnx.merge(graphdef, state.params)
        fn = loss_fn or model_loss(probe) or lm_loss
        own = contextlib.nullcontext() if isinstance(probe, GPT) or mesh is None \
            else jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh))
        with ctx, own, pipe_ctx():
            def loss_of(params: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
                loss, stats = loss_and_stats(fn, nnx.merge(graphdef, params), batch)
                moe_metrics = moe_stats.summarize(stats)   # {} when dense
                if moe_metrics:
                    loss = loss + moe_metrics["router_loss"]
                return loss, moe_metrics
            if lora_adapters.has_adapters(state.params):
                params, (loss, moe_metrics), grads, opt_state = _adapter_update(
                    loss_of, optimizer, state)
            else:
                (loss, moe_metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(
                    state.params)
                updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
                params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   **{f"moe_{k}": v for k, v in moe_metrics.items()}}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics
    return train_step



def _checked_context(pipeline: Pipeline | Mapping[str, Any] | None, rules: Rules | None,
                     mesh: jax.sharding.Mesh | None) -> Callable[[], Any]:
    """The context the step runs its model in for ``pipeline`` (a no-op without one), with
    the mesh's axis types and the pipeline against the rules and the ``stage`` axis checked
    now, before tracing."""
    if mesh is not None:
        require_auto_axes(mesh)
    pipe = Pipeline.of(pipeline)
    if pipe is None:
        return contextlib.nullcontext
    if rules is None or mesh is None:
        raise ValueError("make_train_step(pipeline=...) needs rules= and mesh= (the "
                         "stage axis)")
    check_rules(pipe, rules, mesh)
    return functools.partial(pipeline_context, pipe, stages_of(mesh))


def _adapter_update(loss_of: Callable[[Any], Any], optimizer: optax.GradientTransformation,
                    state: TrainState) -> tuple[dict[Any, Any], Any, Any, Any]:
    """One LoRA update: the loss differentiated with respect to the adapters only (no
    gradient of a frozen weight is ever formed), the optimizer (``adapter_optimizer``:
    state for the adapters only) given zeros where the base is (``set_to_zero`` ignores
    them; XLA drops them), and the base passed through untouched, bit for bit.

    Returns ``(params, (loss, aux), adapter grads, opt_state)``."""
    tx = lora_adapters.adapter_optimizer(optimizer)
    base, adapters = lora_adapters.split_params(state.params)
    out, grads = jax.value_and_grad(
        lambda a: loss_of(lora_adapters.combine(base, a)), has_aux=True)(adapters)
    full = lora_adapters.combine(jax.tree.map(jnp.zeros_like, base), grads)
    updates, opt_state = tx.update(full, state.opt_state, state.params)
    new = optax.apply_updates(adapters, lora_adapters.split_params(updates)[1])
    return lora_adapters.combine(base, new), out, grads, opt_state


def loss_and_stats(loss_fn: LossFn, model: nnx.Module, batch: Mapping[str, jax.Array]
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``loss_fn(model, batch)`` and the model's MoE router statistics.

    :func:`lm_loss` gives them through :func:`lm_loss_and_stats`; another loss of a model
    with MoE layers returns ``(loss, stats)`` itself (``stats`` from
    ``model.hidden_and_stats``), so that the step adds the router loss.

    Raises:
        ValueError: a loss of a mixture-of-experts GPT that returns the loss alone.
    """
    if loss_fn is lm_loss:
        return lm_loss_and_stats(model, batch)
    out = loss_fn(model, batch)
    if isinstance(out, tuple):
        loss, stats = out
        return loss, dict(stats)
    if isinstance(model, GPT) and model.cfg.n_experts:
        raise ValueError(
            f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} returned the loss alone for "
            f"a mixture-of-experts GPT (n_experts={model.cfg.n_experts}): the step adds the "
            "router losses from the model's router statistics, which the loss must return "
            "beside it: `x, stats = model.hidden_and_stats(inputs)`, then `return loss, "
            "stats` (workbench._step.lm_loss_and_stats does this for next-token "
            "cross-entropy)")
    return out, {}


def jit_train_step(train_step: Callable[..., Any], shardings: TrainState,
                   batch_sharding: Mapping[str, NamedSharding], *, donate: bool = True,
                   compiler_options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """``jax.jit`` of ``train_step`` with state/batch in-shardings, state out-shardings and
    the state donated (its buffers are reused for the new state); ``compiler_options``:
    XLA compile options (``workbench.planning._flags.compile_options``: overlap flags)."""
    jitted = jax.jit(train_step, in_shardings=(shardings, dict(batch_sharding)),
                     out_shardings=(shardings, None), donate_argnums=(0,) if donate else (),
                     compiler_options=dict(compiler_options) if compiler_options else None)
    if compiler_options:   # part of the plan cache's key (the lowered text omits them)
        jitted._workbench_options = dict(compiler_options)
    return jitted
