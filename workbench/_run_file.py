"""One safe reader of the files in a run directory: regular files only, inside the run
directory after resolving symlinks, under a size cap, opened without ever blocking.

A run directory holds whatever anyone who can write there put in it: a named pipe
(opening it for reading waits for a writer that never comes), a symlink to ``/dev/zero``
(endless), a symlink to files outside the run, a file of gigabytes. Every reader of run
files (the server's endpoints, ``runs.read_run``, the metrics tail) opens through
:func:`open_file`, which refuses each of those with an error naming the file, what it is
and what to do. Standard library only: the Jupyter server extension uses it.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["FileRefused", "file_kind", "open_file", "read_file", "resolves_inside"]

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class FileRefused(OSError):
    """A file that exists but is not read: not a regular file (a pipe, a device, a
    socket), a symlink that leads out of its run directory, or larger than its cap. The
    message names the file, what it is and what to do."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (``"a named pipe"``)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


def resolves_inside(path: str | os.PathLike[str], inside: str | os.PathLike[str]) -> bool:
    """Whether ``path``, symlinks resolved, lies strictly inside directory ``inside``
    (symlinks of ``inside`` resolved too)."""
    root = os.path.realpath(inside)
    real = os.path.realpath(path)
    return real != root and os.path.commonpath([root, real]) == root


def _open_inside(path: Path, inside: Path) -> int:
    """An fd of ``path`` opened from ``inside`` one component at a time, no symlink
    followed: its resolved form must lie inside ``inside``, and a symlink swapped in
    between that check and the open is refused rather than followed."""
    root = os.path.realpath(inside)
    real = os.path.realpath(path)
    if real == root or os.path.commonpath([root, real]) != root:
        raise FileRefused(f"{path} resolves to {real}, outside the run directory {root}; "
                          "a symlink leading out of a run is not read: copy the file into "
                          "the run directory instead")
    parts = Path(real).relative_to(root).parts
    dfd = os.open(root, _FLAGS | _DIRECTORY)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, _FLAGS | _DIRECTORY | _NOFOLLOW, dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        return os.open(parts[-1], _FLAGS | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dfd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):   # a link or file appeared meanwhile
            raise FileRefused(f"{path} has a symlink in its path that does not resolve "
                              "(a loop, or one swapped in while it was opened); not read"
                              ) from None
        raise
    finally:
        os.close(dfd)


def open_file(path: str | os.PathLike[str], *, inside: str | os.PathLike[str] | None = None,
              max_bytes: int | None = None) -> BinaryIO:
    """Opens a run file for binary reading, or refuses it; never blocks.

    Args:
      path: the file.
      inside: the directory it must lie in after resolving symlinks (the run directory);
        None: anywhere (the file's type and size are still checked).
      max_bytes: refuse a file larger than this (None: any size; read it bounded).

    Raises:
      FileNotFoundError: it does not exist.
      IsADirectoryError: it is a directory.
      FileRefused: a pipe, device or socket (a pipe is opened non-blocking, so opening it
        never waits for a writer), outside ``inside``, or larger than ``max_bytes``.
      OSError: it cannot be opened (permissions).
    """
    path = Path(path)
    fd = (os.open(path, _FLAGS | os.O_NONBLOCK) if inside is None
          else _open_inside(path, Path(inside)))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"{path} is not a regular file ({file_kind(st.st_mode)}); only "
                              "regular files are read: replace it by the file it stands for")
        if max_bytes is not None and st.st_size > max_bytes:
            raise FileRefused(f"{path} is {st.st_size} bytes, over the {_size(max_bytes)} "
                              "a reader accepts")
        os.set_blocking(fd, True)   # a regular file: reads are plain reads again
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_file(path: str | os.PathLike[str], *, max_bytes: int,
              inside: str | os.PathLike[str] | None = None) -> bytes:
    """The bytes of a run file, at most ``max_bytes`` of them (see :func:`open_file`; a
    file that grows past the cap while read is refused too)."""
    with open_file(path, inside=inside, max_bytes=max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileRefused(f"{path} grew past the {_size(max_bytes)} a reader accepts "
                          "while it was read")
    return data


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"
