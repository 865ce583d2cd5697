"""Held-out evaluation: the loss and perplexity of fixed eval batches, token-weighted.

``TrainConfig(eval_every=N, eval_batches=K)`` evaluates after every ``N``-th update on
the first ``K`` batches of the held-out rows (the same batches every time, so the curve
compares like with like, and a resumed run evaluates at the same steps with the same
numbers). The eval loss is the mean next-token cross-entropy over every predicted token
of those batches (``lm_loss`` of each batch weighted by its tokens); the perplexity is
``exp(eval_loss)``. Both go into that step's line of ``metrics.jsonl`` as ``eval_loss``
and ``eval_perplexity``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Evaluator", "eval_record"]


class Evaluator:
    """Dispatches the eval of a state (asynchronously) and turns the result into numbers.

    Args:
      graphdef: the model's graph.
      batches: the eval batches (global arrays, sharded like train batches).
      param_shardings: the parameters' shardings.
      rules, mesh: active while the loss is traced (activation constraints).
      loss_fn: ``(model, batch) -> mean loss`` (default ``workbench._step.lm_loss``).
    """

    def __init__(self, graphdef: Any, batches: Sequence[dict[str, Any]], param_shardings: Any,
                 *, rules: Any, mesh: Any, loss_fn: Callable[..., Any] | None = None) -> None:
        from workbench._step import lm_loss

        self.batches = list(batches)
        fn = loss_fn or lm_loss

        def weighted(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
            with rules.activate(mesh):
                loss = fn(nnx.merge(graphdef, params), batch)
            tokens = jnp.sum(batch["mask"].astype(jnp.float32)) if "mask" in batch else \
                jnp.asarray(batch["targets"].size, jnp.float32)
            return loss * tokens, tokens                        # (), ()

        batch_sh = {k: v.sharding for k, v in self.batches[0].items()}
        self._fn = jax.jit(weighted, in_shardings=(param_shardings, batch_sh))

    def __call__(self, state: Any) -> list[tuple[Any, Any]]:
        """Starts evaluating ``state.params``; returns device values for :func:`eval_record`."""
        return [self._fn(state.params, b) for b in self.batches]


def eval_record(values: list[tuple[Any, Any]]) -> dict[str, float]:
    """``{"eval_loss", "eval_perplexity", "eval_tokens"}`` of :meth:`Evaluator.__call__`'s
    values (blocks until they are computed)."""
    pairs = jax.device_get(values)
    total = math.fsum(float(t) for _, t in pairs)
    loss = math.fsum(float(s) for s, _ in pairs) / max(total, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_tokens": int(total)}
