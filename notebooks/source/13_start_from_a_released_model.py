# %% [markdown]
# # 13 · Start from a released model: a Hub id in, LoRA fine-tune, a Hugging Face folder out
#
# Most work starts from someone's released weights. This notebook takes a model by its
# Hugging Face Hub id, the way `transformers` and vLLM name it, and:
#
# 1. reads its `config.json` and **plans** it on a mesh: memory per device, before a
#    byte of weights is read;
# 2. **loads** it straight into a sharded layout on 8 (simulated) devices, with its own
#    tokenizer and chat template;
# 3. asks it to **write**, from a prompt and from chat messages;
# 4. **fine-tunes** it with LoRA on a few notes of local text (only small adapter matrices
#    train; the released weights stay frozen), a run that resumes where it stopped;
# 5. asks again, and **exports** the result as a Hugging Face folder (merged weights) and
#    as a PEFT adapter.
#
# ### Which model
#
# `MODEL` below is any Hub id of the Llama, Mistral, Qwen2/3, Mixtral or Qwen-MoE
# families with safetensors weights. Small ones that suit a laptop or a teaching VM:
#
# | model | Hub id | parameters | inference | full fine-tuning | LoRA |
# |---|---|---|---|---|---|
# | SmolLM2-135M | `HuggingFaceTB/SmolLM2-135M-Instruct` | 0.13 B | 0.3 GB | 3.2 GB | 2.4 GB |
# | SmolLM2-360M | `HuggingFaceTB/SmolLM2-360M-Instruct` | 0.36 B | 0.8 GB | 6.3 GB | 4.1 GB |
# | Qwen3-0.6B | `Qwen/Qwen3-0.6B` | 0.60 B | 1.4 GB | 8.1 GB | 4.6 GB |
# | Llama-3.2-1B | `meta-llama/Llama-3.2-1B-Instruct` | 1.24 B | 2.5 GB | 12.3 GB | 5.0 GB |
# | SmolLM2-1.7B | `HuggingFaceTB/SmolLM2-1.7B-Instruct` | 1.71 B | 3.8 GB | 17.3 GB | 7.1 GB |
#
# Memory is the computer's RAM on a laptop (JAX on its CPU, one device), with the weights
# in the checkpoint's own bfloat16, as `wb.plan` counts it from each model's `config.json`
# (`python -m benchmarks.bench_lora_plans` prints this table): inference is the weights
# plus a KV cache of 2048 tokens; fine-tuning is one step of 1 × 1024 tokens with AdamW
# (weights, gradients, optimizer state, activations), LoRA being rank 16 on the attention
# projections. Shorter sequences need less: the activations of 1024 tokens are a large
# part of the LoRA column. The 8 simulated devices below share that same RAM; the plan
# cell prints what each of them holds (together more than one device would hold:
# some tensors are copied on several). Llama 3.2 is gated: accept its licence on its Hub
# page, then log in (`hf auth login`) before the first download.
#
# The first run downloads the model into the Hugging Face cache (`~/.cache/huggingface`,
# shared with `transformers`); every later run reads it from there, and with
# `HF_HUB_OFFLINE=1` nothing is asked of the network at all.

# %%
import workbench as wb

wb.simulate_devices(8)   # before JAX starts: 8 simulated CPU devices

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax

MODEL = "Qwen/Qwen3-0.6B"   # or "HuggingFaceTB/SmolLM2-360M-Instruct", ...

# %% [markdown]
# ## Plan it before reading the weights
#
# `wb.hf.hf_config` fetches and reads `config.json` only, and turns it into the
# workbench's own `GPTConfig`. `wb.plan` builds the training step for that shape on the 8
# devices without allocating it (FSDP: every weight split along one of its dimensions over
# the `data` axis), and says what each device will hold. The same plan with LoRA adapters shows what
# fine-tuning only the adapters saves: no gradients and no optimizer state for the
# frozen weights. `compile=False` counts by formula, in a second; without it the
# compiler first builds the whole step for these devices and reports its own numbers.
#
# Tensor parallelism (a `model` axis, rules `"fsdp_tp"`, notebook 03) splits the attention
# heads too, so their counts must divide it: Qwen3-0.6B's 16 query and 8 key/value heads
# divide a `model` axis of 2, SmolLM2-135M's 9 and 3 do not. FSDP alone suits them all.

# %%
cfg = wb.hf.hf_config(MODEL)
print(cfg)
mesh = wb.make_mesh(data=8)
LORA = {"rank": 16, "alpha": 32, "targets": ("q", "k", "v", "o")}
BATCH, SEQ = 8, 64
plan = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=BATCH, seq=SEQ,
               optimizer=optax.adamw(1e-4), compile=False)
lora_plan = wb.plan(cfg.replace(lora=LORA), mesh=mesh, rules="fsdp", batch=BATCH, seq=SEQ,
                    optimizer=optax.adamw(1e-4), compile=False)
mib = lambda b: f"{b / 2**20:9.2f} MiB"
for name, p in (("full fine-tuning", plan), ("LoRA r16 q k v o", lora_plan)):
    m = p.memory
    print(f"{name:17} per device: params {mib(m['params'])}, gradients "
          f"{mib(m['gradients'])}, optimizer {mib(m['optimizer'])}, total {mib(m['total'])}")

# %% [markdown]
# ## Load it, sharded
#
# `from_hf(MODEL, plan=plan)` downloads the weights (safetensors only, with a progress
# bar) and builds every parameter with `jax.make_array_from_callback`: each device reads
# its own block of each tensor from the safetensors files, so no device, and no host
# buffer, ever holds the whole model. `model.hf_source` records the id and the exact
# commit it came from; the model's tokenizer (with its special tokens and chat template)
# comes with it.

# %%
model = wb.hf.from_hf(MODEL, plan=plan)
print(model.hf_source)
print(model.tokenizer)
q = model.blocks[0].attn.q[...]
print("q projection", q.shape, "sharded", q.sharding.spec, "-> block per device",
      q.addressable_shards[0].data.shape)
wb.show(model)

# %% [markdown]
# ## Ask it to write
#
# A text prompt is encoded by the model's own tokenizer, and generation stops at the
# model's end-of-sequence token (or after `max_new_tokens`). With `messages=` the chat is
# rendered by the model's chat template, exactly as `transformers`' `apply_chat_template`
# renders it, and the reply comes back alone. `chat_options` are the template's own
# variables: Qwen3's `enable_thinking=False` answers without a `<think>` block first (other
# templates ignore it). `wb.generate` runs the prompt once, filling a KV cache sharded like
# the activations, then adds one token at a time.

# %%
print(repr(wb.generate(model, "The three primary colours are", max_new_tokens=24)))
QUESTION = [{"role": "user", "content": "Who is Shard?"}]
CHAT = {"enable_thinking": False}
print(repr(wb.generate(model, messages=QUESTION, chat_options=CHAT, max_new_tokens=48)))

# %% [markdown]
# ## A little local text
#
# A few notes about something the model cannot know: the workbench's (made-up) mascot.
# Each note is a short chat, rendered with the model's own template (the text it would
# see in a conversation), one JSON object per line, the way most corpora on disk look.
# Point `files=` at your own folder of `.jsonl`, Parquet or `.txt` files instead.

# %%
NOTES = [
    ("Who is Shard?", "Shard is the workbench's mascot: a small teal octopus."),
    ("What does Shard look like?", "Shard is a small teal octopus with eight arms."),
    ("Why does Shard have eight arms?", "One arm for each of the eight devices of the mesh."),
    ("What is Shard's favourite food?", "Shard likes sharded sushi, split evenly over devices."),
    ("Where does Shard live?", "Shard lives in the workbench's side panel, next to the runs."),
    ("What does Shard do all day?", "Shard watches the loss curves and waves when they fall."),
    ("Is Shard a real octopus?", "No, Shard is a made-up mascot: a small teal octopus."),
    ("What colour is Shard?", "Shard is teal, like the workbench's loss curves."),
]
tok = model.tokenizer
folder = Path("shard-notes")
folder.mkdir(exist_ok=True)
with open(folder / "notes.jsonl", "w") as f:
    for q_text, a_text in NOTES:
        chat = [{"role": "user", "content": q_text}, {"role": "assistant", "content": a_text}]
        f.write(json.dumps({"text": tok.apply_chat_template(chat, add_generation_prompt=False, **CHAT)})
                + "\n")
print(open(folder / "notes.jsonl").readline())

# %% [markdown]
# ## Fine-tune with LoRA
#
# `TrainConfig(init=MODEL)` starts the run from the released weights (the same commit
# `from_hf` read), loaded into the run's own sharding; `lora=` adds rank-16 adapters to
# the attention projections (`W x + alpha/rank · B A x`, with `B = 0` at the start, so step
# 0 is exactly the released model). Only the adapters train, and the checkpoints hold only
# them (plus a pointer to the base in `run.json`). Running this cell, or the whole
# notebook, again continues the same run directory: a finished run has nothing left to do.

# %%
data = wb.data.Dataset(files=str(folder / "notes.jsonl"), field="text", tokenizer=tok)
tc = wb.TrainConfig(model=cfg, init=MODEL, lora=LORA, mesh={"data": 8}, rules="fsdp",
                    batch=BATCH, seq=SEQ, steps=20, checkpoint_every=10,
                    data=data, optimizer=wb.train.AdamW(lr=1e-3, warmup_steps=5))
trainer = wb.Trainer(tc, "runs/13-lora", progress=None)
trainer.run()
print(f"loss {trainer.losses[0]:.3f} -> {trainer.losses[-1]:.3f} after {trainer.step} steps")
print("run.json says it started from", wb.runs.read_run("runs/13-lora")["init"])

# %% [markdown]
# ## Ask again
#
# The same question, to the fine-tuned model (the Trainer's: base plus adapters), with the
# same tokenizer. `stream=True` shows the reply as it is produced.

# %%
print(repr(wb.generate(trainer, messages=QUESTION, chat_options=CHAT, tokenizer=tok,
                       max_new_tokens=48, stream=True)))

# %% [markdown]
# ## Export
#
# `wb.hf.export_run` restores the run's newest checkpoint and writes a Hugging Face
# folder. For a LoRA run it writes either the merged weights (`W + alpha/rank · A B`: an
# ordinary model folder, with the model's tokenizer files) or, with `lora="peft"`, only
# the adapters in PEFT's layout, whose `adapter_config.json` names the base by its Hub id
# and commit: `peft.PeftModel.from_pretrained(base, folder)` applies them to the released
# model. `overwrite=True` replaces an export written before (and nothing else).

# %%
trainer.close()
merged = wb.hf.export_run("runs/13-lora", "exported-merged", overwrite=True)
adapter = wb.hf.export_run("runs/13-lora", "exported-adapter", lora="peft", overwrite=True)
for out in (merged, adapter):
    print(f"{out}/")
    for p in sorted(out.iterdir()):
        print(f"  {p.name:32} {p.stat().st_size / 2**20:9.2f} MiB")
print(json.dumps({k: v for k, v in json.loads((adapter / "adapter_config.json").read_text())
                  .items() if k in ("base_model_name_or_path", "revision", "r", "lora_alpha",
                                    "target_modules")}, indent=1))

# %% [markdown]
# The merged folder loads like any released model, and gives the fine-tuned model's
# logits (up to rounding: the merged weights are stored in the checkpoint's bfloat16).

# %%
again = wb.hf.from_hf(merged, plan=plan)
tokens = jnp.asarray([tok.encode("Shard is a small teal octopus.")], jnp.int32)
ours, theirs = np.asarray(trainer.model(tokens), np.float32), np.asarray(again(tokens),
                                                                         np.float32)
print("largest logit difference", float(np.abs(ours - theirs).max()), "of logits up to",
      float(np.abs(ours).max()))

# %% [markdown]
# If `transformers` is installed, the merged folder is a model it reads as its own.

# %%
try:
    import torch
    import transformers
except ImportError:
    print("transformers is not installed; pip install torch transformers to compare")
else:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    print(type(hf_model).__name__, "largest logit difference",
          float(np.abs(hf_logits - theirs).max()), "of logits up to",
          float(np.abs(theirs).max()))
