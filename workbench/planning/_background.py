"""A plan's compile in a worker process (``wb.plan(wait=False)``): the formula's plan is
returned at once and turns into the compiler's when the worker's answer lands.

The worker (``python -m workbench.planning._worker``) rebuilds the plan's abstract step
from the call's own arguments (the config or factory, the mesh, the rules, the options:
pickled with cloudpickle, each JAX device sent as its platform and id and looked up among
the worker's devices), compiles it as a blocking plan does (``_measure.compile_outcome``),
and sends back what a plan reads of the executable (memory, cost analysis, optimised HLO:
``_plan_record.make_record``). The TPU compiler's memory and threads stay in the worker;
a compile for an abstract TPU slice writes the plan cache's record there, which a
blocking plan (or another worker) reads later. At most ``os.cpu_count()`` workers compile
at once; more wait for a slot. Devices of another platform at hand (a GPU or TPU the
kernel holds) cannot be opened by a second process: their compile runs in a thread of
this process instead, and cancelling it only stops waiting.
"""
from __future__ import annotations

import atexit
import dataclasses
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from workbench.planning._compile import StoredExecutable
from workbench.planning._measure import CompileOutcome, Target

__all__ = ["Background", "Live", "Request", "dumps", "loads", "slots"]

#: Workers compiling at once (the rest wait for a slot): one per core.
_SLOTS = threading.BoundedSemaphore(os.cpu_count() or 1)
#: Seconds between checks of a running worker (and of a cancel).
_POLL = 0.1
#: Characters of a dead worker's stderr quoted in its error.
_TAIL = 1500


#: Worker processes running now: killed when this process exits (atexit), so that no
#: compile outlives the kernel or script that asked for it.
_RUNNING: set[subprocess.Popen] = set()


def _kill_running() -> None:
    for proc in list(_RUNNING):
        if proc.poll() is None:
            proc.kill()


def slots() -> int:
    """How many background compiles run side by side (the cores of this machine)."""
    return os.cpu_count() or 1


# -- the request and the answer across the process boundary ------------------------------

class _Pickler:
    """cloudpickle with each ``jax.Device`` as ``(platform, id)`` (devices do not pickle)."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        import cloudpickle

        class P(cloudpickle.Pickler):
            def persistent_id(self, o: Any) -> Any:
                if isinstance(o, jax.Device):
                    return ("jax.Device", o.platform, int(o.id))
                return None

        buf = io.BytesIO()
        P(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buf.getvalue()


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        _, platform, ident = pid
        devices = {int(d.id): d for d in jax.devices(platform)}
        if ident not in devices:
            raise RuntimeError(
                f"the worker process sees {len(devices)} {platform} device(s) (ids "
                f"{sorted(devices)[:8]}...), not device {ident} of the plan's mesh: start "
                "the kernel with the device count in XLA_FLAGS (wb.simulate_devices(n) sets "
                "it) so that processes it starts see the same devices")
        return devices[ident]


def dumps(obj: Any) -> bytes:
    return _Pickler.dumps(obj)


def loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """What the worker rebuilds the step from: ``stages.resolve``'s arguments, as
    ``wb.plan`` gave them (the mesh resolved: a ``jax.sharding.Mesh`` or ``MeshInfo``)."""

    model: Any
    resolve: dict[str, Any]


def answer_of(out: CompileOutcome) -> dict[str, Any]:
    """The worker's answer: the outcome without its executable and mesh (the target's
    compile, source and reason; what a plan reads of the executable as a record)."""
    from workbench.planning._plan_record import make_record

    compiled, record = out.compiled, None
    if isinstance(compiled, StoredExecutable):
        record = compiled._record
    elif compiled is not None:
        record = make_record("", compiled, out.seconds)
    return {"compile": out.target.compile, "source": out.target.source,
            "reason": out.target.reason, "record": record, "seconds": out.seconds,
            "cached": out.cached, "memory": out.memory, "collectives": out.collectives,
            "retried": out.retried, "extra_options": out.extra_options}


def outcome_of(answer: dict[str, Any], target: Target) -> CompileOutcome:
    """The worker's answer as the ``CompileOutcome`` of this process's ``target``."""
    record = answer["record"]
    return CompileOutcome(
        target=dataclasses.replace(target, compile=answer["compile"], source=answer["source"],
                                   reason=answer["reason"]),
        compiled=StoredExecutable(record) if record is not None else None,
        seconds=answer["seconds"], cached=answer["cached"], memory=answer["memory"],
        collectives=answer["collectives"], retried=answer["retried"],
        extra_options=answer["extra_options"])


# -- one background compile -------------------------------------------------------------------

class Background:
    """One plan's compile running elsewhere: ``state`` is "queued" (waiting for a slot),
    "compiling", "compiled", "failed" or "cancelled"; ``error`` the failure.

    Args:
        label: what is compiled ("wb.plan('fsdp')"), for messages.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.state = "queued"
        self.error: BaseException | None = None
        self.started = time.time()
        self.seconds = 0.0
        self.pid: int | None = None
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._changed: Callable[[], None] = lambda: None
        #: called by ``cancel`` (a search cancels the plans it is waiting on)
        self.on_cancel: Callable[[], None] | None = None
        #: the thread that runs the compile and lands it (``start``)
        self.thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def start(self, run: Callable[[Background], CompileOutcome],
              land: Callable[[CompileOutcome], None], changed: Callable[[], None]) -> None:
        """Run ``run`` (``in_worker`` or ``in_thread``) in a daemon thread, then ``land``
        its outcome there (builds and swaps in the compiled plan; an error it raises fails
        the compile); ``changed`` is called on every change of state."""
        self._changed = changed

        def main() -> None:
            try:
                out = run(self)
                if not self._cancel.is_set():
                    land(out)
                    self.seconds = time.time() - self.started
                    self.mark("compiled")
            except BaseException as err:  # noqa: BLE001 - kept for wait() to raise
                if not self._cancel.is_set():
                    self.error = err
                    self.mark("failed")
            finally:
                self.seconds = time.time() - self.started
                self._done.set()
                self._changed()

        self.thread = threading.Thread(target=main, name=f"workbench-background {self.label}",
                                       daemon=True)
        self.thread.start()

    def mark(self, state: str) -> None:
        """Set ``state`` (unless cancelled) and tell the watchers."""
        if self.state != "cancelled":
            self.state = state
            self._changed()

    def cancel(self) -> None:
        """Stop the compile: its worker process is killed (a thread's compile is left to
        finish unseen)."""
        if self.done:
            return
        self._cancel.set()
        self.state = "cancelled"
        if self.on_cancel is not None:
            self.on_cancel()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._done.set()
        self._changed()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the compile is in, failed or cancelled; True when it is done.
        ``KeyboardInterrupt`` (Ctrl-C, a kernel interrupt) cancels it."""
        try:
            end = None if timeout is None else time.monotonic() + timeout
            while not self._done.wait(_POLL):
                if end is not None and time.monotonic() >= end:
                    return False
        except KeyboardInterrupt:
            self.cancel()
            raise
        return True

    # -- the two ways to run ---------------------------------------------------------------

    def in_worker(self, request: Request, target: Target) -> CompileOutcome:
        """The request compiled by a worker process (in a slot): its answer as the
        outcome of ``target``."""
        while not _SLOTS.acquire(timeout=_POLL):
            if self._cancel.is_set():
                raise _Cancelled
        try:
            return outcome_of(self._worker(request), target)
        finally:
            _SLOTS.release()

    def _worker(self, request: Request) -> dict[str, Any]:
        folder = Path(tempfile.mkdtemp(prefix="wb-plan-"))
        try:
            (folder / "request.pkl").write_bytes(dumps(request))
            with open(folder / "stderr.txt", "wb") as err:
                if self._cancel.is_set():
                    raise _Cancelled
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "workbench.planning._worker", str(folder)],
                    stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                    start_new_session=True)   # Ctrl-C in a terminal reaches us, not it
                self.pid = self._proc.pid
                if not _RUNNING:   # registered once it matters (importing has no effects)
                    atexit.unregister(_kill_running)
                    atexit.register(_kill_running)
                _RUNNING.add(self._proc)
                self.mark("compiling")
                while self._proc.poll() is None:
                    if self._cancel.wait(_POLL):
                        raise _Cancelled
            answer_file = folder / "answer.pkl"
            if self._proc.returncode != 0 or not answer_file.is_file():
                raise self._died(self._proc.returncode, folder / "stderr.txt")
            answer = pickle.loads(answer_file.read_bytes())
            if "error" in answer:
                raise _raised(answer["error"], self.label)
            return answer
        finally:
            proc = self._proc
            if proc is not None and proc.poll() is None:   # cancelled: the worker goes
                proc.kill()
                proc.wait()
            _RUNNING.discard(proc)
            shutil.rmtree(folder, ignore_errors=True)

    def in_thread(self, compile: Callable[[], CompileOutcome]) -> CompileOutcome:
        """``compile()`` in this thread (devices a second process cannot open), in a
        slot."""
        while not _SLOTS.acquire(timeout=_POLL):
            if self._cancel.is_set():
                raise _Cancelled
        try:
            self.mark("compiling")
            return compile()
        finally:
            _SLOTS.release()

    def _died(self, code: int | None, stderr: Path) -> RuntimeError:
        """The error of a worker that ended without an answer (killed, out of memory)."""
        tail = stderr.read_text(errors="replace")[-_TAIL:].strip() if stderr.is_file() else ""
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            how = f"was killed by signal {-code} ({name}" + (
                ": the kernel's out-of-memory killer ends processes so" if name == "SIGKILL"
                else "") + ")"
        else:
            how = f"exited with status {code} without an answer"
        return RuntimeError(
            f"{self.label}: the background compile's worker process (pid {self.pid}) {how} "
            f"after {time.time() - self.started:.0f} s"
            + (f"; its last output:\n{tail}\n" if tail else "; it printed nothing. ")
            + "The plan keeps the formula's numbers (plan.memory, plan.predicted are usable); "
            "plan again with wait=False to retry, or wait=True to compile in this process")


class _Cancelled(Exception):
    """The compile was cancelled before it was in (not an error of the plan)."""


def _raised(error: dict[str, str], label: str) -> BaseException:
    """The worker's exception raised here: a ValueError or TypeError as itself (what the
    user gave wrong), anything else as a RuntimeError naming it; with its traceback."""
    kind = {"ValueError": ValueError, "TypeError": TypeError}.get(error["type"], RuntimeError)
    what = "" if kind is not RuntimeError else f"{error['type']}: "
    return kind(f"{label} (compiled in a background worker): {what}{error['message']}"
                f"\n\nin the worker:\n{error['traceback'][-_TAIL:]}")


class Live:
    """What a result with a background compile has (``Plan`` of ``wb.plan(wait=False)``,
    ``SearchResult`` of ``wb.search(wait=False)``): its state, ``ready``, ``cancel()``, and
    the views watching it (redrawn on every change)."""

    @property
    def compile_state(self) -> str | None:
        """None when made whole at once (``wait=True``, or nothing to compile); else
        "queued" (waiting for a free core), "compiling", "compiled" (the compiler's
        numbers are in), "failed" (``wait()`` raises why) or "cancelled"."""
        bg = self.__dict__.get("_background")
        return None if bg is None else bg.state

    @property
    def ready(self) -> bool:
        """Whether ``wait()`` returns at once: nothing is compiling (the compiler's
        numbers are in, or the compile failed or was cancelled)."""
        bg = self.__dict__.get("_background")
        return bg is None or bg.done

    def cancel(self) -> None:
        """Stop the background compile (worker processes are killed); what is in stays,
        the rest keeps the formula's numbers. Nothing happens to a result that is whole."""
        bg = self.__dict__.get("_background")
        if bg is not None:
            bg.cancel()

    def _wait(self, timeout: float | None, where: str) -> None:
        from workbench._validate import check_float

        if timeout is not None:
            timeout = check_float(timeout, "timeout", where=f"{where}: ", minimum=0,
                                  example="timeout=60")
        bg = self.__dict__.get("_background")
        if bg is None:
            return
        if not bg.wait(timeout):
            raise TimeoutError(f"{where}(timeout={timeout}): {bg.label} is still "
                               f"{bg.state} after {timeout} s; wait again, or cancel()")
        if bg.state == "failed":
            raise bg.error
        if bg.state == "cancelled":
            raise RuntimeError(f"{bg.label}: the background compile was cancelled; what was "
                               "not compiled keeps the formula's numbers (run it again to "
                               "compile)")

    def _start(self, bg: Background, run: Callable[[Background], Any],
               land: Callable[[Any], None]) -> None:
        object.__setattr__(self, "_background", bg)
        bg.start(run, land, self._notify)

    def _watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (held weakly when it is a bound method: a view's) whenever
        the background compile changes something."""
        import weakref

        ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else \
            (lambda: callback)
        self.__dict__.setdefault("_watchers", []).append(ref)

    def _notify(self) -> None:
        for ref in list(self.__dict__.get("_watchers", [])):
            fn = ref()
            if fn is not None:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a closed view must not stop the compile
                    pass
