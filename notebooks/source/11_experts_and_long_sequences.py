# %% [markdown]
# # 11 · Experts and long sequences
#
# Two layouts beyond dense data/FSDP/tensor parallelism: **mixture-of-experts** models
# with their experts sharded over an `expert` mesh axis, and **long sequences** with the
# sequence itself sharded over a `context` mesh axis (context parallelism). Both run on
# the 8 simulated CPU devices here, and both are planned for a TPU pod.

# %%
import time

import workbench as wb

wb.simulate_devices(8)

import jax
import plotly.graph_objects as go

from workbench.models import GPTConfig

MiB, GiB = 2**20, 2**30

# %% [markdown]
# ## Mixture of experts: expert parallelism
#
# A mixture-of-experts (MoE) block replaces the one MLP by `E` expert MLPs and a
# **router** that sends each token to its top `k` experts (weighted by the router's
# softmax). Parameters grow with `E`, compute per token only with `k`: Mixtral-8x7B holds
# 46.7B parameters but a token uses 12.9B. `GPTConfig` has the fields (`n_experts`,
# `experts_per_token`, `expert_d_ff`, `n_shared_experts`, `capacity_factor`, the router
# loss weights) and presets: `moe-tiny`, `moe-small` and the shapes of public models.

# %%
for name in ("moe-tiny", "moe-small", "mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"):
    c = GPTConfig.preset(name)
    print(f"{name:<18} {c.n_experts:>4} experts, top-{c.experts_per_token}: "
          f"{c.n_params / 1e9:7.3f} B parameters, {c.n_active_params / 1e9:6.3f} B active")

# %% [markdown]
# Model FLOPs count the active experts only (MaxText's convention; capacity padding is
# not model work), memory counts every expert:

# %%
from workbench.perf.formulas import gpt_flops

mixtral = GPTConfig.preset("mixtral-8x7b")
print(gpt_flops(mixtral, batch=1, seq=4096))

# %% [markdown]
# ### Experts over an `expert` axis
#
# Expert parallelism shards the experts' first dimension over an `expert` mesh axis
# (rule `experts="expert"`), so each device holds `E / n` experts, and splits the batch
# over *every* axis, the expert axis included, as data parallelism does for the dense
# layers. A token whose expert lives elsewhere has to travel: the MoE layer runs in
# `shard_map`, each device fills an `(E, capacity, D)` buffer with its tokens, and an
# **all-to-all** over the expert axis hands each device the slots of its own experts
# (a second one brings the results back). `moe_dispatch="all_gather"` gathers the tokens
# of the expert group instead and reduce-scatters the outputs. The presets: `ep`,
# `fsdp_ep` (plus FSDP of the weights over the data axes) and `ep_tp`.

# %%
ep_mesh = wb.make_mesh(expert=4, data=2)
print(wb.Rules.preset("ep", ep_mesh))

# %% [markdown]
# ### Exact, and the expert load live
#
# `moe-tiny` routes dropless (`capacity_factor=None`: every expert has room for every
# token), so splitting tokens and experts over devices changes nothing but the rounding.
# Train it with expert parallelism and watch each expert's share of the tokens while it
# trains: the heatmap below is a sink of the run (rows experts, columns steps; blue is
# the balanced share `k x tokens / E`, red twice that). The load-balance loss pulls the
# router towards blue.

# %%
import tempfile

from workbench.widgets import ExpertLoad

moe_dir = tempfile.mkdtemp()
moe_common = dict(model="moe-tiny", batch=8, seq=64, steps=30, checkpoint_every=30, keep=1,
                  data="synthetic")
ep_run = wb.Trainer(wb.TrainConfig(**moe_common, mesh={"expert": 4, "data": 2}, rules="ep"),
                    run_dir=f"{moe_dir}/ep", progress=None)
heat = ExpertLoad(ep_run.run_dir)
heat.display()
ep_run.run(sinks=[heat])
print(repr(heat))

# %% [markdown]
# The same model with every expert on every device (data parallelism over 8 devices):

# %%
dp_run = wb.Trainer(wb.TrainConfig(**moe_common, mesh={"data": 8}, rules="dp"),
                    run_dir=f"{moe_dir}/dp", progress=None)
dp_run.run()
diff = max(abs(a - b) for a, b in zip(ep_run.losses, dp_run.losses))
print(f"30 steps: largest loss difference expert=4 x data=2 vs data=8: {diff:.1e}")

# %% [markdown]
# The run's `metrics.jsonl` has the router's statistics per step (`moe_tokens_per_expert`
# per layer and expert, `moe_dropped`, `moe_entropy`, the aux and z losses); the lab
# dashboard draws the same heatmap for any MoE run.

# %% [markdown]
# ### The all-to-all in the compiled program
#
# `wb.plan` compiles the step and reads its collectives from the HLO. The all-to-alls run
# over `expert`, for dispatch and return in the forward and backward passes. `moe-tiny`
# routes dropless, so by default its experts run as grouped matmuls
# (`moe_matmul="auto"`). Each token's k assignments are sorted by expert, and each
# projection is one `jax.lax.ragged_dot` over exactly the routed rows, with no padding.
#
# Each all-to-all therefore moves, per peer, the most rows one peer can be owed
# (`G x min(k, E/n)`), not the padded `(E, capacity, D)` buffer; a small one carries the
# row counts. The plan's hand count says the same. The all-gather dispatch moves more
# bytes here, in fewer, larger collectives:

# %%
from workbench.perf import formulas

tiny_moe = GPTConfig.preset("moe-tiny", seq_len=64)
for dispatch in ("all_to_all", "all_gather"):
    c = tiny_moe.replace(moe_dispatch=dispatch)
    p = wb.plan(c, mesh=ep_mesh, rules="ep", batch=8, progress=False)
    print(f"{dispatch}: compiled by {p.source}")
    for col in p.collectives:
        if col.axes == ("expert",) and col.kind != "all-reduce":
            print(f"   {col.kind:<15} {col.count} x {col.bytes:>7,} B  {col.shapes[0]}")
    for h in formulas.moe_collectives(c, p.rules, p.mesh, 8, 64):
        print(f"   hand count: {h.kind:<15} {h.count} x {h.bytes:>7,} B")

# %% [markdown]
# ### MoE planned on a pod
#
# `moe-small` (16 experts of which each token uses 2, plus a shared expert) on a v5p-8
# slice (4 chips): the experts over an `expert` axis of 4, the other weights sharded FSDP
# style (`fsdp_ep`), 8 sequences of 1024 tokens, full remat, layers scanned. With the TPU
# compiler installed (`make lab` installs `libtpu`) the plan is the TPU executable's:
# its memory, and the all-to-alls in its program (`plan.source` says which).

# %%
pod_small = wb.abstract_mesh("v5p-8", expert=4)
small_moe = GPTConfig.preset("moe-small", remat="full", scan_layers=True)
print(f"{small_moe.n_params / 1e6:.0f} M parameters ({small_moe.n_active_params / 1e6:.0f} M "
      f"active), {small_moe.seq_len} tokens per sequence")

# %%
t0 = time.perf_counter()
p_small = wb.plan(small_moe, mesh=pod_small, rules="fsdp_ep", batch=8, seq=small_moe.seq_len,
                  name="moe-small fsdp_ep")
print(f"planned in {time.perf_counter() - t0:.0f} s by {p_small.source}")
print(f"per chip: {p_small.memory['total'] / GiB:.2f} GiB of "
      f"{p_small.memory['limit'] / GiB:.0f} GiB; fits: {p_small.fits}")
for col in p_small.collectives:
    if col.kind == "all-to-all":
        print(f"all-to-all over {col.axes}: {col.count} x {col.bytes / MiB:.1f} MiB "
              f"({col.shapes[0]})")

# %% [markdown]
# Mixtral-8x7B on a v5p-128 slice (64 chips), planned by formula (`compile=False`; the
# TPU compiler takes several minutes for it on a laptop, drop the argument to get its
# verdict): 8 experts over `expert=8`, the rest over `data=8`, one 4096-token sequence
# per chip. Memory counts all 8 experts (each chip holds one expert per layer); the
# lints say what the capacity factor drops and whether the expert axis splits the batch.

# %%
pod_moe = wb.abstract_mesh("v5p-128", expert=8, data=8)
p_moe = wb.plan(mixtral.replace(remat="full", scan_layers=True), mesh=pod_moe,
                rules="fsdp_ep", batch=64, seq=4096, compile=False, name="Mixtral fsdp_ep",
                progress=False)
print(f"per chip: {p_moe.memory['total'] / GiB:.1f} GiB of {p_moe.memory['limit'] / GiB:.0f}"
      f" GiB ({p_moe.source}); params {p_moe.memory['params'] / GiB:.2f} GiB")
for col in p_moe.collectives:
    if col.kind == "all-to-all":
        print(f"all-to-all over {col.axes}: {col.count} x {col.bytes / MiB:.0f} MiB "
              f"({col.shapes[0]})")
for w in p_moe.warnings:
    if w.kind.startswith("moe"):
        print(w)

# %% [markdown]
# Layouts that cannot work are refused before anything is compiled or written: 60
# experts (Qwen1.5-MoE) do not split over an expert axis of 8.

# %%
try:
    wb.plan(GPTConfig.preset("qwen1.5-moe-a2.7b"), mesh=wb.make_mesh(expert=8), rules="ep",
            batch=8, seq=128, progress=False)
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# ### Your turn
#
# Over which mesh axis do the all-to-alls run, and how many bytes does one dispatch move?
# The checks trace the MoE layer the model runs and read its collectives.

# %%
wb.exercise("moe_all_to_all_axis")

# %%
wb.exercise("moe_dispatch_bytes")

# %% [markdown]
# ## Long sequences: context parallelism
#
# Data parallelism splits the *batch*; with one 128k-token sequence there is nothing to
# split, and the attention scores of one sequence grow with its length squared. Context
# parallelism splits the **sequence**: the rules map the logical `seq` axis to a
# `context` mesh axis, so each device holds `T / n` positions of every sequence, for
# every activation. Everything in a block is position-wise except attention, which needs
# the keys and values of all earlier positions. `GPTConfig(context_attention=...)` picks
# how they reach each device:
#
# * `"allgather"`: all-gather K and V along the sequence, attend the local queries to all
#   of them (a causal mask on *global* positions). One collective per layer; every device
#   holds the whole sequence's K/V and a `T/n x T` block of scores.
# * `"ring"`: ring attention. K/V blocks travel around the context axis with collective
#   permutes; each device combines its partial results with an online softmax and skips
#   blocks entirely in its causal future. A device holds two K/V blocks and a
#   `T/n x T/n` block of scores at a time.
#
# The presets `cp` and `fsdp_cp` shard `seq` over `context` (the latter also shards the
# weights over every device, FSDP-style):

# %%
mesh = wb.make_mesh(data=2, context=4)
print(wb.Rules.preset("fsdp_cp", mesh))

# %% [markdown]
# ### Exact: the same losses as without it
#
# RoPE gets each position's *global* index and the loss is taken in token order, so a
# model with its sequence split four ways computes the same function. Three steps of the
# tiny model with ring attention, sequence split over `context=4`, against the same
# training with the sequence unsharded (data parallel over 8 devices):

# %%
common = dict(model="tiny", batch=8, seq=128, steps=3, checkpoint_every=3, keep=1,
              data="synthetic")
scratch = tempfile.mkdtemp()
ring = wb.Trainer(wb.TrainConfig(**common, mesh={"data": 2, "context": 4}, rules="cp",
                                 model_overrides={"context_attention": "ring",
                                                  "context_zigzag": True}),
                  run_dir=f"{scratch}/ring", progress=None)
ring.run()
dense = wb.Trainer(wb.TrainConfig(**common, mesh={"data": 8}, rules="dp"),
                   run_dir=f"{scratch}/dense", progress=None)
dense.run()
for step, (a, b) in enumerate(zip(ring.losses, dense.losses), 1):
    print(f"step {step}: context=4 ring {a:.6f}   unsharded {b:.6f}   diff {abs(a - b):.1e}")

# %% [markdown]
# ### Memory per device falls with the context axis
#
# The tiny model at 4096 tokens, one sequence, planned (compiled by XLA) on 1 device and
# on 8 devices of a `context` axis with each variant. The scores dominate: the all-gather
# variant divides them by `n` (each device: `T/n` queries x `T` keys), the ring by `n²`
# per step.

# %%
seq = 4096
plans = {}
for label, n, variant in [("no context parallelism", 1, "allgather"),
                          ("allgather, context=8", 8, "allgather"),
                          ("ring, context=8", 8, "ring")]:
    m = wb.make_mesh(context=n, devices=jax.devices()[:n])
    cfg = GPTConfig.preset("tiny", seq_len=seq, context_attention=variant)
    plans[label] = wb.plan(cfg, mesh=m, rules="fsdp_cp", batch=1, seq=seq, name=label,
                           progress=False)
for label, p in plans.items():
    print(f"{label:<24} {p.memory['total'] / MiB:8.1f} MiB per device")

# %% [markdown]
# The ring's collective permutes are in the compiled program, over the `context` axis
# (forward: `n - 1` K/V blocks per layer; backward: the K/V blocks again and the dK/dV
# accumulators, sent home at the end):

# %%
hlo = plans["ring, context=8"].compiled.as_text()
permutes = [line.split("= ")[1].split(" collective-permute(")[0]
            for line in hlo.splitlines() if " collective-permute(" in line]
print(f"{len(permutes)} collective-permutes in the compiled step, result shapes "
      f"{sorted(set(permutes))}")

# %% [markdown]
# ### Zig-zag: the same causal work on every device
#
# With contiguous blocks, device `i` attends to `i + 1` blocks: the last device of the
# ring works `n` times as long as the first, and the step waits for it.
# `context_zigzag=True` cuts the sequence into `2n` chunks and gives device `i` chunks
# `i` and `2n - 1 - i`; every device then computes the same number of score blocks. The
# model reorders its residual stream once after the embedding and back before the output
# head (two collective permutes), and RoPE gets the permuted positions.

# %%
n = 8
fig = go.Figure([go.Bar(name=f"contiguous (busiest: {max(wb.models.blocks_per_device(n, zigzag=False)):g})",
                        x=list(range(n)), y=wb.models.blocks_per_device(n, zigzag=False)),
                 go.Bar(name=f"zig-zag (busiest: {max(wb.models.blocks_per_device(n, zigzag=True)):g})",
                        x=list(range(n)), y=wb.models.blocks_per_device(n, zigzag=True))])
fig.update_layout(title="Ring attention: score blocks computed per device (context=8)",
                  xaxis_title="device along the context axis",
                  yaxis_title="(T/n x T/n) blocks", barmode="group", height=330)
fig

# %%
print("device 0 holds tokens", wb.models.zigzag_order(64, 4)[:16].tolist())

# %% [markdown]
# ### A 128k-token sequence on a pod
#
# Llama 3.2 1B at 131,072 tokens per sequence on a v5p-128 slice (64 chips), weights and
# optimizer state sharded over all 64 chips (`fsdp_cp`), full rematerialization. First
# the mesh `data=8 x context=8` (8 sequences, one per 8 chips) three ways: the sequence
# whole on each chip (the `context` axis unused), split with the all-gather variant, and
# split with ring attention; then ring attention over `context=16`.
#
# These plans are analytic estimates (`compile=False`, a fraction of a second each): the
# formulas count the attention scores of each device's queries against the keys it
# attends to at once, all `T` for the all-gather variant and one `T/n` block for the
# ring. (The TPU compiler can check any of them with `compile=None`; at this length it
# takes minutes.)

# %%
long = GPTConfig.preset("1b", remat="full", scan_layers=True, seq_len=131072)
long_plans = []
for name, axes, variant, batch, split in [
        ("sequence whole", dict(data=8, context=8), "allgather", 8, False),
        ("allgather, context=8", dict(data=8, context=8), "allgather", 8, True),
        ("ring, context=8", dict(data=8, context=8), "ring", 8, True),
        ("ring, context=16", dict(data=4, context=16), "ring", 4, True)]:
    pod = wb.abstract_mesh("v5p-128", **axes)
    rules = wb.Rules.preset("fsdp_cp", pod)
    long_plans.append(wb.plan(long.replace(context_attention=variant), mesh=pod,
                              rules=rules if split else rules.replace(seq=None), batch=batch,
                              seq=131072, compile=False, name=name, progress=False))
for p in long_plans:
    print(f"{p.name:<22} {p.memory['total'] / GiB:8.1f} GiB per chip "
          f"(a chip has {p.memory['limit'] / GiB:.0f} GiB) fits: {p.fits}")
whole, ring8 = long_plans[0], long_plans[2]
print(f"ring attention over context=8 saves "
      f"{(whole.memory['total'] - ring8.memory['total']) / GiB:,.0f} GiB per chip "
      f"({whole.memory['total'] / ring8.memory['total']:.0f}x less)")
p_cp = long_plans[-1]

# %% [markdown]
# The plan's lints say what the context axis costs: the K/V each chip receives per layer
# (a hand count that the tests check against the compiled program), and a sequence the
# context axis does not divide is an error before anything is compiled:

# %%
for w in p_cp.warnings:
    if w.kind.startswith("context") or w.kind == "ring_slow_links":
        print(w)
try:
    wb.TrainConfig(model="tiny", mesh={"data": 2, "context": 4}, rules="cp", seq=1000 + 2)
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# ### Your turn
#
# How many bytes of K and V does one device *receive* per layer under ring attention?
# The check traces the ring that the model runs and counts its collective permutes.

# %%
wb.exercise("ring_kv_bytes")
