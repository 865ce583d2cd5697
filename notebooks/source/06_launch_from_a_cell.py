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

# %% [markdown]
# ## The same job on a SLURM cluster
#
# On a cluster's login node, `cluster=wb.Slurm(...)` hands the job to SLURM instead of
# starting processes here: `sbatch` queues it, `srun` starts one task per process on the
# allocated nodes, and each task joins through `jax.distributed.initialize()`'s SLURM
# detection. The returned Job is the same object and widget, plus the scheduler's view:
# `PENDING` with its reason, `RUNNING` with the node list, `COMPLETED`, `FAILED`,
# `CANCELLED`, `TIMEOUT`, and every requeue. `job.stop()` cancels (`scancel`): the tasks
# checkpoint first. The run directory must be on storage every node sees.
#
# This is the batch script `wb.launch` would submit (nothing is written yet):

# %%
slurm = wb.Slurm(nodes=1, tasks_per_node=2, cpus_per_task=1, devices_per_task=4,
                 platform="cpu", time="30:00", requeue=True)
print(slurm.script("runs/06-slurm"))

# %% [markdown]
# Where a SLURM controller answers (`sinfo`), this cell submits the job and shows it; the
# widget's first line is the scheduler's state. After a kernel restart,
# `wb.attach("runs/06-slurm")` finds the job again from `runs/06-slurm/slurm.json`.
#
# **Preemption.** With `requeue=True` SLURM sends SIGTERM `signal_before` seconds (120)
# before the time limit, and on a preemption or `scontrol requeue`: every task saves a
# checkpoint at the same step, the job goes back to the queue (it keeps its id; SLURM
# holds it about two minutes, `PENDING (BeginTime)`), and the next start continues from
# that checkpoint, bitwise. The widget shows `RUNNING → REQUEUED → PENDING → RUNNING`, and
# the run directory keeps one curve with a resume marker.

# %%
from workbench.jobs import slurm_available

if slurm_available():
    sjob = wb.launch(cfg.replace(steps=10), run_dir="runs/06-slurm", cluster=slurm)
    display(sjob)
    print(sjob.wait(timeout=900))
    print(sjob.scheduler["history"])
else:
    print("no SLURM controller answers here (`sinfo`); on a login node this cell submits "
          "the script above")

# %% [markdown]
# ## A multi-host TPU slice, or plain hosts over ssh
#
# `wb.TPUSlice(name, zone, project)` runs the same worker on every host of a Cloud TPU
# VM slice, one `gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --project=PROJECT
# --worker=I --command=...` per worker (each with its own log and its own stop); the
# workers join through JAX's Cloud TPU detection. `wb.Hosts(["node1", "node2"])` does the
# same over plain ssh, with the coordinator on the first host. The command worker 1 of a
# 4-host slice would run:

# %%
from pathlib import Path

tpu = wb.TPUSlice("my-v5p-32", "us-east5-a", "my-project", workers=4,
                  python="~/venv/bin/python")
print(tpu.remote_command(1, Path("/mnt/shared/runs/llm"), "<token>", steps=None))
