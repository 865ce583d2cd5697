"""The folder an export writes: what it may replace (a folder ``to_hf`` made, marked in every
safetensors header), whether it can be written, and the swap of the new folder into place.

Shared by ``to_hf`` and ``to_peft``; the rules are in ``_save``'s module docstring."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from workbench._hf_format.tensors import INDEX

#: Files of a model folder copied along with the weights when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json",
                   "chat_template.jinja")


#: safetensors metadata that marks a file written by ``to_hf`` (what ``overwrite`` checks).
MARK = {"format": "pt", "written_by": "workbench.models.to_hf"}


_MAX_HEADER = 100 << 20   # safetensors' own cap on a header


def folder_entries(p: Path) -> list[os.DirEntry] | str:
    """The entries of a folder an export may replace, by name, or why it is not one to list:
    a symlink, not a folder, or a folder that cannot be listed."""
    if p.is_symlink():
        return (f"{p} is a symlink (to {os.readlink(p)}); give the folder itself, or a new "
                "folder")
    if not p.is_dir():
        return f"{p} exists and is not a folder"
    try:
        return sorted(os.scandir(p), key=lambda e: e.name)
    except OSError as e:
        return f"{p} cannot be listed ({e.strerror or e})"


def check_replaceable(folder: str | os.PathLike[str]) -> str | None:
    """Why ``overwrite=True`` may not replace ``folder`` (None: it may).

    It may when it is a model folder ``to_hf`` wrote: a directory (not a symlink) whose
    entries are all regular files named ``config.json``, ``*.safetensors``,
    ``model.safetensors.index.json`` or one of :data:`TOKENIZER_FILES`, with
    ``config.json`` and at least one safetensors file among them, every safetensors file
    carrying :data:`MARK` in its header; or an empty directory (nothing to lose).
    Everything else is refused, by name: a run
    directory (``run.json``), a folder holding folders (runs, checkpoints, a parent of
    the run being exported), other files, a model folder another tool wrote.
    """
    from workbench._runs import RUN_JSON

    p = Path(folder)
    entries = folder_entries(p)
    if isinstance(entries, str):
        return entries
    names = [e.name for e in entries]
    if not names:
        return None   # an empty folder: replacing it loses nothing
    if RUN_JSON in names:
        return f"{p} is a run directory (it holds {RUN_JSON}); it is never replaced"
    dirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    if dirs:
        return (f"{p} holds folders ({few(dirs)}): it is not a model folder to_hf wrote "
                "(a parent of runs, a run's checkpoints?); it is never replaced")
    allowed = {"config.json", INDEX, *TOKENIZER_FILES}
    odd = [e.name for e in entries if not e.is_file(follow_symlinks=False)
           or not (e.name in allowed or e.name.endswith(".safetensors"))]
    if odd:
        return (f"{p} holds files to_hf does not write ({few(odd)}): it is not a model "
                "folder to_hf wrote (a link or pipe never is one)")
    shards = [n for n in names if n.endswith(".safetensors")]
    if "config.json" not in names or not shards:
        return f"{p} is not a model folder to_hf wrote (no config.json or no safetensors file)"
    for n in shards:
        if not marked(p / n):
            return (f"{p / n} was not written by wb.hf.to_hf (its header lacks the mark "
                    f"{MARK}): a model folder of another tool is never replaced")
    return None


def exists_error(out: Path, overwrite: bool) -> FileExistsError | None:
    """The error of writing to ``out`` (None: it is free, or ``overwrite`` may replace it):
    why it may not be replaced, or that it exists and ``overwrite`` was not given."""
    if not os.path.lexists(out):
        return None
    why = check_replaceable(out)
    if why is not None:
        return FileExistsError(f"{why}; choose a new folder (overwrite=True replaces only a "
                               "model folder that wb.hf.to_hf wrote, or an empty one)")
    if overwrite:
        return None
    what = "a model folder to_hf wrote" if any(out.iterdir()) else "an empty folder"
    return FileExistsError(f"{out} exists ({what}); choose a new folder or pass "
                           "overwrite=True (the old one is replaced only after the new one is "
                           "complete)")


def few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def marked(file: Path, mark: dict[str, str] = MARK) -> bool:
    """Whether a safetensors file's header metadata holds ``mark`` (the header only
    is read: 8 bytes of length, then at most ``_MAX_HEADER`` bytes of JSON)."""
    from workbench._run_file import open_file

    try:
        with open_file(file) as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= _MAX_HEADER:
                return False
            meta = json.loads(f.read(n)).get("__metadata__") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(meta, dict) and all(meta.get(k) == v for k, v in mark.items())


def canonical_mark(file: Path, mark: dict[str, str] = MARK) -> None:
    """Puts ``mark``'s two keys in one order in the header just written: safetensors keeps
    metadata in a hash map, so their order (and the file's bytes) would vary from run to
    run; both orders have the same length, so the header is rewritten in place."""
    want, other = (json.dumps(m, separators=(",", ":")).encode()
                   for m in (mark, dict(reversed(mark.items()))))
    with open(file, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        i = header.find(other)
        if i >= 0:
            f.seek(8 + i)
            f.write(want)


def check_writable(out: Path, *, where: str = "") -> None:
    """Refuses, before anything is written, an export folder ``out`` that cannot be made:
    its nearest existing parent is not a folder, or no file can be created in it
    (read-only, immutable, another user's). Tried by creating (and removing) an empty
    temporary folder there, which works as root too (``os.access`` says yes to root).

    Raises:
        NotADirectoryError: a parent of ``out`` is a file.
        PermissionError: the parent cannot be written (the message names it).
    """
    parent = Path(os.path.abspath(out)).parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"{where}cannot write {out}: {parent} is a file, not a "
                                 "folder; choose a path inside a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name or 'export'}.check-", dir=parent))
    except OSError as e:
        raise PermissionError(e.errno, f"{where}cannot write {out}: the folder {parent} "
                              f"cannot be written ({e.strerror or e}); choose a folder you "
                              "can write to, or make it writable") from None


def replace_folder(out: Path, new: Path, check: Any = None) -> None:
    """Puts the complete folder ``new`` in place of the export folder ``out``: ``out`` is
    renamed aside, checked again there by ``check`` (default :func:`check_replaceable`;
    nothing can change it under our feet after the rename), then its files are removed
    one by one; anything else leaves it aside, named."""
    check = check_replaceable if check is None else check
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, aside)   # onto our own empty folder: atomic, same file system
    why = check(aside)
    if why is not None:
        os.rename(aside, out)   # put back what changed since the first check
        shutil.rmtree(new, ignore_errors=True)
        raise FileExistsError(f"{out} changed while it was being replaced ({why}); left as it "
                              "was: choose a new folder")
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(aside, out)   # the old folder back where it was
        raise
    for e in os.scandir(aside):
        os.unlink(e.path)   # regular files of the names the export writes (just checked)
    os.rmdir(aside)
