"""Logical axis names -> mesh axes: the one object that decides how tensors are sharded.

Models name *logical* axes only (``batch, seq, embed, heads, kv_heads, head_dim, mlp,
vocab``, ``layers`` for the stacked blocks of ``GPTConfig(scan_layers=True)``, and
``experts, expert_mlp`` for mixture-of-experts weights). A
:class:`Rules` object maps each logical name to a mesh axis, a tuple of mesh axes, or
``None`` (replicated)::

    rules = wb.Rules(batch="data", embed=None, heads="model", mlp="model", vocab="model",
                     kv_heads="model", head_dim=None, seq=None)
    rules.spec(("embed", "mlp"))               # PartitionSpec(None, 'model')
    rules = wb.Rules.preset("fsdp_tp", mesh)   # dp | fsdp | tp | fsdp_tp

Nothing is replicated silently: a logical name without a rule and a mesh axis used twice
in one tensor are errors. Inside a jitted function, ``with rules.activate(mesh):`` makes
:func:`constrain` put ``with_sharding_constraint`` on activations (a no-op otherwise).

One class, one file: ``Rules`` and its presets are the one mapping of logical to mesh axes,
and the trace-time functions that apply it (``constrain``, ``recording``) read the active
one.
"""
from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from workbench._sharding import tracing
from workbench._validate import check_bool

__all__ = ["CONTEXT_AXIS_NAMES", "DATA_AXIS_NAMES", "EXPERT_AXIS_NAMES", "LOGICAL_AXES",
           "MODEL_AXIS_NAMES", "PENZAI_AXES", "PRESETS", "STAGE_AXIS", "Rules",
           "constrain", "penzai_rules"]

#: The logical axis names used by :mod:`workbench.models` ("layers": the leading axis of
#: scanned blocks' stacked parameters, replicated by every preset since the scan walks it).
LOGICAL_AXES: tuple[str, ...] = (
    "batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
    "experts", "expert_mlp")

#: The mesh axis of pipeline stages: presets shard only ``layers`` over it.
STAGE_AXIS = "stage"

#: Mesh axis names treated as data-parallel / model-parallel by :meth:`Rules.preset`.
DATA_AXIS_NAMES = ("data", "fsdp", "dp", "replica", "batch", "dcn", "pod", "slice")
MODEL_AXIS_NAMES = ("model", "tensor", "tp", "mp")

MeshAxes = str | tuple[str, ...] | None


def _normalise(value: Any, logical: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(
        f"rule for logical axis {logical!r} must be a mesh axis name, a tuple of mesh axis "
        f"names or None; got {value!r}")


#: Names accepted by :meth:`Rules.preset` (and ``TrainConfig.rules``).
PRESETS: tuple[str, ...] = ("dp", "fsdp", "tp", "fsdp_tp", "cp", "fsdp_cp", "ep", "fsdp_ep",
                            "ep_tp")


class Rules(Mapping[str, MeshAxes]):
    """Immutable mapping from logical axis names to mesh axes.

    Args:
        **logical_to_mesh: ``logical_name=mesh_axis`` where ``mesh_axis`` is a mesh axis
            name, a tuple of names (sharded over their product) or ``None`` (replicated).

    Example:
        >>> Rules(batch="data", embed=None).spec(("batch", "embed"))
        PartitionSpec('data', None)
    """

    __slots__ = ("_rules",)

    def __init__(self, **logical_to_mesh: MeshAxes) -> None:
        rules = {k: _normalise(v, k) for k, v in logical_to_mesh.items()}
        object.__setattr__(self, "_rules", rules)

    # -- Mapping ---------------------------------------------------------------
    def __getitem__(self, logical: str) -> MeshAxes:
        axes = self._rules[logical]
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Rules is immutable; use rules.replace(name=...)")

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickled (and copied) as ``Rules.from_dict(rules.to_dict())``: the default would
        set the slot through ``__setattr__``, which refuses."""
        return (Rules.from_dict, (self.to_dict(),))

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._rules.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and self._rules == other._rules

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={self[k]!r}" for k in self._rules)
        return f"Rules({body})"

    # -- construction ----------------------------------------------------------
    def replace(self, **changes: MeshAxes) -> Rules:
        """A copy with some rules changed or added."""
        return Rules(**{**dict(self.items()), **changes})

    def to_dict(self) -> dict[str, str | list[str] | None]:
        """JSON-friendly form (tuples become lists); inverse of :meth:`from_dict`."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.items()}

    @classmethod
    def of(cls, value: Any, *, where: str) -> Rules:
        """``value`` (a ``Rules`` or a mapping) as ``Rules``, or a TypeError naming it and
        the accepted forms (a preset name is resolved by ``preset``, which needs a mesh)."""
        if isinstance(value, Rules):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise TypeError(f"{where}: rules={value!r} ({type(value).__name__}) must be a preset "
                        f"name ({', '.join(PRESETS)}), a wb.Rules or a dict of logical axis "
                        "-> mesh axes, e.g. rules='fsdp'")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Rules:
        """Build from :meth:`to_dict` output."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @classmethod
    def preset(cls, name: str, mesh: Any) -> Rules:
        """Standard strategies for ``mesh`` (a Mesh, AbstractMesh or MeshInfo).

        - ``dp``: batch over every mesh axis, all weights replicated.
        - ``fsdp``: batch and the weights' ``embed`` dim over every mesh axis.
        - ``tp``: heads/kv_heads/mlp/vocab over the model axis; batch over the others.
        - ``fsdp_tp``: like ``tp``, plus ``embed`` over the data axes.
        - ``cp``: context parallelism: ``seq`` over the ``context`` axis (attention by
          ``GPTConfig.context_attention``), batch over the other data axes, weights
          replicated (or tensor-parallel over a model axis if the mesh has one).
        - ``fsdp_cp``: like ``cp``, plus ``embed`` over the data axes *and* ``context``
          (the weights are sharded over every device that splits the tokens).
        - ``ep``: expert parallelism: ``experts`` (MoE expert weights) over the ``expert``
          axis, batch over every axis but a model axis (the expert axis splits the tokens
          of the dense layers too), other weights replicated.
        - ``fsdp_ep``: like ``ep``, plus ``embed`` over the data axes (not ``expert``,
          which already shards the experts' first dim).
        - ``ep_tp``: like ``ep``, plus tensor parallelism over the model axis (heads,
          kv_heads, mlp, vocab, and the experts' hidden dim ``expert_mlp``).

        Data axes are the mesh axes not named like a model axis
        (``model, tensor, tp, mp``). Every preset maps ``layers`` (the scan axis of
        stacked blocks) to None, or to the ``stage`` axis when the mesh has one (pipeline
        stages; ``stage`` then shards nothing else).
        """
        if not isinstance(getattr(mesh, "axis_names", None), tuple):
            raise TypeError(f"Rules.preset({name!r}): mesh={mesh!r} is a {type(mesh).__name__}; "
                            "give a mesh: wb.make_mesh(...) or wb.abstract_mesh(...)")
        names = tuple(a for a in mesh.axis_names if a != STAGE_AXIS)   # stage: layers only
        model = [a for a in names if a in MODEL_AXIS_NAMES]
        data = tuple(a for a in names if a not in MODEL_AXIS_NAMES)
        every = _collapse(names)
        base = dict.fromkeys(LOGICAL_AXES)
        if STAGE_AXIS in mesh.axis_names:   # pipeline parallelism (workbench.models._pipeline)
            base["layers"] = STAGE_AXIS
        if name == "dp":
            return cls(**{**base, "batch": every})
        if name == "fsdp":
            return cls(**{**base, "batch": every, "embed": every})
        if name in ("tp", "fsdp_tp"):
            if len(model) != 1:
                raise ValueError(
                    f"preset {name!r} needs exactly one model axis named one of "
                    f"{MODEL_AXIS_NAMES} in the mesh; mesh axes are {names}. "
                    f"Name the tensor-parallel axis 'model', e.g. wb.make_mesh(data=-1, model=2)")
            m = model[0]
            tp = {"heads": m, "kv_heads": m, "mlp": m, "vocab": m, "expert_mlp": m}
            rules = {**base, **tp, "batch": _collapse(data)}
            if name == "fsdp_tp":
                rules["embed"] = _collapse(data)
            return cls(**rules)
        if name in ("cp", "fsdp_cp"):
            return cls(**_context_rules(name, names, model, base))
        if name in ("ep", "fsdp_ep", "ep_tp"):
            return cls(**_expert_rules(name, names, model, base))
        raise ValueError(f"unknown rules preset {name!r}; choose one of {', '.join(PRESETS)}")

    # -- use ---------------------------------------------------------------------
    def mesh_axes(self, logical: str | None, *, tensor: str = "tensor") -> tuple[str, ...]:
        """Mesh axes (possibly empty) for one logical name; raises if it has no rule."""
        if logical is None:
            return ()
        if logical not in self._rules:
            known = ", ".join(sorted(self._rules)) or "(none)"
            raise KeyError(
                f"logical axis {logical!r} of {tensor!r} has no rule; known logical axes: "
                f"{known}. Add {logical}=<mesh axis> to Rules, or {logical}=None to replicate "
                f"it on purpose")
        return self._rules[logical]

    def axes(self, logical: str | None, mesh: Any = None) -> tuple[str, ...]:
        """Mesh axes of one logical name, empty when it is None or has no rule (unlike
        ``mesh_axes``, which raises). With ``mesh`` (a mesh, ``MeshInfo`` or ``{axis:
        size}``), only the axes that split it: those of size > 1.

        Example:
            >>> Rules(batch=("data", "fsdp")).axes("batch", {"data": 4, "fsdp": 1})
            ('data',)
        """
        axes = self._rules.get(logical, ()) if logical is not None else ()
        if mesh is None:
            return axes
        shape = mesh if isinstance(mesh, Mapping) else dict(mesh.shape)
        return tuple(a for a in axes if shape.get(a, 1) > 1)

    def spec(self, logical_axes: Sequence[str | None], *, tensor: str = "tensor",
             strict: bool = True) -> PartitionSpec:
        """The PartitionSpec for a tensor whose dims carry ``logical_axes``.

        Args:
            logical_axes: one logical name (or None) per dimension.
            tensor: the tensor's name, used in error messages.
            strict: if False, logical names without a rule are replicated instead of
                raising (the plan does this and reports them as a lint).

        Raises:
            KeyError: a logical name has no rule (strict mode).
            ValueError: one mesh axis would shard two dimensions of the tensor.
        """
        strict = check_bool(strict, "strict", where="Rules.spec: ")
        out: list[str | tuple[str, ...] | None] = []
        used: dict[str, int] = {}
        for dim, logical in enumerate(logical_axes):
            if not strict and logical is not None and logical not in self._rules:
                out.append(None)
                continue
            axes = self.mesh_axes(logical, tensor=tensor)
            for a in axes:
                if a in used:
                    raise ValueError(
                        f"mesh axis {a!r} shards both dim {used[a]} ({logical_axes[used[a]]!r}) "
                        f"and dim {dim} ({logical!r}) of {tensor!r} (logical axes "
                        f"{tuple(logical_axes)}); a mesh axis can shard one dim per tensor. "
                        f"Map {logical!r} or {logical_axes[used[a]]!r} to another axis or None")
                used[a] = dim
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*out)

    def unmapped(self, logical_axes: Sequence[str | None]) -> list[str]:
        """Logical names in ``logical_axes`` that have no rule."""
        return [a for a in logical_axes if a is not None and a not in self._rules]

    def check_mesh(self, mesh: Any) -> None:
        """Raise if a rule names a mesh axis that ``mesh`` does not have."""
        names = tuple(mesh.axis_names)
        for logical, axes in self._rules.items():
            for a in axes:
                if a not in names:
                    raise ValueError(
                        f"rule {logical}={self[logical]!r} names mesh axis {a!r}, but the mesh "
                        f"has axes {names}; use one of them or None")

    def check_names(self, used: Iterable[str], *, model: str = "the model") -> None:
        """Raise if a rule names a logical axis outside ``used`` (the names ``model``'s
        tensors carry, and Workbench's :data:`LOGICAL_AXES`): a misspelt name leaves the
        axis it meant without a rule, so that axis would be replicated in silence.

        Example:
            >>> Rules(embedd="data").check_names(LOGICAL_AXES)
            Traceback (most recent call last):
            ValueError: rules name logical axis 'embedd' (-> 'data'), which no tensor of ...
        """
        valid = set(used)
        for logical in self._rules:
            if logical in valid:
                continue
            near = difflib.get_close_matches(logical, sorted(valid), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(
                f"rules name logical axis {logical!r} (-> {self[logical]!r}), which no tensor "
                f"of {model} uses, so it would shard nothing. {hint.capitalize()}The "
                f"logical axes it uses are: {', '.join(sorted(valid))}. Rename the rule or "
                "drop it")

    def sharding(self, logical_axes: Sequence[str | None], mesh: jax.sharding.Mesh, *,
                 tensor: str = "tensor") -> NamedSharding:
        """``NamedSharding(mesh, self.spec(logical_axes))``."""
        self.check_mesh(mesh)
        return NamedSharding(mesh, self.spec(logical_axes, tensor=tensor))

    @contextlib.contextmanager
    def activate(self, mesh: jax.sharding.Mesh) -> Iterator[Rules]:
        """Within this block (while tracing), :func:`constrain` shards activations
        (``workbench._sharding.tracing.scoped(rules=self, mesh=mesh)``)."""
        self.check_mesh(mesh)
        with tracing.scoped(rules=self, mesh=mesh):
            yield self


#: Mesh axis names that the ``cp`` / ``fsdp_cp`` presets shard the sequence over.
CONTEXT_AXIS_NAMES = ("context",)


def _context_rules(name: str, names: tuple[str, ...], model: list[str],
                   base: dict[str, MeshAxes]) -> dict[str, MeshAxes]:
    """The ``cp`` / ``fsdp_cp`` presets (see :meth:`Rules.preset`)."""
    ctx = _one_axis(name, names, CONTEXT_AXIS_NAMES, "the sequence",
                    "wb.make_mesh(data=2, context=4)")
    if len(model) > 1:
        raise ValueError(f"preset {name!r} takes at most one model axis, got {model}")
    data = tuple(a for a in names if a not in MODEL_AXIS_NAMES and a != ctx)
    rules = {**base, "batch": _collapse(data), "seq": ctx}
    if model:
        m = model[0]
        rules.update(heads=m, kv_heads=m, mlp=m, vocab=m)
    if name == "fsdp_cp":
        rules["embed"] = _collapse((*data, ctx))
    return rules


#: Mesh axis names that the ``ep`` presets shard the experts over.
EXPERT_AXIS_NAMES = ("expert",)


def _expert_rules(name: str, names: tuple[str, ...], model: list[str],
                  base: dict[str, MeshAxes]) -> dict[str, MeshAxes]:
    """The ``ep`` / ``fsdp_ep`` / ``ep_tp`` presets (see :meth:`Rules.preset`)."""
    ex = _one_axis(name, names, EXPERT_AXIS_NAMES, "the experts",
                   "wb.make_mesh(expert=4, data=2)")
    if name == "ep_tp" and len(model) != 1:
        raise ValueError(
            f"preset 'ep_tp' needs exactly one model axis named one of {MODEL_AXIS_NAMES}; "
            f"mesh axes are {names}, e.g. wb.make_mesh(expert=2, data=2, model=2)")
    if name != "ep_tp" and model:
        raise ValueError(
            f"preset {name!r} has no tensor parallelism, but the mesh has model axis "
            f"{model[0]!r}; use 'ep_tp', or a mesh without it")
    tokens = tuple(a for a in names if a not in MODEL_AXIS_NAMES)
    data = tuple(a for a in tokens if a != ex)
    rules = {**base, "batch": _collapse(tokens), "experts": ex}
    if name == "fsdp_ep":
        rules["embed"] = _collapse(data)
    if name == "ep_tp":
        m = model[0]
        rules.update(heads=m, kv_heads=m, mlp=m, vocab=m, expert_mlp=m)
    return rules


def _one_axis(name: str, names: tuple[str, ...], axis_names: tuple[str, ...], what: str,
              example: str) -> str:
    """The one mesh axis in ``names`` named one of ``axis_names``, over which preset
    ``name`` shards ``what``; a ValueError with an ``example`` mesh when there is not one."""
    found = [a for a in names if a in axis_names]
    if len(found) != 1:
        raise ValueError(
            f"preset {name!r} needs one mesh axis named {axis_names[0]!r} to shard {what} "
            f"over; mesh axes are {names}. Build the mesh with one, e.g. {example}")
    return found[0]


def _collapse(axes: tuple[str, ...]) -> MeshAxes:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def active() -> tuple[Rules, Any] | None:
    """The ``(rules, mesh)`` set by :meth:`Rules.activate`, or None."""
    return tracing.current().sharding


def constrain(x: jax.Array, logical_axes: Sequence[str | None], *,
              name: str = "activation") -> jax.Array:
    """Shard an activation by logical names under the active rules (no-op without rules).

    Logical names without a rule are left unconstrained (XLA propagates them) rather than
    replicated, so partial rules never force a gather.
    """
    ctx = tracing.current()
    rules, mesh = ctx.rules, ctx.mesh
    if rules is None:
        return x
    spec = rules.spec(logical_axes, tensor=name, strict=False)
    unmapped = set(rules.unmapped(logical_axes))
    if unmapped:
        spec = PartitionSpec(*(PartitionSpec.UNCONSTRAINED if a in unmapped else s
                               for a, s in zip(logical_axes, spec, strict=True)))
    if ctx.record is not None:  # planning.activations lists the constrained activations
        ctx.record.append((name, tuple(logical_axes), x, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@contextlib.contextmanager
def recording() -> Iterator[list[tracing.ActivationRecord]]:
    """Collect the :func:`constrain` calls made while tracing inside this block: each
    appends ``(name, logical axes, value, PartitionSpec)`` to the yielded list
    (``workbench._sharding.tracing.scoped(record=[])``)."""
    with tracing.scoped(record=[]) as ctx:
        yield ctx.record


#: penzai transformer axis names -> the Workbench logical axis whose rule they follow
#: (``penzai.models.transformer``: ``embedding``, ``neurons``, attention ``heads`` or
#: ``head_groups`` x ``query_heads``, ``projection``, ``vocabulary``, ``blocks`` of a
#: layer stack). ``query_heads`` follows ``heads`` only when ``kv_heads`` is not sharded
#: the same way (one mesh axis cannot shard both head dims of a query weight).
PENZAI_AXES: dict[str, str] = {
    "embedding": "embed", "neurons": "mlp", "heads": "heads", "head_groups": "kv_heads",
    "query_heads": "heads", "projection": "head_dim", "vocabulary": "vocab",
    "blocks": "layers", "batch": "batch", "seq": "seq"}


def penzai_rules(rules: Rules) -> Rules:
    """``rules`` plus a rule for each penzai transformer axis (:data:`PENZAI_AXES`) that
    ``rules`` do not name, copied from its Workbench logical axis: the presets and any
    GPT rules shard a penzai Llama-like model as they shard the GPT.

    Example:
        >>> penzai_rules(Rules(embed="data", mlp="model", heads="model",
        ...                    kv_heads="model"))["neurons"]
        'model'
    """
    if not isinstance(rules, Rules):
        raise TypeError(f"penzai_rules: rules={rules!r:.60} must be a wb.Rules (e.g. "
                        "wb.Rules.preset('fsdp_tp', mesh))")
    extra: dict[str, MeshAxes] = {}
    for pz_name, ours in PENZAI_AXES.items():
        if pz_name in rules or ours not in rules:
            continue
        if pz_name == "query_heads" and rules.get("kv_heads") == rules[ours]:
            extra[pz_name] = None
            continue
        extra[pz_name] = rules[ours]
    return rules.replace(**extra) if extra else rules
