"""Normal operations print nothing from third-party libraries: JAX's start after
``wb.simulate_devices`` in a plain script or in the CLI's worker (libtpu's TPU probe),
and opening a run's checkpoints read-only (Orbax's absl warnings).
tests/test_notebooks.py checks every notebook's outputs the same way (tests/_noise.py)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from _noise import THIRD_PARTY_NOISE
from workbench.hardware._libtpu import libtpu_installed, tpu_chips_attached
from workbench.train._checkpoint import Checkpoints

SCRIPT = """
import workbench as wb
{before}
wb.simulate_devices(8)
import jax
print(jax.device_count(), jax.devices()[0].platform)
"""

#: Pretends TPU chips are attached, as on a TPU VM: simulate_devices must then leave
#: JAX's TPU backend to start (here libtpu loads, finds no TPU and says so).
AS_ON_A_TPU_VM = ("import workbench.hardware._libtpu as libtpu\n"
                  "libtpu.tpu_chips_attached = lambda: True")


def _run(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter where JAX picks its platform itself (no
    JAX_PLATFORMS, no simulated-device flag), as in a learner's script."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env)


#: How ``python -m workbench train`` (and a launched worker) starts JAX: without
#: JAX_PLATFORMS or --platform, JAX picks the platform.
CLI_WORKER = """
from workbench.jobs._cluster import DistributedSpec, initialize
print(initialize(DistributedSpec()))
import jax
print(jax.devices()[0].platform)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", [SCRIPT.format(before=""), CLI_WORKER],
                         ids=["simulate_devices", "cli_worker"])
def test_starting_jax_prints_nothing_from_libtpu(script):
    out = _run(script)
    assert out.returncode == 0, out.stderr[-3000:]
    platform = "tpu" if tpu_chips_attached() else "cpu"
    assert out.stdout.split()[-1] == platform, out.stdout + out.stderr[-3000:]
    if platform == "cpu" and script != CLI_WORKER:
        assert out.stdout.split()[0] == "8", out.stdout
    noise = [line for line in out.stderr.splitlines() if THIRD_PARTY_NOISE.search(line)]
    assert not noise, f"{script.strip()}\nprinted:\n" + "\n".join(noise)


@pytest.mark.multiprocess
@pytest.mark.skipif(not libtpu_installed() or tpu_chips_attached(),
                    reason="needs libtpu installed on a host without TPU chips")
def test_simulate_devices_leaves_the_tpu_backend_to_start_where_chips_are_attached():
    """The same script where chips seem attached: libtpu loads (and, finding no TPU here,
    prints the warnings the test above does not see), so on a TPU VM the TPU starts."""
    out = _run(SCRIPT.format(before=AS_ON_A_TPU_VM))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["8", "cpu"], out.stdout + out.stderr[-3000:]
    assert "could not determine TPU accelerator type" in out.stderr, out.stderr[-3000:]
    assert any(THIRD_PARTY_NOISE.search(line) for line in out.stderr.splitlines())


def test_read_only_checkpoints_log_nothing_and_other_absl_lines_pass(tmp_path, caplog):
    Checkpoints(tmp_path / "ckpt", keep=2).close()
    with caplog.at_level(logging.WARNING):   # what a kernel shows (absl's INFO is not)
        ro = Checkpoints(tmp_path / "ckpt", keep=2, read_only=True)
        assert ro.all_steps() == []
        ro.close()
    orbax = [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING]
    assert not orbax, [r.getMessage() for r in orbax]
    # The notice is dropped only while Orbax opens the directory, only for that one.
    with caplog.at_level(logging.WARNING, logger="absl"):
        logging.getLogger("absl").warning("Given directory is read only=%s", tmp_path / "ckpt")
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == [
        f"Given directory is read only={tmp_path / 'ckpt'}"]


def test_the_read_only_filter_drops_only_that_notice_for_that_directory(tmp_path, caplog):
    from workbench.train._orbax_notices import without_read_only_notice

    absl = logging.getLogger("absl")
    with caplog.at_level(logging.WARNING, logger="absl"):
        with without_read_only_notice(tmp_path / "a"):
            absl.warning("Given directory is read only=%s", tmp_path / "a")        # dropped
            absl.warning("Given directory is read only=%s", tmp_path / "b")        # passes
            absl.warning("%s is read only, save will be skipped", tmp_path / "a")  # passes
            absl.error("Given directory is read only=%s (and more)", tmp_path / "a")
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == [
        f"Given directory is read only={tmp_path / 'b'}",
        f"{tmp_path / 'a'} is read only, save will be skipped",
        f"Given directory is read only={tmp_path / 'a'} (and more)"]


def _main_thread_wait_of(manager, seconds, monkeypatch):
    """``manager.wait_until_finished()`` on this (the main) thread, timed by Orbax's clock
    as ``seconds``: what a finished run's wait for its last save adds to the waits Orbax
    reports at the next save."""
    from orbax.checkpoint import checkpoint_manager

    clock = iter([1000.0, 1000.0 + seconds])
    with monkeypatch.context() as m:
        m.setattr(checkpoint_manager.time, "time", lambda: next(clock, 1000.0 + seconds))
        manager.wait_until_finished()


@pytest.mark.parametrize("size", [4, 1 << 22], ids=["snapshot", "direct"])
def test_a_save_after_a_long_wait_logs_no_orbax_wait_notice(tmp_path, caplog, monkeypatch,
                                                            size):
    """A run's end waits for its last save on the main thread (``Checkpoints.wait``); Orbax
    adds that wait up and, at the next run's first save, logs "Waiting for previous save
    to complete took ... consider checkpointing less frequently" (a notebook's second run
    on a loaded machine showed it). Checkpoints' saves drop that notice, by the writer
    thread (a small state's snapshot) and directly (a large one); Orbax's own save of the
    same state after the same wait is the reference that logs it."""
    import jax.numpy as jnp

    from workbench.train._checksum import keys_to_data

    ck = Checkpoints(tmp_path / "ckpt", keep=5)
    state = {"w": jnp.ones((size,), jnp.float32)}
    ck.save(1, state)
    ck.wait()
    notice = "Waiting for previous save to complete took"
    with caplog.at_level(logging.WARNING, logger="absl"):
        _main_thread_wait_of(ck._manager, 5.0, monkeypatch)
        ck.save(2, state)
        ck.wait()
        assert not [r.getMessage() for r in caplog.records if notice in r.getMessage()]
        _main_thread_wait_of(ck._manager, 5.0, monkeypatch)
        tree, impls = keys_to_data(state)
        ck._manager.save(3, args=ck._args(3, tree, impls, None, None, None), force=True)
        ck._manager.wait_until_finished()
    logged = [r.getMessage() for r in caplog.records if notice in r.getMessage()]
    assert len(logged) == 1 and "took 5.0" in logged[0], logged
    assert ck.all_steps() == [1, 2, 3]
    ck.close()
