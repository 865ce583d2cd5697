"""A Hugging Face model fine-tuned by a 2-process ``wb.launch`` job, exported two ways.

The job trains a Qwen3 model (made by transformers, random weights) over jax.distributed
on 127.0.0.1 (2 processes x 2 CPU devices: gloo's loopback collectives cost CPU with every
device of the job, and nothing here needs more); its checkpoint is then exported by a 2-process
``python -m workbench export`` job (each process restores only its shards; process 0
writes) and by ``wb.hf.export_run`` in this process. References: the two folders are
the same bytes, and transformers' float32 logits of the export equal the workbench
model's (the GPT with the checkpoint's parameters, restored in this process) within 1e-4.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import workbench as wb
from tests._hf_models import PROMPT, make_model, reference, save
from tests._tolerance import assert_close_at_scale

pytest.importorskip("transformers", reason="the test extra installs transformers + torch (CPU)")

# a 2-process training job, then a 2-process export job: ~1 min on 2 idle cores
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_two_process_run_exports_like_one_process_and_transformers_reads_it(tmp_path):
    import torch
    import transformers

    from workbench.jobs import launch
    from workbench.jobs._local import free_port

    folder = save(make_model("qwen3"), tmp_path / "qwen3")
    config = wb.TrainConfig(model=wb.hf.hf_config(folder), init=str(folder),
                            mesh={"data": 4}, batch=8, seq=16, steps=2, checkpoint_every=2,
                            data="synthetic")
    run_dir = tmp_path / "run"
    job = launch(config, processes=2, devices_per_process=2, run_dir=run_dir,
                 platform="cpu")
    assert job.wait(600) == "finished", job.tail()

    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "workbench", "export", str(run_dir), str(tmp_path / "two"),
         "--platform", "cpu", "--devices-per-process", "2", "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    one = wb.hf.export_run(run_dir, tmp_path / "one")   # this process, 8 devices

    two = tmp_path / "two"
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir())
    assert "model.safetensors" in names and "config.json" in names
    for name in names:                                     # bitwise, config.json included
        assert (one / name).read_bytes() == (two / name).read_bytes(), name

    from flax import nnx

    from tests.test_hf import RTOL, logits
    from workbench._train_state import abstract_model
    from workbench.hf._export import restore_params

    params, cfg, _ = restore_params(run_dir)                # step 2, onto 8 devices here
    want = logits(nnx.merge(abstract_model(cfg)[0], params))
    start = logits(wb.hf.from_hf(folder, mesh=wb.make_mesh(data=8)))
    assert not np.allclose(want, start)                    # the job did train
    ref = transformers.AutoModelForCausalLM.from_pretrained(two, dtype=torch.float32)
    got, _ = reference(ref, PROMPT, new=1)
    assert_close_at_scale(got, want, rtol=RTOL)   # two implementations: see test_hf
