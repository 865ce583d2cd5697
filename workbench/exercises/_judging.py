"""What the exercises' judges share: the equations of a traced program (sub-jaxprs
included) and the verdict on a wrong number that matches a known mistake."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from workbench.exercises._core import Result, close

__all__ = ["equations", "wrong_number"]


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and, after each, those of the jaxprs in its params
    (``shard_map``, ``scan``, ``cond``, ``pjit`` bodies), depth first.

    Example::

        jx = jax.make_jaxpr(f)(x).jaxpr
        n = sum(e.primitive.name == "ppermute" for e in equations(jx))
    """
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)   # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def wrong_number(answer: float, shown: str, mistakes: Sequence[tuple[float, str]],
                 otherwise: str) -> Result:
    """The verdict on a wrong numeric ``answer`` (written ``shown``, e.g. "512.0 MiB").

    Args:
      answer: the learner's number.
      shown: how the explanation writes it.
      mistakes: ``(value, why)`` of the usual mistakes; the first value close to ``answer``
        gives "``shown``: ``why``."
      otherwise: the whole explanation when no mistake matches.
    """
    for value, why in mistakes:
        if close(answer, value):
            return Result(correct=False, explanation=f"{shown}: {why}.")
    return Result(correct=False, explanation=otherwise)
