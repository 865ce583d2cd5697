"""A Trainer from a ``wb.plan(...)``: the plan's config as a ``TrainConfig`` (its model,
mesh, rules, batch and sequence length; a factory plan's model as a ``ModelSpec``), and
its prediction as ``run.json``'s ``"prediction"`` record.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from workbench import _runs as runs
from workbench.train._config import TrainConfig


def plan_config(plan: Any, *, optimizer: Any, steps: int, data: Any, checkpoint_every: int,
                keep: int, seed: int) -> TrainConfig:
    """The ``TrainConfig`` of ``Trainer.from_plan(plan, ...)`` (its arguments as there).

    Raises:
      TypeError: ``plan`` is not a ``wb.plan(...)`` Plan.
      ValueError: the plan is on no real devices, or its model cannot train on the
        Trainer's token batches (``_plan_spec``).
    """
    from workbench._optimizer import AdamW

    if getattr(plan, "cfg", None) is None and getattr(plan, "factory", None) is None:
        raise TypeError(f"Trainer.from_plan needs a wb.plan(...) Plan, got "
                        f"{type(plan).__name__}")
    if plan.mesh.jax_mesh is None:
        raise ValueError(f"plan is on {plan.mesh.describe()} (no real devices); plan on "
                         "wb.make_mesh(...) to train")
    return TrainConfig(model=plan.cfg if plan.cfg is not None else _plan_spec(plan),
                       mesh=dict(plan.mesh.shape), rules=plan.rules,
                       batch=plan.report.batch, seq=plan.report.seq, steps=steps,
                       optimizer=optimizer if optimizer is not None else AdamW(),
                       data=data, checkpoint_every=checkpoint_every, keep=keep,
                       seed=seed, pipeline=getattr(plan, "pipeline", None))


def _plan_spec(plan: Any) -> Any:
    """The ``ModelSpec`` a factory plan trains: the plan's own spec, or its factory and
    loss wrapped by ``wb.any_model.from_nnx``. The Trainer feeds token batches (``{"inputs",
    "targets"}`` int32 ``(batch, seq)``), so a plan of another batch is refused with the
    supported way: a ``loss_fn`` that makes the model's inputs from the token batch."""
    from workbench.any_model._spec import ModelSpec, from_nnx
    from workbench._step import lm_loss

    tokens = set(plan.abstract_batch) == {"inputs", "targets"} and all(
        len(v.shape) == 2 and np.issubdtype(v.dtype, np.integer)
        for v in plan.abstract_batch.values())
    if not tokens:
        given = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in plan.abstract_batch.items())
        raise ValueError(
            f"Trainer.from_plan: the plan's batch is {{{given}}}, but the Trainer feeds token "
            "batches {inputs, targets: int32[batch, seq]} from TrainConfig.data; plan the model "
            "with a loss_fn that makes its inputs from the token batch (docs/your_model.md)")
    spec = plan.factory
    if not isinstance(spec, ModelSpec):
        spec = from_nnx(plan.factory, name=plan.name,
                        loss_fn=None if plan.loss_fn is lm_loss else plan.loss_fn)
    if spec.vocab_size is None:
        raise ValueError(f"Trainer.from_plan: model {spec.name!r} has no vocab_size, which the "
                         "Trainer's token data needs; plan wb.any_model.from_nnx(factory, "
                         "vocab_size=..., loss_fn=...) instead of the bare factory")
    return spec


def prediction_record(plan: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(run.json "prediction", run event)`` for a plan: the plan's prediction and where
    it comes from, or None and a ``prediction`` event saying why there is none.

    Args:
      plan: a ``wb.plan(...)`` Plan, or None (no prediction, no event).

    The record is ``plan.predicted.to_dict()`` (``step_seconds``, ``mfu``,
    ``tokens_per_s``, ``bound``, ``compiler_seconds``, ``sources``, ``breakdown``) plus
    ``source`` and ``source_reason`` (compiler or estimate), ``hardware`` and
    ``plan_name``. A plan without a prediction (a hardware table without the numbers:
    ``plan.report.prediction_error``) never stops the run: the event says why instead.
    """
    if plan is None:
        return None, None
    if not hasattr(type(plan), "predicted"):  # the class: reading it may raise
        raise TypeError(f"prediction= needs a wb.plan(...) Plan, got {type(plan).__name__}; "
                        "use Trainer.from_plan(plan, run_dir)")
    if plan.predicted is None:   # a hardware table without the numbers: said, not raised
        return None, {"recorded": False, "reason": "the plan has no prediction "
                      f"({plan.report.prediction_error})"}
    predicted = plan.predicted.to_dict()
    mesh = plan.mesh
    record = {**predicted, "source": plan.source, "source_reason": plan.source_reason,
              "hardware": getattr(mesh, "hardware", None) or getattr(mesh, "device_kind", None),
              "plan_name": plan.name}
    return runs.json_safe(record), {"recorded": True, "step_seconds": predicted["step_seconds"],
                                    "mfu": predicted["mfu"], "source": plan.source}
