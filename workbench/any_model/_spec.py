"""Any Flax NNX module as a Workbench model: ``wb.any_model.from_nnx(factory, ...)``.

A model is a factory ``rngs -> nnx.Module`` whose parameters carry sharding annotations
(``nnx.with_partitioning(init, (None, "model"))``, ``nnx.Param(..., out_sharding=...)``,
Flax's deprecated ``sharding=`` too). Annotations name either mesh axes (the Flax
sharding guide's way: no ``Rules`` needed) or logical axes that ``Rules`` map to mesh
axes. The factory is run with Flax's eager sharding off, so no mesh context is needed:
the plan reads the annotations and shards by them::

    spec = wb.any_model.from_nnx(lambda rngs: DotReluDot(1024, rngs=rngs),
                              example_batch=lambda b, t: {"x": jax.ShapeDtypeStruct((b, 1024),
                                                                                    jnp.float32)},
                              loss_fn=lambda m, batch: jnp.mean(m(batch["x"]) ** 2))
    plan = wb.plan(spec, mesh=wb.make_mesh(data=2, model=4), batch=16)
    model = plan.materialize(seed=0)

A plain factory works in ``wb.plan`` too (pass ``example_batch=`` and ``loss_fn=`` there);
a ``ModelSpec`` also carries them into ``wb.TrainConfig(model=spec)`` and the Trainer
(language models: ``vocab_size=``, the batch is tokens).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from workbench._sharding.placement import resolve_placement
from workbench._sharding.rules import LOGICAL_AXES, MODEL_AXIS_NAMES, Rules
from workbench._validate import check_bool

__all__ = ["ModelRecord", "ModelSpec", "UnknownAxesError", "annotation_names", "build_without_mesh",
           "from_nnx", "model_loss", "resolve_rules"]

#: Attribute under which a built module carries its spec's loss (static, in the graphdef).
LOSS_ATTR = "_workbench_loss_fn"

ExampleBatch = Callable[[int, int], Mapping[str, jax.ShapeDtypeStruct]]


class UnknownAxesError(ValueError):
    """Parameter annotations name axes that are neither mesh axes nor covered by rules."""


def build_without_mesh(factory: Callable[[nnx.Rngs], nnx.Module],
                       rngs: nnx.Rngs) -> nnx.Module:
    """``factory(rngs)`` with Flax's eager sharding off: annotated Variables keep their
    ``out_sharding`` metadata and are not placed, so no mesh context is needed (the plan
    and the sharded init place them)."""
    with nnx.use_eager_sharding(False):
        return factory(rngs)


def model_loss(model: nnx.Module) -> Callable[..., jax.Array] | None:
    """The loss a ``ModelSpec`` attached to ``model`` (None for any other module)."""
    return getattr(model, LOSS_ATTR, None)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ModelSpec:
    """A model factory with what the plan and the Trainer need to run its step.

    Calling it (``spec(rngs)``) builds the module without a mesh (``build_without_mesh``).

    Attributes:
        factory: ``rngs -> nnx.Module``.
        name: label (run records, errors).
        loss_fn: ``(model, batch) -> scalar loss``; None: next-token cross-entropy of
            ``model(inputs)`` (a language model taking int32 tokens ``(B, T)``).
        example_batch: ``(batch, seq) -> {name: ShapeDtypeStruct}``; None: the token batch
            ``{"inputs", "targets"}`` int32 ``(batch, seq)``.
        vocab_size: token ids the Trainer's data may produce (language models).
        rules_for: turns ``Rules`` over Workbench's logical axes (``embed``, ``mlp``,
            ...) into rules over this model's own axis names (penzai's ``embedding``,
            ``neurons``, ...); None when the model names Workbench's axes or mesh axes.
        config: JSON-able description saved with a run (``to_dict``).
        require_rules: an axis name that neither the rules nor the mesh cover is an
            error even when rules are given (penzai models), not an ``unmapped`` lint.
    """

    factory: Callable[[nnx.Rngs], nnx.Module]
    name: str = "model"
    loss_fn: Callable[..., jax.Array] | None = None
    example_batch: ExampleBatch | None = None
    vocab_size: int | None = None
    rules_for: Callable[[Any], Any] | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    require_rules: bool = False

    #: Marks a model the Trainer builds from a factory (``TrainConfig(model=spec)``).
    is_model_spec: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_bool(self.require_rules, "require_rules", where="ModelSpec: ")

    @property
    def seq_len(self) -> int:
        """The longest sequence the model takes (``config["seq_len"]``; else no limit)."""
        return int(self.config.get("seq_len") or 2 ** 31 - 1)

    def __call__(self, rngs: nnx.Rngs) -> nnx.Module:
        model = build_without_mesh(self.factory, rngs)
        if self.loss_fn is not None:
            setattr(model, LOSS_ATTR, self.loss_fn)
        return model

    def batch(self, batch: int, seq: int) -> dict[str, jax.ShapeDtypeStruct]:
        """ShapeDtypeStructs of one global batch (``example_batch`` or the token batch)."""
        if self.example_batch is not None:
            out = self.example_batch(batch, seq)
            return dict(out)
        return {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("inputs", "targets")}

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with fields changed; GPTConfig fields (``TrainConfig.model_overrides``)
        are an error: change the factory instead."""
        if not changes:
            return self
        fields = {k: v for k, v in changes.items() if k in {f.name for f in
                                                             dataclasses.fields(self)}}
        extra = {k: v for k, v in changes.items() if k not in fields}
        if extra:
            raise ValueError(f"model {self.name!r} is a model factory: {sorted(extra)} are "
                             "GPTConfig fields; change the factory instead")
        return dataclasses.replace(self, **fields)

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": "model", "name", "vocab_size", **config}`` (the run's identity)."""
        return {"kind": "model", "name": self.name, "vocab_size": self.vocab_size,
                **dict(self.config)}

    def __repr__(self) -> str:
        return f"ModelSpec(name={self.name!r}, vocab_size={self.vocab_size})"


class ModelRecord(dict):
    """A ``ModelSpec``'s ``to_dict()`` read back from a run record (``TrainConfig.from_dict``):
    it compares equal to the spec that wrote it (so a run resumes with the same model), but
    cannot build the model: pass the ``ModelSpec`` itself to train."""

    is_model_spec: ClassVar[bool] = True

    @property
    def seq_len(self) -> int:
        """As ``ModelSpec.seq_len``."""
        return int(self.get("seq_len") or 2 ** 31 - 1)

    @property
    def vocab_size(self) -> int | None:
        """The recorded vocabulary size."""
        return self.get("vocab_size")

    def replace(self, **changes: Any) -> ModelRecord:
        """Itself (a record has nothing to override); changes are an error."""
        if changes:
            raise ValueError(f"model {self.get('name')!r} is a recorded model factory; "
                             f"{sorted(changes)} cannot be overridden")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The recorded dict."""
        return dict(self)

    def __call__(self, rngs: nnx.Rngs) -> nnx.Module:
        raise TypeError(f"the run recorded model {self.get('name')!r} as a factory, which a "
                        "JSON record cannot rebuild; pass TrainConfig(model=<the same "
                        "wb.any_model.from_nnx / from_penzai spec>)")


def from_nnx(factory: Callable[[nnx.Rngs], nnx.Module], *, name: str | None = None,
             loss_fn: Callable[..., jax.Array] | None = None,
             example_batch: ExampleBatch | Mapping[str, Any] | None = None,
             vocab_size: int | None = None,
             config: Mapping[str, Any] | None = None) -> ModelSpec:
    """Wrap any Flax NNX module factory for ``wb.plan``, ``wb.show``, ``plan.materialize``
    and the Trainer.

    Args:
        factory: ``rngs -> nnx.Module`` (a class taking ``rngs`` works).
        name: label (default the factory's name).
        loss_fn: ``(model, batch) -> loss`` for models that are not token -> logits.
        example_batch: ``(batch, seq) -> {name: ShapeDtypeStruct}``, or a fixed dict of
            ShapeDtypeStructs (its dim 0 is the global batch). Dim 0 of every entry is
            sharded by the ``batch`` rule.
        vocab_size: for language models trained by the Trainer on token data.
        config: JSON-able fields that identify the model in a run record.
    """
    if not callable(factory):
        raise TypeError(f"from_nnx: factory={factory!r} is a {type(factory).__name__}; give a "
                        "callable rngs -> nnx.Module (a module class taking rngs works)")
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"from_nnx: config={config!r:.80} is a {type(config).__name__}; give a "
                        "dict of JSON-able fields that identify the model, or None")
    if isinstance(example_batch, Mapping):
        fixed = dict(example_batch)
        example_batch = lambda b, t: fixed  # noqa: E731 - a fixed batch ignores (b, t)
    return ModelSpec(factory=factory, name=name or getattr(factory, "__name__", "model"),
                     loss_fn=loss_fn, example_batch=example_batch, vocab_size=vocab_size,
                     config=dict(config or {}))


# -- rules for a model's annotations --------------------------------------------------------

def annotation_names(logical: Mapping[str, Sequence[str | None]]) -> dict[str, list[str]]:
    """``{axis name: [parameter paths]}`` of every name the annotations use."""
    out: dict[str, list[str]] = {}
    for path, axes in logical.items():
        for a in axes:
            if a is not None:
                out.setdefault(a, []).append(path)
    return out


def resolve_rules(logical: Mapping[str, Sequence[str | None]], rules: Any, mesh: Any, *,
                  spec: ModelSpec | None = None) -> Any:
    """The ``Rules`` a model factory is planned with.

    - Annotations that name mesh axes map to themselves (``model="model"``) unless
      ``rules`` say otherwise: the Flax guide's models need no rules.
    - ``rules`` None: the batch goes over the mesh's data axes (not named like a model
      axis); the default preset (``workbench._sharding.placement``: "fsdp_tp" on a mesh with one
      model axis larger than 1, else "fsdp") covers Workbench's own logical axes
      (``embed``, ...); any other name is an error saying which rules to add.
    - A spec with ``rules_for`` (penzai) gets its own names from Workbench's rules.

    Args:
        logical: ``{parameter path: annotation names}``.
        rules: ``Rules``, a preset name, or None.
        mesh: a ``MeshInfo`` (``axis_names``).
        spec: the model's ``ModelSpec`` (for ``rules_for``).

    Raises:
        UnknownAxesError: ``rules`` is None and an annotation names neither a mesh axis
            nor a Workbench logical axis; the message lists the names, a tensor of each,
            the mesh's axes and the rules to add.
    """
    names = annotation_names(logical)
    mesh_axes = tuple(mesh.axis_names)
    direct = [a for a in names if a in mesh_axes]
    if rules is None or isinstance(rules, str):
        given = rules is not None
        base = resolve_placement(mesh, rules, where="wb.plan").rules   # the one default
        if spec is not None and spec.rules_for is not None:
            base = spec.rules_for(base)
        if direct and not given:
            data = tuple(a for a in mesh_axes if a not in MODEL_AXIS_NAMES)
            base = base.replace(batch=None if not data else data[0] if len(data) == 1
                                else data, embed=None)
        unknown = [a for a in names if a not in mesh_axes and a not in base]
        if unknown:
            lines = "; ".join(f"{a!r} (e.g. {names[a][0]!r})" for a in unknown)
            add = ", ".join(f"{a}=<one of {mesh_axes} or None>" for a in unknown)
            raise UnknownAxesError(
                f"the model's parameters are annotated with axis names {lines} that are "
                f"neither axes of this mesh {mesh_axes} nor logical axes with a rule "
                f"(known: {', '.join(LOGICAL_AXES)}). If they are mesh axes, build the mesh "
                f"with them (wb.make_mesh({unknown[0]}=...)) or fix the annotation; if they "
                f"are logical axes, pass rules=wb.Rules({add}, ...)")
        rules = base
    else:
        if spec is not None and spec.rules_for is not None:
            rules = spec.rules_for(rules)
        uncovered = [a for a in names if a not in mesh_axes and a not in rules]
        if uncovered and spec is not None and spec.require_rules:
            lines = "; ".join(f"{a!r} (e.g. {names[a][0]!r})" for a in uncovered)
            add = ", ".join(f"{a}=<one of {mesh_axes} or None>" for a in uncovered)
            raise UnknownAxesError(
                f"model {spec.name!r} has axes no rule covers: {lines}; add them to the "
                f"rules: rules.replace({add})")
    extra = {a: a for a in direct if a not in rules}
    return rules.replace(**extra) if extra else rules
