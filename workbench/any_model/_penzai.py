"""penzai models as Workbench models: ``wb.any_model.from_penzai(builder_or_model)``.

A penzai model's parameters are named-axis arrays (``{"embedding": 64, "neurons": 256}``);
their axis names become the logical axes of an NNX module that holds the same arrays as
``nnx.Param`` (axes in penzai's order), so ``wb.plan``, ``wb.show``, ``wb.compare``,
``wb.search`` and the Trainer take it like any NNX model. ``Rules`` over Workbench's
logical axes (the presets) are turned into rules over penzai's names by
``rules.penzai_rules`` (``embed -> embedding``, ``mlp -> neurons``, ...)::

    from penzai.models.transformer.variants import llamalike_common as lc
    config = lc.LlamalikeTransformerConfig(num_kv_heads=2, query_head_multiplier=2, ...)
    spec = wb.any_model.from_penzai(
        lambda key: lc.build_llamalike_transformer(config, init_base_rng=key),
        config=config)
    plan = wb.plan(spec, mesh=wb.make_mesh(data=4, model=2), rules="fsdp_tp", batch=8, seq=64)

The forward pass is penzai's: tokens ``(B, T)`` are tagged ``("batch", "seq")``, the
model returns logits named ``("batch", "seq", "vocabulary")``, and the loss is the
next-token cross-entropy of ``workbench._step.lm_loss``.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from workbench._sharding import tracing
from workbench._validate import check_str
from workbench.any_model._spec import ModelSpec
from workbench._sharding.rules import PENZAI_AXES, constrain, penzai_rules

__all__ = ["PENZAI_AXES", "PenzaiModel", "from_penzai", "penzai_tree",
           "with_activation_records"]

#: The penzai structure (parameter slots) of each adapted model, by a token that the NNX
#: module keeps as a static attribute (penzai's structures hold arrays, which a GraphDef
#: cannot hash). Filled whenever the factory builds the model.
_STRUCTURES: dict[int, Any] = {}
_TOKENS = itertools.count()


def _param_path(label: str) -> tuple[str, ...]:
    """``'transformer/block_0/attention/query.weights'`` -> ``('block_0', 'attention',
    'query', 'weights')`` (the top-level name dropped, ``/`` and ``.`` split)."""
    parts = [p for p in re.split(r"[/.]", label) if p]
    return tuple(parts[1:]) if len(parts) > 1 else tuple(parts)


class PenzaiModel(nnx.Module):
    """An NNX module holding a penzai model's parameters as ``nnx.Param`` whose logical
    axes are penzai's axis names; calling it runs the penzai model on int32 tokens
    ``(B, T)`` and returns logits ``(B, T, vocabulary)``.

    Attributes:
        params: nested ``nnx.Dict`` of the parameters (path from the penzai label).
        labels: static ``((label, path, axis names), ...)``.
    """

    def __init__(self, model: Any) -> None:
        from penzai import pz

        slots, values = pz.unbind_params(model, freeze=True)
        # the structure's own arrays (rescale factors, mask values) must be concrete: it
        # outlives the trace that built it (``from_penzai`` builds it under ``jax.ensure_compile_time_eval``)
        token = next(_TOKENS)
        _STRUCTURES[token] = slots
        self.structure = token
        labels = []
        self.params = nnx.Dict()
        for v in values:
            arr = v.value
            if arr.positional_shape:
                raise ValueError(f"penzai parameter {v.label!r} has positional axes "
                                 f"{arr.positional_shape}; from_penzai needs every axis named")
            names = tuple(arr.named_shape)
            path = _param_path(v.label)
            node = self.params
            for part in path[:-1]:
                if part not in node:
                    node[part] = nnx.Dict()
                node = node[part]
            node[path[-1]] = nnx.Param(arr.unwrap(*names), out_sharding=names,
                                       eager_sharding=False)
            labels.append((v.label, path, names))
        self.labels = tuple(labels)

    def penzai(self) -> Any:
        """The penzai model with this module's current parameter values bound."""
        from penzai import pz

        values = []
        for label, path, names in self.labels:
            node = self.params
            for part in path:
                node = node[part]
            values.append(pz.ParameterValue(label=label, value=pz.nx.wrap(node[...]).tag(*names)))
        return pz.bind_variables(_STRUCTURES[self.structure], values)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        from penzai import pz

        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq) int32, got shape {tokens.shape}")
        tokens = constrain(tokens, ("batch", "seq"), name="tokens")
        model = self.penzai()
        if tracing.current().record is not None:  # plan.activations: per-layer activations
            model = with_activation_records(model)
        logits = model(pz.nx.wrap(tokens).tag("batch", "seq"))
        out = logits.unwrap("batch", "seq", "vocabulary")
        return constrain(out, ("batch", "seq", "vocabulary"), name="logits")


def _record_named(name: str, x: Any) -> None:
    """Append a penzai named array to ``rules.recording()``'s list as ``(name, axis names,
    array, PartitionSpec, "jaxpr")``: the spec the active rules give its named axes, the
    axes no rule covers left to the compiler; no constraint is added to the program."""
    from jax.sharding import PartitionSpec

    from penzai import pz

    ctx = tracing.current()
    record, rules = ctx.record, ctx.rules
    if record is None or rules is None or not isinstance(x, pz.nx.NamedArrayBase) \
            or x.positional_shape:
        return
    names = tuple(x.named_shape)
    # the model dim of an activation is not sharded, as the GPT's ("batch", "seq", None)
    logical = tuple(None if a == "embedding" else a for a in names)
    try:
        spec = rules.spec(logical, tensor=name, strict=False)
    except ValueError:  # two dims on one mesh axis: only the batch dim is known
        spec = rules.spec(tuple(a if a == "batch" else None for a in logical), tensor=name,
                          strict=False)
        logical = tuple(a if a == "batch" else None for a in logical)
    unmapped = set(rules.unmapped(logical))
    spec = PartitionSpec(*(PartitionSpec.UNCONSTRAINED if a is None or a in unmapped else v
                           for a, v in zip(logical, spec, strict=True)))
    record.append((name, logical, x.unwrap(*names), spec, "jaxpr"))


def _recorder_type() -> type:
    """The penzai layer that records its input (``_record_named``) and returns it as is."""
    global _Recorder
    if _Recorder is None:
        from penzai import pz

        @pz.pytree_dataclass
        class ActivationRecord(pz.nn.Layer):
            """Identity layer: records the named array passing through (planning only)."""

            name: str = dataclasses.field(metadata={"pytree_node": False})

            def __call__(self, x: Any, /, **side_inputs: Any) -> Any:
                _record_named(self.name, x)
                return x

        _Recorder = ActivationRecord
    return _Recorder


_Recorder: type | None = None


def with_activation_records(model: Any) -> Any:
    """``model`` with identity layers that record, while ``rules.recording()`` is active,
    each attention layer's output before its output projection (``"attn_out"``: ``batch,
    seq, [head_groups,] heads, projection``, the input of the last ``Linear`` of
    ``attn_value_to_output``) and each feed-forward layer's hidden activation
    (``"mlp_hidden"``: the input of its last ``Linear``, ``batch, seq, neurons``), as the
    GPT's ``attn_out`` and ``mlp_hidden``. Layers of another shape pass through."""
    from penzai import pz
    from penzai.models.transformer import model_parts

    rec = _recorder_type()

    def before_last_linear(seq: Any, name: str) -> Any:
        subs = list(getattr(seq, "sublayers", ()))
        if not subs or not isinstance(subs[-1], pz.nn.Linear):
            return seq
        return dataclasses.replace(seq, sublayers=[*subs[:-1], rec(name=name), subs[-1]])

    model = pz.select(model).at_instances_of(pz.nn.Attention).apply(
        lambda a: dataclasses.replace(a, attn_value_to_output=before_last_linear(
            a.attn_value_to_output, "attn_out")))
    return pz.select(model).at_instances_of(model_parts.TransformerFeedForward).apply(
        lambda ff: before_last_linear(ff, "mlp_hidden"))


def from_penzai(model_or_builder: Any, *, name: str = "penzai",
                config: Any = None, vocab_size: int | None = None,
                loss_fn: Callable[..., jax.Array] | None = None) -> ModelSpec:
    """A penzai language model as a Workbench model (plan, show, compare, search, Trainer).

    Args:
        model_or_builder: ``key -> penzai model`` (e.g. ``lambda key:
            llamalike_common.build_llamalike_transformer(config, init_base_rng=key)``: its
            parameters are initialised from the plan's or the Trainer's seed, directly into
            their shards) or a built penzai model (its values are the initial parameters
            whatever the seed).
        name: label of the model in plans and run records.
        config: the penzai config (a dataclass such as ``LlamalikeTransformerConfig``):
            recorded with runs and gives ``vocab_size``.
        vocab_size: token ids the model takes (default ``config.vocab_size``).
        loss_fn: ``(model, batch) -> loss``; default next-token cross-entropy.

    Returns:
        A ``ModelSpec`` whose modules are :class:`PenzaiModel`; its rules translate
        Workbench's logical axes to penzai's (``rules.penzai_rules``), and a penzai axis
        no rule covers is an error that lists the uncovered names.
    """
    from penzai import pz

    if isinstance(model_or_builder, pz.nn.Layer):
        built = model_or_builder
        build: Callable[[Any], Any] = lambda key: built  # noqa: E731 - fixed values
    elif callable(model_or_builder):
        build = model_or_builder
    else:
        raise TypeError(f"from_penzai: model_or_builder={model_or_builder!r} is a "
                        f"{type(model_or_builder).__name__}; give a penzai model or a callable "
                        "key -> penzai model")
    described = _describe(config)
    if vocab_size is None and config is not None:
        vocab_size = getattr(config, "vocab_size", None)

    def factory(rngs: nnx.Rngs) -> PenzaiModel:
        key = rngs.params()
        with jax.ensure_compile_time_eval():  # constants concrete, the init traced
            return PenzaiModel(build(key))

    factory.__name__ = check_str(name, "name", where="from_penzai: ", example="name='my-model'")
    return ModelSpec(factory=factory, name=name, loss_fn=loss_fn, vocab_size=vocab_size,
                     rules_for=penzai_rules, config={"family": "penzai", **described},
                     require_rules=True)


def _describe(config: Any) -> dict[str, Any]:
    """JSON-able fields of a penzai config dataclass (dtypes and types as strings)."""
    if config is None or not dataclasses.is_dataclass(config):
        return {}
    out: dict[str, Any] = {"config_type": type(config).__name__}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        out[f.name] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
    return out


def penzai_tree(model: PenzaiModel) -> Any:
    """The penzai model of a (materialised, sharded) :class:`PenzaiModel`, for treescope:
    ``treescope.render_to_html(penzai_tree(plan.materialize()))`` draws its named arrays
    with their shardings."""
    if not isinstance(model, PenzaiModel):
        raise TypeError(f"penzai_tree needs a PenzaiModel (plan.materialize() of a "
                        f"from_penzai plan), got {type(model).__name__}")
    return model.penzai()
