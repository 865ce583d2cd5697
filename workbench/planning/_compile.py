"""Compiling a plan's step: in a background thread, with progress, Ctrl-C and a cache.

A 7B step compiles for minutes on a laptop (the TPU compiler included). ``compile_lowered``

* shows what is being compiled and the elapsed time (one line updated in place in a
  notebook; a line every ``REPORT_EVERY`` seconds on stderr elsewhere);
* keeps the kernel responsive: XLA compiles in a worker thread, the caller waits in short
  slices, so Ctrl-C (a ``KeyboardInterrupt``) returns at once. The compile itself cannot be
  cancelled; it finishes in the background and the next identical request picks it up;
* caches executables (and compile errors, such as the TPU compiler's out-of-memory
  verdict) in this process by the lowered program's fingerprint (its StableHLO
  text) and the devices it is compiled for: the same plan again is instant;
* across processes, for compile-only TPU devices (an abstract TPU slice), keeps what a
  plan reads of the executable (memory and cost analysis, the optimized HLO text) on disk
  under ``<cache_root>/plans/`` (``persist=True``): JAX's persistent compilation cache
  stores these executables but cannot load them back without a TPU client ("PjRtCompiler
  must be constructed with a Client"), so it is no help there. A fresh compile is handed
  back as that record too (``StoredExecutable``): its HLO text is printed once per plan.
  A record is believed only when its key, checksum, types and ranges hold
  (``_plan_record``); else the step compiles again and the record is replaced.
  Executables for real devices use JAX's persistent cache where the Trainer enabled it.
"""
from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import json
import re
import threading
import time
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from workbench._cache import doubted
from workbench.planning._plan_record import (load_record, make_record, record_key,
                                             record_path, store_record)

__all__ = ["CompileResult", "StoredExecutable", "clear_cache", "compile_lowered",
           "fingerprint", "one_tracer"]

REPORT_EVERY = 10.0          # seconds between progress lines outside a notebook
_MAX_ENTRIES = 32            # executables kept (they hold their HLO; a 7B one is ~10 MB)
_LOCK = threading.Lock()
_CACHE: OrderedDict[str, concurrent.futures.Future] = OrderedDict()


class CompileResult:
    """A compiled executable, how long it took, and whether it came from the cache."""

    __slots__ = ("compiled", "seconds", "cached")

    def __init__(self, compiled: Any, seconds: float, cached: bool) -> None:
        self.compiled, self.seconds, self.cached = compiled, seconds, cached


#: A Mosaic (Pallas TPU) kernel inside the lowered program: base64 MLIR bytecode in the
#: tpu_custom_call's backend config (``\\22`` is the text's escaped quote).
_KERNEL_BODY = re.compile(r'(\\22body\\22: \\22)([A-Za-z0-9+/=]+)(\\22)')
#: The kernel's source locations, which JAX 0.12 ships beside its body as bytecode of their
#: own (file paths of JAX's install): left out of the key whole.
_KERNEL_LOCATIONS = re.compile(r'(\\22debug_locations\\22: \\22)[A-Za-z0-9+/=]+(\\22)')


def _program_text(lowered: Any) -> str:
    """The lowered program's text without source locations (as JAX prints it), each Mosaic
    kernel's body replaced by the hash of its own text without locations. The bytecode
    JAX embeds for a kernel keeps the file paths of the code that traced it (the splash
    kernel's, in JAX's install), so the same kernel installed elsewhere (another venv,
    another checkout) would otherwise be another program to the cache."""
    text = lowered.as_text()
    if "tpu_custom_call" not in text:
        return text
    text = _KERNEL_LOCATIONS.sub(r"\1\2", text)
    return _KERNEL_BODY.sub(lambda m: m.group(1) + _kernel_digest(m.group(2)) + m.group(3),
                            text)


def _kernel_digest(body: str) -> str:
    """SHA-256 of a Mosaic kernel's MLIR printed without locations; of ``body`` itself if
    it cannot be read (a key that only depends on where JAX is installed)."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib import tpu
        from jax._src.lib.mlir import ir

        ctx = mlir.make_ir_context()
        tpu.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(base64.b64decode(body), context=ctx)
        text = module.operation.get_asm(enable_debug_info=False)
    except Exception:  # noqa: BLE001 - any failure only costs a cache hit
        text = body
    return "kernel-" + hashlib.sha256(text.encode()).hexdigest()


def fingerprint(lowered: Any, devices: Any, options: dict[str, Any] | None = None) -> str:
    """Cache key: the lowered program's text plus the platform, kind and id of every
    device in mesh order (the same program for a TPU slice and for CPU devices differs),
    and the compile options (overlap flags) when there are any."""
    h = hashlib.sha256(_program_text(lowered).encode())
    if options:
        h.update(json.dumps(options, sort_keys=True, default=str).encode())
    for d in devices:
        h.update(f"{d.platform}/{d.device_kind}/{d.id}/{getattr(d, 'slice_index', 0)};"
                 .encode())
    return h.hexdigest()


class StoredExecutable:
    """What a plan reads of a compile-only executable, as stored in the plan cache on disk
    (or just compiled): ``memory_analysis()``, ``cost_analysis()`` and ``as_text()`` answer
    as the executable did. It cannot run (neither can a compile-only TPU executable)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self._record = record

    def memory_analysis(self) -> Any:
        return types.SimpleNamespace(**self._record["memory"])

    def cost_analysis(self) -> dict[str, float]:
        return dict(self._record["cost"])

    def as_text(self) -> str:
        return self._record["hlo"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this executable was compiled for TPU devices that are not here "
                           "(an abstract slice); it can be inspected, not run")


def _disk_load(key: str) -> tuple[tuple[StoredExecutable, float] | None, str]:
    """``((executable, seconds), "")`` from the plan cache on disk, ``(None, "")`` when
    it has none, ``(None, why)`` when its record is not believed (``_plan_record``)."""
    record, why = load_record(record_key(key))
    if record is None:
        return None, why
    return (StoredExecutable(record), float(record.get("seconds", 0.0))), ""


def _disk_store(key: str, compiled: Any, seconds: float, doubt: str) -> StoredExecutable:
    """Write what a plan reads of ``compiled`` to the plan cache; returns it as the
    ``StoredExecutable`` a later process would load. ``doubt``: why the record there was
    not used (it is replaced, and a ``CacheWarning`` says so)."""
    record = make_record(record_key(key), compiled, seconds)
    failed = store_record(record)
    if doubt:
        doubted(record_path(record["key"]), doubt, "the step was compiled again and "
                + (f"the record could not be replaced ({failed}): remove it" if failed
                   else "the record replaced"), stacklevel=2)
    return StoredExecutable(record)


def clear_cache() -> None:
    """Forget every cached executable of this process (running compiles finish unseen)."""
    with _LOCK:
        _CACHE.clear()


def _submit(key: str, lowered: Any, persist: bool, extra: dict[str, Any] | None = None
            ) -> tuple[concurrent.futures.Future, bool]:
    with _LOCK:
        fut = _CACHE.get(key)
        if fut is not None:  # done, failed (compile errors are deterministic) or running
            _CACHE.move_to_end(key)
            return fut, True
        fut = concurrent.futures.Future()
        _CACHE[key] = fut
        while len(_CACHE) > _MAX_ENTRIES:
            _CACHE.popitem(last=False)

    def work() -> None:
        t0 = time.perf_counter()
        try:
            if persist:
                stored, doubt = _disk_load(key)
                if stored is not None:
                    fut.set_result((*stored, True))
                    return
                with warnings.catch_warnings():
                    # JAX's own cache (if on) cannot read compile-only executables back
                    warnings.filterwarnings(
                        "ignore", message="Error reading persistent compilation cache")
                    compiled = lowered.compile(extra or None)
                # the same record a later process loads: one answer either way
                compiled = _disk_store(key, compiled, time.perf_counter() - t0, doubt)
            else:
                compiled = lowered.compile(extra or None)
        except MemoryError as err:  # the host ran short: another try may succeed
            with _LOCK:
                if _CACHE.get(key) is fut:
                    del _CACHE[key]
            fut.set_exception(err)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
            fut.set_exception(err)
            return
        fut.set_result((compiled, time.perf_counter() - t0, False))

    threading.Thread(target=work, name="workbench-compile", daemon=True).start()
    return fut, False


#: ``on_wait``: called when this thread's compile starts waiting on the compiler
#: (``one_tracer``). Per thread, not a context variable: the trace context
#: (``workbench._sharding.tracing``) is the package's one context variable.
_THREAD = threading.local()


@contextlib.contextmanager
def one_tracer(lock: threading.Lock) -> Iterator[None]:
    """Hold ``lock`` while this thread plans (traces and lowers) until its compile starts:
    ``compile_lowered`` releases it then, so the next thread traces while the compiler
    runs (``wb.search(workers=)``). Threads tracing at once lower slightly different
    programs (constants numbered in another order: another cache key, another compile),
    so only the compilers run in parallel."""
    lock.acquire()
    held = [True]

    def release() -> None:
        if held[0]:
            held[0] = False
            lock.release()

    before = getattr(_THREAD, "on_wait", None)
    _THREAD.on_wait = release
    try:
        yield
    finally:
        _THREAD.on_wait = before
        release()


def compile_lowered(lowered: Any, devices: Any, *, what: str,
                    status: Callable[[str], Callable[[str], None]] | None,
                    in_place: bool = False, persist: bool = False,
                    options: dict[str, Any] | None = None,
                    extra: dict[str, Any] | None = None) -> CompileResult:
    """Compile ``lowered`` (a ``jax.stages.Lowered``) for ``devices`` with progress.

    Args:
      lowered: the lowered step.
      devices: the mesh's devices, in order (part of the cache key).
      what: the progress text's subject ("wb.plan('fsdp'): the train step on ...").
      status: ``workbench._display.status_line`` or None for silence.
      in_place: the status line is updated in place (a notebook): show the elapsed time
        every second; else every ``REPORT_EVERY`` seconds.
      persist: keep the result in the plan cache on disk and look there first (for
        compile-only devices; the result is then a ``StoredExecutable``).
      options: the compile options ``lowered`` carries (from ``jax.jit(compiler_options=)``),
        part of the cache key.
      extra: compile options added to those ``lowered`` carries for this compile
        (``lowered.compile(extra)``: a retry with an option that avoids a compiler
        failure, ``measure.RETRY_OPTIONS``); part of the cache key.

    Raises:
      KeyboardInterrupt: Ctrl-C while waiting; the compile goes on in the background and a
        later identical call returns its result.
      Exception: whatever the compiler raised.
    """
    t0 = time.perf_counter()
    key = fingerprint(lowered, devices, {**(options or {}), **(extra or {})})
    fut, cached = _submit(key, lowered, persist, extra)
    if cached and fut.done() and fut.exception() is None:
        compiled, seconds, _ = fut.result()
        if status is not None:
            status(f"{what}: compiled before in this process ({seconds:.1f} s then); "
                   "reused")
        return CompileResult(compiled, 0.0, True)
    on_wait = getattr(_THREAD, "on_wait", None)
    if on_wait is not None:   # another thread may trace while the compiler runs
        on_wait()
    update = status(f"{what}: compiling" + (" (already running in the background)"
                                            if cached else "") + "...") \
        if status is not None else None
    every = 1.0 if in_place else REPORT_EVERY
    last = t0
    try:
        while True:
            try:
                compiled, seconds, from_disk = fut.result(timeout=0.25)
                break
            except concurrent.futures.TimeoutError:
                now = time.perf_counter()
                if update is not None and now - last >= every:
                    last = now
                    update(f"{what}: compiling... {now - t0:.0f} s (Ctrl-C stops waiting)")
    except KeyboardInterrupt:
        if update is not None:
            update(f"{what}: interrupted after {time.perf_counter() - t0:.0f} s; the "
                   "compile finishes in the background and the same call again picks it up")
        raise
    except Exception:
        if update is not None:
            update(f"{what}: compilation failed after {time.perf_counter() - t0:.1f} s")
        raise
    elapsed = time.perf_counter() - t0
    if from_disk:
        if update is not None:
            update(f"{what}: loaded from the plan cache ({seconds:.1f} s to compile then)")
        return CompileResult(compiled, 0.0, True)
    if update is not None:
        update(f"{what}: compiled in {elapsed:.1f} s")
    return CompileResult(compiled, elapsed, cached)
