# %% [markdown]
# # 12 · Train on your own text
#
# Every earlier notebook trained on bytes. Here a model learns from *your* documents,
# with a real tokenizer:
#
# 1. **a tokenizer**: train a small BPE with Hugging Face `tokenizers` (or load your
#    `tokenizer.json` / SentencePiece `.model`) and wrap it in `wb.data.Tokenizer`;
# 2. **your files**: `wb.data.Dataset(files=..., field=..., tokenizer=...)` reads JSONL,
#    Parquet, plain-text folders or ArrayRecord, tokenizes once into a cache, holds out
#    documents for evaluation and **packs** documents into rows with segment ids;
#    `wb.data.Dataset(hf="org/name", split=..., field=...)` does the same for a dataset on
#    the Hugging Face Hub;
# 3. **plan** the model sized to the tokenizer, **train** it with a held-out loss every
#    few steps, **interrupt and resume**, and draw the eval curve.
#
# Only the Hub dataset's split is downloaded (WikiText-2's train split, a few MB, once;
# with `HF_HUB_OFFLINE=1` it is read from the Hugging Face cache). To use your own text,
# point `files=` at your folder.

# %%
import workbench as wb

wb.simulate_devices(8)

import json
import os
import pathlib
import signal
import sysconfig
import threading
import time

import numpy as np

# %% [markdown]
# ## A folder of text
#
# Stand-in for your documents: the paragraphs of a few standard-library modules, one
# JSON object per line with the text in a `"text"` field (what most corpora on disk look
# like). A folder of `.txt` files or a Parquet file works the same way.

# %%
stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
docs = []
for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py"):
    text = (stdlib / name).read_text()
    docs += [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
folder = pathlib.Path("my-text")
folder.mkdir(exist_ok=True)
with open(folder / "docs.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
print(f"{len(docs)} documents, {sum(map(len, docs)):,} characters in {folder}/docs.jsonl")

# %% [markdown]
# ## A tokenizer
#
# A byte-level BPE of 512 tokens, trained on these documents in a second, with three
# special tokens. `wb.data.Tokenizer` reads the saved `tokenizer.json` (it would read a
# SentencePiece `.model` the same way) and finds BOS, EOS and PAD by their usual names.
# Each document becomes `[<s>] + tokens + [</s>]`.

# %%
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

bpe = HFTokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(docs, trainers.BpeTrainer(
    vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
bpe.save(str(folder / "tokenizer.json"))

tok = wb.data.Tokenizer(folder / "tokenizer.json")
ids = tok.encode("def wrap(text, width=70):")
print(tok)
print(ids, "->", repr(tok.decode(ids)))

# %% [markdown]
# ## The dataset: cached tokens, a held-out split, packed rows
#
# `eval_fraction=0.1` holds out 10% of the *documents* (never trained on). The files are
# tokenized once into a cache named by their content and the tokenizer, so the next run
# (or another process of a job) reads token ids straight away. Documents are packed into
# rows of `seq + 1` tokens: each row holds several documents, told apart by segment ids;
# attention never crosses from one to the next, and positions restart at each document.
# A document longer than a row is split across rows (`split_documents` counts them).

# %%
data = wb.data.Dataset(files=str(folder / "docs.jsonl"), field="text", tokenizer=tok,
                       eval_fraction=0.1)
seq = 64
prepared = wb.data.prepare(data, seq=seq, vocab_size=tok.vocab_size)
print("train:", prepared.info["train"])
print("eval: ", prepared.info["eval"])
row = prepared.train[0]
print("segments ", row["segments"][:40])
print("positions", row["positions"][:40])

# %% [markdown]
# ## A dataset from the Hub, beside your files
#
# The same `Dataset`, with a Hub id instead of files: `hf=`, the dataset's `config` (its
# subset) and `split`, and the `field` holding the text. The split's files are resolved
# the way the `datasets` library resolves them and fetched into the Hugging Face cache
# (once); then they are read like local Parquet files, into the same token cache and the
# same packed rows. `revision=` pins a branch, tag or commit; the commit actually read is
# in `info["hf"]`, and a run records it in `run.json` (a resume on other data is refused,
# naming the commit and the file that changed). Rows of chat `messages` are rendered with
# the tokenizer's chat template. To train on it, pass `data=wiki` to the `TrainConfig`
# below.

# %%
wiki = wb.data.Dataset(hf="Salesforce/wikitext", config="wikitext-2-raw-v1", split="train",
                       field="text", tokenizer=tok)
hub_rows = wb.data.prepare(wiki, seq=seq, vocab_size=tok.vocab_size)
print("hub:  ", hub_rows.info["hf"])
print("files:", list(hub_rows.info["file_sha256"]))
print("train:", hub_rows.info["train"])

# %% [markdown]
# ## Plan a model sized to the tokenizer
#
# The `tiny` preset with its vocabulary set to the tokenizer's 512 tokens. A tokenizer
# larger than the model's vocabulary is refused with both sizes named. The plan shows
# the memory per device before anything is allocated.

# %%
import optax

model_cfg = wb.models.GPTConfig.preset("tiny", vocab_size=tok.vocab_size, seq_len=seq)
mesh = wb.make_mesh(data=8)
plan = wb.plan(model_cfg, mesh=mesh, rules="fsdp", batch=8, seq=seq,
               optimizer=optax.adamw(3e-3))
print(plan.memory)

# %% [markdown]
# ## Train with a held-out loss
#
# `eval_every=5, eval_batches=2`: after every 5th update the model is evaluated on the
# same two batches of held-out rows; `eval_loss` and `eval_perplexity` go into
# `metrics.jsonl` beside the training loss, and the panel draws the eval loss dashed
# beside it. Each run of this notebook starts a new run directory (as in notebook 05).

# %%
cfg = wb.TrainConfig(model="tiny", model_overrides={"vocab_size": tok.vocab_size,
                                                    "seq_len": seq},
                     mesh={"data": 8}, batch=8, seq=seq, steps=30, checkpoint_every=5,
                     data=data, eval_every=5, eval_batches=2,
                     optimizer=wb.train.AdamW(lr=3e-3, warmup_steps=5))


def run_number(path):
    tail = path.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


earlier = sorted(pathlib.Path("runs").glob("12-own-text-*"), key=run_number)
run_dir = f"runs/12-own-text-{max(map(run_number, earlier), default=0) + 1}"
print("run directory:", run_dir)
trainer = wb.Trainer(cfg, run_dir=run_dir)
trainer.run(steps=10)

# %% [markdown]
# ## Interrupt and resume
#
# The next cell interrupts itself five steps on (a kernel interrupt, ■, is the same
# SIGINT): the step in flight finishes and a checkpoint is saved, with the data
# pipeline's position in the packed, shuffled rows. A new `Trainer` on the same run
# directory, as after a kernel restart, carries on from there.

# %%
def interrupt_after(step):
    while trainer.step < step:
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGINT)


threading.Thread(target=interrupt_after, args=(trainer.step + 5,), daemon=True).start()
result = trainer.run()
print(result)
assert result.status == "interrupted"

# %%
trainer = wb.Trainer(cfg, run_dir=run_dir)
print("restored at step", trainer.step)
trainer.run()

# %% [markdown]
# ## The eval curve
#
# One continuous history across the interruption: the training loss every step, the
# held-out loss and perplexity every 5 steps, read back from the run directory.

# %%
import plotly.graph_objects as go

history = [m for m in wb.runs.read_metrics(run_dir) if "loss" in m]
assert [m["step"] for m in history] == list(range(1, cfg.steps + 1))
evals = [m for m in history if "eval_loss" in m]
assert [m["step"] for m in evals] == list(range(5, cfg.steps + 1, 5))
fig = go.Figure([
    go.Scatter(x=[m["step"] for m in history], y=[m["loss"] for m in history],
               mode="lines", name="train loss"),
    go.Scatter(x=[m["step"] for m in evals], y=[m["eval_loss"] for m in evals],
               mode="lines+markers", name="held-out loss", line=dict(dash="dash")),
])
fig.update_layout(title="train on your own text", xaxis_title="step", yaxis_title="loss",
                  height=320, margin=dict(t=40, b=40))
for m in evals:
    print(f"step {m['step']:3d}  eval loss {m['eval_loss']:.3f}  "
          f"perplexity {m['eval_perplexity']:.1f}")
fig
