"""Exercises on mixture of experts, checked against the jaxpr of the MoE layer the model
runs: the collectives JAX traces inside its ``shard_map`` and their per-device operands."""
from __future__ import annotations

from typing import Any

from workbench.exercises._core import AnswerError, Exercise, Result, close, parse_number
from workbench.exercises._judging import equations, wrong_number

__all__ = ["moe_all_to_all_axis", "moe_dispatch_bytes", "traced_dispatch"]

_MIB = 2**20


def traced_dispatch(cfg: Any, mesh_axes: dict[str, int], rules: str, *, batch: int,
                    seq: int) -> list[tuple[str, tuple[str, ...], int]]:
    """``[(primitive, mesh axes, bytes per device)]`` of the collectives in the forward
    pass of ``cfg``'s MoE layer (:func:`workbench.models._moe.dispatch_combine`) under
    ``Rules.preset(rules)`` on an abstract mesh, read from its jaxpr (no devices needed)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType

    from workbench.models._moe import dispatch_combine
    from workbench._sharding.rules import Rules

    mesh = AbstractMesh(tuple(mesh_axes.values()), tuple(mesh_axes),
                        axis_types=(AxisType.Auto,) * len(mesh_axes))
    r = Rules.preset(rules, mesh)
    e, d, f, k = cfg.n_experts, cfg.d_model, cfg.moe_d_ff, cfg.experts_per_token
    cfg = cfg.resolved(jax.default_backend())   # dtype "auto": as the model would run here
    dt = jnp.dtype(cfg.dtype)
    sds = jax.ShapeDtypeStruct
    args = (sds((batch, seq, d), dt), sds((batch, seq, k), jnp.int32),
            sds((batch, seq, k), jnp.float32), sds((e, d, f), dt), sds((e, d, f), dt),
            sds((e, f, d), dt))

    def layer(*a: Any) -> Any:
        with r.activate(mesh):
            return dispatch_combine(cfg, *a)

    out: list[tuple[str, tuple[str, ...], int]] = []
    for eqn in equations(jax.make_jaxpr(layer)(*args).jaxpr):
        name = eqn.primitive.name
        if name in ("all_to_all", "all_gather", "reduce_scatter", "psum_scatter"):
            axes = eqn.params.get("axis_name")
            axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
            size = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
            out.append((name, axes, int(size)))
    return out


def _axis(answer: Any) -> str:
    text = str(answer).strip().strip("'\"")
    if not text or not text.replace("_", "").isalnum():
        raise AnswerError(f"write one mesh axis name, e.g. data, got {answer!r}")
    return text


def moe_all_to_all_axis() -> Exercise:
    axes = {"expert": 4, "data": 2}

    def judge(axis: str) -> Result:
        from workbench.models import GPTConfig

        cfg = GPTConfig.preset("moe-tiny")
        found = traced_dispatch(cfg, axes, "ep", batch=8, seq=cfg.seq_len)
        a2a = sorted({a for name, ax, _ in found if name == "all_to_all" for a in ax})
        if [axis] == a2a:
            return Result(correct=True, explanation=(
                f"The experts' weights are split over {axis!r} (rule experts={axis!r}), so a "
                f"token routed to expert e must reach the device holding e: the dispatch "
                f"all-to-all runs over {axis!r} ({len(found)} collectives traced in the "
                f"layer's forward pass, {sum(n == 'all_to_all' for n, _, _ in found)} "
                f"all-to-alls). 'data' only splits the batch: devices along it hold the same "
                f"experts and never exchange tokens."))
        if axis == "data":
            return Result(correct=False, explanation=(
                "'data' splits the batch, but every device along it holds the same experts, "
                "so tokens never need to move along it. Which axis splits the experts?"))
        return Result(correct=False, explanation=(
            f"{axis!r} is not it; the mesh axes are {list(axes)}. Look at the rules: "
            f"Rules.preset('ep', mesh)['experts']."))

    return Exercise(
        name="moe_all_to_all_axis", title="Which axis does the all-to-all run over?",
        notebook="11",
        prompt=("moe-tiny (8 experts, top-2) trained with rules 'ep' on the mesh "
                "{'expert': 4, 'data': 2}. Over which mesh axis do the token dispatch's "
                "all-to-alls run?"),
        placeholder="a mesh axis name", hint="Which axis shards the experts' first dim?",
        solution="expert", parse=_axis, judge=judge)


def moe_dispatch_bytes() -> Exercise:
    batch, seq, axes = 64, 4096, {"expert": 8, "data": 8}

    def judge(mib: float) -> Result:
        from workbench.models import GPTConfig
        from workbench.models._moe_choice import capacity

        cfg = GPTConfig.preset("mixtral-8x7b")
        found = traced_dispatch(cfg, axes, "fsdp_ep", batch=batch, seq=seq)
        got = [b for name, _, b in found if name == "all_to_all"]
        want = got[0] / _MIB
        g = batch * seq // 64
        cap = capacity(cfg, g)
        if close(mib, want):
            return Result(correct=True, explanation=(
                f"Each device routes its own {g} tokens (64 sequences x 4096 over 64 "
                f"devices). Capacity per expert: ceil(1.25 x {g} x 2 / 8) = {cap} slots, so "
                f"the dispatch buffer is 8 experts x {cap} x 4096 x 2 bytes = {want:.0f} MiB; "
                f"the traced all-to-all moves exactly that ({len(got)} all-to-alls in the "
                f"forward pass: dispatch and return)."))
        mistakes = [
            (want * 2, "that is float32; Mixtral computes in bfloat16 (2 bytes)"),
            (want / 1.25, "that leaves out the capacity factor 1.25 (slack for imbalance)"),
            (want / 8, "that is one expert's slots; the buffer holds all 8 experts' slots"),
            (want * 8 / 1.25 / 2, "that is dropless (room for every token at every expert)"),
            (want * 64, "that is the whole mesh; the question asks per device"),
        ]
        return wrong_number(mib, f"{mib:.4g} MiB", mistakes, (
            f"{mib:.4g} MiB is not it. The buffer is (experts, capacity, d_model) in the "
            f"compute dtype; capacity = ceil(capacity_factor x tokens x k / experts)."))

    return Exercise(
        name="moe_dispatch_bytes", title="Bytes of one dispatch all-to-all", notebook="11",
        prompt=("Mixtral-8x7B (8 experts, top-2, d_model 4096, bfloat16, capacity factor "
                "1.25) with rules 'fsdp_ep' on {'expert': 8, 'data': 8}: a batch of 64 "
                "sequences of 4096 tokens. How many MiB does one device send into one "
                "dispatch all-to-all (its whole buffer, per layer)?"),
        placeholder="e.g. 40 MiB", hint="Tokens per device first, then the capacity.",
        solution="80 MiB", parse=parse_number("MiB"), judge=judge)
