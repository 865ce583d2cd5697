"""Joining a job within a stated bound: the coordinator's address checked, the wait shown.

``jax.distributed.initialize`` blocks until every process of the job has registered with
the coordinator (process 0). When the coordinator never answers, JAX (0.10) retries for
``initialization_timeout`` seconds in silence, then *aborts the process from C++* (a
``Check failure stack trace``, exit status 134): no Python exception to catch, nothing
said about what it waited for. So the bound is enforced here, from the outside: while
``initialize`` waits (it releases the GIL), a watchdog thread says what the process
waits for, repeats it every few seconds with what a TCP connect to the coordinator's
port finds, and at the bound prints what to check and ends the process with
``EXIT_JOIN_TIMEOUT`` (``os._exit``: the main thread is inside C++ and cannot be
interrupted). JAX is given a longer timeout (``JAX_MARGIN_S`` more), so its own abort
never comes first.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["DEFAULT_INITIALIZATION_TIMEOUT", "EXIT_JOIN_TIMEOUT", "JAX_MARGIN_S",
           "REPEAT_S", "parse_address", "watch"]

#: Seconds a process waits for the job to form (JAX's own default, 5 minutes: the
#: processes of a cluster job may start minutes apart).
DEFAULT_INITIALIZATION_TIMEOUT = 300
#: Exit status of a process that gave up joining (EX_UNAVAILABLE).
EXIT_JOIN_TIMEOUT = 69
#: JAX's own timeout is the bound plus this, so the watchdog always ends the wait first.
JAX_MARGIN_S = 30
#: Seconds between two "still waiting" lines.
REPEAT_S = 5.0

_FIX = "give HOST:PORT of process 0's coordinator, e.g. 10.0.0.1:12345 or [::1]:12345"


def parse_address(address: object, name: str = "coordinator") -> tuple[str, int]:
    """``(host, port)`` of a ``HOST:PORT`` address (IPv6 as ``[addr]:PORT``).

    Raises:
      TypeError: not a string.
      ValueError: no port, an empty host, a port outside 1..65535, a bare IPv6 address;
        the message names the value and the fix.
    """
    if not isinstance(address, str):
        raise TypeError(f"{name}={address!r} is a {type(address).__name__}; {_FIX}")
    bracketed = re.fullmatch(r"\[([0-9A-Fa-f:.%\w]+)\](?::(.*))?", address)
    if bracketed:
        host, port = f"[{bracketed.group(1)}]", bracketed.group(2)
    elif address.startswith("["):
        raise ValueError(f"{name}={address!r}: an IPv6 address needs its closing ']'; {_FIX}")
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            host, port = address, None
        elif ":" in host:
            raise ValueError(f"{name}={address!r}: write an IPv6 address in brackets, "
                             f"[{host}]:{port}; {_FIX}")
    if port is None:
        raise ValueError(f"{name}={address!r} has no port; {_FIX}")
    if not host or any(c.isspace() for c in address):
        raise ValueError(f"{name}={address!r} has no host (or holds a space); {_FIX}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        why = (" (port 0 would let the system pick one, which the other processes cannot "
               "know)") if port.isdigit() and int(port) == 0 else ""
        raise ValueError(f"{name}={address!r}: port {port!r} is not a port number from 1 to "
                         f"65535{why}; {_FIX}")
    return host, int(port)


def _say(msg: str) -> None:
    print(f"[workbench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _probe(address: str | None) -> str:
    """What a TCP connect to ``address`` finds, in words (one second at most)."""
    if address is None:
        return "the address comes from the cluster environment"
    host, port = parse_address(address)
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=1.0):
            return f"{address} accepts TCP connections"
    except OSError as err:
        return f"nothing answers at {address} ({err.strerror or type(err).__name__})"


def _waits_for(address: str | None, process_id: int | None, num_processes: int | None,
               where: str) -> str:
    if process_id == 0:
        return (f"process 0 of {num_processes} (the coordinator, at {address}) waits for the "
                f"other {(num_processes or 1) - 1} process(es) to join")
    who = f"process {process_id} of {num_processes}" if process_id is not None \
        else f"this process ({where})"
    return f"{who} waits for the coordinator (process 0) at {address or 'the address JAX finds'}"


def _give_up(address: str | None, process_id: int | None, bound: int, waited: float,
             on_timeout: Callable[[int], None] | None) -> None:
    port = parse_address(address)[1] if address else None
    check = ("that every other process was started with the same --coordinator and "
             "--num-processes, and that they can reach this host's port "
             f"{port} (firewall)") if process_id == 0 else (
        f"that process 0 is running (its log), that {address} is its address and port, "
        f"and that no firewall blocks port {port} between the hosts") if address else (
        "that every process of the job was started, and the cluster's network")
    _say(f"gave up joining the job after {waited:.0f} s (initialization_timeout={bound}): "
         f"{_probe(address)}. Check {check}; raise --initialization-timeout if the "
         "processes start far apart.")
    if on_timeout is not None:
        on_timeout(EXIT_JOIN_TIMEOUT)
    sys.stdout.flush()
    os._exit(EXIT_JOIN_TIMEOUT)


@contextlib.contextmanager
def watch(address: str | None, process_id: int | None, num_processes: int | None,
          bound: int, *, where: str = "explicit",
          on_timeout: Callable[[int], None] | None = None) -> Iterator[None]:
    """Around ``jax.distributed.initialize``: says what this process waits for, again
    every ``REPEAT_S`` seconds, and ends the process after ``bound`` seconds.

    Args:
      address: the coordinator's ``HOST:PORT`` (None: the cluster environment's).
      process_id, num_processes: this process's index and the job's size (None: detected).
      bound: seconds to wait at most (``initialization_timeout``).
      where: how the address was found ("explicit" or the detected cluster's name).
      on_timeout: called with the exit status just before the process ends.
    """
    what = _waits_for(address, process_id, num_processes, where)
    _say(f"{what}; giving up after {bound} s (initialization_timeout)")
    done, t0 = threading.Event(), time.monotonic()

    def run() -> None:
        while not done.wait(min(REPEAT_S, max(0.0, bound - (time.monotonic() - t0)))):
            waited = time.monotonic() - t0
            if waited >= bound:
                _give_up(address, process_id, bound, waited, on_timeout)
            _say(f"still waiting ({waited:.0f} s of {bound} s): {what}; {_probe(address)}")

    threading.Thread(target=run, name="workbench-join-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()
