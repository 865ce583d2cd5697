# %% [markdown]
# # 01 · Meshes and devices
#
# Every sharded JAX program starts from two things: the **devices** you have and a
# **mesh**, a named grid of those devices. This notebook covers:
#
# 1. the device inventory, and what a laptop can simulate;
# 2. building meshes with named axes, and what the axis order means;
# 3. physical topology: hosts and chip coordinates;
# 4. abstract meshes for hardware you do not have (a TPU pod, two GPU servers).
#
# Everything runs on a laptop with 8 simulated CPU devices; the same code runs unchanged
# on a GPU server or a TPU VM.

# %%
import workbench as wb

wb.simulate_devices(8)  # must run before JAX starts; on a GPU/TPU machine it changes nothing

import jax
import numpy as np

# %% [markdown]
# ## 1. Devices
#
# `jax.devices()` lists what the default backend sees. `wb.devices()` shows the same
# devices as a table: id, kind, platform, owning process (host), chip coordinates
# (TPU only) and memory. The peak FLOP/s per device comes from a published table for
# GPUs and TPUs; for a CPU it is measured once with a matmul and cached.

# %%
print(jax.devices())
wb.devices()

# %%
peak, source = wb.peak_flops()
print(f"peak per device: {peak / 1e9:.1f} GFLOP/s  ({source})")

# %% [markdown]
# The 8 "devices" here are separate XLA CPU devices that share the laptop's cores. They
# behave like 8 accelerators for everything this course needs: shardings, collectives,
# compiled programs; only speed differs.
#
# ## 2. A mesh names the devices
#
# A mesh arranges the devices in an n-dimensional grid whose axes have names. Tensors
# are later split *along mesh axes by name* (`'data'`, `'model'`), so no code needs to
# know device ids.

# %%
mesh = wb.make_mesh(data=4, model=2)
print(mesh)
print(mesh.devices)  # the device grid: rows = 'data', columns = 'model'
wb.show(mesh)

# %% [markdown]
# `wb.make_mesh` returns a plain `jax.sharding.Mesh`; every JAX API takes it. Its axes
# are *Auto* by default: under `jit`, GSPMD propagates shardings from the inputs
# through every op. (Since JAX 0.7, `jax.make_mesh` defaults to *Explicit* axes, where
# sharding is part of each array's type; pass `axis_types="explicit"` for those.)
#
# One size may be `-1` and is inferred. Sizes must multiply to the number of devices,
# and the error says what to change:

# %%
print(wb.make_mesh(data=-1, model=2).shape)
try:
    wb.make_mesh(data=3, model=2)
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# ### The axis order matters
#
# Here the device ids fill the grid in row-major order: along the **last** axis,
# neighbours have consecutive ids. On GPU servers consecutive ids share a host (and its
# NVLink); on TPUs `jax.make_mesh` orders the chips along the physical torus, so the
# devices of the last axis are direct neighbours. Either way the last axis is the
# closest-knit, and the one to give the chattiest kind of parallelism (tensor
# parallelism).

# %%
for axes in ({"data": 4, "model": 2}, {"model": 2, "data": 4}):
    m = wb.make_mesh(axes)
    groups = np.moveaxis(np.vectorize(lambda d: d.id)(m.devices), m.axis_names.index("model"), -1)
    print(axes, "-> 'model' groups:", groups.reshape(-1, 2).tolist())

# %% [markdown]
# ### Exercise: choose the mesh shape
#
# Type your answer in the box and press **Check**: the kernel builds your mesh and asks
# JAX which block each device gets.

# %%
wb.exercise("mesh_for_block")

# %% [markdown]
# Exercises can also be checked from code, which is what the feedback looks like for a
# wrong answer:

# %%
print(wb.exercise("mesh_for_block").check("data=2, model=4"))

# %% [markdown]
# ## 3. Physical topology: hosts and chips
#
# On a multi-host system each device belongs to a process (`device.process_index`,
# one per host) and, on TPUs, has physical chip coordinates (`device.coords`) on the
# torus. Traffic inside a host (NVLink, a TPU's ICI links) is far faster than between
# hosts over the data-centre network (DCN). You do not need the hardware to see this:
# `wb.abstract_mesh` describes a preset slice or GPU cluster, with the hosts, chip
# coordinates, memory and peak FLOP/s of the real thing.

# %%
pod = wb.abstract_mesh("v5e-16", data=4, model=4)
print(pod)
wb.show(pod, color_by="host")

# %% [markdown]
# A v5e-16 is 16 chips on 4 hosts. With `data=4, model=4` every `model` row of the grid
# is one host: tensor parallelism stays on the host's fast links, and only the
# data-parallel gradient reduction crosses hosts.
#
# Two 8-GPU servers make the same point, with NVLink inside a server and the network
# between them:

# %%
gpus = wb.abstract_mesh("2x8xH100", data=2, model=8)
print(gpus)

# %% [markdown]
# ### Exercise: keep tensor parallelism inside a host

# %%
wb.exercise("tp_within_host")

# %% [markdown]
# ## 4. Abstract meshes: plan for hardware you do not have
#
# An abstract mesh has a shape and axis names but no devices, so it can be any size.
# Layouts (and, in notebook 03, whole training plans) work on it, which is how to
# check a configuration for a 2048-chip job from a laptop.

# %%
big = wb.abstract_mesh(data=256, model=8)
print(big.describe())
lay = wb.layout((2048, 4096, 12288), ("data", None, "model"), big, dtype="bfloat16",
                name="activations")
print(lay.summary())

# %% [markdown]
# `big.abstract` is the `jax.sharding.AbstractMesh` JAX itself uses for tracing without
# devices; JAX answers the same question from it:

# %%
from jax.sharding import NamedSharding, PartitionSpec as P

print(NamedSharding(big.abstract, P("data", None, "model")).shard_shape((2048, 4096, 12288)))

# %% [markdown]
# TPU slice names count differently by generation: "v4-32" and "v5p-256" count
# TensorCores (two per chip, driven as one JAX device), "v5e-16" and "v6e-256" count
# chips. `wb.abstract_mesh` knows which:

# %%
for name in ("v4-32", "v5p-256", "v5e-16"):
    info = wb.abstract_mesh(name)
    print(f"{name:8} {info.size:4} devices on {info.n_hosts:3} hosts, "
          f"{info.memory_per_device / 2**30:.0f} GiB each, {info.device_kind}")

# %% [markdown]
# **Next:** notebook 02 splits tensors over these meshes with PartitionSpecs.
