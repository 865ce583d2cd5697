# %% [markdown]
# # 03 · A sharded model, step by step
#
# The order that avoids surprises on real hardware:
#
# 1. **abstract**: the model's shapes and logical axes, with nothing allocated;
# 2. **rules**: one object maps logical axes (`embed`, `mlp`, `heads`, ...) to mesh axes;
# 3. **plan**: compile one train step ahead of time and read memory per device,
#    FLOPs, collectives and layout mistakes, before a single parameter exists;
# 4. **materialize**: create the parameters directly in their shards;
# 5. **inspect** what landed where, and take a step;
# 6. **compare** data parallel, FSDP, tensor parallel and FSDP + TP side by side.

# %%
import workbench as wb

wb.simulate_devices(8)

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

mesh = wb.make_mesh(data=4, model=2)
cfg = wb.models.GPTConfig.preset("tiny")
print(cfg)
print(f"{cfg.n_params:,} parameters")

# %% [markdown]
# ## 1. Abstract: shapes and logical axes, no memory
#
# `nnx.eval_shape` runs the model's constructor abstractly: every parameter is a
# `ShapeDtypeStruct`. The model only names **logical** axes (look for `out_sharding`
# below); it never mentions the mesh.

# %%
abstract = nnx.eval_shape(lambda: wb.models.GPT(cfg, rngs=nnx.Rngs(0)))
print(abstract.blocks[0].mlp)

# %% [markdown]
# ## 2. Rules: logical axes -> mesh axes
#
# A `wb.Rules` object is the one place that decides the parallelism. The presets are
# `dp`, `fsdp`, `tp` and `fsdp_tp`; any rule can be changed with `.replace(...)`.

# %%
rules = wb.Rules.preset("tp", mesh)
print(rules)
print("MLP up (embed, mlp):  ", rules.spec(("embed", "mlp")))
print("MLP down (mlp, embed):", rules.spec(("mlp", "embed")))
wb.show(abstract, rules=rules, mesh=mesh)

# %% [markdown]
# Megatron-style tensor parallelism splits the MLP's first matrix by columns and the
# second by rows. Why that pairing?

# %%
wb.exercise("megatron_mlp")

# %% [markdown]
# ## 3. Plan before you allocate
#
# `wb.plan` builds the abstract train state (parameters and optax state with their
# shardings), AOT-compiles one full train step (forward, backward, AdamW update) for
# this mesh, and reads back what XLA decided: memory per device, FLOPs per device and
# every collective. Nothing is allocated.

# %%
plan = wb.plan(cfg, mesh=mesh, rules=rules, batch=8, seq=128, name="tp")
print(plan.summary())
plan

# %% [markdown]
# Each tensor's layout is in `plan.layouts`, so any single one can be looked at:

# %%
print(plan.layouts["params.blocks.0.mlp.up"])

# %% [markdown]
# ## 4. Materialize: parameters created in their shards
#
# `plan.materialize()` runs the initializer inside a `jit` whose outputs carry the
# plan's shardings, so each device only ever computes and stores its own blocks. For a
# model larger than one device this is the only way to create it at all.

# %%
model = plan.materialize(seed=0)
up = model.blocks[0].mlp.up[...]  # the parameter's array
print(up.sharding)
print("global shape", up.shape, "-> per device", up.addressable_shards[0].data.shape)
assert up.addressable_shards[0].data.shape == plan.layouts["params.blocks.0.mlp.up"].shard_shape

# %% [markdown]
# ## 5. Inspect
#
# `wb.show(model)` lists every parameter with its layout; click a row to see its blocks
# on the mesh. The same view works on the abstract model of step 1, which is the point:
# what you planned is what you get.

# %%
wb.show(model)

# %% [markdown]
# The plan's compiled step (`plan.compiled`) can be called directly on a state created
# with `plan.init_state(seed)`; notebook 05 trains with `wb.Trainer`, which does this in
# a loop with checkpoints.
#
# ## 6. dp vs fsdp vs tp vs fsdp_tp
#
# The same model and batch, four ways. `wb.compare` puts the plans side by side:
# memory per device, FLOPs per device, bytes each device sends per step, and the
# replicated compute factor (1 when the devices split the work exactly; lower when
# they repeat each other's work).

# %%
plans = [wb.plan(cfg, mesh=mesh, rules=r, batch=8, seq=128) for r in ("dp", "fsdp")]
plans.insert(2, plan)  # "tp", planned above
plans.append(wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=8, seq=128))
comparison = wb.compare(plans)
print(comparison.table())
comparison

# %% [markdown]
# What to read from it, at this toy size:
#
# - **dp** keeps a whole copy of the weights and optimizer state on every device, and
#   communicates by all-reducing gradients;
# - **fsdp** stores everything split over all 8 devices (least memory) and pays with an
#   all-gather of every weight each step, plus the gradient reduction;
# - **tp** splits the weights over `model` only and communicates activations instead
#   (an all-reduce after each block's row-split matmul, as in the exercise above);
# - **fsdp_tp** combines both.
#
# `print(p)` of any plan lists its collectives one by one. With a tiny model the numbers
# are small and close together; notebook 04 runs the same comparison at GPT-3 scale,
# where they decide what fits.

# %% [markdown]
# ## 7. Where the time went: the prediction against a profile
#
# Every plan predicts its step time from FLOPs, memory traffic and each collective
# (`plan.predicted.breakdown`). `wb.profile_step(plan)` runs the plan's own compiled step
# on the devices at hand under `jax.profiler`, reads the trace back op by op, and lines it
# up with the prediction **term by term**: matmuls against the compute term, every other
# op against the memory term, each collective against its own row (matched by kind and
# mesh axes), plus what the prediction leaves out (idle time, the host between steps).
# On a `wb.Trainer` it is `trainer.profile(steps=3)`. The trace stays on disk: open it in
# XProf with `xprof --logdir profiles`.
#
# Two layouts first, fsdp and tp (CPU timings are noisy on a shared machine; the table
# says which term is off, not by how much a GPU would be):

# %%
by_name = {p.name: p for p in plans}
profiled = {name: wb.profile_step(by_name[name], steps=2, warmup=1) for name in ("fsdp", "tp")}
print(profiled["fsdp"])
profiled["tp"]

# %% [markdown]
# **Calibrate, then predict a layout that was not profiled.** `wb.calibrate` fits this
# device kind's achieved rates to the profiles: matmul FLOP/s, memory bandwidth, and for
# each kind of collective its latency and bandwidth. By default it stores them in the
# cache directory, and every later prediction for this kind of device uses them
# (`sources["calibration"]` says which profiles); here `save=False` keeps it to this
# notebook, and the third layout, fsdp_tp, is predicted with it explicitly:

# %%
cal = wb.calibrate(list(profiled.values()), save=False)
print(f"achieved matmul {cal.matmul_flops / 1e9:.2f} GFLOP/s per device "
      f"({cal.compute_factor:.2f} x the table), memory {cal.hbm_bandwidth / 1e9:.2f} GB/s "
      f"({cal.memory_factor:.2f} x)")
third = by_name["fsdp_tp"]
table_only, calibrated = third.predict(calibration=False), third.predict(calibration=cal)
measured = wb.profile_step(third, steps=2, warmup=1)
print(f"fsdp_tp: measured {measured.term('step').measured * 1e3:.1f} ms/step; predicted "
      f"{table_only.step_seconds * 1e3:.1f} ms from the hardware table, "
      f"{calibrated.step_seconds * 1e3:.1f} ms calibrated")
print(calibrated.sources["calibration"])

# %% [markdown]
# On a quiet machine the calibrated prediction of a layout it never saw lands within
# about 15% of the measured step (BENCHMARKS.md, `bench_profile`); on accelerators
# `python -m benchmarks.bench_profile --store` profiles a preset, writes this table and
# keeps the calibration for every later plan on that chip.
