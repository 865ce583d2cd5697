# %% [markdown]
# # 10 · Pipelines: stages, micro-batches, schedules and the bubble
#
# Pipeline parallelism cuts the model by depth: the layers are split into **stages**, each
# held by one row of devices, and the batch is cut into **micro-batches** that flow from
# stage to stage. It is how the largest models are spread over slow links and many hosts:
# between stages only one micro-batch's activations travel, never the weights.
#
# The price is the **bubble**: at the start, later stages wait for the first micro-batch;
# at the end, earlier stages wait for the last gradients. This notebook draws schedules,
# measures the bubble, trains a pipelined model that gives the same losses as an
# unpipelined one, and plans a 70B-class model with stages across two TPU slices.
#
# In Workbench a pipeline is one mesh axis, `stage`, and one option:
# `pipeline={"microbatches": M, "schedule": "gpipe" | "circular" | "1f1b", "repeats": R}`
# on `wb.TrainConfig` and `wb.plan`. The model must hold its blocks stacked
# (`scan_layers=True`): the rules shard the stacked `layers` axis over `stage`.

# %%
import numpy as np

import workbench as wb
from workbench.models import GPTConfig, Pipeline

wb.simulate_devices(8)

# %% [markdown]
# ## A schedule, drawn
#
# GPipe (Huang et al., 2019) on 4 stages with 4 micro-batches: every stage runs all its
# forwards, then all its backwards (a backward takes about twice a forward). Each block is
# one stage working on one micro-batch, coloured by micro-batch; backwards are hatched; the
# grey stripes are the bubble. Change the micro-batches, the stages, the schedule or the
# repeats in the widget: the timeline is recomputed in the browser.

# %%
Pipeline(microbatches=4, schedule="gpipe").on(stages=4)

# %% [markdown]
# ## The bubble shrinks with micro-batches
#
# Each stage is busy for `M` forward + backward units out of `M + S - 1`, so the idle
# share is `(S - 1) / (M + S - 1)`. The **circular** schedule (Paxml's and MaxText's
# repeats) gives each stage `R` smaller chunks of layers, visited `R` times per
# micro-batch: the bubble's length shrinks `R`-fold, `(S - 1) / (R M + S - 1)`. **1F1B**
# (PipeDream-flush, Narayanan et al., 2021) has GPipe's bubble but starts backwards early,
# so a stage holds at most `S - s` micro-batches' activations instead of all `M`.
# The numbers below come from the timelines themselves, next to the formula.

# %%
S = 4
print(f"{'M':>3} {'gpipe':>8} {'1f1b':>8} {'circular R=2':>13} {'formula gpipe':>14}")
for m in (1, 2, 4, 8, 16, 32):
    row = [Pipeline(microbatches=m, schedule=s).on(S).bubble for s in ("gpipe", "1f1b")]
    circ = Pipeline(microbatches=m, schedule="circular", repeats=2).on(S).bubble if m >= S \
        else float("nan")
    print(f"{m:>3} {row[0]:>8.3f} {row[1]:>8.3f} {circ:>13.3f} "
          f"{Pipeline(microbatches=m).bubble_fraction(S):>14.3f}")
print("activations held per stage, M=8:",
      {s: Pipeline(microbatches=8, schedule=s).on(S).in_flight for s in ("gpipe", "1f1b")})

# %% [markdown]
# ### Exercise: the bubble of a GPipe schedule

# %%
wb.exercise("pipeline_bubble")

# %% [markdown]
# ## Training with a pipeline gives the same losses
#
# The tiny model with 8 stacked layers, trained for a few steps on `data=8`, then on
# `stage=4 x data=2` with GPipe over 4 micro-batches. Inside the step, each iteration
# runs every stage on its micro-batch at once (a `vmap` over the stage dim, sharded on
# `stage`) and shifts the activations one stage on: a **collective permute**. Gradients
# come from `jax.grad` of the whole loop, so the losses are the unpipelined ones to
# float32 rounding.

# %%
import tempfile

common = dict(model="tiny", model_overrides={"n_layers": 8, "scan_layers": True}, batch=8,
              seq=32, steps=5, data="synthetic", checkpoint_every=5,
              optimizer=wb.train.AdamW(lr=1e-3, warmup_steps=2, decay_steps=100))
flat = wb.Trainer(wb.TrainConfig(**common, mesh={"data": 8}),
                  run_dir=tempfile.mkdtemp() + "/flat", progress=None)
piped = wb.Trainer(wb.TrainConfig(**common, mesh={"stage": 4, "data": 2},
                                  pipeline={"microbatches": 4, "schedule": "gpipe"}),
                   run_dir=tempfile.mkdtemp() + "/piped", progress=None)
flat.run()
piped.run()
print("data=8          ", np.round(flat.losses, 6))
print("stage=4 x data=2", np.round(piped.losses, 6))
print("largest relative difference", np.max(np.abs(np.array(piped.losses) / flat.losses - 1)))

# %% [markdown]
# ## The plan: bubble, per-stage memory, collective permutes
#
# `wb.plan(..., pipeline=...)` compiles the same step and adds `plan.pipeline`: the bubble
# by formula and from the schedule, the activations each stage holds, per-stage memory,
# and the collective permutes found in the compiled program (inside the pipeline loop: one
# micro-batch's activation shard each). Every stage computes all `M + S - 1` iterations,
# so the plan's FLOPs per device carry the factor `1 / (1 - bubble)`.

# %%
cfg = GPTConfig.preset("tiny", n_layers=8, scan_layers=True)
plan = wb.plan(cfg, mesh=wb.make_mesh(stage=4, data=2), batch=8, seq=32,
               pipeline={"microbatches": 4, "schedule": "circular", "repeats": 2})
print(plan.summary())
for c in plan.pipeline["permutes"]:
    print(f"  collective-permute over {c['axes']} x{c['count']} {c['shapes']}, "
          f"in the loop: {c['in_loop']}")

# %% [markdown]
# ### Exercise: block weights per device with stages
#
# Check your answer against the layouts above (`plan.layouts["params.blocks.attn.q"]` and
# friends hold the real shard shapes).

# %%
wb.exercise("stage_block_bytes")

# %% [markdown]
# ## A 70B-class model with stages across two slices
#
# Two TPU v5p-128 slices (64 chips each) joined over the data-center network. Without a
# pipeline, FSDP spans both slices and every layer's weights are gathered (and their
# gradients reduced) across the slow link each step. With `stage` as the DCN axis, each
# slice holds 40 of the 80 layers and only micro-batch activations cross, in collective
# permutes: about half the bytes per device, none of them weights. The price shows in the
# same table: each chip's batch share doubles (it splits the batch 64 ways, not 128), so
# it holds more activations, and the bubble (circular, 4 repeats, 4 micro-batches: about
# 6%) lowers MFU. Whether that pays depends on how slow the link between the slices is.
# These plans are estimates (`compile=False`); drop it to have the TPU compiler compile
# them (minutes each).

# %%
big = GPTConfig.preset("70b", remat="full", scan_layers=True)
one_axis = wb.plan(big, mesh=wb.abstract_mesh("v5p-128", fsdp=-1, dcn={"fsdp": 2}),
                   batch=256, seq=4096, compile=False, name="fsdp over both slices")
staged = wb.plan(big, mesh=wb.abstract_mesh("v5p-128", stage=2, fsdp=-1, dcn={"stage": 2}),
                 batch=256, seq=4096, compile=False, name="stages across slices",
                 pipeline={"microbatches": 4, "schedule": "circular", "repeats": 4})
print(staged.summary())
wb.compare([one_axis, staged])

# %% [markdown]
# ## What to remember
#
# - A pipeline is a `stage` mesh axis plus `pipeline={"microbatches", "schedule",
#   "repeats"}`; the layers (stacked) are split over `stage`, nothing else is.
# - The bubble is `(S - 1) / (R M + S - 1)`: more micro-batches or more repeats shrink it;
#   1F1B keeps the bubble but holds fewer activations.
# - Only activations cross between stages, which is why stages go over the slowest links.
# - Bad layouts are refused before compiling, with the fix: layers not divisible by
#   stages x repeats, micro-batches not dividing the batch, rules sharding `layers`
#   elsewhere or anything else over `stage`.
