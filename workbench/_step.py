"""The one train step: state pytree, shardings from logical axes, sharded init, pure step.

The plan (:mod:`workbench.planning`) compiles exactly this step and the Trainer runs it.

API::

    factory = model_factory(cfg)                   # GPTConfig or (rngs -> nnx.Module)
    graphdef, abstract = abstract_state(factory, optimizer, rules, mesh)
    #   abstract: TrainState of ShapeDtypeStruct with NamedSharding; nothing allocated
    shardings = state_shardings(factory, optimizer, rules, mesh)   # TrainState of NamedSharding
    graphdef, state = init_state(factory, optimizer, rules, mesh, seed=0)
    #   jitted with out_shardings: each device only ever holds its own shards
    train_step = make_train_step(graphdef, optimizer, rules=rules, mesh=mesh)
    step = jax.jit(train_step, in_shardings=(shardings, batch_shardings(rules, mesh)),
                   out_shardings=(shardings, None), donate_argnums=0)
    state, metrics = step(state, batch)            # metrics: loss, grad_norm (scalars)
    model = nnx.merge(graphdef, state.params)      # an nnx.Module again, for eval/inspection

    st = abstract_train_state(factory, optimizer, rules, mesh, strict=False)
    #   the same plus logical axes of every sharded leaf and the axes without a rule (the plan)
    batch_abs = abstract_batch(example, rules, mesh)   # any batch: dim 0 "batch", tokens' dim 1 "seq"

``TrainState(step, params, opt_state)``: ``params`` is a plain nested dict of arrays
(``nnx.to_pure_dict`` of the model's ``nnx.Param`` state), so optax and Orbax see an
ordinary pytree. A batch is ``{"inputs": int32 (B, T), "targets": int32 (B, T)}`` with an
optional float ``"mask"`` (B, T); ``{"tokens": int32 (B, T+1)}`` is split into the two.
Batch entries are sharded by the rules for ``("batch", "seq")`` when they are integer
arrays of rank >= 2 (tokens), else for ``("batch", None, ...)`` (:func:`batch_logical_axes`).
Gradient accumulation: wrap the optimizer in ``optax.MultiSteps`` before calling these.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench import _param_init as param_init
from workbench.models import GPT, GPTConfig, _moe as moe
from workbench.models._pipeline import Pipeline, check_rules, stages_of
from workbench.models._pipeline import activate as pipeline_context
from workbench.any_model._spec import ModelSpec, build_without_mesh, model_loss, resolve_rules
from workbench.models._xent import token_cross_entropy
from workbench.models import _lora as lora_adapters
from workbench._sharding.pytrees import path_str
from workbench._sharding.rules import LOGICAL_AXES, Rules

__all__ = ["AbstractTrainState", "LossFn", "ModelFactory", "TrainState", "abstract_batch",
           "abstract_model", "abstract_state", "abstract_train_state", "batch_logical_axes",
           "batch_shardings", "init_state", "jit_train_step", "lm_loss", "lm_loss_and_stats", "logical_axes",
           "loss_and_stats", "make_train_step", "model_factory", "param_specs", "path_str", "require_auto_axes",
           "seed_params", "sharded_init", "state_shardings"]

ModelFactory = Callable[[nnx.Rngs], nnx.Module]
LossFn = Callable[[nnx.Module, Mapping[str, jax.Array]], jax.Array]


class TrainState(NamedTuple):
    """Everything a train step reads and writes.

    Attributes:
        step: int32 scalar, optimizer steps taken.
        params: plain nested dict of parameter arrays (same tree as ``nnx.to_pure_dict``).
        opt_state: the optax state for ``params``.
    """

    step: Any
    params: Any
    opt_state: Any


def model_factory(cfg_or_factory: GPTConfig | ModelFactory) -> ModelFactory:
    """``rngs -> model``: a GPTConfig becomes ``GPT(cfg, rngs=rngs)``; callables pass through."""
    if isinstance(cfg_or_factory, GPTConfig):
        cfg = cfg_or_factory
        return lambda rngs: GPT(cfg, rngs=rngs)
    if callable(cfg_or_factory):
        if isinstance(cfg_or_factory, ModelSpec):
            return cfg_or_factory
        factory = cfg_or_factory
        return functools.wraps(factory)(lambda rngs: build_without_mesh(factory, rngs))
    raise TypeError(f"expected a GPTConfig or a callable rngs -> nnx.Module, got "
                    f"{type(cfg_or_factory).__name__}")


def require_auto_axes(mesh: Any) -> None:
    """Raise unless every axis of ``mesh`` is ``AxisType.Auto`` (what the step relies on)."""
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    if any(t != jax.sharding.AxisType.Auto for t in types):
        names = tuple(mesh.axis_names)
        raise ValueError(
            f"mesh axes {names} have axis types {tuple(t.name for t in types)}; the train step "
            f"names logical axes and lets GSPMD propagate shardings, so it needs Auto axes: "
            f"build the mesh with wb.make_mesh(...) or jax.make_mesh(..., axis_types="
            f"(jax.sharding.AxisType.Auto,) * {len(names)})")


def _split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(rest)})
        raise TypeError(f"the train step handles models whose state is nnx.Param only; "
                        f"this model also holds {kinds}")
    return graphdef, params


def abstract_param_state(cfg_or_factory: GPTConfig | ModelFactory
                         ) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, nnx.State of abstract nnx.Param)`` via ``nnx.eval_shape`` (no allocation);
    the Variables keep their logical axes as ``out_sharding`` metadata."""
    if isinstance(cfg_or_factory, GPTConfig):
        return _abstract_gpt(cfg_or_factory)
    factory = model_factory(cfg_or_factory)
    model = nnx.eval_shape(lambda: _built(factory, nnx.Rngs(0)))
    return _split_params(model)


def _built(factory: ModelFactory, rngs: nnx.Rngs) -> nnx.Module:
    """``factory(rngs)``, refused unless it is an ``nnx.Module``."""
    model = factory(rngs)
    if not isinstance(model, nnx.Module):
        name = getattr(factory, "__name__", None) or getattr(factory, "name", "factory")
        raise TypeError(f"the model factory {name!r} returned {model!r:.60} (a "
                        f"{type(model).__name__}), not an nnx.Module; a factory is rngs -> "
                        "nnx.Module, e.g. lambda rngs: MyModel(rngs=rngs)")
    return model


@functools.lru_cache(maxsize=16)
def _abstract_gpt(cfg: GPTConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The abstract GPT of a config, built once per config: shapes and logical axes do not
    depend on the mesh or the rules, and ``wb.search`` plans one config many times.
    Callers must not mutate the returned state."""
    factory = model_factory(cfg)
    return _split_params(nnx.eval_shape(lambda: factory(nnx.Rngs(0))))


def logical_axes(param_state: nnx.State) -> dict[str, tuple[str | None, ...]]:
    """``{'blocks.0.attn.q': ('embed', 'heads', 'head_dim'), ...}`` from Param metadata."""
    logical: dict[str, tuple[str | None, ...]] = {}
    for path, var in nnx.to_flat_state(param_state):
        axes = var.get_metadata().get("out_sharding")
        logical[path_str(path)] = tuple(axes) if axes is not None else (None,) * len(var.shape)
    return logical


def abstract_model(cfg_or_factory: GPTConfig | ModelFactory
                   ) -> tuple[nnx.GraphDef, Any, dict[str, tuple[str | None, ...]]]:
    """Build the model with ``nnx.eval_shape`` (no allocation).

    Returns:
        ``(graphdef, params, logical)``: ``params`` a pure dict of ShapeDtypeStruct;
        ``logical`` maps each parameter path (``'blocks.0.attn.q'``) to its logical axes.
    """
    graphdef, params = abstract_param_state(cfg_or_factory)
    return graphdef, nnx.to_pure_dict(params), logical_axes(params)


def param_specs(params: Any, logical: Mapping[str, tuple[str | None, ...]], rules: Rules, *,
                strict: bool = True) -> Any:
    """Tree of PartitionSpec for ``params`` from their logical axes and ``rules``."""
    def spec(path: tuple[Any, ...], leaf: Any) -> PartitionSpec:
        name = path_str(path)
        return rules.spec(logical[name], tensor=name, strict=strict)
    return jax.tree_util.tree_map_with_path(spec, params)


def opt_state_params(opt_state: Any, params: Any) -> list[str | None]:
    """For each leaf of an optax state (flattened order), the path of the parameter it
    mirrors: the longest parameter path its key path ends with, of the same shape (Adam's
    mu/nu, MultiSteps' buffers); None for counts, scalars and factored moments."""
    shapes = {path_str(p): tuple(x.shape)
              for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    depths = sorted({k.count(".") + 1 for k in shapes}, reverse=True)
    out: list[str | None] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        parts = path_str(path).split(".")
        shape = tuple(getattr(leaf, "shape", ()))
        out.append(next((c for d in depths if shapes.get(c := ".".join(parts[-d:])) == shape),
                        None))
    return out


class AbstractTrainState(NamedTuple):
    """The train state before anything is allocated (:func:`abstract_train_state`).

    Attributes:
        graphdef: the model's ``nnx.GraphDef``.
        param_state: ``nnx.State`` of abstract ``nnx.Param`` (logical axes in metadata).
        state: ``TrainState`` of ``ShapeDtypeStruct`` carrying their ``NamedSharding``.
        logical: ``{path: logical axes}`` of every sharded leaf of ``state``
            (``'params.blocks.0.attn.q'``, ``'opt_state.0.mu.blocks.0.attn.q'``); leaves
            not listed (step, counts) are replicated.
        unmapped: ``{logical axis: [parameter paths]}`` for logical axes without a rule
            (replicated; only non-empty with ``strict=False``).
    """

    graphdef: nnx.GraphDef
    param_state: nnx.State
    state: TrainState
    logical: dict[str, tuple[str | None, ...]]
    unmapped: dict[str, list[str]]

    @property
    def shardings(self) -> TrainState:
        """``TrainState`` of ``NamedSharding``."""
        return jax.tree.map(lambda a: a.sharding, self.state)


def abstract_train_state(cfg_or_factory: GPTConfig | ModelFactory,
                         optimizer: optax.GradientTransformation, rules: Rules,
                         mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, *,
                         strict: bool = True,
                         abstract: tuple[nnx.GraphDef, nnx.State] | None = None
                         ) -> AbstractTrainState:
    """Params and optimizer state as ShapeDtypeStructs with their shardings; no allocation.

    Parameters are sharded by ``rules`` from their logical axes; an optimizer leaf that
    mirrors a parameter (:func:`opt_state_params`) like that parameter; the rest replicated.

    Args:
        mesh: a ``Mesh``, or an ``AbstractMesh`` to plan hardware you do not have.
        strict: raise on logical axes without a rule (False replicates them and lists them
            in ``unmapped``; the plan reports them as a lint).
        abstract: ``abstract_param_state(cfg_or_factory)`` when the caller has it already.
    """
    rules.check_mesh(mesh)
    require_auto_axes(mesh)
    if strict and isinstance(cfg_or_factory, GPTConfig):   # (plans: a lint instead)
        moe.check_layout(cfg_or_factory, rules, mesh)   # experts vs the expert axis
    graphdef, param_state = abstract if abstract is not None else \
        abstract_param_state(cfg_or_factory)
    params, logical = nnx.to_pure_dict(param_state), logical_axes(param_state)
    if not isinstance(cfg_or_factory, GPTConfig):  # rules for a model's own axis names
        spec = cfg_or_factory if isinstance(cfg_or_factory, ModelSpec) else None
        rules = resolve_rules(logical, rules, mesh, spec=spec)
    check_rule_names(rules, logical, cfg_or_factory)
    unmapped: dict[str, list[str]] = {}
    for tensor, axes in logical.items():
        for ax in rules.unmapped(axes):
            unmapped.setdefault(ax, []).append(tensor)
    specs = {k: rules.spec(v, tensor=k, strict=strict) for k, v in logical.items()}
    # a model with LoRA adapters: the optimizer (and its state) covers the adapters only
    optimizer = lora_adapters.for_params(optimizer, params)
    opt_state = jax.eval_shape(optimizer.init, params)
    param_paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    mirrors = [None, *param_paths, *opt_state_params(opt_state, params)]  # step, params, opt
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                       opt_state=opt_state)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    out, state_logical = [], {}
    for (path, a), param in zip(flat, mirrors, strict=True):
        if param is not None:
            state_logical[path_str(path)] = logical[param]
        spec = specs[param] if param is not None else PartitionSpec()
        out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)))
    return AbstractTrainState(graphdef=graphdef, param_state=param_state,
                              state=jax.tree.unflatten(treedef, out), logical=state_logical,
                              unmapped=unmapped)


def check_rule_names(rules: Rules, logical: Mapping[str, tuple[str | None, ...]],
                     cfg_or_factory: Any) -> None:
    """Refuse a rule for a logical axis this model does not use (``Rules.check_names``):
    its tensors' annotation names, Workbench's logical axes, and the names a model's
    ``rules_for`` (penzai) derives from them."""
    used = {a for axes in logical.values() for a in axes if a is not None}
    used.update(LOGICAL_AXES)
    to_own = getattr(cfg_or_factory, "rules_for", None)
    if to_own is not None:
        used.update(to_own(Rules(**dict.fromkeys(LOGICAL_AXES))))
    name = getattr(cfg_or_factory, "name", None)
    rules.check_names(used, model=f"model {name!r}" if isinstance(name, str) else "the model")


def abstract_state(cfg_or_factory: GPTConfig | ModelFactory,
                   optimizer: optax.GradientTransformation, rules: Rules,
                   mesh: jax.sharding.Mesh, *, strict: bool = True
                   ) -> tuple[nnx.GraphDef, TrainState]:
    """``(graphdef, TrainState of ShapeDtypeStruct carrying NamedSharding)``; no allocation
    (:func:`abstract_train_state` without the logical axes)."""
    a = abstract_train_state(cfg_or_factory, optimizer, rules, mesh, strict=strict)
    return a.graphdef, a.state


def state_shardings(cfg_or_factory: GPTConfig | ModelFactory,
                    optimizer: optax.GradientTransformation, rules: Rules,
                    mesh: jax.sharding.Mesh, *, strict: bool = True) -> TrainState:
    """TrainState-shaped pytree of NamedSharding (from the parameters' logical axes)."""
    return abstract_train_state(cfg_or_factory, optimizer, rules, mesh, strict=strict).shardings


def batch_logical_axes(x: Any) -> tuple[str | None, ...]:
    """Logical axes of one batch entry: dim 0 is ``"batch"``; dim 1 of an integer array of
    rank >= 2 (token ids, ``(B, T)``) is ``"seq"``; every other dim is None (features,
    float masks). A ``seq`` rule thus shards token arrays along the sequence."""
    rank = len(x.shape)
    if rank == 0:
        return ()
    seq = rank >= 2 and jnp.issubdtype(x.dtype, jnp.integer)
    return ("batch", "seq" if seq else None, *([None] * (rank - 2)))[:rank]


def batch_shardings(rules: Rules, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, *,
                    keys: tuple[str, ...] = ("inputs", "targets"),
                    example: Mapping[str, Any] | None = None) -> dict[str, NamedSharding]:
    """NamedSharding per batch entry, by the rules for :func:`batch_logical_axes`.

    Args:
        keys: the entries of a language-model batch, each int32 ``(B, T)``: sharded by the
            rules for ``("batch", "seq")``.
        example: instead of ``keys``, any batch (arrays or ShapeDtypeStructs).
    """
    if example is None:
        example = {k: jax.ShapeDtypeStruct((1, 1), jnp.int32) for k in keys}
    return {k: NamedSharding(mesh, rules.spec(batch_logical_axes(v), tensor=f"batch.{k}",
                                              strict=False))
            for k, v in example.items()}


def abstract_batch(example: Mapping[str, Any], rules: Rules,
                   mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
                   ) -> dict[str, jax.ShapeDtypeStruct]:
    """``example``'s entries as ShapeDtypeStructs carrying :func:`batch_shardings`."""
    sh = batch_shardings(rules, mesh, example=example)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in example.items()}


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
        _, params = _split_params(model_factory(cfg_or_factory)(nnx.Rngs(params=key)))
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

    For a mixture-of-experts model the loss includes the router losses
    (``moe_router_loss``: load balance and z-loss, weighted by the config) and the metrics
    add ``moe_aux_loss``, ``moe_z_loss``, ``moe_entropy``, ``moe_dropped`` and
    ``moe_tokens_per_expert`` (int32 ``(moe layers, experts)``); see
    :func:`workbench.models._moe.summarize`.

    With ``rules`` and ``mesh``, activations are constrained by their logical axes while
    the step is traced. With ``pipeline`` (``{"microbatches", "schedule", "repeats"}``),
    a scanned GPT's blocks run as pipeline stages over the mesh's ``stage`` axis
    (:mod:`workbench.models._pipeline`): the batch is cut into micro-batches inside the
    model; the loss is the same function of the batch. ``loss_fn`` None: the loss a
    ``wb.any_model.from_nnx`` model carries, else :func:`lm_loss`. A model that is not a GPT
    is traced with ``mesh`` as the context mesh (``jax.sharding.use_abstract_mesh``), so
    its own ``with_sharding_constraint(x, PartitionSpec(...))`` calls resolve (the Flax
    sharding guide's models).
    """
    if mesh is not None:
        require_auto_axes(mesh)
    pipe = Pipeline.of(pipeline)
    pipe_ctx: Callable[[], Any] = contextlib.nullcontext
    if pipe is not None:
        if rules is None or mesh is None:
            raise ValueError("make_train_step(pipeline=...) needs rules= and mesh= (the "
                             "stage axis)")
        check_rules(pipe, rules, mesh)
        pipe_ctx = functools.partial(pipeline_context, pipe, stages_of(mesh))
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
                moe_metrics = moe.summarize(stats)   # {} when dense
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
