# %% [markdown]
# # 05 · Training that survives interrupts and restarts
#
# A notebook kernel is a fragile place for a long job: you press ■ to look at
# something, the kernel dies, the laptop sleeps. With `wb.Trainer`, none of that loses
# work:
#
# - **interrupt** (■ / Ctrl-C / SIGTERM): the step in flight finishes, a checkpoint is
#   saved, and the cell returns;
# - **restart** (a new kernel, or a new process): `wb.Trainer` on the same run directory
#   restores the newest checkpoint, including the input pipeline's position;
# - the run directory keeps one **continuous** metrics history, which the inline panel
#   and the JupyterLab side panel both draw.
#
# All of it is checked at the end against a run that was never interrupted.

# %%
import workbench as wb

wb.simulate_devices(8)

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

# %% [markdown]
# ## The experiment
#
# A `TrainConfig` is a frozen, JSON-round-trippable description of the whole
# experiment: model preset, mesh, sharding rules, optimizer, data, batch, steps,
# checkpoint cadence, seed. The data here is byte-level text (the Python standard
# library's sources), read through a deterministic Grain pipeline.
#
# **Running this notebook again.** The story below (train to step 10, interrupt at 20,
# restart, finish at 40) needs an empty run directory, so each run of the notebook from
# the top starts a new one: `runs/05-resumable-1`, then `-2`, ... Nothing is reused from
# an earlier run of the notebook except the reference run at the end (see there). In
# your own notebooks, write one fixed `run_dir`: running the cells again then *continues*
# that run, which is what this notebook demonstrates.

# %%
import pathlib

cfg = wb.TrainConfig(model="tiny", mesh={"data": 8}, rules="fsdp", batch=8, seq=64,
                     steps=40, checkpoint_every=10, seed=0)


def run_number(path):
    tail = path.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


earlier = sorted(pathlib.Path("runs").glob("05-resumable-*"), key=run_number)
run_dir = f"runs/05-resumable-{max(map(run_number, earlier), default=0) + 1}"
if earlier:
    print(f"earlier runs of this notebook left {', '.join(p.name for p in earlier)} in runs/; "
          f"this run starts a new run directory, {run_dir}, and reuses nothing from them")
else:
    print(f"run directory: {run_dir}")
cfg

# %% [markdown]
# ## Train a little
#
# `run(steps=N)` trains until the run has done N updates *in total*: running the cell
# again does nothing once there. The panel shows loss and MFU live.

# %%
trainer = wb.Trainer(cfg, run_dir=run_dir)
trainer.run(steps=10)

# %% [markdown]
# ## Interrupt
#
# Press ■ (Kernel ▸ Interrupt) during the next cell. To make this notebook run by
# itself, the cell interrupts itself ten steps on (once step 20 is done), the same way:
# a kernel interrupt is a SIGINT to the kernel process.

# %%
def interrupt_after(step):
    while trainer.step < step:
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGINT)


threading.Thread(target=interrupt_after, args=(trainer.step + 10,), daemon=True).start()
result = trainer.run()
print(result)
assert result.status == "interrupted"
stopped_at = trainer.step

# %% [markdown]
# The checkpoint of the step it stopped at is on disk. Re-running `trainer.run(...)`
# would simply continue; instead, let's lose the whole process.
#
# ## Restart
#
# In a live session: **Kernel ▸ Restart**, then `wb.Trainer(cfg, run_dir=run_dir)` with
# the same `run_dir` restores the checkpoint and `trainer.run(...)` carries on (in this
# notebook, set `run_dir` to the directory printed above instead of running the cell
# that picks a new one). So that this notebook also runs unattended, a *fresh Python process*
# stands in for the restarted kernel: it runs the same configuration with the
# `workbench train` command, the one launched jobs and cluster workers run, for five
# more steps.

# %%
with open("05-config.json", "w") as f:
    f.write(cfg.to_json())
done = subprocess.run([sys.executable, "-m", "workbench", "train", "05-config.json",
                       "--run-dir", run_dir, "--steps", str(stopped_at + 5)],
                      capture_output=True, text=True, timeout=300)
print(done.stdout[-600:], done.stderr[-600:])
assert done.returncode == 0

# %% [markdown]
# ## Continue
#
# A new `Trainer` on the run directory, as after a kernel restart: it finds the newest
# checkpoint (written by the other process) and finishes the run.

# %%
trainer = wb.Trainer(cfg, run_dir=run_dir)
print("restored at step", trainer.step)
trainer.run()

# %% [markdown]
# ## One continuous history
#
# `metrics.jsonl` in the run directory now holds steps from three processes: this
# kernel, the "restarted" process, this kernel again. Each step appears once.

# %%
import plotly.graph_objects as go

history = wb.runs.read_metrics(run_dir)
steps = [m["step"] for m in history if "step" in m and "loss" in m]
assert steps == list(range(1, cfg.steps + 1)), steps
fig = go.Figure(go.Scatter(x=steps, y=[m["loss"] for m in history if "loss" in m],
                           mode="lines+markers", name="loss"))
for x, label in ((stopped_at, "interrupted"), (stopped_at + 5, "other process")):
    fig.add_vline(x=x, line_dash="dot", annotation_text=label)
fig.update_layout(title="one run, three processes", xaxis_title="step",
                  yaxis_title="loss", height=320, margin=dict(t=40, b=40))
fig

# %% [markdown]
# ## Same numbers as an uninterrupted run
#
# Resuming restores the parameters, the optimizer state, the step and the data
# pipeline's position, so on CPU the resumed run computes bit-for-bit the same losses
# as a run that never stopped.
#
# The reference is the same run every time, so it lives in one fixed directory,
# `runs/05-reference`: the first run of this notebook trains it; when you run the
# notebook again, it already holds all 40 steps, `reference.run()` says there is nothing
# to do, and the comparison reads the losses it saved the first time.

# %%
reference = wb.Trainer(cfg, run_dir="runs/05-reference", progress=None)
reference.run()
ref = [m["loss"] for m in wb.runs.read_metrics("runs/05-reference") if "loss" in m]
got = [m["loss"] for m in history if "loss" in m]
np.testing.assert_array_equal(got[:cfg.steps], ref[:cfg.steps])
print(f"all {cfg.steps} losses identical; last {got[cfg.steps - 1]:.4f}")
