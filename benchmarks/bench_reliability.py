"""Reliability: what checkpoint checksums cost, and how many hostile cases the tests hold.

- Checksum cost: ``Checkpoints`` save (to committed) and restore wall time with checksums
  on vs off (``Checkpoints(checksums=False)``: nothing recorded, so nothing verified), for
  the "tiny" Trainer state (snapshotted: the checksum runs in the writer thread) and a
  larger state (256 MiB, saved per shard from the calling thread). On and off alternate
  window by window (interleaved: drift on a shared machine hits both), median of the
  windows; the first save and restore of each state (compiles) are not timed.
- Reliability table: ``pytest --junitxml`` over the hostile-input test files (server fuzz,
  checkpoint corruption matrix, bad input, run-directory lock), in a subprocess; per file
  the cases tried (test cases, parametrized ones each counted; a hypothesis test is one case
  of many examples) and the cases that held (passed).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RELIABILITY_TESTS = ["tests/test_server_fuzz.py", "tests/test_checkpoint_corruption.py",
                     "tests/test_bad_input.py", "tests/test_run_lock.py"]
WINDOWS = 5
LARGE_BYTES = 256 << 20


def _tiny_state() -> Any:
    """The "tiny" model's train state (params, AdamW state, step) and an RNG key."""
    import jax

    from workbench._sharding.mesh import make_mesh
    from workbench.models._config import GPTConfig
    from workbench._sharding.rules import Rules
    from workbench._step import init_state
    from workbench._optimizer import AdamW

    mesh = make_mesh({"data": 8})
    _, state = init_state(GPTConfig.preset("tiny"), AdamW().build(1000),
                          Rules.preset("fsdp", mesh), mesh, seed=0)
    return {"train": state, "rng": jax.random.key(0)}


def _large_state() -> Any:
    """8 float32 arrays of 32 MiB, sharded over 8 devices (256 MiB)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from workbench._sharding.mesh import make_mesh

    mesh = make_mesh({"data": 8})
    n = LARGE_BYTES // 8 // 4
    sh = NamedSharding(mesh, P("data"))
    make = jax.jit(lambda k: jax.random.normal(k, (n // 1024, 1024), jnp.float32),
                   out_shardings=sh)
    return {f"w{i}": make(jax.random.key(i)) for i in range(8)}


def _nbytes(tree: Any) -> int:
    import jax

    return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree))


def _save_restore(tmp: Path, tree: Any, checksums: bool, step: int) -> tuple[float, float]:
    """Seconds to save ``tree`` until committed, then to restore it (verified if on)."""
    from workbench.train._checkpoint import Checkpoints

    ck = Checkpoints(tmp / f"{'on' if checksums else 'off'}", keep=1, checksums=checksums)
    t0 = time.perf_counter()
    ck.save(step, tree, force=True)
    ck.wait()
    t1 = time.perf_counter()
    restored = ck.restore(tree)
    import jax

    jax.block_until_ready(restored.state)
    t2 = time.perf_counter()
    ck.close()
    return t1 - t0, t2 - t1


def _checksum_rows(name: str, tree: Any, how: str) -> list[dict[str, Any]]:
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-reliability-") as tmp:
        for on in (True, False):   # warm-up: compiles (checksum, copies), Orbax set-up
            _save_restore(Path(tmp), tree, on, 1)
        for w in range(WINDOWS):
            order = (True, False) if w % 2 == 0 else (False, True)
            for on in order:
                times[on].append(_save_restore(Path(tmp), tree, on, w + 2))
    med = {on: (statistics.median(t[0] for t in times[on]),
                statistics.median(t[1] for t in times[on])) for on in times}
    mb = _nbytes(tree) / 2**20
    from workbench.train._checksum import keys_to_data, leaf_checksums

    data, _ = keys_to_data(tree)          # what a save checksums (PRNG keys as their data)
    leaf_checksums(data)                  # compiled by the warm-up saves already
    passes = []
    for _ in range(WINDOWS):              # the checksum pass alone, as a save runs it
        t0 = time.perf_counter()
        leaf_checksums(data)
        passes.append(time.perf_counter() - t0)
    alone, save_off = statistics.median(passes), med[False][0]
    rows = [{
        "name": f"checksums: the checksum pass / save without it, {name} ({mb:.0f} MiB)",
        "value": round(1 + alone / save_off, 3), "unit": "x", "target": "<= 1.25",
        "ok": 1 + alone / save_off <= 1.25,
        "notes": f"checksum pass {1e3 * alone:.1f} ms (median of {WINDOWS}; on the devices, "
                 f"both sums in one fused pass) added to a {1e3 * save_off:.1f} ms save: the "
                 "cost itself, without the disk's write-back noise of the on/off windows"}]
    for i, op in enumerate(("save", "restore")):
        on, off = med[True][i], med[False][i]
        rows.append({
            "name": f"checksums: {op} time on / off, {name} ({mb:.0f} MiB)",
            "value": round(on / off, 3), "unit": "x", "target": "<= 1.25",
            "ok": on / off <= 1.25,
            "notes": f"{op} {1e3 * on:.1f} ms with checksums, {1e3 * off:.1f} ms without "
                     f"(median of {WINDOWS} interleaved windows; {how})"})
    return rows


def _reliability_rows() -> list[dict[str, Any]]:
    files = [f for f in RELIABILITY_TESTS if (ROOT / f).exists()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-reliability-junit-") as tmp:
        for f in files:
            xml = Path(tmp) / (Path(f).stem + ".xml")
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   f, f"--junitxml={xml}"], cwd=ROOT, capture_output=True,
                                  text=True, env=dict(os.environ))
            took = time.perf_counter() - t0
            tried = failed = skipped = 0
            if xml.exists():
                for suite in ET.parse(xml).getroot().iter("testsuite"):
                    tried += int(suite.get("tests", 0))
                    failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
                    skipped += int(suite.get("skipped", 0))
            held = tried - failed - skipped
            tail = "" if proc.returncode in (0, 1) else \
                f"; pytest exit {proc.returncode}: {(proc.stdout + proc.stderr)[-200:]}"
            rows.append({
                "name": f"reliability: {Path(f).name}", "value": held,
                "unit": f"of {tried} held", "target": "all", "ok": tried > 0 and held == tried,
                "notes": f"{tried} cases tried, {held} held, {failed} failed, {skipped} skipped "
                         f"in {took:.0f} s{tail}"})
    return rows


def run() -> list[dict[str, Any]]:
    """Checksum cost rows, then one reliability row per hostile-input test file."""
    rows = _checksum_rows("tiny train state", _tiny_state(),
                          "snapshotted: checksum and copy in the writer thread")
    rows += _checksum_rows("large state", _large_state(),
                           "per-shard save from the calling thread")
    return rows + _reliability_rows()
