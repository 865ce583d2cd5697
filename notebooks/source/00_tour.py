# %% [markdown]
# # 00 · A five-minute tour of Workbench
#
# Everything Workbench does, once, on 8 simulated devices: devices and a mesh, how one
# tensor is laid out, a plan of a sharded GPT before anything is allocated, the sharded
# model itself, training with live metrics that survive interrupts, and the same
# configuration launched as a multi-process job. Each step has its own notebook (01-07)
# for the details.

# %%
import workbench as wb

wb.simulate_devices(8)  # first cell, before JAX starts (on a GPU/TPU machine: harmless)

import jax

wb.devices()

# %% [markdown]
# ## 1. A mesh
#
# Named axes over the devices; `wb.show` draws it (hover a device for its details).

# %%
mesh = wb.make_mesh(data=4, model=2)
wb.show(mesh)

# %% [markdown]
# ## 2. A layout
#
# Where each block of one tensor lives: an activation (batch, seq, hidden) with the
# batch split over `data` and the hidden dim over `model`.

# %%
lay = wb.layout((64, 2048, 12288), ("data", None, "model"), mesh, dtype="bfloat16",
                name="activations")
print(lay.summary())
wb.show(lay)

# %% [markdown]
# The same geometry works for hardware you do not have, such as a 256-chip TPU v5p
# slice:

# %%
pod = wb.abstract_mesh("v5p-256", data=-1, model=4)
print(wb.layout((8192, 28672), ("data", "model"), pod, dtype="bfloat16", name="w").summary())

# %% [markdown]
# ## 3. Plan a sharded model before allocating it
#
# `wb.plan` compiles one whole train step (forward, backward, AdamW) ahead of time for
# this mesh and these sharding rules, and reports memory per device, FLOPs,
# collectives and layout lints. Its summary also says which attention the step runs,
# and why. The default, `attention="auto"`, is XLA's attention on CPU, cuDNN flash
# attention on a GPU and the Pallas splash kernel on a TPU.

# %%
cfg = wb.models.GPTConfig.preset("tiny")
plan = wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=8, seq=128)
print(plan.summary())
plan

# %% [markdown]
# ## 4. Materialize it, sharded from the start

# %%
model = plan.materialize(seed=0)
wb.show(model)

# %% [markdown]
# ## 5. Train, with live metrics
#
# `wb.Trainer` runs the jitted step with checkpoints in a run directory. Interrupt the
# cell or restart the kernel: re-running it continues (notebook 05). The JupyterLab
# **Runs** side panel (left sidebar) shows every run directory live.
#
# Running this notebook again reuses `runs/00-tour`: the run is already at step 20 from
# the first time, so `trainer.run()` restores that checkpoint, says there is nothing
# to do, and the losses below are the first run's. Delete `runs/00-tour` to train anew.

# %%
cfg_train = wb.TrainConfig(model="tiny", mesh={"data": 4, "model": 2}, rules="fsdp_tp",
                           batch=8, seq=64, steps=20, checkpoint_every=10)
trainer = wb.Trainer(cfg_train, run_dir="runs/00-tour")
trainer.run()

# %%
print(f"loss {trainer.losses[0]:.3f} -> {trainer.losses[-1]:.3f} in {trainer.step} steps")

# %% [markdown]
# ## 6. The same configuration as a multi-process job
#
# Two processes with four devices each, joined by `jax.distributed`; process 0 streams
# the metrics into a run directory, which the widget and the side panel follow. Run
# again, the job finds `runs/00-tour-job` already at its 6 steps and finishes at once.

# %%
job = wb.launch(cfg_train.replace(steps=6), processes=2, devices_per_process=4,
                run_dir="runs/00-tour-job")
job

# %%
status = job.wait(timeout=300)
print(status)
print(job.tail(2))
assert status == "finished", job.tail(20)

# %% [markdown]
# ## 7. Exercises check your answers with JAX
#
# The teaching notebooks (01, 02, 03, 04, 07) carry exercises like this one: type an
# answer, press **Check**, and the kernel works out with JAX what your answer gives.

# %%
wb.exercise("spec_for_block")

# %% [markdown]
# **Where next:** 01 meshes and devices · 02 PartitionSpecs and their pitfalls ·
# 03 a sharded model step by step · 04 memory math for GPT-3 175B · 05 resumable
# training · 06 launching jobs · 07 teaching on TPU VMs.
