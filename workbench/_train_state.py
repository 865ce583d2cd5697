"""The train state before anything is allocated: its pytree, shapes, logical axes and shardings.

:func:`workbench._step.init_state` allocates this state into its shards and
:func:`workbench._step.make_train_step` updates it; the plan (:mod:`workbench.planning`)
reads it as it is here, with nothing on a device (``nnx.eval_shape``, ``jax.eval_shape``).

API::

    factory = model_factory(cfg)                   # GPTConfig or (rngs -> nnx.Module)
    graphdef, abstract = abstract_state(factory, optimizer, rules, mesh)
    #   abstract: TrainState of ShapeDtypeStruct with NamedSharding; nothing allocated
    shardings = state_shardings(factory, optimizer, rules, mesh)   # TrainState of NamedSharding
    st = abstract_train_state(factory, optimizer, rules, mesh, strict=False)
    #   the same plus logical axes of every sharded leaf and the axes without a rule (the plan)
    batch_abs = abstract_batch(example, rules, mesh)   # dim 0 "batch", tokens' dim 1 "seq"

``TrainState(step, params, opt_state)``: ``params`` is a plain nested dict of arrays
(``nnx.to_pure_dict`` of the model's ``nnx.Param`` state), so optax and Orbax see an
ordinary pytree. Batch entries are sharded by the rules for ``("batch", "seq")`` when they
are integer arrays of rank >= 2 (tokens), else for ``("batch", None, ...)``
(:func:`batch_logical_axes`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench.models import GPT, GPTConfig
from workbench.models import _lora as lora_adapters
from workbench.models._moe_choice import check_layout as check_moe_layout
from workbench.any_model._spec import ModelSpec, build_without_mesh, resolve_rules
from workbench._sharding.pytrees import path_str
from workbench._sharding.rules import LOGICAL_AXES, Rules

__all__ = ["AbstractTrainState", "ModelFactory", "TrainState", "abstract_batch",
           "abstract_model", "abstract_param_state", "abstract_state", "abstract_train_state",
           "batch_logical_axes", "batch_shardings", "check_rule_names", "logical_axes",
           "model_factory", "opt_state_params", "param_specs", "require_auto_axes",
           "split_param_state", "state_shardings"]

ModelFactory = Callable[[nnx.Rngs], nnx.Module]


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


def split_param_state(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
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
    return split_param_state(model)


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
    return split_param_state(nnx.eval_shape(lambda: factory(nnx.Rngs(0))))


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
        check_moe_layout(cfg_or_factory, rules, mesh)   # experts vs the expert axis
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
    state, state_logical = _with_shardings(state, mirrors, logical, specs, mesh)
    return AbstractTrainState(graphdef=graphdef, param_state=param_state, state=state,
                              logical=state_logical, unmapped=unmapped)


def _with_shardings(state: TrainState, mirrors: list[str | None],
                    logical: Mapping[str, tuple[str | None, ...]],
                    specs: Mapping[str, PartitionSpec], mesh: Any
                    ) -> tuple[TrainState, dict[str, tuple[str | None, ...]]]:
    """``state``'s leaves as ShapeDtypeStructs carrying their NamedSharding: the spec of
    the parameter each mirrors (``mirrors``, in flattened order; None: replicated), and
    ``{leaf path: logical axes}`` of the sharded ones."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    out, state_logical = [], {}
    for (path, a), param in zip(flat, mirrors, strict=True):
        if param is not None:
            state_logical[path_str(path)] = logical[param]
        spec = specs[param] if param is not None else PartitionSpec()
        out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)))
    return jax.tree.unflatten(treedef, out), state_logical


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

