"""Workbench's cache directory (``$WORKBENCH_CACHE`` or ``$XDG_CACHE_HOME/workbench``), and
how every cache reads its files back: through the safe reader, believed only when checked.

Whatever sits in a cache may have been edited, copied from another entry, truncated or
replaced by a pipe, a directory or a symlink. Each cache (plans, token caches, corpora,
measurements) reads its files with :func:`read_cached` (a regular file inside the cache,
under a size cap, opened without blocking: ``workbench._run_file``), checks what they say
against the key it looked them up by, and on any doubt builds the entry again and replaces
it, with a :class:`CacheWarning` naming the file and what was wrong (:func:`doubted`).
"""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import BinaryIO

from workbench._run_file import FileRefused, open_file, resolves_inside

__all__ = ["CacheWarning", "cache_root", "doubted", "hash_cached", "read_cached"]


class CacheWarning(UserWarning):
    """A cache file that was not believed: its entry is built again and replaced."""


def cache_root() -> Path:
    """Workbench's cache directory: ``$WORKBENCH_CACHE`` or ``~/.cache/workbench``."""
    root = os.environ.get("WORKBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "workbench")
    return Path(root)


def read_cached(path: Path, *, inside: Path, max_bytes: int) -> tuple[bytes | None, str]:
    """``(bytes, "")`` of the cache file ``path``; ``(None, "")`` when there is none;
    ``(None, why)`` when something is there that is not read (a pipe, a directory, a
    symlink out of ``inside``, over ``max_bytes``, unreadable)."""
    f, why = _open(path, inside, max_bytes)
    if f is None:
        return None, why
    with f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        return None, f"it grew past the {max_bytes} bytes a cache file may hold while read"
    return data, ""


def hash_cached(path: Path, *, inside: Path, max_bytes: int) -> tuple[str | None, str]:
    """``(SHA-256 hex, "")`` of the cache file ``path`` read in blocks, or ``(None, why)``
    as :func:`read_cached` (``why`` is "" when there is no file)."""
    f, why = _open(path, inside, max_bytes)
    if f is None:
        return None, why
    h = hashlib.sha256()
    with f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest(), ""


def _open(path: Path, inside: Path, max_bytes: int) -> tuple[BinaryIO | None, str]:
    if os.path.lexists(path) and not resolves_inside(path, inside):
        return None, (f"it resolves to {os.path.realpath(path)}, outside the cache folder "
                      f"{os.path.realpath(inside)} (a symlink leading out is not followed)")
    try:
        return open_file(path, inside=inside, max_bytes=max_bytes), ""
    except FileNotFoundError:
        return None, ""
    except IsADirectoryError:
        return None, "Is a directory"
    except FileRefused as e:
        return None, str(e)
    except OSError as e:
        return None, f"it cannot be read ({e.strerror or e})"


def doubted(path: Path, why: str, rebuilt: str, *, stacklevel: int = 3) -> None:
    """Warns that the cache file ``path`` was not believed (``why``) and what was done
    (``rebuilt``: "compiled again and replaced")."""
    warnings.warn(f"cache file {path} was not used: {why}; {rebuilt}", CacheWarning,
                  stacklevel=stacklevel)
