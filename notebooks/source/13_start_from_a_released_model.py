# %% [markdown]
# # 13 · Start from a released model: Hugging Face weights in, fine-tune, generate, out
#
# Most training starts from someone's released weights, in the Hugging Face layout
# (`config.json` + `*.safetensors`), and ends by handing a checkpoint back in that layout.
# This notebook:
#
# 1. makes a small model folder in that layout here (random weights: a stand-in for a
#    download; a Qwen3-style model, with per-head q/k norms),
# 2. imports it with `wb.hf.from_hf`, straight into a sharded layout, and shows where
#    each tensor landed,
# 3. asks it to write something, fine-tunes it a few steps on local text, and asks again,
# 4. exports the fine-tuned run as a Hugging Face folder and loads it back.
#
# Nothing is downloaded. The same calls read a real Llama, Mistral, Qwen2/3, Mixtral or
# Qwen-MoE folder.

# %%
import workbench as wb

wb.simulate_devices(8)   # before JAX starts: 8 simulated CPU devices

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

# %% [markdown]
# ## A "released" model folder
#
# A byte-level Qwen3-style model (256 token ids: one per byte), exported with
# `wb.hf.to_hf`: the files a download would give you. `to_hf` writes into a temporary
# folder and renames it when complete, so a folder that exists is whole.

# %%
released = Path("released-qwen3")
if not released.exists():
    cfg0 = wb.models.GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                               n_kv_heads=2, head_dim=16, d_ff=128, seq_len=128,
                               qk_norm=True, norm_eps=1e-6, rope_theta=1e6)
    stand_in = wb.models.GPT(cfg0, rngs=nnx.Rngs(7))   # random weights
    wb.hf.to_hf(stand_in, released, max_shard_bytes=100_000)
print(sorted(p.name for p in released.iterdir()))
print(json.dumps(json.loads((released / "config.json").read_text()), indent=1)[:400], "...")

# %% [markdown]
# ## Import it into a sharded layout
#
# `wb.hf.hf_config` reads `config.json` only, so the model can be planned before a
# byte of weights is read. `from_hf(..., plan=plan)` then builds every parameter with
# `jax.make_array_from_callback`: each device asks for its own block, which is read from
# its shard with safetensors' `get_slice`, one tensor at a time.

# %%
cfg = wb.hf.hf_config(released)
mesh = wb.make_mesh(data=4, model=2)
plan = wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=8, seq=64)
model = wb.hf.from_hf(released, plan=plan)
print(model.hf_source)
q = model.blocks[0].attn.q[...]
print("q projection", q.shape, "sharded", q.sharding.spec, "-> block per device",
      q.addressable_shards[0].data.shape)
wb.show(model)

# %% [markdown]
# ## Ask it to write
#
# `wb.generate` runs the prompt once, filling a KV cache sharded like the activations
# (batch over `data`, kv heads over `model`), then one token at a time. Any object with
# `encode`/`decode` is a tokenizer (`wb.data.Tokenizer` reads a `tokenizer.json`, a
# SentencePiece model, or bytes); this model reads bytes.

# %%
tok = wb.data.Tokenizer()   # byte-level: ids 0..255
print(repr(wb.generate(model, "def ", tokenizer=tok, max_new_tokens=32)))

# %% [markdown]
# ## Fine-tune a few steps
#
# `TrainConfig(init=folder)` starts the run from the folder's weights, read straight into
# the run's own sharding; `run.json` records where it started. The data is local text
# (the Python standard library's sources, byte-level). Running the cell again continues
# the same run directory.

# %%
tc = wb.TrainConfig(model=cfg, init=str(released), mesh={"data": 4, "model": 2},
                    rules="fsdp_tp", batch=8, seq=64, steps=30, checkpoint_every=10,
                    data="text", optimizer=wb.train.AdamW(lr=3e-3, warmup_steps=5))
trainer = wb.Trainer(tc, "runs/13-finetune", progress=None)
result = trainer.run()
print(f"loss {trainer.losses[0]:.3f} -> {trainer.losses[-1]:.3f} after {trainer.step} steps")
print("run.json says it started from", wb.runs.read_run("runs/13-finetune")["init"])

# %% [markdown]
# One call shows what the trained model writes. `stream=True` shows the tokens as they are
# produced: in JupyterLab a live view in the cell (`wb.widgets.GenerationView`), in a
# terminal the text on stdout; `stream=` also takes any callable of the tokens so far. The
# tokens are the same as without streaming.

# %%
text = wb.generate(trainer, "def ", tokenizer=tok, max_new_tokens=32, stream=True)
print(repr(text))
print(repr(wb.generate(trainer, "def ", tokenizer=tok, max_new_tokens=32,
                       temperature=0.8, top_p=0.9, seed=1)))

# %% [markdown]
# ## Export and reload
#
# `wb.hf.export_run` restores a checkpoint step of the run and writes a Hugging Face
# folder (config.json, safetensors shards and their index), one tensor at a time from the
# arrays' own shards. Loading it back gives the same logits as the trained model. A run
# trained by a multi-process `wb.launch` job exports the same way from a notebook, or from
# a job of its own (`python -m workbench export RUN_DIR OUT` on every process: each
# restores only its shards, process 0 writes; the files are the same bytes).

# %%
trainer.close()
exported = wb.hf.export_run("runs/13-finetune", "exported-qwen3", overwrite=True)
print(sorted(p.name for p in exported.iterdir()))
again = wb.hf.from_hf(exported, plan=plan)
tokens = jnp.asarray(np.frombuffer(b"import numpy as np\n", np.uint8)[None].astype(np.int32))
same = np.array_equal(np.asarray(again(tokens)), np.asarray(trainer.model(tokens)))
print("reloaded export gives the trained model's logits:", same)

# %% [markdown]
# If `transformers` is installed (the test extra installs it), the exported folder is a
# model it reads as its own `Qwen3ForCausalLM`.

# %%
try:
    import torch
    import transformers
except ImportError:
    print("transformers is not installed; pip install torch transformers to compare")
else:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf_model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    ours = np.asarray(again(tokens))
    print(type(hf_model).__name__, "largest logit difference",
          float(np.abs(theirs - ours).max()), "of logits up to", float(np.abs(ours).max()))
