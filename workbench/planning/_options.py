"""``PlanOptions``: how a step is planned apart from what is planned (the model, mesh, rules,
batch and sequence length), checked once. ``wb.plan`` and ``wb.search`` take these as their
own keyword arguments (``wb.plan(cfg, batch=8, optimizer=optax.sgd(1e-2), progress=False)``)
and hold them in one frozen record inside (``wb.search`` hands each candidate's plan its
``as_keywords()``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import optax

from workbench._optimizer import AdamW
from workbench._step import LossFn, lm_loss
from workbench._validate import check_bool

__all__ = ["DEFAULT_REPLICATED_THRESHOLD", "PlanOptions"]

#: Parameters at least this large (elements) must not be replicated (a lint says so).
DEFAULT_REPLICATED_THRESHOLD = 16 * 1024 ** 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How a step is planned: ``wb.plan``'s keyword arguments of that name (``wb.search``
    takes all but ``name``, ``compile`` and ``pipeline``, which it sets per candidate).

    Attributes:
        optimizer: optax transformation, or a ``wb.train.AdamW`` spec, whose state is
            planned (default ``wb.train.AdamW()``: the Trainer's).
        dtype: compute dtype override for a GPTConfig ("bfloat16", "auto", ...); "auto"
            is resolved for the mesh's platform (``plan.dtype`` says which).
        name: label for ``wb.compare`` (default: the rules' preset name); ``wb.search``
            names each candidate itself.
        compile: force (True) or skip (False) compilation; default: compile when the mesh
            has real devices (``wb.search`` decides per pass: formulas, then ``top_k``).
        memory_limit: bytes per device to check against (default: the device's memory).
        replicated_threshold: parameters at least this large must not be replicated.
        loss_fn: ``(model, batch) -> loss`` of a model factory (default next-token
            cross-entropy).
        example_batch: ShapeDtypeStructs of a factory model's batch (dim 0 is "batch");
            for ``wb.search`` also a callable ``(batch, seq) -> {name: ShapeDtypeStruct}``.
        progress: say when compilation starts and how long it took (``wb.search``: one
            status line while it works).
        pipeline: ``{"microbatches", "schedule", "repeats"}`` of pipeline stages over the
            mesh's ``stage`` axis (``wb.plan``); ``wb.search`` varies it with its own
            ``stages=`` and ``pipeline=``.
        overlap: compile with the platform's flags that overlap collectives with compute
            (``workbench.planning._flags.OVERLAP_FLAGS``); False: without; a dict: exactly
            these XLA compile options. (``wb.search``'s ``overlap=`` is the predicted
            overlap fraction, a search option.)
    """

    optimizer: optax.GradientTransformation | AdamW | None = None
    dtype: str | None = None
    name: str | None = None
    compile: bool | None = None
    memory_limit: int | None = None
    replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD
    loss_fn: LossFn | None = None
    example_batch: Mapping[str, jax.ShapeDtypeStruct] | Any | None = None
    progress: bool = True
    pipeline: Mapping[str, Any] | Any | None = None
    overlap: bool | Mapping[str, Any] = True

    def __post_init__(self) -> None:
        for f in ("progress", "compile"):   # "no" is truthy: a flag is a bool
            object.__setattr__(self, f, check_bool(getattr(self, f), f,
                                                   none=f == "compile"))
        _check_values(self)

    def replace(self, **changes: Any) -> PlanOptions:
        """A copy with ``changes`` (unknown names are refused with the known ones)."""
        _check_names(changes, "PlanOptions.replace")
        return dataclasses.replace(self, **changes)

    def as_keywords(self) -> dict[str, Any]:
        """These options as ``wb.plan``'s keyword arguments."""
        return {f: getattr(self, f) for f in FIELDS}

    @property
    def loss(self) -> LossFn:
        """``loss_fn``, or the next-token loss when none is given."""
        return self.loss_fn if self.loss_fn is not None else lm_loss


FIELDS = tuple(f.name for f in dataclasses.fields(PlanOptions))


def _check_values(o: PlanOptions) -> None:
    """The options a step is traced with, checked before anything is traced: a loss is a
    callable, a batch maps names to arrays' shapes, overlap is a bool or compile options."""
    if o.loss_fn is not None and not callable(o.loss_fn):
        raise TypeError(f"loss_fn={o.loss_fn!r:.60} is a {type(o.loss_fn).__name__}, not a "
                        "callable (model, batch) -> scalar loss; give a function, or leave "
                        "loss_fn out for next-token cross-entropy")
    eb = o.example_batch
    if eb is not None and not callable(eb):
        bad = None if isinstance(eb, Mapping) else eb
        if bad is None:
            bad = next((f"{k!r}: {v!r:.40}" for k, v in eb.items() if not isinstance(k, str)
                        or not hasattr(v, "shape") or not hasattr(v, "dtype")), None)
        if bad is not None:
            raise TypeError(f"example_batch={eb!r:.80}: {bad} is not a name -> array shape; "
                            "give {name: jax.ShapeDtypeStruct((batch, ...), dtype)}, e.g. "
                            "{'x': jax.ShapeDtypeStruct((16, 1024), jnp.float32)}")
    if not isinstance(o.overlap, (bool, Mapping)) or isinstance(o.overlap, Mapping) and not all(
            isinstance(k, str) for k in o.overlap):
        raise TypeError(f"overlap={o.overlap!r:.80} must be True (the platform's overlap "
                        "flags), False, or a dict of XLA compile option name -> value")


def _check_names(given: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise TypeError(f"{where}: unknown option(s) {unknown}; PlanOptions has "
                        f"{', '.join(FIELDS)}")
