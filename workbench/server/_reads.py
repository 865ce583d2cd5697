"""The server's blocking file reads, off the event loop and bounded: at most ``workers`` run
at once, and a request waits at most ``timeout`` seconds for a free worker and at most
``timeout`` seconds for its read.

Files are opened by the one safe reader (``workbench._run_file``: regular files only, never
blocking), so a read should never hang; this is the second wall, for what no check can
rule out (a stalled network filesystem, a read of a huge metrics file). A read that
overruns its time keeps its worker until it ends (a thread cannot be stopped), so stalled
reads fill at most ``workers`` threads and later requests answer 503 in ``timeout``
seconds instead of queueing forever behind them; asyncio's default executor, shared with
the rest of the server, is never used.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Reads", "ReadsBusy"]


class ReadsBusy(Exception):
    """A read did not finish (or start) within the time allowed; the message says which
    and what to do."""


class Reads:
    """A bounded pool for the server's file reads.

    Args:
      workers: reads that run at once (threads of the pool).
      timeout: seconds a request waits for a free worker, and then for its read.
    """

    def __init__(self, workers: int = 8, timeout: float = 10.0) -> None:
        if workers < 1 or not timeout > 0:
            raise ValueError(f"Reads(workers={workers}, timeout={timeout}): both must be "
                             "positive")
        self.workers = workers
        self.timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="workbench-read")
        self._slots: asyncio.Semaphore | None = None   # made on the loop that uses it
        self.running = 0   # reads running now (stalled ones included)

    async def run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the pool (:meth:`start`, then :meth:`wait`)."""
        return await self.wait(what, await self.start(what, fn, *args))

    async def start(self, what: str, fn: Callable[..., T], *args: Any
                    ) -> concurrent.futures.Future[T]:
        """Starts ``fn(*args)`` once a slot is free; raises :class:`ReadsBusy` (``what``
        names the read) when none frees up within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        slots = self._slots
        try:
            await asyncio.wait_for(slots.acquire(), self.timeout)
        except asyncio.TimeoutError:
            raise ReadsBusy(self._busy(what, "waited")) from None
        self.running += 1

        def done(_: Any) -> None:   # the slot frees when the read ends, not when we stop waiting
            try:
                loop.call_soon_threadsafe(self._release, slots)
            except RuntimeError:   # the loop is closed: nobody waits for the slot
                pass

        try:
            fut = self._pool.submit(fn, *args)
        except BaseException:
            self._release(slots)
            raise
        fut.add_done_callback(done)
        return fut

    async def wait(self, what: str, fut: concurrent.futures.Future[T]) -> T:
        """The result of a started read; raises :class:`ReadsBusy` when it does not
        finish within ``timeout`` seconds (the read goes on in its thread)."""
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)),
                                          self.timeout)
        except asyncio.TimeoutError:
            raise ReadsBusy(self._busy(what, "ran")) from None

    def _release(self, slots: asyncio.Semaphore) -> None:
        self.running -= 1
        slots.release()

    def _busy(self, what: str, how: str) -> str:
        return (f"{what} {how} longer than {self.timeout:g} s ({self.running} of "
                f"{self.workers} file reads are running; a file system that stalls?); try "
                "again, or raise c.WorkbenchExtension.read_timeout")

    def close(self) -> None:
        """Stops taking reads (running ones finish in their threads)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
