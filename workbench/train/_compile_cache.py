"""JAX's persistent compilation cache as the Trainer turns it on: its entries checked
before JAX reads them.

JAX reads an entry with ``Path.read_bytes`` (a named pipe there hangs the first compile
of the step for ever) and never writes over an existing one (a directory, a symlink or an
empty file there makes every later compile of that step warn and compile again, for
good). :func:`check_compile_cache` takes each such entry out of JAX's way, with a
``CacheWarning`` naming it: a link, a pipe or an empty file is removed (it holds nothing),
a directory (not Workbench's to delete) is renamed beside it. An entry whose bytes are
damaged is JAX's to judge: it warns and compiles again.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from workbench._cache import doubted
from workbench._run_file import file_kind

__all__ = ["check_compile_cache"]

#: The names of JAX's entries (``jax._src.lru_cache``: ``<key>-cache``, ``<key>-atime``).
_SUFFIXES = ("-cache", "-atime")


def check_compile_cache(path: str | os.PathLike[str]) -> None:
    """Takes the entries of the compilation cache ``path`` that JAX would hang on or never
    replace out of its way (see the module); a missing folder is fine."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        if not entry.name.endswith(_SUFFIXES):
            continue
        try:
            st = os.lstat(entry.path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size > 0:
            continue
        _clear(Path(entry.path), st.st_mode)


def _clear(path: Path, mode: int) -> None:
    why = ("a symlink (JAX would read whatever it points to)" if stat.S_ISLNK(mode)
           else "an empty file" if stat.S_ISREG(mode) else file_kind(mode))
    try:
        if stat.S_ISDIR(mode):
            aside = path.with_name(f".{path.name}.{os.getpid()}.stale")
            os.rename(path, aside)
            done = f"moved aside to {aside}; JAX compiles the step again and stores it"
        else:
            path.unlink()
            done = "removed; JAX compiles the step again and stores it"
    except OSError as e:
        done = f"it could not be moved out of JAX's way ({e.strerror or e}): remove it"
    doubted(path, f"it is {why}, not an entry JAX wrote", done, stacklevel=4)
