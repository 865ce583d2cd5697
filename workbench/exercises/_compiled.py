"""Exercises checked by compiling the learner's layout with jit and reading what XLA did."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from workbench._flops import compiled_flops
from workbench._compiled.hlo import KINDS, Collective, parse_collectives
from workbench.exercises._core import (
    Exercise,
    Result,
    fmt_spec,
    parse_choice,
    parse_spec,
    parse_specs,
)
from workbench.exercises._sharding import _spec_errors, concrete_mesh

__all__ = ["Compiled", "compile_on_mesh", "fsdp_collective", "megatron_mlp", "repeated_work"]

COLLECTIVES = KINDS


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What XLA made of a jitted function on a mesh.

    Attributes:
      collectives: the collectives of the compiled program (``workbench._compiled.hlo``).
      flops: FLOPs each device executes (``compiled.cost_analysis()``).
    """

    collectives: tuple[Collective, ...]
    flops: float

    @property
    def kinds(self) -> tuple[str, ...]:
        """One entry per collective instruction, in order of traffic."""
        return tuple(k for c in self.collectives for k in [c.kind] * c.count)

    def describe(self) -> str:
        if not self.collectives:
            return "no collectives"
        return ", ".join(
            f"{c.kind}{f' x{c.count}' if c.count > 1 else ''} over {'/'.join(c.axes) or '-'} "
            f"(result {', '.join(c.shapes)} per device)" for c in self.collectives)


def compile_on_mesh(fn: Callable[..., Any], shapes: Sequence[tuple[int, ...]],
                    specs: Sequence[PartitionSpec], out: PartitionSpec | None,
                    axes: dict[str, int]) -> Compiled:
    """AOT-compile ``fn`` for float32 inputs laid out by ``specs`` on a real mesh of ``axes``."""
    mesh = concrete_mesh(**axes)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p))
            for s, p in zip(shapes, specs)]
    kw = {} if out is None else {"out_shardings": NamedSharding(mesh, out)}
    compiled = jax.jit(fn, **kw).lower(*args).compile()
    ops = parse_collectives(compiled.as_text(), tuple(axes), tuple(axes.values()))
    return Compiled(collectives=tuple(ops), flops=compiled_flops(compiled) or 0.0)


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w  # (B, D) @ (D, F) -> (B, F)


def fsdp_collective() -> Exercise:
    axes = {"data": 8}
    shapes = ((64, 256), (256, 512))
    specs = (PartitionSpec("data", None), PartitionSpec("data", None))
    options = COLLECTIVES + ("none",)

    def judge(choice: str) -> Result:
        c = compile_on_mesh(_matmul, shapes, specs, None, axes)
        kinds = set(c.kinds) or {"none"}
        total = 2 * 64 * 256 * 512
        share = (f"{c.flops:,.0f} FLOPs per device = 1/{total / c.flops:.0f} of the "
                 f"{total:,} total")
        fsdp = (f"XLA compiled: {c.describe()}. Each device gathers the full (256, 512) "
                f"weight and multiplies it with its own 8 rows of x ({share}). This is FSDP "
                "(ZeRO-3): the weight is *stored* split over 'data' and gathered when used; "
                "every replica computes with the same, whole weight, so it is one model, not "
                "8 different ones.") if "all-gather" in kinds else (
                f"XLA compiled: {c.describe()} ({share}).")
        if choice in kinds:
            return Result(correct=True, explanation=fsdp)
        why = {
            "all-reduce": "an all-reduce sums partial results; here no device holds a partial "
                          "sum, because x's contraction dim (256) is not split.",
            "none": "w's rows are split over 'data' while x's contraction dim is whole, so the "
                    "devices must exchange something before they can multiply.",
        }.get(choice, f"XLA did not use {choice} here.")
        return Result(correct=False, explanation=f"{why} {fsdp}")

    return Exercise(
        name="fsdp_collective", title="Weights sharded along the data axis", notebook="02",
        prompt=("On the mesh data=8, x (64, 256) has P('data', None) and the weight w "
                "(256, 512) ALSO has P('data', None): its rows are split over the data axis.\n"
                "    y = jax.jit(lambda x, w: x @ w)(x, w)\n"
                f"Which collective does XLA insert? ({', '.join(options)})"),
        placeholder="all-gather / all-reduce / ...",
        hint="each device has 8 rows of x with all 256 columns, but only 32 of w's 256 rows; "
             "what must it fetch from the others to compute its rows of y?",
        solution="all-gather", parse=parse_choice(options), judge=judge)


def repeated_work() -> Exercise:
    axes = {"data": 4, "model": 2}
    shapes = ((64, 256), (256, 512))
    w_spec = PartitionSpec(None, "model")
    total = 2 * 64 * 256 * 512

    def judge(x_spec: PartitionSpec) -> Result:
        err = _spec_errors(shapes[0], x_spec, axes, "x")
        if err:
            return Result(correct=False, explanation=err)
        c = compile_on_mesh(_matmul, shapes, (x_spec, w_spec), None, axes)
        repeat = c.flops * 8 / total
        per = f"{c.flops:,.0f} FLOPs per device (jax cost_analysis) of {total:,} in all"
        if repeat <= 1.01:
            return Result(correct=True, explanation=(
                f"{fmt_spec(x_spec)}: {per}, exactly 1/8 each, so no device repeats another's "
                f"work. XLA compiled: {c.describe()}."))
        used = _axes_in(x_spec) | _axes_in(w_spec)
        idle = [a for a in axes if a not in used]
        why = [(f"no spec uses {' or '.join(map(repr, idle))}, so the devices along it hold "
                "the same blocks and do the same work")] if idle else []
        if len(x_spec) and "model" in _axes_in(PartitionSpec(x_spec[0])):
            why.append("x's batch and w's columns both sit on 'model', so XLA first re-gathers "
                       "x over 'model'")
        return Result(correct=False, explanation=(
            f"{fmt_spec(x_spec)}: {per}, so every FLOP is done {repeat:.0f} times over. XLA "
            f"compiled: {c.describe()}. " + _sentence("; ".join(why))))

    return Exercise(
        name="repeated_work", title="Batch and weights on the same axis", notebook="02",
        prompt=("On the mesh data=4, model=2, w (256, 512) has P(None, 'model'). Someone gave "
                "the batch x (64, 256) the spec P('model', None), so both use 'model'.\n"
                "    y = jax.jit(lambda x, w: x @ w)(x, w)\n"
                "Write a spec for x with which no two devices repeat each other's work."),
        placeholder="P(...)",
        hint="an axis that appears in no spec means every device along it does the same "
             "thing; put the batch on the axis that w does not use.",
        solution="P('data', None)", parse=parse_spec, judge=judge)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "." if text else ""


def _axes_in(spec: PartitionSpec) -> set[str]:
    return {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}


def _mlp(x: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ up)  # (B, D) @ (D, F) -> (B, F)
    return h @ down          # (B, F) @ (F, D) -> (B, D)


def megatron_mlp() -> Exercise:
    axes = {"data": 4, "model": 2}
    d, f = 256, 1024
    shapes = ((64, d), (d, f), (f, d))
    x_spec = out_spec = PartitionSpec("data", None)

    def judge(specs: dict[str, PartitionSpec]) -> Result:
        for name, shape in (("up", (d, f)), ("down", (f, d))):
            err = _spec_errors(shape, specs[name], axes, name)
            if err:
                return Result(correct=False, explanation=err)
            used = _axes_in(specs[name])
            parts = 1
            for a in used:
                parts *= axes[a]
            if used != {"model"}:
                return Result(correct=False, explanation=(
                    f"{name} {fmt_spec(specs[name])} is stored in {parts} piece(s); tensor "
                    "parallelism stores each weight split 2 ways over 'model' (and not over "
                    "'data', which holds the batch)"))
        c = compile_on_mesh(_mlp, shapes, (x_spec, specs["up"], specs["down"]), out_spec, axes)
        yours = f"up={fmt_spec(specs['up'])}, down={fmt_spec(specs['down'])}"
        if c.kinds == ("all-reduce",):
            return Result(correct=True, explanation=(
                f"{yours}: XLA compiled exactly one collective: {c.describe()}. Each device "
                "computes its own columns of the hidden layer (relu needs nothing from the "
                "others) and a partial sum of the output; one all-reduce over 'model' adds "
                "them. This is Megatron-LM's MLP (Shoeybi et al. 2019)."))
        return Result(correct=False, explanation=(
            f"{yours}: XLA compiled {len(c.kinds)} collective(s): {c.describe()}; the target "
            "is a single all-reduce."))

    return Exercise(
        name="megatron_mlp", title="A tensor-parallel MLP with one all-reduce", notebook="03",
        prompt=("On the mesh data=4, model=2 the batch x (64, 256) has P('data', None) and "
                "y = relu(x @ up) @ down must come out as P('data', None); up is (256, 1024), "
                "down is (1024, 256).\nGive specs for up and down that store each weight split "
                "over 'model' and make the forward pass need exactly one collective."),
        placeholder="up=P(...), down=P(...)",
        hint="split up by columns (its 1024 hidden units) and down by rows (the same hidden "
             "units): then relu is local and only the final sum crosses devices.",
        solution="up=P(None, 'model'), down=P('model', None)", parse=parse_specs(("up", "down")),
        judge=judge)
