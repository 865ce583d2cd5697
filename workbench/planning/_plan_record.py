"""The plan cache's records on disk (``<cache_root>/plans/<key>.json.gz``): written, read
back through the safe reader and checked before they are believed.

A record is what a plan reads of a compiled step (memory and cost analysis, the optimised
HLO text), named by its key: the SHA-256 of the compile cache's fingerprint and the jax,
jaxlib and libtpu versions. It carries that key and a checksum of its own numbers, so a
record copied onto another key's name, or edited, is told apart from the compiler's
answer; a record from before they were kept (``tests/tpu_plans``) is checked by its name
and the types and ranges of its fields. A record that is not believed is compiled again
and replaced, with a ``CacheWarning`` naming the file and what was wrong.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

from workbench._cache import cache_root, read_cached

__all__ = ["MEMORY_FIELDS", "load_record", "make_record", "record_key", "record_path",
           "record_problem", "store_record", "versions"]

MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                 "temp_size_in_bytes", "generated_code_size_in_bytes")
_MAX_GZIP = 256 << 20        # bytes of a record file read (a 70B step's is a few MB)
_MAX_JSON = 2 << 30          # bytes it may inflate to
_MAX_BYTES = 1 << 60         # a memory field above this is no device's


def versions() -> str:
    """The jax, jaxlib and libtpu versions a record is written under (part of its key)."""
    from importlib import metadata

    out = []
    for pkg in ("jax", "jaxlib", "libtpu"):
        try:
            out.append(f"{pkg}={metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            out.append(f"{pkg}=none")
    return ",".join(out)


def record_key(fingerprint: str) -> str:
    """The key (and file name) of the record of the step of ``fingerprint``."""
    return hashlib.sha256(f"{fingerprint}|{versions()}".encode()).hexdigest()


def record_path(key: str) -> Path:
    return cache_root() / "plans" / f"{key}.json.gz"


def _checksum(record: dict[str, Any]) -> str:
    """SHA-256 of what a plan reads of ``record`` and the key it was written under."""
    body = json.dumps([record.get("key"), record["memory"], record["cost"], record["hlo"],
                       record["seconds"], record["versions"]], sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def make_record(key: str, compiled: Any, seconds: float) -> dict[str, Any]:
    """The record of ``compiled`` (the HLO text read once: each ``as_text()`` of the
    executable prints the whole module again)."""
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    record = {"key": key, "memory": {k: int(getattr(ma, k)) for k in MEMORY_FIELDS},
              "cost": {k: float(v) for k, v in (cost or {}).items()
                       if isinstance(v, (int, float)) and math.isfinite(v)},
              "hlo": compiled.as_text(), "seconds": float(seconds), "versions": versions()}
    record["checksum"] = _checksum(record)
    return record


def load_record(key: str) -> tuple[dict[str, Any] | None, str]:
    """``(record, "")`` of ``key`` from disk; ``(None, "")`` when there is none;
    ``(None, why)`` when the file there is not believed."""
    path = record_path(key)
    raw, why = read_cached(path, inside=path.parent, max_bytes=_MAX_GZIP)
    if raw is None:
        return None, why
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            text = f.read(_MAX_JSON + 1)
        if len(text) > _MAX_JSON:
            return None, f"it inflates past {_MAX_JSON >> 30} GiB"
        record = json.loads(text)
    except (OSError, EOFError, zlib.error) as e:
        return None, f"it is not a whole gzip file ({e})"
    except (ValueError, RecursionError) as e:
        return None, f"it is not JSON ({str(e)[:100]})"
    why = record_problem(record, key)
    return (None, why) if why else (record, "")


def record_problem(record: Any, key: str) -> str:
    """What is wrong with ``record`` as the record of ``key`` ("" when nothing is)."""
    if not isinstance(record, dict):
        return f"it holds a JSON {type(record).__name__}, not a record"
    if "key" in record and record["key"] != key:
        return (f"it is the record of another step (its key is {_short(record['key'])}, "
                f"its name says {key[:16]}...)")
    if record.get("versions") != versions():
        return (f"it was written by {str(record.get('versions'))[:80]!r}, not by "
                f"{versions()!r}")
    why = _memory_problem(record.get("memory")) or _cost_problem(record.get("cost"))
    if why:
        return why
    hlo = record.get("hlo")
    if not isinstance(hlo, str) or not hlo.startswith("HloModule "):
        return (f"its hlo is {_short(hlo)}, not the optimised HLO text of a compiled step "
                "('HloModule ...')")
    seconds = record.get("seconds", 0.0)
    if not _number(seconds):
        return f"its seconds is {_short(seconds)}, not a finite number >= 0"
    if "key" in record or "checksum" in record:
        if record.get("checksum") != _checksum(record):
            return "its numbers were changed after the compiler wrote them (the checksum " \
                   "does not match)"
    return ""


def _memory_problem(memory: Any) -> str:
    if not isinstance(memory, dict):
        return f"its memory is {_short(memory)}, not an object of byte counts"
    for k in MEMORY_FIELDS:
        v = memory.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_BYTES:
            return f"its memory[{k!r}] is {_short(v)}, not a byte count (an int >= 0)"
    return ""


def _cost_problem(cost: Any) -> str:
    if not isinstance(cost, dict):
        return f"its cost is {_short(cost)}, not an object of the compiler's cost analysis"
    for k, v in cost.items():
        # optimal_seconds is the TPU compiler's own estimate and may be negative
        if not _number(v, negative=k == "optimal_seconds"):
            return f"its cost[{k!r}] is {_short(v)}, not a finite number >= 0"
    return ""


def _number(v: Any, *, negative: bool = False) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and (negative or v >= 0))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def store_record(record: dict[str, Any]) -> str:
    """Writes ``record`` under its key (a temporary file of this thread, renamed over
    whatever was there); returns "" or why it could not be written (a full or read-only
    cache, a directory at its name: the next process compiles again)."""
    path = record_path(record["key"])
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as f:
            f.write(json.dumps(record).encode())
        os.replace(tmp, path)
        return ""
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return e.strerror or str(e)
