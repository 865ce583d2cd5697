"""What model code reads while it is traced: one typed context, set with a context manager.

A model names logical axes only; how they map to the mesh, whether the plan is listing
the activations, and whether the stacked blocks run as pipeline stages are decided by the
caller (the train step, the plan) while JAX traces the model. They travel in one frozen
:class:`TraceContext` held by one ``contextvars.ContextVar`` (the pattern of treescope's
``ContextualValue``): :func:`current` reads it, :func:`scoped` replaces some fields inside
a ``with`` block and restores them after, nested blocks layering on the outer ones::

    with rules.activate(mesh):               # scoped(rules=rules, mesh=mesh)
        with pipeline.activate(pipe, 4):     # scoped(pipeline=pipe, stages=4)
            logits = model(tokens)           # constrain(), attention, MoE read current()

Only inputs flow in this way. Values that flow *out* of a model (MoE router statistics)
are returned by the layers, through ``scan``, ``remat`` and the pipeline, to the caller.

This module is the bottom of the tree: ``rules`` and ``models`` import it, so it names
none of their types (not even for annotations, which would make two modules that need
each other). It carries their values; each owner reads its own through a typed accessor:
``workbench._sharding.rules.active()`` -> ``(Rules, mesh)``,
``workbench.models._pipeline.active()`` -> ``(Pipeline, stages)``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["ActivationRecord", "TraceContext", "current", "scoped"]

#: One constrained activation, as the plan lists it: ``(name, logical axes, value,
#: PartitionSpec)`` (penzai models add a fifth entry, ``"jaxpr"``: no constraint added).
ActivationRecord = tuple[Any, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceContext:
    """Everything the model reads from its caller while it is traced.

    Attributes:
        rules: the ``Rules`` that shard activations (``workbench._sharding.rules.constrain``,
            attention kernels, MoE dispatch, context parallelism); None: unconstrained.
        mesh: the mesh the rules shard over (a ``Mesh`` or ``AbstractMesh``; set with
            ``rules``).
        record: a list receiving one :data:`ActivationRecord` per constrained activation
            (``workbench._sharding.rules.recording``, for the plan's activation table); None: off.
        pipeline: the ``Pipeline`` a scanned GPT's blocks run through; None: a plain scan.
        stages: the pipeline's stages (size of the ``stage`` mesh axis).
        defer_draws: the sharded init is tracing the model: ``param()`` keeps the PRNG key
            of each float32 normal parameter as its value, and ``workbench._param_init``
            draws them all in one random expansion, each device only its own shards.
    """

    rules: Any = None   # a workbench._sharding.rules.Rules (see the module's docstring)
    mesh: Any = None
    record: list[ActivationRecord] | None = None
    pipeline: Any = None   # a workbench.models._pipeline.Pipeline
    stages: int = 1
    defer_draws: bool = False

    @property
    def sharding(self) -> tuple[Any, Any] | None:
        """``(rules, mesh)`` when rules are active, else None."""
        return None if self.rules is None else (self.rules, self.mesh)


_CURRENT: contextvars.ContextVar[TraceContext] = contextvars.ContextVar(
    "workbench_trace_context", default=TraceContext())


def current() -> TraceContext:
    """The context of the code being traced now (all fields None outside any block)."""
    return _CURRENT.get()


@contextlib.contextmanager
def scoped(**changes: Any) -> Iterator[TraceContext]:
    """The current context with ``changes`` (field names of :class:`TraceContext`) inside
    the ``with`` block; the previous one again after it (also on an exception).

    Example:
        >>> with scoped(stages=4) as ctx:
        ...     assert current() is ctx and ctx.stages == 4
        >>> current().stages
        1
    """
    ctx = dataclasses.replace(_CURRENT.get(), **changes)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
