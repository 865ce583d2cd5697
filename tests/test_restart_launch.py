"""``restart="ok"`` reaches launched workers (issue 56, item 4): ``python -m workbench train
--restart ok`` and ``wb.launch(..., restart="ok")`` start a new attempt of a run whose
checkpoints were deleted, as ``wb.Trainer(restart="ok")`` does; without it the worker refuses
and the run directory is left as it was. The reference is the run's own first attempt: the same
config, seed and data, so attempt 2's losses equal attempt 1's step for step."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench import _runs as runs
from workbench.jobs._worker import check_consent, train_args

ROOT = Path(__file__).resolve().parent.parent
CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                     rules="fsdp", batch=8, seq=32, steps=4, checkpoint_every=2, keep=2,
                     data="synthetic", optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=2))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT, check=False)


def _losses(run_dir: Path, attempt: int) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in runs.read_attempts(run_dir)[attempt] if "loss" in r}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_cli_refuses_then_restarts_a_run_whose_checkpoints_were_deleted(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(CFG.to_json())
    first = _cli("train", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir))
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(run_dir / "checkpoints")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    refused = _cli("train", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir))
    assert refused.returncode != 0
    assert "restart='ok'" in refused.stderr and "Nothing was changed" in refused.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    again = _cli("train", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir),
                 "--restart", "ok")
    assert again.returncode == 0, again.stderr[-2000:]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["attempt"] == 2
    assert [h["event"] for h in record["history"] if h.get("event") == "restart"] == ["restart"]
    one, two = _losses(run_dir, 1), _losses(run_dir, 2)
    assert sorted(two) == [1, 2, 3, 4] and two == one


def test_launch_passes_restart_to_every_worker_and_checks_it() -> None:
    assert train_args(None, None, "ok") == ["--restart", "ok"]
    assert train_args(5, "ok", "ok") == ["--steps", "5", "--data-changed", "ok",
                                         "--restart", "ok"]
    assert check_consent("restart", "ok", "wb.launch: ") == "ok"
    with pytest.raises(ValueError, match=r"wb.launch: restart='yes': leave it out .* "
                                         r"restart='ok' to start a new attempt"):
        wb.launch(CFG, processes=1, restart="yes")
    with pytest.raises(TypeError, match=r"restart=True"):
        wb.launch(CFG, processes=1, restart=True)
    script = wb.Slurm(nodes=1, partition="x").script("/tmp/run", restart="ok")
    assert "--restart ok" in script
