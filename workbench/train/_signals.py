"""Ctrl-C and SIGTERM during training: ask the run loop to stop at the next step boundary.

While :class:`StopSignals` is active (the main thread only), the first SIGINT (Ctrl-C,
or a Jupyter kernel interrupt) and SIGTERM (preemption, ``kill``, a job scheduler) only
set a flag; the run loop finishes the step it is in, saves a checkpoint, waits for the
save and returns. A second Ctrl-C raises ``KeyboardInterrupt`` at once, as usual. The
previous handlers are restored on exit.

Across processes (after ``jax.distributed.initialize``) every process must stop at the
same step, or their collectives would hang: SIGTERM is then left to JAX's preemption
notifier and :meth:`StopSignals.should_stop` asks JAX's preemption sync point, which
agrees on one step across all processes.
"""
from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any, Self

_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class StopSignals:
    """Context manager turning SIGINT/SIGTERM into a stop request checked between steps.

    Attributes:
      signal: the name of the first signal received ("SIGINT", "SIGTERM") or None.
    """

    def __init__(self, *, message: bool = True, distributed: bool = False) -> None:
        self.signal: str | None = None
        self.distributed = distributed
        self._message = message
        self._previous: dict[int, Any] = {}

    def should_stop(self, step: int) -> bool:
        """Whether to stop after ``step`` (the same answer on every process)."""
        if self.distributed:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.request("SIGTERM")
                return True
            return False
        return self.requested

    @property
    def requested(self) -> bool:
        """True once a stop was requested."""
        return self.signal is not None

    def request(self, name: str = "request") -> None:
        """Asks for a stop programmatically (as a signal would)."""
        if self.signal is None:
            self.signal = name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = _NAMES.get(signum, str(signum))
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now, without a final save
        self.request(name)
        if self._message:
            hint = " (press Ctrl-C again to abort without saving)" \
                if signum == signal.SIGINT else ""
            print(f"\n{name} received: stopping after this step and saving a checkpoint"
                  f"{hint}", file=sys.stderr, flush=True)

    def __enter__(self) -> Self:
        # Across processes JAX's preemption notifier owns SIGTERM; no local handlers.
        if not self.distributed and threading.current_thread() is threading.main_thread():
            for signum in _NAMES:
                try:
                    self._previous[signum] = signal.signal(signum, self._handle)
                except (ValueError, OSError):  # e.g. an embedded interpreter
                    pass
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
