"""Plan before you allocate: abstract init + AOT-compiled train step -> memory, FLOPs,
collectives and layout lints per device; ``materialize()`` builds the sharded model.

::

    plan = wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=8, seq=128)
    plan.memory              # per-device bytes: params, optimizer, temp, total, limit, ...
    plan.model_flops         # analytic, whole step, all devices
    plan.compiled_flops_per_device, plan.collectives, plan.warnings, plan.shardings
    model = plan.materialize(seed=0)   # sharded init; no device ever holds the whole model

On a mesh larger than the machine (``wb.abstract_mesh("v5p-1024", data=-1, model=4)``)
the plan is analytic: memory by formula, FLOPs, and collectives estimated from layouts,
all labelled as estimates.
"""
from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from workbench.planning import analytic
from workbench.planning import lints
from workbench._notebook import in_notebook
from workbench.planning.hlo import Collective, parse_collectives
from workbench.planning.lints import Lint
from workbench.planning.report import Comparison, PlanReport
from workbench.flops import FlopCount, dot_flops, gpt_flops
from workbench.flops import compiled_flops as flops_of
from workbench.layouts import Layout, layout
from workbench.mesh import MeshInfo, mesh_info
from workbench.models import GPTConfig
from workbench.rules import Rules
from workbench.step import (
    LossFn,
    ModelFactory,
    TrainState,
    abstract_param_state,
    jit_train_step,
    lm_loss,
    logical_axes,
    make_train_step,
    model_factory,
    opt_state_specs,
    param_specs,
    path_str,
    require_auto_axes,
    sharded_init,
)

__all__ = ["Collective", "Comparison", "Lint", "Plan", "compare", "plan"]

DEFAULT_REPLICATED_THRESHOLD = 16 * 1024 ** 2


class Plan(PlanReport):
    """What one train step needs on a mesh, before any parameter is allocated.

    Attributes:
        name: label used by ``compare``.
        cfg: the GPTConfig (None for a model factory).
        mesh: the ``MeshInfo``.
        rules: the ``Rules`` used.
        batch, seq: global batch size and sequence length.
        is_estimate: True when nothing was compiled (abstract mesh): all numbers by formula.
        flops: the analytic ``FlopCount`` (formula, breakdown, 6N).
        memory: per-device bytes ``params, optimizer, batch, gradients, temp, total, limit``
            (compiled when available, else ``memory_estimate``).
        memory_estimate: the same keys by formula (plus ``activations``).
        collectives: ``Collective`` records (compiled HLO, or estimates).
        warnings: ``Lint`` records.
        layouts: ``{path: Layout}`` of every parameter (``params.*``), optimizer leaf
            (``opt_state.*``) and batch input (``batch.*``), each with its logical axes.
        shardings: ``TrainState`` of ``NamedSharding`` matching the model state.
        compiled: the ``jax.stages.Compiled`` step (None when analytic).
        compile_seconds: lowering + compilation time.
    """

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    @property
    def model_flops(self) -> float:
        """Analytic model FLOPs of one step, all devices (no remat; MaxText convention)."""
        return self.flops.total

    @property
    def compiled_flops_per_device(self) -> float | None:
        """FLOPs per device from ``compiled.cost_analysis()`` (None when analytic)."""
        return self._compiled_flops

    @property
    def flops_per_device(self) -> float:
        """Compiled per-device FLOPs, or (estimate) model FLOPs × remat overhead / the
        number of ways the mesh splits the compute."""
        if self._compiled_flops is not None:
            return self._compiled_flops
        # remat="full" runs every block's forward twice: 4 forwards' worth instead of 3
        remat = 4 / 3 if self.cfg is not None and self.cfg.remat == "full" else 1.0
        return self.model_flops * remat / self._split

    @property
    def replicated_compute_factor(self) -> float:
        """``model_flops / (devices × per-device FLOPs)``: 1 when devices split the work
        exactly; below 1 when devices repeat each other's work (or rematerialise)."""
        return self.model_flops / (self.mesh.size * self.flops_per_device)

    @property
    def comm_bytes_per_device(self) -> float:
        """Bytes each device sends per step over all collectives (ring model)."""
        return float(sum(c.total_wire_bytes for c in self.collectives))

    @property
    def fits(self) -> bool | None:
        """Whether ``memory['total'] <= memory['limit']`` (None when the limit is unknown)."""
        limit = self.memory.get("limit")
        return None if not limit else self.memory["total"] <= limit

    def init_state(self, seed: int = 0) -> TrainState:
        """Params and optimizer state created directly into the plan's shardings."""
        self._require_devices("init_state")
        return sharded_init(self._factory, self.optimizer, self.shardings)(jax.random.key(seed))

    def materialize(self, seed: int = 0) -> Any:
        """The sharded ``nnx.Module``: parameters are created by a function jitted with the
        plan's output shardings, so no device ever holds the full parameters."""
        self._require_devices("materialize")
        params = sharded_init(self._factory, None, self.shardings.params)(jax.random.key(seed))
        return nnx.merge(self.graphdef, params)

    def train_step(self) -> Callable[..., Any]:
        """The step this plan compiled, ``(state, batch) -> (state, metrics)``: the AOT
        executable (donates ``state``), or the jitted function when nothing was compiled."""
        self._require_devices("train_step")
        return self.compiled if self.compiled is not None else self._jitted

    def _require_devices(self, what: str) -> None:
        if self.mesh.jax_mesh is None:
            raise RuntimeError(
                f"plan.{what}() needs real devices, but this plan is on {self.mesh.describe()}; "
                "plan on wb.make_mesh(...) to build the model")


def plan(cfg_or_factory: GPTConfig | ModelFactory, *, mesh: Any,
         rules: Rules | str | None = None, batch: int, seq: int | None = None,
         optimizer: optax.GradientTransformation | None = None, dtype: str | None = None,
         name: str | None = None, compile: bool | None = None,
         memory_limit: int | None = None,
         replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD,
         loss_fn: LossFn = lm_loss,
         example_batch: Mapping[str, jax.ShapeDtypeStruct] | None = None,
         progress: bool = True) -> Plan:
    """Plan one train step of a model on a mesh without allocating it.

    Args:
        cfg_or_factory: a ``GPTConfig`` or a callable ``rngs -> nnx.Module``.
        mesh: ``wb.make_mesh(...)`` (compiled plan) or ``wb.abstract_mesh(...)`` (analytic).
        rules: ``Rules`` or a preset name ("dp", "fsdp", "tp", "fsdp_tp"); default "fsdp".
        batch: global batch size (sequences per step).
        seq: sequence length (default ``cfg.seq_len``).
        optimizer: optax transformation (default ``optax.adamw(3e-4)``).
        dtype: compute dtype override for a GPTConfig ("bfloat16", ...).
        name: label for ``compare`` (default: the preset name).
        compile: force (True) or skip (False) compilation; default: compile when the mesh
            has real devices.
        memory_limit: bytes per device to check against (default: the device's memory).
        replicated_threshold: parameters at least this large must not be replicated.
        loss_fn: ``(model, batch) -> loss`` (default next-token cross-entropy).
        example_batch: ShapeDtypeStructs of a factory model's batch (dim 0 is "batch");
            default ``{"inputs", "targets"}`` int32 ``(batch, seq)``.
        progress: say when compilation starts and how long it took (it can take minutes
            for a large model on many devices).
    """
    t0 = time.perf_counter()
    info = mesh_info(mesh)
    rules_name = rules if isinstance(rules, str) else None
    rules = Rules.preset(rules or "fsdp", info) if rules is None or isinstance(rules, str) \
        else rules
    rules.check_mesh(info)
    if info.jax_mesh is not None:
        require_auto_axes(info.jax_mesh)
    cfg = cfg_or_factory if isinstance(cfg_or_factory, GPTConfig) else None
    if dtype is not None:
        if cfg is None:
            raise ValueError(f"dtype={dtype!r} applies to a GPTConfig; a model factory sets "
                             "its own dtypes")
        cfg = cfg.replace(dtype=dtype)
    factory = model_factory(cfg if cfg is not None else cfg_or_factory)
    seq = int(seq or (cfg.seq_len if cfg else 1))
    optimizer = optimizer if optimizer is not None else optax.adamw(3e-4)
    jmesh = info.jax_mesh if info.jax_mesh is not None else info.abstract

    graphdef, param_state = abstract_param_state(factory)
    params, logical = nnx.to_pure_dict(param_state), logical_axes(param_state)
    missing: dict[str, list[str]] = {}
    for tensor, axes in logical.items():
        for ax in rules.unmapped(axes):
            missing.setdefault(ax, []).append(tensor)
    pspecs = param_specs(params, logical, rules, strict=False)
    opt_abstract = jax.eval_shape(optimizer.init, params)
    specs = TrainState(step=jax.sharding.PartitionSpec(), params=pspecs,
                       opt_state=opt_state_specs(opt_abstract, params, pspecs))
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                          opt_state=opt_abstract)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(jmesh, s), specs,
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    example = dict(example_batch) if example_batch is not None else {
        k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("inputs", "targets")}
    batch_spec = rules.spec(("batch",), tensor="batch", strict=False)
    batch_sh = {k: jax.sharding.NamedSharding(jmesh, jax.sharding.PartitionSpec(
        *batch_spec, *([None] * (len(v.shape) - 1)))) for k, v in example.items()}

    layouts = _layouts(abstract, specs, logical, info, example, batch_sh)
    p_lay = {k[len("params."):]: v for k, v in layouts.items() if k.startswith("params.")}
    o_lay = {k: v for k, v in layouts.items() if k.startswith("opt_state.")}
    b_lay = {k: v for k, v in layouts.items() if k.startswith("batch.")}
    if cfg is not None:
        flops = gpt_flops(cfg, batch, seq)
    else:
        flops = _factory_flops(graphdef, params, loss_fn, example, batch)
    split = analytic.compute_split(rules, info, p_lay)
    act = analytic.activation_bytes(cfg, batch, seq, rules, info) if cfg else None
    limit = memory_limit if memory_limit is not None else info.memory_per_device
    estimate = analytic.analytic_memory(p_lay, o_lay, b_lay, act, limit)

    do_compile = info.jax_mesh is not None if compile is None else compile
    if do_compile and info.jax_mesh is None:
        raise ValueError(f"compile=True needs real devices; {info.describe()} is abstract")
    compiled = jitted = compiled_flops = None
    compile_seconds = 0.0
    if info.jax_mesh is not None:
        step = make_train_step(graphdef, optimizer, loss_fn=loss_fn, rules=rules,
                               mesh=info.jax_mesh)
        jitted = jit_train_step(step, shardings, batch_sh)
    if do_compile:
        tc = time.perf_counter()
        batch_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sh[k])
                     for k, v in example.items()}
        label = f"wb.plan({name or rules_name or 'fsdp'!r})"
        done = _announce(f"{label}: compiling the train step on {info.describe()}...",
                         progress)
        compiled = jitted.lower(abstract, batch_abs).compile()
        compile_seconds = time.perf_counter() - tc
        done(f"{label}: compiled the train step in {compile_seconds:.1f} s")
        compiled_flops = flops_of(compiled)
        memory = _compiled_memory(compiled, estimate, limit)
        collectives = parse_collectives(compiled.as_text(), info.axis_names, info.axis_sizes)
    else:
        memory = dict(estimate)
        collectives = analytic.analytic_collectives(p_lay, rules, info, cfg, batch, seq)

    warnings = (lints.over_memory(memory, "compiled" if compiled else "estimate")
                + lints.unmapped(missing) + lints.uneven({**p_lay, **b_lay})
                + lints.redundant_compute(rules, info, p_lay)
                + lints.replicated(p_lay, replicated_threshold)
                + lints.fsdp_gathers(p_lay, rules, info, collectives, compiled is not None))
    return Plan(
        name=name or rules_name or "plan", cfg=cfg, mesh=info, rules=rules, batch=batch,
        seq=seq, optimizer=optimizer, is_estimate=compiled is None, flops=flops,
        memory=memory, memory_estimate=estimate, collectives=collectives, warnings=warnings,
        layouts=layouts, logical=logical, shardings=shardings, abstract_state=abstract,
        param_state=param_state,
        graphdef=graphdef, compiled=compiled, compile_seconds=compile_seconds,
        plan_seconds=time.perf_counter() - t0, _compiled_flops=compiled_flops, _split=split,
        _factory=factory, _jitted=jitted)


def _announce(text: str, enabled: bool) -> Callable[[str], None]:
    """Shows ``text`` now; the returned callable replaces it (in a notebook, one output line
    updated in place; elsewhere, lines on stderr)."""
    if not enabled:
        return lambda _: None
    if in_notebook():
        from IPython.display import display

        handle = display({"text/plain": text}, raw=True, display_id=True)
        return lambda done: handle.update({"text/plain": done}, raw=True)
    print(text, file=sys.stderr, flush=True)
    return lambda done: print(done, file=sys.stderr, flush=True)


def _layouts(abstract: TrainState, specs: TrainState, logical: Mapping[str, tuple],
             info: MeshInfo, example: Mapping[str, Any],
             batch_sh: Mapping[str, Any]) -> dict[str, Layout]:
    """One Layout per tensor, named after it, with its logical axes (optimizer leaves take
    those of the parameter they mirror). Tensors of equal (shape, dtype, spec) share one
    geometry: 70B on 512 devices has ~2,200 tensors but a few dozen distinct layouts."""
    out: dict[str, Layout] = {}
    cache: dict[tuple, Layout] = {}
    depths = sorted({k.count(".") + 1 for k in logical}, reverse=True)

    def make(key: str, shape: tuple, dtype: Any, spec: Any, axes: Any) -> Layout:
        ck = (shape, str(dtype), tuple(spec))
        if ck not in cache:
            cache[ck] = layout(shape, spec, info, dtype=dtype, name=key)
        lay = copy.copy(cache[ck])
        lay.name, lay.logical_axes = key, axes
        return lay

    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract)
    for (path, leaf), spec in zip(flat, flat_specs, strict=True):
        key = path_str(path)
        section, _, rest = key.partition(".")
        axes = logical.get(rest) if section == "params" else None
        if section == "opt_state":
            parts = rest.split(".")
            for d in depths:
                cand = logical.get(".".join(parts[-d:]))
                if cand is not None and len(cand) == len(leaf.shape):
                    axes = cand
                    break
        out[key] = make(key, tuple(leaf.shape), leaf.dtype, spec, axes)
    for k, v in example.items():
        axes = ("batch",) + (None,) * (len(v.shape) - 1)
        out[f"batch.{k}"] = make(f"batch.{k}", tuple(v.shape), v.dtype, batch_sh[k].spec, axes)
    return out


def _factory_flops(graphdef: Any, params: Any, loss_fn: LossFn, example: Mapping[str, Any],
                   batch: int) -> FlopCount:
    """Matmul FLOPs of one training step, counted in the jaxpr of the loss's value-and-grad.

    Not 3 x forward: the first layer needs no gradient with respect to its input, so a
    small model's backward pass is well under 2 x forward, and the 3 x convention would
    make devices look as if they skipped work (replicated compute factor above 1).
    """
    loss = lambda p, b: loss_fn(nnx.merge(graphdef, p), b)
    fwd = dot_flops(loss, params, dict(example))
    step = dot_flops(jax.value_and_grad(loss), params, dict(example))
    n = sum(x.size for x in jax.tree.leaves(params))
    return FlopCount(total=step, forward=fwd,
                     breakdown={"forward": fwd, "backward": step - fwd},
                     six_n=6.0 * n * batch, tokens=batch, causal=False,
                     formula=(f"forward + backward matmul FLOPs counted in the jaxpr of the "
                              f"loss's value-and-grad ({step / fwd:.2f} x forward; the "
                              f"3 x forward convention would give {3 * fwd:.3g})"))


def _compiled_memory(compiled: Any, estimate: Mapping[str, Any],
                     limit: int | None) -> dict[str, int | None]:
    """Per-device bytes from ``memory_analysis()``; params/optimizer/batch are the exact
    argument shards, XLA's temp is split into gradients (their shards) and the rest."""
    ma = compiled.memory_analysis()
    if ma is None:
        return dict(estimate)
    temp = int(ma.temp_size_in_bytes)
    grads = min(int(estimate["gradients"]), temp)
    total = int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                - ma.alias_size_in_bytes + temp)
    return {"params": estimate["params"], "optimizer": estimate["optimizer"],
            "batch": estimate["batch"], "gradients": grads, "temp": temp,
            "activations": temp - grads, "total": total, "limit": limit,
            "arguments": int(ma.argument_size_in_bytes),
            "outputs": int(ma.output_size_in_bytes), "aliased": int(ma.alias_size_in_bytes)}


def compare(plans: list[Plan]) -> Comparison:
    """Plans side by side: memory per device, FLOPs per device, bytes communicated per
    step, replicated compute factor, fits. Shows a table and a chart in a notebook."""
    if not plans:
        raise ValueError("compare needs at least one plan, e.g. wb.compare([plan_dp, plan_tp])")
    return Comparison(list(plans))

