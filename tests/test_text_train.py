"""Training on your own text: packed BPE-tokenized JSONL over several epochs, held-out eval
at fixed steps, and SIGKILL + resume bitwise against an uninterrupted run."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import workbench as wb
from workbench import _runs as runs
from workbench._step import lm_loss

#: the module's reference run trains 30 steps (tens of seconds on 2 cores)
pytestmark = pytest.mark.slow

N = 30


def _docs():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = (stdlib / "textwrap.py").read_text() + (stdlib / "shlex.py").read_text()
    lines = (line.strip() for line in text.splitlines())   # one document per source line
    return list(dict.fromkeys(x for x in lines if len(x) > 20))[:80]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("own-text")
    docs = _docs()
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(root / "tokenizer.json"))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = wb.data.Dataset(files=str(root / "docs.jsonl"), tokenizer=root / "tokenizer.json",
                           eval_fraction=0.25)
    cfg = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1, "vocab_size": 384},
                         mesh={"data": 8}, batch=8, seq=32, steps=N, checkpoint_every=3,
                         data=data, eval_every=5, eval_batches=2,
                         optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=3))
    ref = wb.Trainer(cfg, run_dir=root / "ref", progress=None)
    ref.run()
    return {"root": root, "cfg": cfg, "ref": ref}


def test_several_epochs_each_a_new_permutation_of_the_same_rows(setup):
    batches = setup["ref"].parts.data
    info = batches.info
    rows = info["epoch_records"]
    assert N * 8 > 2 * rows                                   # the run saw over 2 epochs
    fresh = wb.data.ShardedBatches(setup["cfg"].data, seq=32, batch=8, seed=0,
                                   sharding=batches.sharding, vocab_size=384, prefetch=0)
    seen = [fresh.next_local()["tokens"] for _ in range(2 * rows // 8)]
    flat = np.concatenate(seen)                               # (steps * 8, seq + 1)
    e1, e2 = flat[:rows], flat[rows:2 * rows]
    key = lambda a: sorted(map(bytes, a))
    assert key(e1) == key(e2)                                 # the same rows ...
    assert not np.array_equal(e1, e2)                         # ... in another order


def test_eval_at_the_same_steps_with_the_held_out_loss(setup):
    ref, cfg = setup["ref"], setup["cfg"]
    evals = {r["step"]: r for r in ref.history if "eval_loss" in r}
    assert sorted(evals) == list(range(5, N + 1, 5))
    for r in evals.values():
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)
    # the last eval, by hand: lm_loss of the final model on each held-out batch, weighted
    # by that batch's predicted tokens
    graphdef = ref.parts.graphdef

    @jax.jit
    def loss(params, b):
        with ref.rules.activate(ref.mesh):
            return lm_loss(nnx.merge(graphdef, params), b)

    sums = counts = 0.0
    for b in ref.parts.data.eval_batches(cfg.eval_batches):
        n = float(np.sum(np.asarray(b["mask"])))
        sums += float(loss(ref.state.params, b)) * n
        counts += n
    assert evals[N]["eval_tokens"] == counts
    assert evals[N]["eval_loss"] == pytest.approx(sums / counts, rel=2e-6)
    assert evals[N]["eval_loss"] < evals[5]["eval_loss"]      # it learns
    assert ref.history[-1]["data_time"] >= 0                  # the data wait, per step


CHILD = """
import json, sys
import workbench as wb
cfg = wb.TrainConfig.from_json(sys.argv[1])
trainer = wb.Trainer(cfg, run_dir=sys.argv[2], progress=None)
result = trainer.run()
print(json.dumps({"status": result.status, "step": result.step}), flush=True)
"""


@pytest.mark.multiprocess
def test_sigkill_mid_epoch_then_resume_is_bitwise(setup, tmp_path):
    from tests.test_resume import _wait_for_checkpoint, _wait_for_step

    cfg, ref = setup["cfg"], setup["ref"]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, cfg.to_json(), str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    _wait_for_checkpoint(proc, run_dir)
    _wait_for_step(proc, run_dir, 8)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed = [r["step"] for r in runs.read_metrics(run_dir)]
    assert killed[-1] < N
    with pytest.warns(UserWarning, match="taking over the stale lock"):
        trainer = wb.Trainer(cfg, run_dir=run_dir, progress=None)
    assert 3 <= trainer.step <= killed[-1]
    trainer.run()
    assert trainer.losses == ref.losses                       # bitwise, all N steps
    got = [(r["step"], r["eval_loss"]) for r in trainer.history if "eval_loss" in r]
    want = [(r["step"], r["eval_loss"]) for r in ref.history if "eval_loss" in r]
    assert got == want


def test_eval_split_too_small_is_refused_and_the_run_dir_is_untouched(setup, tmp_path):
    run_dir = tmp_path / "kept"
    shutil.copytree(setup["root"] / "ref", run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    bad = setup["cfg"].replace(eval_batches=500)              # a run-control field
    with pytest.raises(ValueError, match=r"eval split has \d+ packed rows .* fewer than "
                                         r"eval_batches=500. Use eval_batches<="):
        wb.Trainer(bad, run_dir=run_dir, progress=None)
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.multiprocess
def test_a_2x2_job_reads_its_slices_and_resumes_bitwise_after_sigkill(setup, tmp_path):
    """Two processes x 2 devices, each reading its own block of every global batch of
    packed rows: bitwise the losses of one process with 4 devices and the same gloo
    collectives (the CLI, as on a cluster of one host), the notebook Trainer's to float32
    rounding (XLA's in-process all-reduce sums in another order than gloo's ring), and a
    job killed mid-run and relaunched gives the uninterrupted job's losses and eval losses
    bitwise. The suite's one "2 processes train like 1" check of a local launch and its
    one SIGKILL-and-relaunch of a multi-process job (its data-iterator state per process
    is the hardest to resume): the killed process fails the job within a minute, names
    itself, leaves no process behind, and the relaunch resumes from the last committed
    step and recomputes every later step.

    Two devices per process (the module's reference trains on 8 in this process): gloo
    runs every collective over loopback TCP between all devices of the job, and 2 x 4 spent
    ~60% more CPU than 2 x 2 on the same steps, for nothing this test checks."""
    import time

    from tests.test_jobs import _alive, _committed_steps, _losses, _wait_for
    from workbench.jobs import launch
    from workbench.jobs._local import free_port
    from workbench.widgets._job_view import job_payload

    cfg, ref = setup["cfg"].replace(mesh={"data": 4}), setup["ref"]
    whole = launch(cfg, processes=2, devices_per_process=2, run_dir=tmp_path / "whole",
                   platform="cpu")
    (tmp_path / "config.json").write_text(cfg.to_json())
    one = subprocess.run(
        [sys.executable, "-m", "workbench", "train", str(tmp_path / "config.json"),
         "--run-dir", str(tmp_path / "1x4"), "--platform", "cpu", "--devices-per-process", "4",
         "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "1",
         "--process-id", "0"], capture_output=True, text=True, timeout=600, check=False)
    assert whole.wait(600) == "finished", whole.tail()
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    want = _losses(tmp_path / "whole")
    assert len(want) == N and want[-1] < want[0]
    assert _losses(tmp_path / "1x4") == want                  # 2 x 2 = 1 x 4, 0 ulp
    assert want == pytest.approx(ref.losses, rel=1e-5, abs=0)  # seen: 2e-7
    assert [y for _, y in job_payload(whole)["loss"]] == want  # the Job widget's curve
    run_dir = tmp_path / "killed"
    job = launch(cfg, processes=2, devices_per_process=2, run_dir=run_dir, platform="cpu")
    _wait_for(lambda: 6 in _committed_steps(run_dir) and len(_losses(run_dir)) >= 8, 300, job)
    t0 = time.monotonic()
    os.kill(job.processes[1].pid, signal.SIGKILL)
    assert job.wait(60) == "failed" and time.monotonic() - t0 < 60
    assert job.failure["process"] == 1 and "SIGKILL" in job.failure["reason"]
    assert not any(_alive(p.pid) for p in job.processes)
    run = runs.read_run(run_dir)
    assert run["status"] == "failed" and "process 1" in run["error"]
    resume_from = _committed_steps(run_dir)[-1]
    again = launch(cfg, processes=2, devices_per_process=2, run_dir=run_dir, platform="cpu")
    assert again.wait(600) == "finished", again.tail()
    assert [e["step"] for e in runs.read_events(run_dir) if e["event"] == "resume"] \
        == [resume_from]
    assert _losses(run_dir) == want                           # bitwise, the whole curve
    # and the steps the relaunch computed itself (after its resume marker) match too
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mark = max(i for i, x in enumerate(lines) if x.get("event") == "resume")
    redone = {x["step"]: x["loss"] for x in lines[mark:] if "loss" in x and "event" not in x}
    assert sorted(redone) == list(range(resume_from + 1, len(want) + 1))
    assert all(redone[k] == want[k - 1] for k in redone)
    evals = lambda d: [(r["step"], r["eval_loss"]) for r in runs.read_metrics(d)
                       if "eval_loss" in r]
    assert evals(run_dir) == evals(tmp_path / "whole")
