# %% [markdown]
# # 09 · Bring your own model: Flax NNX modules, penzai models, every tensor of the step
#
# Workbench plans, draws and trains *your* model, not only its own GPT:
#
# - any **Flax NNX module** whose parameters carry sharding annotations, written the way
#   the Flax sharding guide writes them (annotations that name mesh axes need no
#   `Rules`, and no `with jax.set_mesh(...)` either);
# - **penzai** models (`wb.any_model.from_penzai`): their named axes become logical axes,
#   sharded by the same rules presets as Workbench's GPT.
#
# Then we look inside one train step: the **activations** (per layer, with their
# shardings and bytes per device) and each **collective** traced to the source line, the
# tensor it moves and the rule that made the compiler insert it. Last, one wrong
# annotation, found by the lints.

# %%
import workbench as wb

wb.simulate_devices(8)   # before JAX starts: 8 simulated CPU devices

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from penzai.models.transformer.variants import llamalike_common

# %% [markdown]
# ## The Flax guide's model
#
# The Flax NNX sharding guide's model: a kernel annotated `(None, 'model')` with
# `nnx.with_partitioning`, a parameter annotated `('model', None)`, and an activation
# constrained to `P('data', 'model')`. The annotations name **mesh axes**, so the mesh
# alone says how to shard it.

# %%
class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init_fn, (None, "model")))
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)),
                            out_sharding=("model", None))

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        return jnp.dot(y, self.w2[...])


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


mesh = wb.make_mesh(data=2, model=4)
example = {k: jax.ShapeDtypeStruct((16, 1024), jnp.float32) for k in ("x", "y")}

# %% [markdown]
# `wb.plan` takes a factory `rngs -> module`. The batch is not tokens here, so the plan
# gets an `example_batch` (shapes and dtypes; dim 0 is the batch, sharded by the batch
# rule) and a `loss_fn`. No rules: the annotations name the mesh's axes, and the batch
# goes over the data axis.

# %%
guide = wb.plan(lambda rngs: DotReluDot(1024, rngs), mesh=mesh, batch=16,
                example_batch=example, loss_fn=mse, name="flax guide")
print(guide.rules)
guide

# %% [markdown]
# `plan.materialize()` builds the module with each parameter created directly in its
# shards; `wb.show` draws any module's layout.

# %%
model = guide.materialize(seed=0)
print(model.dot1.kernel[...].sharding.spec, model.w2[...].sharding.spec)
wb.show(model)

# %% [markdown]
# The same module written with **logical** names (`('embed', 'mlp')`) needs rules for
# them; an annotation naming an axis the mesh does not have is an error that lists the
# mesh's axes and the rules to add:

# %%
class Typo(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "modle"))
        self.l = nnx.Linear(1024, 1024, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return self.l(x)


try:
    wb.plan(Typo, mesh=mesh, batch=16, example_batch=example, loss_fn=mse)
except ValueError as err:
    print(err)

# %% [markdown]
# ## A penzai Llama-like model, beside Workbench's GPT
#
# penzai builds Llama-, Mistral-, Gemma- and GPT-NeoX-style transformers from a config.
# This one has the shapes of Workbench's `"tiny"` GPT: width 64, 2 blocks, 4 query heads
# in 2 key/value groups, SwiGLU of width 256, a 256-token vocabulary.

# %%
tiny = wb.models.GPTConfig.preset("tiny")
pz_config = llamalike_common.LlamalikeTransformerConfig(
    num_kv_heads=tiny.n_kv_heads, query_head_multiplier=tiny.n_heads // tiny.n_kv_heads,
    embedding_dim=tiny.d_model, projection_dim=tiny.head_dim, mlp_hidden_dim=tiny.d_ff,
    num_decoder_blocks=tiny.n_layers, vocab_size=tiny.vocab_size, mlp_variant="swiglu",
    tie_embedder_and_logits=tiny.tie_embeddings)
penzai_model = wb.any_model.from_penzai(
    lambda key: llamalike_common.build_llamalike_transformer(pz_config, init_base_rng=key),
    config=pz_config, name="penzai llama")

# %% [markdown]
# penzai's axis names (`embedding`, `neurons`, `head_groups`, `query_heads`,
# `projection`, `vocabulary`) become logical axes; `wb.models.penzai_rules` maps them
# from Workbench's (`embed`, `mlp`, `kv_heads`, `heads`, `head_dim`, `vocab`), so the
# same preset shards both models the same way:

# %%
tp_mesh = wb.make_mesh(data=4, model=2)
ours = wb.plan(tiny, mesh=tp_mesh, rules="fsdp_tp", batch=8, seq=64, name="our GPT")
theirs = wb.plan(penzai_model, mesh=tp_mesh, rules="fsdp_tp", batch=8, seq=64,
                 name="penzai llama")
print(f"parameters per device: ours {ours.memory['params']:,} B, "
      f"penzai {theirs.memory['params']:,} B")
wb.compare([ours, theirs])

# %% [markdown]
# ### Their layouts side by side
#
# The query projection of block 0 in each model: ours is `(embed, heads, head_dim)`,
# penzai's `(embedding, head_groups, query_heads, projection)`. Both are split over
# `data` on the embedding and over `model` on the heads.

# %%
for plan, path in ((ours, "params.blocks.0.attn.q"),
                   (theirs, "params.params.block_0.attention.query.weights")):
    lay = plan.layouts[path]
    print(f"{plan.name:>14}: {path}  shape {lay.shape}  logical {lay.logical_axes}  "
          f"spec {lay.spec}  {lay.padded_bytes_per_device:,} B/device")

# %%
wb.show(theirs.layouts["params.params.block_0.attention.query.weights"])

# %% [markdown]
# `wb.show(plan)` of a penzai plan has a treescope tab that draws the penzai model
# itself, its named arrays materialised in their shards.

# %%
penzai_view = wb.show(theirs)
penzai_view

# %% [markdown]
# ## Activations and collectives of one step
#
# `plan.activations` lists the tensors the step computes: every activation the model
# constrains (per block: queries, keys, values, attention output, residual stream, MLP
# hidden), the attention scores found in the traced program, and the logits, with their
# shardings and bytes per device.

# %%
for act in ours.activations:
    print(act)

# %% [markdown]
# Each collective of the compiled step carries the source line of the op the compiler
# inserted it for (from the HLO's op metadata), the tensor it moves, and the rule that
# caused it.

# %%
for c in ours.collectives[:8]:
    print(f"{c.kind:<14} over {'+'.join(c.axes):<6} x{c.count:<3} {c.tensors[0][:44]:<44} "
          f"at {c.sources[0] if c.sources else '-'}\n{'':>16}because {c.rule}")

# %% [markdown]
# The plan widget has the same in its **Activations** and **Collectives** tabs; clicking a
# collective draws its tensor's layout before and after it (here: the first FSDP gather
# of an MLP weight, selected from code).

# %%
view = wb.show(ours)
gather = next(i for i, c in enumerate(ours.collectives)
              if c.kind == "all-gather" and any("mlp" in t for t in c.tensors))
view.select_collective(gather)
print(view.summary.collective_note)
view

# %% [markdown]
# ## One wrong annotation, found by the lints
#
# Annotate the guide model's second weight `(None, 'model')` instead of `('model', None)`:
# the first matmul leaves its output split over `model` on the features, the second wants
# them whole. The step still compiles, but the compiler has to move the activation between
# the two ops. The `reshard` lint names both ops and their source lines.

# %%
class Wrong(DotReluDot):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        super().__init__(depth, rngs)
        self.w2 = nnx.Param(self.w2[...], out_sharding=(None, "model"))   # the mistake


wrong = wb.plan(lambda rngs: Wrong(1024, rngs), mesh=mesh, batch=16, example_batch=example,
                loss_fn=mse, name="wrong annotation")
for lint in wrong.warnings:
    print(lint)

# %% [markdown]
# ## Search the layouts of your model
#
# `wb.search` takes the same models. The guide model's annotations name the mesh axis
# `model`, so its candidates are the meshes `data x model` of the 8 devices, each planned
# with the rules its annotations give; a penzai model's candidates are the rules presets
# (`penzai_rules`). They are ranked by predicted step time, and the best is compiled.

# %%
found = wb.search(lambda rngs: DotReluDot(1024, rngs), batch=16, example_batch=example,
                  loss_fn=mse, top_k=1)
print(wb.search(penzai_model, batch=8, seq=64, top_k=1).summary())
found

# %% [markdown]
# ## Train the penzai model
#
# A `ModelSpec` goes into `wb.TrainConfig(model=...)` like a preset name: the Trainer
# initialises the penzai parameters into their shards, checkpoints and resumes them
# bitwise like its own GPT. Run this cell twice: the second run continues the run.

# %%
config = wb.TrainConfig(model=penzai_model, mesh={"data": 4, "model": 2}, rules="fsdp_tp",
                        batch=8, seq=64, steps=20, checkpoint_every=10, data="text")
trainer = wb.Trainer(config, "runs/09-penzai", progress=None)
trainer.run()
print([round(x, 3) for x in trainer.losses[::4]])
