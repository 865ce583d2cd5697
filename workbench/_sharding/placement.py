"""Placement: the one place that picks a mesh and rules when the caller gives none.

``wb.plan``, the ``Trainer`` (``TrainConfig``), ``wb.hf.from_hf``, ``wb.generate``,
``wb.hf.export_run`` and ``wb.search`` all call :func:`resolve_placement`, so a model is
laid out the same way by each of them unless told otherwise. The default:

- **mesh**: every device (``jax.devices()``, all processes) on one ``data`` axis, i.e.
  ``wb.make_mesh(data=-1)``. A dict of axis sizes is built with ``wb.make_mesh``.
- **rules**: ``"fsdp_tp"`` when the mesh has exactly one model axis (named ``model``,
  ``tensor``, ``tp`` or ``mp``) larger than 1, else ``"fsdp"``. Naming an axis ``model``
  asks for tensor parallelism; ``fsdp`` alone would treat it as one more data axis.
  A size-1 model axis splits nothing, and two model axes are ambiguous (``fsdp_tp``
  takes one), so both get ``"fsdp"``, and the reason says so.

What is given is used as given: a preset name is that preset on the mesh, a ``Rules``
(or a mapping, made a ``Rules``) as it is. :class:`Placement` carries the mesh, the rules
and ``why``: one line saying where each came from, which plans and runs report::

    p = resolve_placement(mesh={"data": 4, "model": 2})
    p.preset, p.why   # ('fsdp_tp', "mesh {'data': 4, 'model': 2} (given) ...")
    mesh, rules = p   # unpacks as a pair
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh

from workbench._sharding.rules import (CONTEXT_AXIS_NAMES, EXPERT_AXIS_NAMES, MODEL_AXIS_NAMES,
                                      PRESETS, Rules)

__all__ = ["DEFAULT_AXIS", "Placement", "default_preset", "resolve_placement"]

#: The one axis of the default mesh (every device on it).
DEFAULT_AXIS = "data"

_MESH_FORMS = ("wb.make_mesh(...), wb.abstract_mesh(...), a dict of axis sizes such as "
               "{'data': 4, 'model': 2}, or None (every device on one 'data' axis)")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a model goes: a mesh, the rules for it, and why they were chosen.

    Attributes:
        mesh: the mesh as given (a ``Mesh``, ``AbstractMesh`` or ``MeshInfo``), or the
            ``jax.sharding.Mesh`` made for a dict of sizes or for no mesh.
        rules: the ``wb.Rules``.
        preset: the preset name the rules are (given or chosen), None for a given table.
        mesh_why, rules_why: where the mesh and the rules came from; ``why`` joins them.
    """

    mesh: Any
    rules: Rules
    preset: str | None
    mesh_why: str
    rules_why: str

    @property
    def why(self) -> str:
        """One line: where the mesh and the rules came from."""
        return f"{self.mesh_why}; {self.rules_why}"

    def from_annotations(self) -> Placement:
        """This placement for a model factory given no rules: its annotations pick the rules
        (``workbench.any_model._spec.resolve_rules``; this preset covers Workbench's logical
        axes), as ``wb.plan`` and the Trainer both resolve them."""
        return dataclasses.replace(self, rules_why=(
            f"no rules given: from the model's annotations ({self.preset!r} for Workbench's "
            "logical axes)"))

    def __iter__(self) -> Iterator[Any]:
        """``mesh, rules = placement``."""
        return iter((self.mesh, self.rules))

    def __str__(self) -> str:
        return self.why


def _sizes(mesh: Any, where: str = "default_preset") -> dict[str, int]:
    """``{axis: size}`` of a ``Mesh``, ``AbstractMesh`` or ``MeshInfo``."""
    from workbench._sharding.mesh import MeshInfo

    if isinstance(mesh, Mesh):
        return {str(k): int(v) for k, v in mesh.shape.items()}
    if isinstance(mesh, (AbstractMesh, MeshInfo)):
        return {str(k): int(v) for k, v in zip(mesh.axis_names, mesh.axis_sizes)}
    raise TypeError(f"{where}: mesh={mesh!r:.80} is a {type(mesh).__name__}; expected a mesh: "
                    "wb.make_mesh(...), wb.abstract_mesh(...) or its MeshInfo")


def default_preset(mesh: Any) -> tuple[str, str]:
    """The preset for ``mesh`` when no rules are given, and why (see the module).

    Args:
        mesh: a ``Mesh``, ``AbstractMesh`` or ``MeshInfo``.

    Returns:
        ``(name, reason)``: ``"fsdp_tp"`` with exactly one model axis larger than 1, else
        ``"fsdp"``.
    """
    sizes = _sizes(mesh)
    model = [a for a in sizes if a in MODEL_AXIS_NAMES]
    big = [a for a in model if sizes[a] > 1]
    if len(model) == 1 and big:
        name = "fsdp_tp"
        why = (f"model axis {big[0]!r} (size {sizes[big[0]]}) splits the weights, the other "
               "axes the batch and the weights' embed dim")
    else:
        name = "fsdp"
        why = ("batch and the weights' embed dim over every axis"
               + ("" if not model else
                  f"; model axis {model[0]!r} has size 1" if len(model) == 1 else
                  f"; the mesh has {len(model)} model axes {tuple(model)} and fsdp_tp takes "
                  "one: pass rules= to say which splits the weights"))
    for names, preset in ((CONTEXT_AXIS_NAMES, "fsdp_cp"), (EXPERT_AXIS_NAMES, "fsdp_ep")):
        extra = [a for a in names if sizes.get(a, 1) > 1]
        if extra:
            why += (f"; axis {extra[0]!r} is used as a data axis (rules={preset!r} uses it "
                    "for what it is named)")
    return name, why


def _default_mesh(devices: Sequence[Any] | None, where: str) -> tuple[Mesh, str]:
    from workbench._sharding.mesh import make_mesh

    if devices is None:
        mesh = make_mesh({DEFAULT_AXIS: -1})
        what = "every device"
    else:
        mesh = make_mesh({DEFAULT_AXIS: -1}, devices=devices)
        what = f"the {len(mesh.devices.flat)} given device(s)"
    kind = mesh.devices.flat[0].device_kind
    return mesh, f"no mesh given: {what} ({mesh.size} x {kind}) on one {DEFAULT_AXIS!r} axis"


def _mesh(mesh: Any, devices: Sequence[Any] | None, where: str) -> tuple[Any, str]:
    """The mesh to use and where it came from."""
    from workbench._sharding.mesh import MeshInfo, make_mesh

    if mesh is None:
        return _default_mesh(devices, where)
    if isinstance(mesh, Mapping):
        try:
            made = make_mesh(dict(mesh), devices=devices)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}: mesh={dict(mesh)!r}: {err}") from None
        shape = {str(k): int(v) for k, v in made.shape.items()}
        return made, f"mesh {shape} (given" + ("" if shape == dict(mesh) else
                                              f" as {dict(mesh)}") + ")"
    if not isinstance(mesh, (Mesh, AbstractMesh, MeshInfo)):
        raise TypeError(f"{where}: mesh={mesh!r} is a {type(mesh).__name__}; expected a mesh: "
                        f"{_MESH_FORMS}")
    if devices is not None:
        raise ValueError(f"{where}: devices= chooses the devices of a mesh to be made; the "
                         "mesh given has its own: leave devices out, or give mesh as a dict "
                         "of axis sizes")
    return mesh, f"mesh {_sizes(mesh)} (given)"


def _rules(rules: Any, mesh: Any, where: str) -> tuple[Rules, str | None, str]:
    """The rules for ``mesh``, their preset name and where they came from."""
    if rules is None:
        name, why = default_preset(mesh)
        return Rules.preset(name, mesh), name, f"no rules given: {name!r}: {why}"
    if isinstance(rules, str):
        if rules not in PRESETS:
            raise ValueError(f"{where}: rules={rules!r}: unknown rules preset {rules!r}; choose "
                             f"one of {', '.join(PRESETS)}, give a wb.Rules, or leave rules "
                             "out for the default")
        try:
            return Rules.preset(rules, mesh), rules, f"rules {rules!r} (given)"
        except ValueError as err:
            raise ValueError(f"{where}: rules={rules!r} on mesh {_sizes(mesh)}: {err}") from None
    if isinstance(rules, Mapping) and not isinstance(rules, Rules):
        try:
            table = Rules.from_dict(rules)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{where}: rules={rules!r:.80} is not a table of logical axis -> "
                            f"mesh axes ({err}); e.g. rules={{'batch': 'data', 'embed': None}}"
                            ) from None
        return table, None, "rules: the given table"
    table = Rules.of(rules, where=where)   # a wb.Rules, or its TypeError naming rules=
    return table, None, "rules: the given wb.Rules"


def resolve_placement(mesh: Any = None, rules: Any = None, *,
                      devices: Sequence[Any] | None = None,
                      where: str = "resolve_placement") -> Placement:
    """The mesh and rules to use: the given ones, else the one default (see the module).

    Args:
        mesh: a ``wb.make_mesh`` / ``jax.sharding.Mesh``, a ``wb.abstract_mesh`` (or its
            ``MeshInfo``), a dict of axis sizes (built by ``wb.make_mesh``; one may be -1),
            or None: every device on one ``data`` axis.
        rules: a preset name, a ``wb.Rules``, a dict of logical axis -> mesh axes, or
            None: ``"fsdp_tp"`` on a mesh with one model axis larger than 1, else
            ``"fsdp"``.
        devices: the devices a mesh made here spans (for None or a dict; default every
            device). ``wb.generate`` passes the one device a model's unsharded parameters
            are on.
        where: the caller, to start error messages with (``"wb.plan"``).

    Returns:
        A :class:`Placement` (``mesh, rules = placement`` unpacks it).

    Raises:
        TypeError: ``mesh`` or ``rules`` of a type not listed above.
        ValueError: an unknown preset, a preset the mesh cannot take (``tp`` without a
            model axis), rules naming a mesh axis the mesh lacks, a dict of sizes the
            devices do not fill, or ``devices`` with a mesh that has its own.

    Example::

        mesh, rules = resolve_placement()             # data=<all devices>, fsdp
        resolve_placement({"data": -1, "model": 2}).preset   # 'fsdp_tp'
    """
    if not isinstance(where, str):
        raise TypeError(f"resolve_placement: where={where!r} must be a string (the caller)")
    made, mesh_why = _mesh(mesh, devices, where)
    table, name, rules_why = _rules(rules, made, where)
    names = tuple(made.axis_names)
    for logical, axes in table.items():
        for a in (axes,) if isinstance(axes, str) else axes or ():
            if a not in names:
                raise ValueError(
                    f"{where}: rules map {logical!r} to mesh axis {a!r}, but the mesh has "
                    f"axes {names}; add {a!r} to the mesh (e.g. wb.make_mesh({a}=2, ...)), "
                    f"or map {logical} to one of {names} or None")
    return Placement(mesh=made, rules=table, preset=name, mesh_why=mesh_why, rules_why=rules_why)
