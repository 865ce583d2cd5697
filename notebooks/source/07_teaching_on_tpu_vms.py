# %% [markdown]
# # 07 · Teaching a hands-on session on TPU VMs
#
# A guide for instructors. It covers the set-up (JupyterLab on a Cloud TPU VM, reached
# through an SSH tunnel), sharing one VM's chips between students (one kernel each),
# what the mesh widget shows on a real TPU topology, and the TPU-specific pitfalls worth
# a live demo. The code cells run anywhere: on a laptop they use simulated devices and
# abstract meshes of the TPU slices, on a TPU VM the real chips.

# %%
import workbench as wb

wb.simulate_devices(8)  # on a TPU VM this only adds CPU devices; JAX still uses the TPU

import json
import pathlib

import jax

print(jax.default_backend(), jax.devices()[:2])

# %% [markdown]
# ## 1. JupyterLab on the VM, through an SSH tunnel
#
# Create a VM (one host; a v5e-8 has 8 chips), install Workbench on it, and start
# JupyterLab bound to the VM's localhost only:
#
# ```bash
# gcloud compute tpus tpu-vm create teach-1 --zone=us-west4-a \
#     --accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite
# gcloud compute tpus tpu-vm ssh teach-1 --zone=us-west4-a
# # on the VM:
# git clone <this repository> workbench && cd workbench
# python3 -m venv .venv && .venv/bin/pip install -e . "jax[tpu]"
# .venv/bin/jupyter lab --no-browser --port=8888 --ip=127.0.0.1 --notebook-dir=notebooks
# ```
#
# Then, on your laptop, open a tunnel and browse to the URL (with its token) that
# JupyterLab printed:
#
# ```bash
# gcloud compute tpus tpu-vm ssh teach-1 --zone=us-west4-a -- -N -L 8888:localhost:8888
# # -> http://localhost:8888/lab?token=...
# ```
#
# Nothing listens on a public address: the token and the tunnel are the access control.
# Without `gcloud`, plain `ssh -N -L 8888:localhost:8888 user@VM_IP` does the same.
#
# ## 2. One kernel per student
#
# Only **one process** can own a TPU chip: a second kernel on the same chips fails at
# its first JAX call with a "TPU in use" error. For a class on one VM, give each
# student their own chips through a kernel spec whose environment restricts libtpu to
# them (the variables Cloud TPU uses to run several independent processes on one VM;
# each process also needs its own port). The cell below writes one kernel spec per
# chip; install them on the VM with `jupyter kernelspec install --user <dir>` and every
# student picks theirs in the launcher.

# %%
def student_kernel(chip: int, python: str = "python") -> dict:
    """A kernel spec that gives one student one TPU chip of the VM."""
    return {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 (TPU chip {chip})",
        "language": "python",
        "env": {
            "TPU_VISIBLE_CHIPS": str(chip),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": str(8476 + chip),
            "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{8476 + chip}",
            "TPU_MESH_CONTROLLER_PORT": str(8476 + chip),
        },
    }


out = pathlib.Path("student-kernels")
for chip in range(8):
    spec_dir = out / f"tpu-chip-{chip}"
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps(student_kernel(chip), indent=1))
print(sorted(p.name for p in out.iterdir()))
print("install with: for d in student-kernels/*; do jupyter kernelspec install --user $d; done")

# %% [markdown]
# With one chip each, students do every single-device exercise on real hardware and
# the sharding exercises on simulated devices (`wb.simulate_devices(8)` plus
# `JAX_PLATFORMS=cpu` in their kernel), which behave identically for layouts, plans
# and collectives. For multi-chip work, give pairs or groups a kernel with 2 or 4
# chips, or run the demo yourself on all 8. For a larger class, a JupyterHub on one VM
# per group, or the Binder link (CPU only) for the sharding notebooks, scales better.
#
# ## 3. What the mesh widget shows on a real topology
#
# On a TPU, each device has physical chip coordinates on the torus
# (`device.coords`), and `jax.make_mesh` orders the devices so that neighbouring mesh
# positions are neighbouring chips. The widget shows those coordinates and, on
# multi-host slices, the host of each chip. Here the same is drawn for slices you may
# not have, from Workbench's table of TPU topologies:

# %%
v5e8 = wb.abstract_mesh("v5e-8", data=2, model=4)
print(v5e8)
print("chip coordinates (x, y, z) per mesh position:")
print(v5e8.coords.reshape(-1, 3).tolist())
wb.show(v5e8)

# %% [markdown]
# A multi-host slice: a v4-32 is 16 chips on 4 hosts, a 2x2x4 torus. Colour by host to
# see which mesh axis crosses hosts.

# %%
v4 = wb.abstract_mesh("v4-32", data=4, model=4)
print(v4.describe())
wb.show(v4, color_by="host")

# %% [markdown]
# ### The program the TPU compiler makes, on a laptop
#
# With the TPU compiler installed (`make lab` installs it, `pip install
# "workbench[tpu-compile]"` elsewhere), `wb.plan` on a TPU preset compiles the real train
# step for that slice, here on a CPU-only machine: memory per chip, the collectives and
# the HLO come from the TPU executable itself (`plan.source`), and its roofline prediction
# sits beside the TPU compiler's own estimate. A class can see what a v5e-8 runs before
# anyone has one.

# %%
cfg = wb.models.GPTConfig.preset("tiny")          # 2 kv heads: model=2 divides them
tpu_plan = wb.plan(cfg, mesh=wb.abstract_mesh("v5e-8", data=4, model=2), rules="fsdp_tp",
                   batch=16, seq=128)
print(tpu_plan.source, "-", tpu_plan.source_reason)
print(tpu_plan.predicted)

# %% [markdown]
# The collectives, read from the TPU program: which mesh axis each one crosses, how many
# bytes, and how often. Compare with the CPU program of the same step on simulated
# devices (section 3 of notebook 03): XLA for TPU picks its own fusions and layouts.

# %%
for c in tpu_plan.collectives[:8]:
    print(f"{c.kind:<18} over {','.join(c.axes):<10} x{c.count:<3} {c.bytes:>8} B  {c.shapes[0]}")
hlo = tpu_plan.compiled.as_text()
line = next(ln.strip() for ln in hlo.splitlines() if "all-gather-start(" in ln or " all-gather(" in ln)
print("\none all-gather as the TPU compiler wrote it (T(8,128) is the TPU tile layout):")
print(line[:300])

# %% [markdown]
# On the VM itself, the real thing (on a laptop these are the simulated CPU devices):

# %%
mesh = wb.make_mesh(data=2, model=4)
wb.show(mesh)

# %% [markdown]
# ## 4. TPU pitfalls worth showing
#
# ### Slice names count differently
#
# "v4-32" counts TensorCores; JAX sees one device per chip.

# %%
wb.exercise("megacore_devices")

# %% [markdown]
# Ironwood (TPU7x) names its slices the same way ("tpu7x-128" is 64 chips in a 4x4x4
# cube), but each of its chips has two TensorCores that JAX shows as two devices; the mesh
# widget draws them (colour by "chip" to see the pairs).

# %%
wb.show(wb.abstract_mesh("tpu7x-16", data=-1))

# %%
wb.exercise("ironwood_devices")

# %% [markdown]
# ### Every host runs the program, and loads only its share of the batch
#
# On a multi-host slice, every host must run the same program (`jax.distributed`),
# so an interactive notebook on host 0 alone cannot use the other hosts' chips. Train
# on the whole slice with `wb.launch` / `python -m workbench train` on every worker
# (see the README), and check the workers first with `python -m workbench ping`. Each
# host feeds only its own chips:

# %%
wb.exercise("host_batch")

# %% [markdown]
# ### Shapes that do not fit the hardware tiles
#
# TPU matrix units work on tiles of 128 (the lanes) by 8 (the sublanes); shards whose
# last dims are not multiples of these are padded, and dims that do not divide by their
# mesh axes are refused by JAX (notebook 02's `vocab_padding` exercise). Workbench's
# plan lints report both; a quick check on the shard shapes:

# %%
for name, shape, spec in [("embedding, GPT-2 vocab", (50257, 768), (None, "model")),
                          ("embedding, padded vocab", (50304, 768), ("model", None)),
                          ("q projection, head_dim 96", (12288, 12, 96), (None, "model", None))]:
    lay = wb.layout(shape, spec, v5e8, dtype="bfloat16", name=name)
    last = lay.shard_shape[-1]
    print(f"{name:<26} shard {lay.shard_shape}: last dim {last} "
          f"{'is' if last % 128 == 0 else 'is NOT'} a multiple of 128")

# %% [markdown]
# ### Compilation takes time; cache it
#
# The first call of a jitted step compiles it: seconds for these toy models, minutes
# for large ones on a pod. `wb.plan` shows the compile time before training starts;
# `wb.Trainer` turns on JAX's persistent compilation cache (under
# `~/.cache/workbench/jax-compile`), so a restarted kernel or a relaunched job does not
# pay it again. In class, run the big compile once before the session.
#
# ### Memory is per chip, and smaller than it sounds
#
# A v5e chip has 16 GiB of HBM. Plan before allocating: `wb.plan(...)` on
# `wb.abstract_mesh("v5e-8", ...)` tells you on your laptop whether a configuration
# fits, and the lint says what to change (notebook 04). On the VM,
# `jax.devices()[0].memory_stats()` gives the live numbers.
#
# ### Tensor parallelism belongs inside a host
#
# Inside a slice all chips share the fast ICI links; between slices (multi-slice,
# `make_mesh(..., dcn=...)`) and between GPU servers traffic goes over the data-centre
# network. Keep `model` within the fast domain and put only `data` across it
# (notebook 01's `tp_within_host` exercise).
