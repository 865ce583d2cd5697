"""Checkpoints of a run: one composite Orbax save of state, data position and metadata.

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
half-written checkpoint under a step's name. A checkpoint that is unreadable anyway
(truncated files, missing items) is skipped on restore: the previous one is used and a
warning names both steps. Restoring onto another mesh goes through an abstract target
(``jax.ShapeDtypeStruct`` leaves with shardings): Orbax reads each device's block.

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
import os
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

#: Snapshots (see the module docstring) hold arrays of at most this size: each is saved
#: as one chunk, where larger arrays are better written per shard.
SNAPSHOT_LEAF_BYTES = 8 << 20
#: States up to this size are snapshotted on device and written from a writer thread.
SNAPSHOT_BYTES = 256 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpoints.restore` returns."""

    step: int
    state: Any
    meta: dict[str, Any]
    skipped: list[tuple[int, str]]


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def keys_to_data(tree: Any) -> tuple[Any, list[str]]:
    """Typed PRNG keys -> their ``uint32`` key data; also the implementations, in order."""
    impls: list[str] = []

    def convert(x: Any) -> Any:
        if _is_key(x):
            impls.append(str(jax.random.key_impl(x)))
            return jax.random.key_data(x)
        return x

    return jax.tree.map(convert, tree), impls


def _abstract_key_data(x: Any) -> Any:
    """ShapeDtypeStruct of a key array -> that of its key data (sharding extended)."""
    if not _is_key(x):
        return x
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        extra = (None,) * (len(data.shape) - len(x.shape))
        spec = jax.sharding.PartitionSpec(*sharding.spec, *extra)
        sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def data_to_keys(tree: Any, target: Any, impls: list[str]) -> Any:
    """Inverse of :func:`keys_to_data`: wraps key data where ``target`` has key leaves."""
    it = iter(impls)

    def convert(x: Any, t: Any) -> Any:
        return jax.random.wrap_key_data(x, impl=next(it)) if _is_key(t) else x

    return jax.tree.map(convert, tree, target)


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
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3, every: int = 1,
                 async_save: bool = True, read_only: bool = False) -> None:
        self.directory = Path(directory).absolute()
        self.every = every
        self._async = async_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=every, create=not read_only,
            read_only=read_only, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only)
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
        if isinstance(state, Snapshot):  # taken earlier: its seconds were not in t0's span
            self._submit(step, state, meta, force)
            return time.perf_counter() - t0 + state.seconds
        tree, impls = keys_to_data(state)
        snap = self._snapshot(tree, impls, data, t0)
        if snap is not None:
            self._submit(step, snap, meta, force)
            return time.perf_counter() - t0
        args = self._args(step, tree, impls, data, meta)
        try:
            saved = self._manager.save(step, args=args, force=force)
        except OSError as e:
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
        tree = jax.device_get(snap.tree)  # a private copy: no later step can change it
        args = self._args(step, tree, snap.impls, snap.data, meta)
        return self._manager.save(step, args=args, force=force)

    @staticmethod
    def _args(step: int, tree: Any, impls: list[str], data: Any,
              meta: dict[str, Any] | None) -> ocp.args.Composite:
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(tree),
            "meta": ocp.args.JsonSave({"step": step, "time": time.time(),
                                       "key_impls": impls, **(meta or {})}),
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
        except OSError as e:
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
        return CheckpointError(
            f"saving checkpoint step {step} to {self.directory} failed{why}. {prev[0].upper()}{prev[1:]}; "
            "free disk space (or fix the error) and re-run to continue from it")

    # ------------------------------------------------------------------ restore
    def restore(self, target: Any, *, data: Any = None, step: int | None = None) -> Restored:
        """Restores ``step`` (default: the newest readable one) onto ``target``.

        Args:
          target: the state's structure: arrays or ``jax.ShapeDtypeStruct`` leaves whose
            shardings say where each block goes (any mesh).
          data: an iterator with ``set_state`` to move to the saved data position.
          step: a specific step; None tries the newest and falls back to older ones,
            warning which step was unreadable and which one was used.

        Raises:
          CheckpointError: no checkpoint exists, or none can be read.
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        abstract_target = jax.tree.map(_abstract_key_data, abstract(target))
        skipped: list[tuple[int, str]] = []
        for s in steps:
            try:
                restored = self._restore_step(s, abstract_target, target, data)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
                skipped.append((s, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
                continue
            if skipped:
                bad = ", ".join(str(b) for b, _ in skipped)
                warnings.warn(
                    f"checkpoint step {bad} in {self.directory} is unreadable "
                    f"({skipped[0][1]}); restored step {s} instead", stacklevel=2)
            restored.skipped = skipped
            return restored
        detail = "; ".join(f"step {s}: {why}" for s, why in skipped)
        raise CheckpointError(f"no readable checkpoint in {self.directory} ({detail})")

    def _restore_step(self, step: int, abstract_target: Any, target: Any,
                      data: Any) -> Restored:
        items: dict[str, Any] = {"state": ocp.args.StandardRestore(abstract_target),
                                 "meta": ocp.args.JsonRestore()}
        if data is not None:
            import grain

            items["data"] = grain.checkpoint.CheckpointRestore(data)
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        meta = dict(out["meta"])
        state = data_to_keys(out["state"], target, list(meta.get("key_impls", [])))
        return Restored(step=step, state=state, meta=meta, skipped=[])

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            self._manager.close()
