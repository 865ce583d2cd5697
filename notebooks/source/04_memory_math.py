# %% [markdown]
# # 04 · Memory math: GPT-3 175B on 64 A100s
#
# The classic back-of-the-envelope question: GPT-3 175B, 64 A100 80GB GPUs (8 servers of
# 8), 8-way model (tensor) parallelism inside each server and 8-way data parallelism
# across them. Does a training step fit, and what takes the memory?
#
# We redo the estimate with `wb.plan` on an **abstract mesh**: the real shapes,
# shardings and optimizer state of the model, counted per device, with no GPU in sight.
# Then we check the formulas against what XLA actually allocates, on a scaled-down copy
# compiled on 8 simulated devices.

# %%
import workbench as wb

wb.simulate_devices(8)

import optax

GiB, GB = 2**30, 1e9

# %% [markdown]
# ## The model and the machine
#
# GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, width 12288, 96 heads of 128,
# context 2048. Workbench's GPT is Llama-style (SwiGLU MLP with three matrices), so
# `d_ff = 32768` gives it exactly GPT-3's MLP parameter count (3 x 12288 x 32768 =
# 2 x 12288 x 49152); the vocabulary is padded to 50304 (see notebook 02). Training
# keeps float32 master weights and computes in bfloat16.

# %%
gpt3 = wb.models.GPTConfig(
    vocab_size=50304, d_model=12288, n_layers=96, n_heads=96, n_kv_heads=96, head_dim=128,
    d_ff=32768, seq_len=2048, dtype="bfloat16", param_dtype="float32")
print(f"{gpt3.n_params / 1e9:.1f} B parameters")

a100s = wb.abstract_mesh("8x8xA100", data=8, model=8)
print(a100s)

# %% [markdown]
# ## The hand estimate
#
# "175 B parameters x 2 bytes (bfloat16) / 8-way model parallel = 43.75 GB per GPU, and
# an A100 has 80 GB: it fits." Let's see what the plan says.

# %%
hand = gpt3.n_params * 2 / 8
print(f"hand estimate: {hand / GB:.2f} GB = {hand / GiB:.1f} GiB per GPU")

# %% [markdown]
# ## The plan: Megatron tensor parallelism, Adam, one sequence per data replica
#
# `Rules.preset("tp")` splits heads, MLP and vocabulary over `model` and the batch over
# `data`; the weights are replicated over `data` (plain data parallelism across
# servers). On an abstract mesh the plan is analytic: every number comes from the real
# parameter and optimizer-state shapes and their layouts, and is labelled an estimate.

# %%
adam = optax.adam(1e-4)
tp = wb.plan(gpt3, mesh=a100s, rules="tp", batch=8, seq=2048, optimizer=adam, name="tp")
print(tp)

# %% [markdown]
# ### Where the hand estimate went wrong
#
# 1. **Training keeps float32 weights**: 4 bytes per parameter, not 2 (the bfloat16
#    copy used for the matmuls is made on the fly).
# 2. **Gradients** are another full copy.
# 3. **Adam keeps two moments** per parameter (mu, nu), each the size of the weights,
#    in float32: twice the weights again.
# 4. **Activations** of the backward pass, kept from the forward pass, grow with batch,
#    sequence and layers; without rematerialization they dwarf everything else.
# 5. **Units**: an "80 GB" A100 has 80 x 10^9 bytes = 74.5 GiB.

# %%
m = tp.memory
for key in ("params", "gradients", "optimizer", "activations"):
    print(f"{key:>12}: {m[key] / GiB:8.1f} GiB per device  ({m[key] / hand:5.1f}x the hand estimate)")
print(f"{'total':>12}: {m['total'] / GiB:8.1f} GiB per device, limit {m['limit'] / GiB:.1f} GiB"
      f" -> fits: {tp.fits}")

# %% [markdown]
# ### Exercise: Adam state per device
#
# Check item 3 on one weight.

# %%
wb.exercise("adam_state_bytes")

# %% [markdown]
# ## Making it fit
#
# Two standard fixes, each one change to the plan:
#
# - **ZeRO-3 / FSDP over the data axis** (`fsdp_tp`): weights, gradients and optimizer
#   state are also split over the 8 data replicas, so the 8 copies become 8 shards;
# - **rematerialization** (`remat="full"`): keep only each block's input and recompute
#   the rest in the backward pass (about a third more FLOPs).

# %%
fsdp_tp = wb.plan(gpt3, mesh=a100s, rules="fsdp_tp", batch=8, seq=2048, optimizer=adam,
                  name="fsdp_tp")
both = wb.plan(gpt3.replace(remat="full"), mesh=a100s, rules="fsdp_tp", batch=8, seq=2048,
               optimizer=adam, name="+ remat")
bigger = wb.plan(gpt3.replace(remat="full"), mesh=a100s, rules="fsdp_tp", batch=64, seq=2048,
                 optimizer=adam, name="+ batch 64")
comparison = wb.compare([tp, fsdp_tp, both, bigger])
print(comparison.table())
comparison

# %% [markdown]
# With both fixes a step with one sequence per data replica fits; eight sequences per
# replica (batch 64) no longer do, so a real run accumulates gradients over
# micro-batches. The communication column is the price of FSDP: every weight is
# all-gathered over the data axis each step.
#
# ## Checking the formulas against the compiler
#
# On an abstract mesh nothing is compiled, so all of the above is formula. To see how
# far the formulas are from what XLA allocates, plan a scaled-down GPT-3 (same layout,
# small widths) on 8 simulated devices, where `wb.plan` compiles the real train step and
# reads `compiled.memory_analysis()`.

# %%
small = gpt3.replace(d_model=256, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=32, d_ff=768,
                     vocab_size=512, seq_len=128, dtype="float32")
mesh = wb.make_mesh(data=4, model=2)
compiled = wb.plan(small, mesh=mesh, rules="fsdp_tp", batch=8, seq=128, optimizer=adam,
                   name="small, compiled")
print(f"{'bytes per device':>16} {'compiled':>12} {'formula':>12}")
for row in compiled.memory_rows():
    if row["bytes"] is not None and row["estimate"] is not None:
        print(f"{row['key']:>16} {row['bytes']:>12,} {row['estimate']:>12,}")

# %% [markdown]
# Parameters and optimizer state match to the byte: they are just shapes and layouts.
# The temporary memory (activations and everything else the step needs while it runs)
# is where a formula can only approximate what the compiler schedules, which is why
# `wb.plan` compiles whenever the devices exist.
