# %% [markdown]
# # 06 · From a cell to a multi-process job
#
# Once a configuration trains in the notebook, the same `TrainConfig` runs as a
# multi-process `jax.distributed` job: `wb.launch` starts the workers (here on this
# machine, over 127.0.0.1 with the gloo CPU collectives), each running
# `python -m workbench train`, the command a SLURM task or a TPU pod worker runs.
# Process 0 writes the metrics into the run directory, so the job's loss streams into
# the widget below and into the JupyterLab **Runs** side panel.
#
# On a GPU server, `processes=1` uses every GPU; on a pod or cluster, the same command
# runs on every host (see the README's section on GPU, TPU and SLURM).

# %%
import workbench as wb

wb.simulate_devices(8)

import time

# %% [markdown]
# ## One configuration, 2 processes x 4 devices
#
# The mesh still has 8 devices (`data=8`); they now belong to two processes. Every
# process feeds its own half of each global batch.
#
# Running this notebook again reuses `runs/06-job`: the job continues from the last
# checkpoint the earlier run left there (`already` below says how many steps that is),
# and the history keeps growing. Delete `runs/06-job` to start from step 0.

# %%
cfg = wb.TrainConfig(model="tiny", mesh={"data": 8}, rules="fsdp", batch=8, seq=64,
                     steps=10_000, checkpoint_every=5, seed=0)
already = max((m["step"] for m in wb.runs.read_metrics("runs/06-job") if "loss" in m),
              default=0)
print(f"runs/06-job already holds {already} steps" if already else "a new run: runs/06-job")
job = wb.launch(cfg, processes=2, devices_per_process=4, run_dir="runs/06-job")
job

# %% [markdown]
# The widget above shows each process, the live loss and MFU, and the tail of the logs.
# From code, the same information:

# %%
deadline = time.time() + 240
while (job.progress().get("step") or 0) < already + 8 and not job.done and time.time() < deadline:
    time.sleep(0.5)
print(job)
print(job.tail(3))

# %% [markdown]
# ## Stop with a checkpoint
#
# `job.stop()` sends SIGTERM to every worker, as a scheduler's preemption would: they
# agree on one step (JAX's preemption sync point), save a checkpoint there together, and
# exit.

# %%
status = job.stop()
stopped_at = job.progress().get("step")
print(status, "at step", stopped_at)
assert status == "stopped", job.tail(20)

# %% [markdown]
# ## Continue where it stopped
#
# Launching into the same run directory continues from its newest checkpoint. Here the
# job runs three more steps and finishes.

# %%
job = wb.launch(cfg, processes=2, devices_per_process=4, run_dir="runs/06-job",
                steps=stopped_at + 3)
print(job.wait(timeout=300))
print(job.tail(2))

# %% [markdown]
# The run directory holds one continuous history across both launches (the lab's Runs
# panel draws it the same way):

# %%
history = [m for m in wb.runs.read_metrics("runs/06-job") if "loss" in m]
print([m["step"] for m in history])
assert [m["step"] for m in history] == list(range(1, stopped_at + 4))
assert all(p.returncode is not None for p in job.processes), "every worker has exited"
