# %% [markdown]
# # 02 · PartitionSpecs
#
# A `PartitionSpec` says how one tensor is split over a mesh. This notebook builds the
# intuition step by step and then takes apart the two classic mistakes, measuring each
# with what XLA actually compiles:
#
# 1. a PartitionSpec matches **tensor** dims, not mesh dims;
# 2. nothing is split until `device_put` (or a `jit` output sharding);
# 3. orthogonal splits, replication, and dims that do not divide;
# 4. pitfall: weights sharded along the data axis (under `jit` this is FSDP);
# 5. pitfall: batch and weights on the same axis (devices repeat work).

# %%
import workbench as wb

wb.simulate_devices(8)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = wb.make_mesh(data=4, model=2)
wb.show(mesh)

# %% [markdown]
# ## 1. One entry per tensor dim
#
# `P('data', 'model')` on a 2-D tensor: dim 0 is split over the mesh axis `data`
# (4 ways), dim 1 over `model` (2 ways). Each entry is a mesh axis name, a tuple of
# names (split over their product), or `None` (not split). The spec has as many entries
# as the **tensor** has dims; it says nothing about the mesh's own shape.

# %%
x_layout = wb.layout((16, 8), P("data", "model"), mesh, name="x")
print(x_layout)
wb.show(x_layout)

# %% [markdown]
# A 3-D activation (batch, seq, hidden) on the same 2-D mesh needs 3 entries; a 1-D
# tensor can use both mesh axes on its single dim:

# %%
print(wb.layout((64, 128, 512), P("data", None, "model"), mesh, name="h").summary())
print(wb.layout((1024,), P(("data", "model")), mesh, name="bias").summary())

# %% [markdown]
# Writing the spec as if it followed the mesh is the first classic slip. Workbench (and
# JAX) say what is wrong:

# %%
try:
    wb.layout((64, 512), P("data", "model", None), mesh, name="h2")
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# ### Exercise: a PartitionSpec for a given block

# %%
wb.exercise("spec_for_block")

# %% [markdown]
# ## 2. Sharding happens at `device_put`
#
# A spec is only a description. An array created by `jnp` lives on one device until it
# is placed with `jax.device_put(x, NamedSharding(mesh, spec))` (or produced by a `jit`
# with that output sharding). After that, each device holds only its block.

# %%
x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
print("before:", x.sharding)
xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
print("after: ", xs.sharding)
for shard in xs.addressable_shards[:3]:
    rows, cols = shard.index
    print(f"device {shard.device.id} holds x[{rows.start}:{rows.stop}, {cols.start}:{cols.stop}]"
          f" -> a block of shape {shard.data.shape}")
wb.show(xs)

# %% [markdown]
# Operations on sharded arrays stay sharded: `jit` (GSPMD) propagates the input
# shardings through the computation, and the result is the same array you would get on
# one device.

# %%
ys = jax.jit(lambda a: jnp.sin(a) * 2)(xs)
print(ys.sharding)
np.testing.assert_allclose(np.asarray(ys), np.sin(np.asarray(x)) * 2, rtol=1e-6)

# %% [markdown]
# ### Exercise: which block does a device hold?

# %%
wb.exercise("device_block")

# %% [markdown]
# ## 3. Orthogonal splits, replication, and dims that do not divide
#
# Splitting dim 0 over `data` and dim 1 over `model` cuts the matrix into 8 distinct
# tiles, one per device: the splits are *orthogonal*. Leave an axis out of the spec and
# the tensor is **replicated** along it: every device along that axis holds the same
# block.

# %%
w_layout = wb.layout((1024, 4096), P(None, "model"), mesh, name="w")
print(w_layout)
wb.show(w_layout)

# %% [markdown]
# ### Exercise: how many copies?

# %%
wb.exercise("replication")

# %% [markdown]
# A dim must divide evenly by the number of ways it is split. JAX refuses otherwise:

# %%
try:
    jax.device_put(jnp.zeros((50257, 8)), NamedSharding(mesh, P("data", None)))
except ValueError as e:
    print(type(e).__name__, ":", str(e).split(" (full shape")[0])

# %% [markdown]
# ### Exercise: pad the vocabulary

# %%
wb.exercise("vocab_padding")

# %% [markdown]
# ## 4. Pitfall: weights sharded along the data axis
#
# A common explanation goes: "the batch is split over `data`, so each data-parallel
# replica is its own model; if you also split a weight over `data`, each replica gets
# a different piece of the weight, and the replicas train different models."
#
# Under `jit` that is wrong. `jit` compiles **one global program**: its result is
# always the result of the unsharded computation, whatever the shardings. A sharding
# only says where the bytes live. If a weight is stored split over `data`, XLA inserts
# an **all-gather** before the weight is used: every device computes with the whole
# weight, on its own part of the batch. That is **FSDP** (ZeRO-3): weights, gradients
# and optimizer state are stored split over the data axis (less memory per device), at
# the price of gathering each weight when it is used. Let's compile it and look.

# %%
mesh8 = wb.make_mesh(data=8)
x = jax.random.normal(jax.random.key(0), (64, 256))
w = jax.random.normal(jax.random.key(1), (256, 512))
xs = jax.device_put(x, NamedSharding(mesh8, P("data", None)))
ws = jax.device_put(w, NamedSharding(mesh8, P("data", None)))  # w's rows split over 'data'

matmul = jax.jit(lambda a, b: a @ b)
compiled = matmul.lower(xs, ws).compile()
import re

ops = re.findall(r"(\w+\[[\d,]*\])\S* (all-gather|all-reduce|reduce-scatter|all-to-all)\(",
                 compiled.as_text())
for result, op in ops:
    print(f"{op}: every device ends up with {result}")
y = matmul(xs, ws)
np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w), rtol=2e-5, atol=1e-4)
print("same result as one device: yes; output sharding:", y.sharding.spec)

# %% [markdown]
# The "different model per replica" picture *does* describe manual SPMD
# (`jax.shard_map`, formerly `pmap`): there each device runs the function on its local
# blocks, and a weight split over `data` really is a different local array unless you
# `all_gather` it yourself. Under `jit`, the compiler does that for you.

# %%
from functools import partial

@partial(jax.shard_map, mesh=mesh8, in_specs=(P("data", None), P("data", None)),
         out_specs=P("data", None))
def local_matmul(a, b):
    # a: (8, 256) this device's rows of x; b: (32, 256) -> cannot even multiply a @ b.
    b_full = jax.lax.all_gather(b, "data", tiled=True)  # (256, 512): what jit inserts
    return a @ b_full

np.testing.assert_allclose(np.asarray(local_matmul(xs, ws)), np.asarray(y), rtol=1e-5)

# %% [markdown]
# ### Quantified on a whole model with `wb.plan`
#
# The same comparison for a small GPT's full train step (forward, backward, AdamW) on
# `data=8`: `dp` replicates the weights, `fsdp` stores them split over `data`. `wb.plan`
# compiles each step ahead of time and reads what XLA did.

# %%
cfg = wb.models.GPTConfig.preset("tiny")
dp = wb.plan(cfg, mesh=mesh8, rules="dp", batch=8, seq=128, name="weights replicated")
fsdp = wb.plan(cfg, mesh=mesh8, rules="fsdp", batch=8, seq=128, name="weights on data")
for p in (dp, fsdp):
    state = (p.memory["params"] + p.memory["optimizer"]) / 2**10
    gathers = sum(c.count for c in p.collectives if c.kind == "all-gather")
    print(f"{p.name:>18}: params + optimizer {state:6.0f} KiB/device, "
          f"FLOPs/device {p.flops_per_device / 1e6:.0f} M, all-gathers per step {gathers}")
wb.compare([dp, fsdp])

# %% [markdown]
# Storing the weights on `data` cuts parameter and optimizer memory per device by 8 and
# leaves the FLOPs per device unchanged: every device still computes with whole
# weights, on its 1/8 of the batch. What it adds is communication: the weights are
# all-gathered each step. One model, stored differently.

# %% [markdown]
# ### Exercise: which collective?

# %%
wb.exercise("fsdp_collective")

# %% [markdown]
# ## 5. Pitfall: batch and weights on the same axis
#
# On `data=4, model=2`, tensor parallelism splits a weight's columns over `model`. If
# the batch is *also* put on `model` (and `data` is used by nothing), the four devices
# along `data` hold the same blocks and do the same work: the mesh has 8 devices but
# the program runs as if it had 2. XLA's own cost analysis shows it:

# %%
def flops_per_device(x_spec, w_spec, m=mesh, shapes=((64, 256), (256, 512))):
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(m, p))
            for s, p in zip(shapes, (x_spec, w_spec))]
    return jax.jit(lambda a, b: a @ b).lower(*args).compile().cost_analysis()["flops"]

total = 2 * 64 * 256 * 512
for x_spec in (P("model", None), P("data", None)):
    f = flops_per_device(x_spec, P(None, "model"))
    print(f"x {x_spec}, w P(None, 'model'): {f:>12,.0f} FLOPs per device "
          f"= 1/{total / f:.0f} of the work -> each FLOP done {8 * f / total:.0f}x")

# %% [markdown]
# ### Exercise: remove the repeated work

# %%
wb.exercise("repeated_work")

# %% [markdown]
# ### Quantified with `wb.plan`
#
# For the GPT, `wb.Rules` refuses this layout outright: its activations carry both the
# batch and the heads, and one mesh axis cannot split two dims of one tensor. Written by
# hand, one layer at a time, nothing stops it. `wb.plan` takes any NNX model (a factory
# `rngs -> module` whose parameters name logical axes), so we plan the layer above,
# with a squared-error loss, both ways. The *replicated compute factor* is the model
# FLOPs divided by what all devices together execute: 1 means no repeated work.

# %%
import optax
from flax import nnx


class Dense(nnx.Module):
    """y = x @ w, with w's dims named 'embed' and 'mlp'."""

    def __init__(self, rngs: nnx.Rngs):
        w = nnx.initializers.normal(0.02)(rngs.params(), (256, 512))
        self.w = nnx.Param(w, out_sharding=("embed", "mlp"), eager_sharding=False)

    def __call__(self, x):
        return x @ self.w[...]  # (B, 256) @ (256, 512) -> (B, 512)


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


example = {"x": jax.ShapeDtypeStruct((64, 256), jnp.float32),
           "y": jax.ShapeDtypeStruct((64, 512), jnp.float32)}
layer_plans = [
    wb.plan(Dense, mesh=mesh, rules=wb.Rules(batch=batch_axis, embed=None, mlp="model"),
            batch=64, loss_fn=mse, example_batch=example, optimizer=optax.sgd(0.1),
            name=f"batch on {batch_axis}")
    for batch_axis in ("data", "model")]
on_data, on_model = layer_plans
print(f"FLOPs per device: batch on data {on_data.flops_per_device / 1e6:.1f} M, batch on "
      f"model {on_model.flops_per_device / 1e6:.1f} M "
      f"({on_model.flops_per_device / on_data.flops_per_device:.1f}x the work for the same step)")
for w in on_model.warnings:
    if w.kind == "redundant_compute":
        print(w)
