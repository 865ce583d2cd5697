"""Checkpoints of a run: one composite Orbax save of state, data position and metadata.

One class, one file: save, verify, fall back and set aside share one Orbax manager and its
pending-save state; what a save records (``_checksum``) and the Orbax log notices it drops
(``_orbax_notices``) live beside it.

Each checkpoint ``<run_dir>/checkpoints/<step>/`` holds three items written by one
``orbax.checkpoint.CheckpointManager`` save:

- ``state``: the train state pytree (params, optimizer state, step counter, RNG keys).
  Typed PRNG keys are stored as their key data (``jax.random.key_data``) and wrapped
  again on restore.
- ``data``: the Grain iterator position, one file per process
  (``grain.checkpoint.CheckpointSave``).
- ``meta``: JSON (step, config, time, RNG implementations, ...).

Saves are asynchronous (the blocking part copies device arrays to host; the rest is
written in a background thread) and atomic: Orbax writes into a temporary directory and
renames it when every item is complete, so a crash or a full disk never leaves a
half-written checkpoint under a step's name. Restoring onto another mesh goes through an
abstract target (``jax.ShapeDtypeStruct`` leaves with shardings): Orbax reads each
device's block.

Restore verifies before it trusts. Every save records in ``meta`` two 32-bit checksums
per array (:func:`leaf_checksums`: position-weighted sums of the array's bits, computed on
the devices, so they do not depend on the mesh and work across processes) and, in one
process, the data position it wrote. Restore first compares the checkpoint's array shapes
with the target (a different model is a :class:`CheckpointMismatch` naming the first
differing parameter, never "corrupt"), then reads the step and recomputes the checksums of
what it read. A step that cannot be read (truncated, random or zeroed files, missing or
garbage metadata or manifests, an emptied directory) or whose checksums differ (flipped
bytes inside an array file) is skipped for the next older one, and once an older step has
restored (so the failure is the step's, not this machine's) it is **moved aside**, never
deleted, to ``checkpoints/corrupt/<step>`` (Orbax ignores that folder; a
``<step>.reason.txt`` beside it says why) with a warning naming it. A later save of
the same step number therefore never trips over it. What is verified: every array leaf
(parameters, optimizer state, step counter, RNG key data) bit for bit; the data position
in single-process runs (multi-process runs: each process's position file must parse); the
JSON metadata must parse. Not verified: Orbax's own bookkeeping files that restore does
not read (``_CHECKPOINT_METADATA``, ``commit_success.txt``, the per-process OCDBT
manifests), whose damage does not change what is restored. Cost: one pass over the state
on the devices at save and one at restore (plus one compile of the checksum per state
layout); ``benchmarks/bench_reliability.py`` measures it.

A small state (one process; every leaf a fully addressable array of at most
``SNAPSHOT_LEAF_BYTES``, in all at most ``SNAPSHOT_BYTES``) is saved without draining the
step pipeline: :meth:`Checkpoints.snapshot` copies it on the devices (asynchronously, a
few ms to dispatch) and captures the data position, the next step is dispatched, and one
writer thread copies the snapshot to the host and hands it to Orbax while that step runs.
It is saved as whole host arrays: Orbax writes a sharded ``jax.Array`` as one chunk per
device shard, and for the many small leaves of a small model (66 leaves x 8 shards for
"tiny") that per-chunk cost dominates -- 0.25 s of CPU per save against 0.06 s for the same
leaves whole. The files are Zarr arrays either way and restore onto any mesh. Larger
states, and runs across processes, are saved from the calling thread with Orbax's
per-shard writes; the blocking part is Orbax's device-to-host copy.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from workbench.train._checksum import (
    CHECKSUM_ALGORITHM,
    abstract_key_data,
    data_to_keys,
    keys_to_data,
    leaf_checksums,
    leaf_name,
)
from workbench.train._orbax_notices import without_read_only_notice, without_wait_notice

#: Snapshots (see the module docstring) hold arrays of at most this size: each is saved
#: as one chunk, where larger arrays are better written per shard.
SNAPSHOT_LEAF_BYTES = 8 << 20
#: States up to this size are snapshotted on device and written from a writer thread.
SNAPSHOT_BYTES = 256 << 20


#: Where unreadable or corrupt steps are moved (inside the checkpoint directory).
CORRUPT_DIR = "corrupt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointMismatch(CheckpointError, ValueError):
    """The checkpoint holds a state of other shapes than the target (another model)."""


class _Unusable(Exception):
    """A step cannot be used (raised and caught inside ``restore``)."""


class _Damaged(_Unusable):
    """A step was read but differs from what was saved (checksum or data position)."""


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpoints.restore` returns."""

    step: int
    state: Any
    meta: dict[str, Any]
    skipped: list[tuple[int, str]]
    set_aside: list[Path] = dataclasses.field(default_factory=list)




class _DataPosition:
    """A data iterator's position, captured now, for ``grain.checkpoint.CheckpointSave``."""

    def __init__(self, iterator: Any) -> None:
        self._state = iterator.get_state()

    def get_state(self) -> Any:
        return self._state


@dataclasses.dataclass
class Snapshot:
    """A state held for saving: a device-side copy of it, captured between two steps.

    Attributes:
      tree: the copy, typed PRNG keys replaced by their key data.
      impls: the key implementations, in leaf order.
      data: the data iterator's position when the snapshot was taken (or None).
      seconds: how long taking it blocked the caller (counted in ``save``'s result).
    """

    tree: Any
    impls: list[str]
    data: _DataPosition | None
    seconds: float = 0.0


def _reason(error: BaseException) -> str:
    """One line saying why a step could not be used."""
    if isinstance(error, _Unusable):
        return str(error)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


def _all_agree(ok: bool) -> bool:
    """Whether every process of a multi-process job says ``ok`` (one process: ``ok``)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    votes = multihost_utils.process_allgather(np.int32(ok))
    return bool(np.all(np.asarray(votes)))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def abstract(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` (with sharding) for every array leaf of ``tree``."""
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


class Checkpoints:
    """The checkpoints of one run (an ``orbax.checkpoint.CheckpointManager``).

    Args:
      directory: where step directories live (created if missing).
      keep: keep the newest ``keep`` checkpoints.
      every: ``save`` writes only at multiples of ``every`` unless ``force=True``.
      async_save: write in a background thread after the blocking device-to-host copy.
      read_only: only restore (e.g. the source run of a fork); nothing is written or removed.
      checksums: record per-array checksums at save (restore checks them whenever a
        checkpoint has them); False skips the device pass at save (see the module docstring).
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3, every: int = 1,
                 async_save: bool = True, read_only: bool = False,
                 checksums: bool = True) -> None:
        self.directory = Path(directory).absolute()
        self.every = every
        self.read_only = read_only
        self.checksums = checksums
        self._async = async_save
        # Read-only options are given as Orbax would set them (no saves, no deletions, no
        # creation, no clean-up), so it has nothing to change and warn about.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else every, create=not read_only,
            read_only=read_only, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only)
        with without_read_only_notice(self.directory):
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=("state", "data", "meta"))
        self._pending: int | None = None
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._submitted: tuple[int, concurrent.futures.Future[bool]] | None = None

    # ------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint on disk, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save
    def snapshot(self, state: Any, data: Any = None) -> Snapshot | None:
        """A device-side copy of a small ``state`` and the ``data`` position, or None.

        None when the state is too large to copy (see the module docstring), saves are
        synchronous, or the run spans processes: then ``save`` the state itself.
        """
        t0 = time.perf_counter()
        tree, impls = keys_to_data(state)
        return self._snapshot(tree, impls, data, t0)

    def _snapshot(self, tree: Any, impls: list[str], data: Any, t0: float) -> Snapshot | None:
        """:meth:`snapshot` of a tree whose keys are already key data."""
        if not self._async or jax.process_count() > 1:
            return None
        leaves = jax.tree.leaves(tree)
        if not all(isinstance(x, jax.Array) and x.is_fully_addressable
                   and x.nbytes <= SNAPSHOT_LEAF_BYTES for x in leaves):
            return None
        if sum(x.nbytes for x in leaves) > SNAPSHOT_BYTES:
            return None
        # An asynchronous copy with the same shardings (a jitted copy would wait for the
        # step in flight on CPU, where small programs run inline). Not gathered onto one
        # device: device_put then aliases shard 0 of a replicated leaf, whose buffer the
        # next step donates.
        copy = jax.device_put(tree, may_alias=False)
        position = _DataPosition(data) if data is not None else None
        return Snapshot(copy, impls, position, seconds=time.perf_counter() - t0)

    def save(self, step: int, state: Any, *, data: Any = None,
             meta: dict[str, Any] | None = None, force: bool = False) -> float:
        """Starts saving ``state`` (and the data iterator position) as ``step``.

        Args:
          step: the checkpoint's step.
          state: the train state pytree, or a :class:`Snapshot` of it (which holds its own
            data position; ``data`` is then ignored).
          data: the data iterator (``get_state``), saved with Grain's checkpoint handler.
          meta: JSON-able facts stored next to the state.
          force: save even if ``step`` is not a multiple of ``every``.

        Returns the seconds the caller was blocked (for a snapshot, taking it included);
        the files are written in the background. Raises ``CheckpointError`` if the
        *previous* background save failed (disk full, ...).
        """
        t0 = time.perf_counter()
        self.raise_if_failed()
        self._join_writer()  # at most one save is handed over at a time
        self._clear_the_way(step)
        if isinstance(state, Snapshot):  # taken earlier: its seconds were not in t0's span
            self._submit(step, state, meta, force)
            return time.perf_counter() - t0 + state.seconds
        tree, impls = keys_to_data(state)
        snap = self._snapshot(tree, impls, data, t0)
        if snap is not None:
            self._submit(step, snap, meta, force)
            return time.perf_counter() - t0
        args = self._args(step, tree, impls, data, meta,
                          leaf_checksums(tree) if self.checksums else None)
        try:
            with without_wait_notice():
                saved = self._manager.save(step, args=args, force=force)
        except (OSError, ocp.checkpoint_manager.StepAlreadyExistsError) as e:
            raise self._write_error(step, e) from e
        if saved:
            self._pending = step
        return time.perf_counter() - t0

    def _submit(self, step: int, snap: Snapshot, meta: dict[str, Any] | None,
                force: bool) -> None:
        """Hands ``snap`` to the writer thread."""
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="workbench-checkpoint")
        self._submitted = (step, self._writer.submit(self._write, step, snap, meta, force))
        self._pending = step

    def _write(self, step: int, snap: Snapshot, meta: dict[str, Any] | None,
               force: bool) -> bool:
        """The writer thread: the snapshot to host, then Orbax's (async) save."""
        # of the device copy: the same numbers as a restore's
        sums = leaf_checksums(snap.tree) if self.checksums else None
        tree = jax.device_get(snap.tree)  # a private copy: no later step can change it
        args = self._args(step, tree, snap.impls, snap.data, meta, sums)
        with without_wait_notice():
            return self._manager.save(step, args=args, force=force)

    @staticmethod
    def _args(step: int, tree: Any, impls: list[str], data: Any,
              meta: dict[str, Any] | None, sums: dict[str, list[int]] | None
              ) -> ocp.args.Composite:
        facts: dict[str, Any] = {"step": step, "time": time.time(), "key_impls": impls,
                                 **(meta or {})}
        if sums is not None:
            facts["checksums"] = {"algorithm": CHECKSUM_ALGORITHM, "leaves": sums}
        if data is not None and jax.process_count() == 1:
            position = data.get_state()
            facts["data_state"] = position.decode() if isinstance(position, bytes) else position
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(tree),
            "meta": ocp.args.JsonSave(facts),
        }
        if data is not None:
            import grain

            items["data"] = grain.checkpoint.CheckpointSave(data)
        return ocp.args.Composite(**items)

    def _join_writer(self) -> None:
        """Waits until the writer thread has handed its save to Orbax (or failed)."""
        if self._submitted is None:
            return
        step, future = self._submitted
        self._submitted = None
        try:
            saved = future.result()
        except (OSError, ocp.checkpoint_manager.StepAlreadyExistsError) as e:
            self._pending = None
            raise self._write_error(step, e) from e
        except BaseException:
            self._pending = None
            raise
        if not saved and self._pending == step:
            self._pending = None

    def wait(self) -> float:
        """Blocks until background saves are done; returns the seconds waited.

        Raises:
          CheckpointError: the save failed; the previous checkpoint is intact.
        """
        t0 = time.perf_counter()
        self._join_writer()
        try:
            self._manager.wait_until_finished()
        except OSError as e:
            raise self._write_error(self._pending or -1, e) from e
        self.raise_if_failed()
        return time.perf_counter() - t0

    def raise_if_failed(self) -> None:
        """Raises ``CheckpointError`` if the last finished save did not commit."""
        if self._submitted is not None:
            if not self._submitted[1].done():
                return
            self._join_writer()
        step = self._pending
        if step is None or self._manager.is_saving_in_progress():
            return
        self._pending = None
        try:
            self._manager.check_for_errors()
        except Exception as e:  # orbax re-raises the background thread's error
            raise self._write_error(step, e) from e
        if not (self.directory / str(step)).is_dir():  # a commit renames tmp -> "<step>"
            raise self._write_error(step, None)

    def _write_error(self, step: int, error: BaseException | None) -> CheckpointError:
        steps = [s for s in self.all_steps() if s != step]
        prev = f"the previous checkpoint (step {steps[-1]}) is intact" if steps else \
            "no earlier checkpoint exists"
        why = f": {type(error).__name__}: {error}" if error is not None else \
            " (the background write did not commit; see the log for the error)"
        code = getattr(error, "errno", None)
        if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            fix = "free disk space and re-run to continue from it"
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = f"make {self.directory} writable and re-run to continue from it"
        elif isinstance(error, ocp.checkpoint_manager.StepAlreadyExistsError):
            fix = ("another writer saved it meanwhile, or an earlier run left it and this one "
                   f"does not continue from it: stop the other writer, or move {self.directory}"
                   f"/{step} out of the way if it should go, then re-run to continue from the "
                   "newest checkpoint")
        else:
            fix = "fix the error above and re-run to continue from it"
        return CheckpointError(
            f"saving checkpoint step {step} to {self.directory} failed{why}. "
            f"{prev[0].upper()}{prev[1:]}; {fix}")

    # ------------------------------------------------------------------ restore
    def restore(self, target: Any, *, data: Any = None, step: int | None = None) -> Restored:
        """Restores ``step`` (default: the newest good one) onto ``target``, verified.

        Args:
          target: the state's structure: arrays or ``jax.ShapeDtypeStruct`` leaves whose
            shardings say where each block goes (any mesh).
          data: an iterator with ``set_state`` to move to the saved data position.
          step: a specific step; None tries the newest and falls back to older ones.

        A step that cannot be read or fails verification (see the module docstring) is
        skipped for the next older one; once an older step restores, the skipped ones are
        moved aside to ``<directory>/corrupt/`` (not in a read-only ``Checkpoints``) and a
        warning names them, why, where they went and the step restored instead. When none
        restores, only steps whose checksums or data position differ are moved (the others
        may fail because of this machine, not their files).

        Raises:
          CheckpointMismatch: the newest checkpoint holds other shapes than ``target``
            (names the first differing leaf); nothing is moved.
          CheckpointError: no checkpoint exists, or none can be read.
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        abstract_target = jax.tree.map(abstract_key_data, abstract(target))
        failed: list[tuple[int, str, bool]] = []   # (step, why, definitely damaged)
        if step is None:   # newer step names Orbax skips: symlinks to nothing (or loops)
            failed += [(b, "its directory is a symlink that leads to no directory (dangling, "
                           "or a loop)", True) for b in self._broken_links()
                       if b > (steps[0] if steps else -1)]
        for s in steps:
            restored, why, damaged = None, "", False
            try:
                dtypes = self._check_fits(s, abstract_target)
                restored = self._restore_step(s, abstract_target, target, data, dtypes)
            except CheckpointError:  # a mismatch, or the verification itself failed
                raise
            except _Damaged as e:
                why, damaged = str(e), True
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
                why = _reason(e)
            if not _all_agree(restored is not None):
                failed.append((s, why or "another process of this job could not read it",
                               damaged))
                continue
            assert restored is not None
            return self._fell_back(restored, failed)
        raise self._none_restored(failed)

    def _fell_back(self, restored: Restored, failed: list[tuple[int, str, bool]]) -> Restored:
        """An older step restored, so the newer ``failed`` ones are damaged, not the
        environment: they are moved aside and a warning names them."""
        moved = [m for b, w, _ in failed if (m := self._set_aside(b, w)) is not None]
        restored.skipped, restored.set_aside = [(b, w) for b, w, _ in failed], moved
        if failed:
            bad = ", ".join(str(b) for b, _, _ in failed)
            where = (f"moved aside to {', '.join(str(m) for m in moved)} (nothing deleted)"
                     if moved else "left in place (read-only)")
            warnings.warn(
                f"checkpoint step {bad} in {self.directory} is unreadable "
                f"({failed[0][1]}); {where}; restored step {restored.step} instead",
                stacklevel=3)
        return restored

    def _none_restored(self, failed: list[tuple[int, str, bool]]) -> CheckpointError:
        """Nothing restored: only steps that read but failed verification are surely
        damaged and moved aside; the rest stay (the cause may be here: memory, devices, a
        wrong target). The error lists every step and why."""
        moved = [m for b, w, d in failed if d and (m := self._set_aside(b, w)) is not None]
        detail = "; ".join(f"step {s}: {why}" for s, why, _ in failed)
        where = (f" Damaged step(s) were moved aside to {self.directory / CORRUPT_DIR} "
                 "(nothing deleted)." if moved else "")
        return CheckpointError(
            f"no readable checkpoint in {self.directory} ({detail}).{where} If the files are "
            f"damaged, move the step directories out of {self.directory} (nothing is deleted "
            "by Workbench) and start a new run_dir, or restore them from a copy")

    def _broken_links(self) -> list[int]:
        """Step-named entries that are symlinks resolving to no directory, newest first."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted((int(n) for n in names if n.isdigit()
                       and os.path.islink(self.directory / n)
                       and not os.path.isdir(self.directory / n)), reverse=True)

    def set_aside_steps(self) -> list[Path]:
        """Steps moved aside as unreadable or corrupt (``<directory>/corrupt/*``)."""
        folder = self.directory / CORRUPT_DIR
        if not folder.is_dir():
            return []
        return sorted(p for p in folder.iterdir() if p.is_dir())

    def _check_fits(self, step: int, abstract_target: Any) -> dict[str, Any]:
        """Compares the step's array shapes (Orbax's metadata) with the target's; returns
        the saved dtype of each leaf (read as saved, verified, then cast to the target's).

        Raises:
          CheckpointMismatch: the shapes or leaves differ (another model or optimizer).
          _Unusable: the metadata cannot be read.
        """
        from etils import epath

        try:
            md = ocp.StandardCheckpointHandler().metadata(
                epath.Path(self.directory / str(step) / "state"))
            leaves = jax.tree_util.tree_leaves_with_path(md)
            saved = {leaf_name(p): tuple(getattr(m, "shape", ()) or ()) for p, m in leaves}
            dtypes = {leaf_name(p): getattr(m, "dtype", None) for p, m in leaves}
        except Exception as e:
            raise _Unusable(f"its array metadata cannot be read ({_reason(e)})") from e
        if not saved:
            raise _Unusable("its array metadata lists no arrays")
        want = {leaf_name(p): tuple(x.shape)
                for p, x in jax.tree_util.tree_leaves_with_path(abstract_target)}
        diffs = [(n, saved.get(n), shape) for n, shape in want.items() if saved.get(n) != shape]
        diffs += [(n, shape, None) for n, shape in saved.items() if n not in want]
        if not diffs:
            return dtypes
        name, old, new = diffs[0]

        def shape(x: tuple[int, ...] | None, where: str) -> str:
            return f"absent {where}" if x is None else f"{x} {where}"

        more = f" ({len(diffs) - 1} more differ)" if len(diffs) > 1 else ""
        raise CheckpointMismatch(
            f"checkpoint step {step} in {self.directory} does not fit this state: "
            f"{name!r} is {shape(old, 'in the checkpoint')}, {shape(new, 'in this config')}"
            f"{more}. Continuing a run (force=True) keeps its parameters, so their shapes "
            "cannot change: go back to the model and optimizer the run was trained with, or "
            "train the new model in a new run_dir. Nothing was changed")

    def _restore_step(self, step: int, abstract_target: Any, target: Any, data: Any,
                      dtypes: dict[str, Any]) -> Restored:
        def as_saved(path: Any, x: Any) -> Any:
            dt = dtypes.get(leaf_name(path))
            if dt is None or not isinstance(x, jax.ShapeDtypeStruct) or dt == x.dtype:
                return x
            return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)

        read_target = jax.tree_util.tree_map_with_path(as_saved, abstract_target)
        items: dict[str, Any] = {"state": ocp.args.StandardRestore(read_target),
                                 "meta": ocp.args.JsonRestore()}
        if data is not None:
            import grain

            items["data"] = grain.checkpoint.CheckpointRestore(data)
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        if not isinstance(out["meta"], dict):
            raise _Unusable(f"its metadata is a {type(out['meta']).__name__}, not an object")
        meta = dict(out["meta"])
        saved_as = meta.get("step")
        if isinstance(saved_as, int) and not isinstance(saved_as, bool) and saved_as != step:
            raise _Damaged(f"it holds step {saved_as}'s data (its metadata says step "
                           f"{saved_as}), not step {step}'s: a copied or renamed step "
                           "directory")
        self._verify(meta, out["state"], data)
        tree = jax.tree.map(  # the bits as saved were verified; now the target's dtypes
            lambda x, t: x.astype(t.dtype) if hasattr(t, "dtype") and x.dtype != t.dtype
            else x, out["state"], abstract_target)
        state = data_to_keys(tree, target, list(meta.get("key_impls", [])))
        return Restored(step=step, state=state, meta=meta, skipped=[])

    @staticmethod
    def _verify(meta: dict[str, Any], tree: Any, data: Any) -> None:
        """Checks what was read against the checksums and data position recorded at save
        (checkpoints written before checksums existed are not checked)."""
        sums = meta.get("checksums")
        if isinstance(sums, dict) and sums.get("algorithm") == CHECKSUM_ALGORITHM:
            want = sums.get("leaves")
            if not isinstance(want, dict):
                raise _Unusable("its recorded checksums are not readable")
            try:
                got = leaf_checksums(tree)
            except Exception as e:
                raise CheckpointError(f"verifying a checkpoint failed ({_reason(e)}); it was "
                                      "left in place") from e
            bad = [n for n in sorted(set(want) | set(got)) if want.get(n) != got.get(n)]
            if bad:
                raise _Damaged(
                    f"the data of {len(bad)} array(s) differs from what was saved (checksum "
                    f"mismatch, first {bad[0]!r}: saved {want.get(bad[0])}, read "
                    f"{got.get(bad[0])})")
        position = meta.get("data_state")
        if data is not None and isinstance(position, str) and jax.process_count() == 1:
            now = data.get_state()
            try:
                same = json.loads(now) == json.loads(position)
            except ValueError:
                same = False
            if not same:
                raise _Damaged("the data position read back differs from the one recorded "
                                "at save")

    # ------------------------------------------------------------------ set aside
    def _set_aside(self, step: int, why: str) -> Path | None:
        """Moves step ``step``'s directory to ``corrupt/`` (never deletes); its new path."""
        src = self.directory / str(step)
        if self.read_only or not os.path.lexists(src):   # a dangling symlink is moved too
            return None
        folder = self.directory / CORRUPT_DIR
        name, n = str(step), 1
        while (folder / name).exists():
            n += 1
            name = f"{step}-{n}"
        dest = folder / name
        if jax.process_index() == 0:
            folder.mkdir(exist_ok=True)
            os.replace(src, dest)
            (folder / f"{name}.reason.txt").write_text(
                f"checkpoint step {step} moved here from {src} at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {why}\n", encoding="utf-8")
        _barrier(f"workbench-set-aside-{step}")
        self._manager.reload()
        return dest

    def _clear_the_way(self, step: int) -> None:
        """Before saving ``step``: a directory of that name Orbax does not list is moved
        aside; one it lists means another writer saved it (refused with the fix)."""
        path = self.directory / str(step)
        if not os.path.lexists(path):
            return
        if step in self.all_steps() and path.is_dir():
            raise self._write_error(
                step, ocp.checkpoint_manager.StepAlreadyExistsError(
                    f"checkpoint step {step} already exists in {self.directory} and was not "
                    "overwritten"))
        dest = self._set_aside(step, "Orbax does not list it as a checkpoint (a damaged or "
                                     "never-committed step directory)")
        warnings.warn(f"{path} is not a complete checkpoint; moved aside to {dest} before "
                      f"saving step {step} (nothing deleted)", stacklevel=3)

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            self._manager.close()
