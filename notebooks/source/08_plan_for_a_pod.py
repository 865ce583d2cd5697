# %% [markdown]
# # 08 · Plan for a pod: Llama 2 70B on TPU v5p, from a laptop
#
# Before you rent a pod slice you want three answers: **which layout, how much memory per
# chip, how fast**. This notebook answers them for Llama 2 70B on a v5p-128 slice (64
# chips) without a TPU: the TPU compiler itself (the `libtpu` package, installed by
# `make lab`) compiles the training step for that slice's topology on this machine's
# CPU, and Workbench reads memory, FLOPs, collectives and HLO from the TPU executable.
#
# The workload is the one MaxText publishes for this model (its `llama2-70b-4096`
# benchmark configuration): sequence length 4096, 4 sequences per chip, the weights and
# optimizer state sharded over every chip (FSDP), and full rematerialization of each
# block in the backward pass.

# %%
import time

import workbench as wb

wb.simulate_devices(8)   # nothing here runs on devices; the plans are for the v5p slice

GiB = 2**30

# %% [markdown]
# ## The model and the slice
#
# Llama 2 70B: 80 layers, width 8192, 64 query heads sharing 8 key/value heads (GQA),
# SwiGLU MLP of width 28672, a 32000-token vocabulary. Workbench's `"70b"` preset is
# Llama 3 70B, the same shape with a 128256-token vocabulary, so one `replace` gives
# Llama 2. `scan_layers=True` stacks the 80 blocks and runs them as one scanned layer,
# as MaxText does: the compiler sees one block instead of 80, which keeps the compile to
# a minute or two on a laptop.

# %%
cfg = wb.models.GPTConfig.preset("70b").replace(vocab_size=32000, remat="full",
                                                 scan_layers=True)
SEQ = 4096   # tokens per sequence: MaxText's llama2-70b-4096
print(f"{cfg.n_params / 1e9:.1f} B parameters")
pod = wb.abstract_mesh("v5p-128", data=-1)
print(pod.describe())
pod

# %% [markdown]
# ## The public layout, compiled by the TPU compiler
#
# `wb.plan` on a TPU preset compiles the very step the Trainer would run, for the
# slice's real topology (`v5p:4x4x4`). It reports progress while the compiler works;
# Ctrl-C stops waiting at once (the compile finishes in the background, and running the
# cell again picks it up), and the same plan again, even in a new kernel, comes from the
# plan cache.

# %%
t0 = time.perf_counter()
public = wb.plan(cfg, mesh=pod, rules="fsdp", batch=64 * 4, seq=SEQ, name="MaxText layout")
print(f"planned in {time.perf_counter() - t0:.0f} s")
print(public.summary())

# %% [markdown]
# The TPU compiler's verdict: the step fits, but with little to spare. The memory lint
# (if any) and `plan.fits` say the same; `source_reason` says what compiled it.

# %%
mem = public.memory
print(public.source, "—", public.source_reason)
print(f"per chip: {mem['total'] / GiB:.1f} GiB of {mem['limit'] / GiB:.1f} GiB "
      f"({mem['total'] / mem['limit']:.0%}); fits: {public.fits}")

# %% [markdown]
# ## Where the estimate was off
#
# The formulas alone (`compile=False`, what a plan on hardware you don't have gave
# before the TPU compiler was in the loop) put this layout far lower. Side by side, per
# chip:

# %%
print(f"{'':<13}{'TPU compiler':>14}{'formula':>12}")
for row in public.memory_rows():
    if row["bytes"] is not None and row["key"] != "limit":
        print(f"{row['key']:<13}{row['bytes'] / GiB:>12.1f} G{(row['estimate'] or 0) / GiB:>10.1f} G")

# %% [markdown]
# Parameters, optimizer state and gradients agree: they are shards of known tensors.
# The activations and temporaries are where a formula is a guess. Workbench's attention
# is XLA's dense attention (`jax.nn.dot_product_attention` without a fused kernel), so
# the backward pass of each rematerialized block materializes the `(batch, heads, 4096,
# 4096)` score matrix, its softmax and their gradients — per chip, one float32 copy is
# `4 x 64 x 4096² x 4 bytes`:

# %%
scores = 4 * cfg.n_heads * SEQ**2 * 4
print(f"one float32 score matrix per chip: {scores / GiB:.0f} GiB")

# %% [markdown]
# MaxText runs this workload with a flash attention kernel (splash attention) that never
# holds the whole matrix, which is where its headroom comes from. Here, a layout with
# more room is the lever we have.
#
# %% [markdown]
# ## Search for a layout
#
# `wb.search` enumerates mesh splits (data x model) x sharding rules x micro-batching
# for the same global batch (256 sequences of 4096 tokens), plans each one analytically
# (a fraction of a second each), drops what does not fit, ranks the rest by predicted
# step time, then compiles the best two with the TPU compiler (the first is the plan
# above: it comes from the compile cache), and the candidates that could still beat them
# (the best of a strategy or remat policy not compiled yet; up to 2 x top_k compiles),
# and re-ranks them.
# `result.notes` says why it stopped.
# Micro-batching (gradient accumulation) divides the activations by the number of
# micro-batches at the price of re-gathering the weights each time.

# %%
result = wb.search(cfg, hardware="v5p-128", batch=256, seq=SEQ, strategies=("fsdp", "fsdp_tp"),
                   remat=("full",), microbatches=(1, 2, 4), top_k=2)
result

# %%
print(result.table())

# %% [markdown]
# The chart puts every candidate at its memory per chip (x) and predicted step time (y);
# the shaded region fits in a chip's HBM. Hover a point for its layout.

# %%
result.figure()

# %% [markdown]
# ## The best layout, exactly
#
# The best candidate's plan was compiled by the TPU compiler: its memory is what the
# chip will allocate. Its predicted step time is the TPU compiler's own: the cycles it
# estimates for every fusion and matmul it scheduled (the scanned block's loop body
# counted once per layer) at v5p's clock, plus the collectives the compiler wrote, each
# timed on the torus links it crosses where the program does not overlap them. The
# roofline over the step's FLOPs and HBM bytes (v5p's peak FLOP/s and HBM bandwidth from
# the hardware table, sources in `docs/predictions.md`) stays beside it as the ideal.
# Neither number is a measurement: nothing here ran on a TPU.

# %%
best = result.best
print(best.summary())
print()
print(best.predicted)
print(best.predicted.sources["local"])

# %% [markdown]
# MFU is model FLOPs over (step time x chips x peak). With full rematerialization the
# chips also redo each block's forward pass, so the best possible MFU is about 3/4 even
# before communication and memory traffic; the prediction shows how far below that the
# layout lands and which term bounds it.

# %%
p = best.predicted
print(f"predicted: {p.step_seconds:.2f} s/step, MFU {p.mfu:.1%}, {p.tokens_per_s:,.0f} tokens/s "
      f"({p.bound}-bound)")
if p.compiler_seconds is not None:
    print(f"the TPU compiler's own estimate: {p.compiler_seconds:.2f} s/step")

# %% [markdown]
# ## MaxText's own run: a fused attention kernel and a named remat policy
#
# MaxText publishes this model on a v5p-512 slice (256 chips) at the same 4 sequences of
# 4096 tokens per chip, at 65.4% MFU (causal-halved FLOPs, 692 tokens/s/chip; its
# `llama2_70b_v5p_128` benchmark config). It does not use full remat: it runs attention
# with the Pallas *splash* kernel, which never holds the 4096 x 4096 scores, and keeps
# the q/k/v and output projections (remat policy `save_dot_except_mlpwi`), so the
# backward pass recomputes only the MLP's input projections and the attention.
#
# Workbench has both: `GPTConfig(attention="splash")` (or `"auto"`: splash on TPU,
# cuDNN flash attention on GPU) and named remat policies (`wb.models.REMAT_POLICIES`).
# The path from the step above to MaxText's, each step compiled by the TPU compiler for
# the 256-chip slice (Llama 2's RoPE base, 10000, and `overlap=True`: the TPU flags that
# run the FSDP collectives as async collective fusions, `plan.compiler_options`). It
# starts from MaxText's remat policy with Workbench's XLA attention. A step the compiler
# refuses for memory comes back as a plan that says so, with the compiler's own count of
# what it needs.

# %%
ref_cfg = cfg.replace(rope_theta=10000.0, seq_len=SEQ)
ref_pod = wb.abstract_mesh("v5p-512", fsdp=-1)
path = {}


def plan_step(label, **change):
    """One step of the path, compiled by the TPU compiler (a minute or two each)."""
    path[label] = wb.plan(ref_cfg.replace(**change), mesh=ref_pod, rules="fsdp",
                          batch=256 * 4, seq=SEQ, name=label)
    p = path[label]
    print(f"{label}: {'fits' if p.fits else 'does NOT fit'} ({p.source})")


# %% [markdown]
# One compile per cell: MaxText's remat policy with XLA attention first.

# %%
plan_step("XLA attention, save_dot_except_mlpwi", attention="xla", remat="save_dot_except_mlpwi")

# %%
plan_step("XLA attention, remat full", attention="xla", remat="full")

# %%
plan_step("splash, remat full", attention="splash", remat="full")

# %%
plan_step("splash, remat save_dot_except_mlpwi", attention="splash",
          remat="save_dot_except_mlpwi")

# %%
for label, p in path.items():
    pred = p.predicted
    need = p.memory.get("compiler_required_temp")
    verdict = "fits" if p.fits else (
        f"does NOT fit (the compiler needs {need / GiB:.0f} GiB of temporaries)" if need
        else "does NOT fit")
    print(f"{label:<38} {p.memory['total'] / GiB:6.1f} GiB/chip  {verdict}")
    print(f"{'':<38} predicted {pred.step_seconds:.1f} s/step, MFU {pred.mfu:.1%}, "
          f"{pred.tokens_per_s / 256:,.0f} tokens/s/chip ({pred.bound}-bound)")
final = path["splash, remat save_dot_except_mlpwi"].predicted
print(f"\nMaxText measured 65.4% MFU, 692 tokens/s/chip ({4 * 4096 / 692:.1f} s/step); "
      f"predicted {final.mfu:.1%}, {final.tokens_per_s / 256:,.0f} tokens/s/chip")
print(f"local work: {final.breakdown['local']:.1f} s by the compiler's cycle estimates, "
      f"{final.breakdown['roofline_local']:.1f} s at peak FLOP/s (the roofline's ideal); "
      f"collectives not overlapped: {final.breakdown['communication']:.1f} s")

# %% [markdown]
# Reading the path:
#
# * **MaxText's policy with XLA attention does not fit**: the backward pass of each
#   block holds float32 score matrices (`4 x 64 x 4096²` per chip per layer) on top of
#   the saved projections; the compiler asks for more than the chip's 95 GiB.
# * **Full remat** makes it fit, at the price of running every block's forward pass
#   twice (about a third more FLOPs).
# * **Splash attention** removes the score matrices from the temporaries: the same
#   full-remat step needs far less memory (the kernel's own backward pass does more
#   matmuls than XLA's, so alone it is not faster).
# * **`save_dot_except_mlpwi`** spends the memory splash freed on keeping the
#   projections: less recomputation, the shortest predicted step, and it fits: MaxText's
#   configuration, compiled and checked by the TPU compiler on this laptop.
# * The splash kernel's FLOPs are added by formula (`plan.kernel_flops`): XLA's cost
#   analysis does not see inside a Pallas kernel (`predicted.sources["flops"]`).
# * The prediction times the step as the TPU compiler scheduled it (its cycle estimates
#   per fusion), not at peak FLOP/s: it lands within a few MFU points of MaxText's
#   measured 65.4%, where the roofline's ideal says about 80%. What it leaves out is
#   named in `benchmarks/bench_reference.py`, which does the same for MaxText's v6e runs
#   (BENCHMARKS.md, "reference" rows).

# %%
wb.compare(list(path.values()))

# %% [markdown]
# ## Your turn
#
# * Plan the same model on `"v5p-256"` with 4 sequences per chip: how much headroom
#   does splitting the optimizer state over twice the chips buy?
# * Search with `strategies=("fsdp_tp",)` only: how much slower does tensor parallelism
#   make each step here, and why (look at `best.predicted.breakdown["collectives"]`)?
# * `wb.compare([public, best])` puts the two plans side by side.
