"""The offline text corpus: local files -> one byte stream -> fixed windows in ArrayRecord.

The default corpus is built from files already on every machine: the ``.py`` sources of
the Python standard library (``sysconfig.get_paths()["stdlib"]``), code and docstrings,
without its test suites, ``idlelib``, ``lib2to3`` and ``site-packages`` (about 600 files,
11 MB on CPython 3.11). Files are read in sorted
order and joined, each after a ``# ==== <relative path> ====`` header line, into one byte
stream (tokens are bytes, vocabulary 256). Training windows are ``seq + 1`` bytes at
stride ``seq`` (inputs and next-byte targets). They are written once as an ArrayRecord
file (``group_size:1`` for random access) named by the stream's SHA-256 and ``seq``, under
the cache directory (``$WORKBENCH_CACHE`` or ``~/.cache/workbench``)/``data``, and read
through Grain's ``ArrayRecordDataSource``. Each record holds ``per_record`` consecutive
windows (about 8 KiB of text; window ``i`` is in record ``i // per_record``), because
ArrayRecord's single-record read costs grow with the number of records in a file (about
0.4 ms per read at 170k records, 30 us at 10k). A different Python version gives a
different corpus; its hash is recorded with every run.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from workbench._cache import cache_root, doubted, read_cached
from workbench._validate import check_int, check_path, check_str
from workbench.data._files import DataFileNotFound

#: Bytes of text per ArrayRecord record (several windows each).
RECORD_BYTES = 8192

#: Directory names never read into the default corpus.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextData:
    """Byte-level language modelling on local text files (offline).

    Attributes:
      root: directory to read; ``None`` is the Python standard library.
      patterns: file-name patterns (``fnmatch``) of the files read, anywhere below ``root``.
      exclude: directory names skipped anywhere below ``root``.
      max_bytes: keep only the first ``max_bytes`` bytes of the stream (``None``: all).
    """

    root: str | None = None
    patterns: tuple[str, ...] = ("*.py",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.root is not None and not isinstance(self.root, (str, os.PathLike)):
            raise TypeError(f"TextData.root={self.root!r} must be a folder path, or None for "
                            "the Python standard library")
        if self.root is not None:   # absolute: a job or a resume may start elsewhere
            object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(
                os.fspath(self.root))))
        object.__setattr__(self, "patterns", _names(self.patterns, "patterns", "'*.py'"))
        object.__setattr__(self, "exclude", _names(self.exclude, "exclude", "'tests'",
                                                   empty=True))
        if self.max_bytes is not None:
            check_int(self.max_bytes, "TextData.max_bytes", minimum=2,
                      fix="give at least 2 bytes, or None for all")

    @property
    def vocab_size(self) -> int:
        """Byte-level tokens: 256."""
        return 256

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form with ``"kind": "text"``."""
        d = dataclasses.asdict(self)
        return {"kind": "text", **{k: list(v) if isinstance(v, tuple) else v
                                   for k, v in d.items()}}


def _names(value: Any, name: str, example: str, *, empty: bool = False) -> tuple[str, ...]:
    """``TextData.patterns`` / ``.exclude`` as a tuple of non-empty strings (one string is
    one name; a list from ``to_dict()`` is accepted)."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"TextData.{name}={value!r} is a {type(value).__name__}; {name} must "
                        f"be a tuple of strings (e.g. ({example},))")
    if not value and not empty:
        raise ValueError(f"TextData.{name}=() matches no file; give at least one pattern "
                         f"(e.g. ({example},))")
    for i, v in enumerate(value):
        check_str(v, f"{name}[{i}]", where="TextData.", example=example)
    return tuple(value)


def _check_spec(spec: Any, name: str = "spec") -> TextData:
    if not isinstance(spec, TextData):
        raise TypeError(f"{name}={spec!r} is a {type(spec).__name__}; give a "
                        "wb.data.TextData(...)")
    return spec


def corpus_root(spec: TextData) -> Path:
    """The directory a ``TextData`` reads (the stdlib when ``spec.root`` is None)."""
    return Path(spec.root) if spec.root is not None else Path(sysconfig.get_paths()["stdlib"])


def corpus_files(spec: TextData) -> list[Path]:
    """The files of the corpus, sorted by relative path (the stream's order)."""
    root = corpus_root(spec)
    if not root.is_dir():
        raise DataFileNotFound(f"text corpus root {str(root)!r} is not a directory; "
                                "pass TextData(root=...) pointing at a folder of text files")
    found: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in spec.exclude]  # prune: never walk into them
        found.extend(Path(folder, n) for n in names
                     if any(fnmatch.fnmatchcase(n, pat) for pat in spec.patterns))
    if not found:
        raise DataFileNotFound(f"no files match {list(spec.patterns)} under {root} "
                                f"(excluding directories {list(spec.exclude)})")
    return sorted((p for p in found if p.is_file()),
                  key=lambda p: p.relative_to(root).as_posix())


def corpus_bytes(spec: TextData, files: list[Path] | None = None) -> bytes:
    """The corpus as one byte stream: a header line, then each file's bytes.

    Args:
      spec: which files.
      files: the files to read (default ``corpus_files(spec)``), each below its root.
    """
    _check_spec(spec)
    root = corpus_root(spec)
    if files is not None:
        files = _check_files(files, root)
    parts: list[bytes] = []
    total = 0
    for path in corpus_files(spec) if files is None else files:
        chunk = f"# ==== {path.relative_to(root).as_posix()} ====\n".encode() + path.read_bytes()
        if not chunk.endswith(b"\n"):
            chunk += b"\n"
        parts.append(chunk)
        total += len(chunk)
        if spec.max_bytes is not None and total >= spec.max_bytes:
            break
    stream = b"".join(parts)
    return stream[: spec.max_bytes] if spec.max_bytes is not None else stream


def _check_files(files: Any, root: Path) -> list[Path]:
    """``corpus_bytes``' ``files``: readable files below ``root``, as Paths."""
    if isinstance(files, (str, os.PathLike)) or not isinstance(files, (list, tuple)):
        raise TypeError(f"files={files!r} is a {type(files).__name__}; files must be a list of "
                        "paths below the corpus root (corpus_files(spec)), or None for all")
    out = []
    for i, f in enumerate(files):
        path = check_path(f, f"files[{i}]")
        if not path.is_relative_to(root):
            raise ValueError(f"files[{i}]={str(path)!r} is not below the corpus root "
                             f"{str(root)!r}; give files from corpus_files(spec)")
        if not path.is_file():
            raise DataFileNotFound(f"files[{i}]={str(path)!r} is not a file; give files from "
                                   "corpus_files(spec)")
        out.append(path)
    return out


def _listing_key(spec: TextData, files: list[Path], seq: int) -> str:
    """Hash of the spec and every file's (path, size, mtime): unchanged files, same key."""
    h = hashlib.sha256(json.dumps([spec.to_dict(), str(corpus_root(spec)), seq]).encode())
    for path in files:
        st = path.stat()
        h.update(f"{path}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = _own_tmp(path)
    try:
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _own_tmp(path: Path) -> Path:
    """A new empty file beside ``path`` that this call made (a file already there under a
    guessable name is never overwritten, nor removed on failure)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def build_text_corpus(spec: TextData, seq: int, cache_dir: str | os.PathLike[str] | None = None
                      ) -> tuple[Path, dict[str, Any]]:
    """Writes the corpus' windows of ``seq + 1`` bytes as ArrayRecord (once) and returns it.

    A listing manifest (file paths, sizes, mtimes) finds the file of an earlier call; the
    stream's SHA-256, computed on every call, must match it (an edit that keeps a file's
    size and mtime would otherwise serve the old text), and so must every other field of
    the listing and the SHA-256 of the ArrayRecord file it names (read with the safe
    reader); otherwise the file is written again and the listing replaced, with a
    ``CacheWarning`` naming the file not believed.

    Args:
      spec: which files.
      seq: tokens per training sequence.
      cache_dir: where to write (default ``cache_root() / "data"``).

    Returns:
      ``(path, info)``: the ArrayRecord file and a description (``sha256``, ``bytes``,
      ``files``, ``windows``, ``per_record``, ``root``), also stored beside it as JSON.
    """
    _check_spec(spec)
    check_int(seq, "seq", fix="give the tokens per training sequence")
    folder = (check_path(cache_dir, "cache_dir") if cache_dir is not None
              else cache_root() / "data").absolute()
    files = corpus_files(spec)
    manifest = folder / f"listing-{_listing_key(spec, files, seq)}.json"
    stream = corpus_bytes(spec, files)
    digest = hashlib.sha256(stream).hexdigest()
    n_windows = (len(stream) - 1) // seq
    if n_windows < 1:
        raise ValueError(f"text corpus of {len(stream)} bytes is too short for one sequence "
                         f"of seq+1={seq + 1} bytes; raise TextData.max_bytes or lower seq")
    per_record = max(1, RECORD_BYTES // seq)
    path = folder / f"text-{digest[:16]}-seq{seq}.array_record"
    info = {"sha256": digest, "bytes": len(stream), "windows": n_windows, "seq": seq,
            "per_record": per_record, "root": str(corpus_root(spec)), "files": len(files),
            "path": str(path)}
    # the listing (sizes, mtimes) found it; the content hash decides (an edit may keep a
    # file's size and mtime), and the ArrayRecord file must be the one the listing names
    found, doubt = _believed(manifest, info, len(stream))
    if found is not None:
        return Path(found["path"]), found
    folder.mkdir(parents=True, exist_ok=True)
    doubted_file = manifest if doubt and doubt[0] == "listing" else path
    if os.path.isdir(path):    # not ours to remove: write beside it
        fd, alt = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=".array_record", dir=folder)
        os.close(fd)
        path = Path(alt)
        info["path"] = str(path)
    info["file_sha256"] = _write_windows(path, stream, seq, n_windows, per_record)
    try:
        _write_json(manifest, info)
        done = "the corpus was written again and the listing replaced"
    except OSError as e:   # a directory at its name: the next call writes it again
        done = f"the corpus was written again; the listing could not be replaced ({e})"
    if doubt:
        doubted(doubted_file, doubt[1], done)
    return path, info


def _write_windows(path: Path, stream: bytes, seq: int, n_windows: int,
                   per_record: int) -> str:
    """Writes ``n_windows`` windows of ``seq + 1`` bytes of ``stream`` to ``path`` as
    ArrayRecord, ``per_record`` windows a record (each record ``per_record * seq + 1``
    bytes: consecutive windows overlap by one), under a temporary name renamed when
    complete (no process ever sees half a file); returns the file's SHA-256."""
    from array_record.python.array_record_module import ArrayRecordWriter

    tmp = _own_tmp(path)
    try:
        writer = ArrayRecordWriter(str(tmp), "group_size:1")
        span = per_record * seq
        for start in range(0, n_windows * seq, span):
            stop = min(start + span, n_windows * seq)
            writer.write(stream[start: stop + 1])  # (windows * seq + 1,) bytes
        writer.close()
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest


def _believed(manifest: Path, info: dict[str, Any], size: int
              ) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """``(stored info, None)`` when the listing ``manifest`` and the ArrayRecord file it
    names hold the corpus ``info`` describes; else ``(None, (which file, why))``, or
    ``(None, None)`` when there is no listing."""
    raw, why = read_cached(manifest, inside=manifest.parent, max_bytes=1 << 20)
    if raw is None:
        return None, ("listing", why) if why else None
    try:
        stored = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return None, ("listing", f"it is not JSON ({str(e)[:80]})")
    if not isinstance(stored, dict):
        return None, ("listing", f"it holds a JSON {type(stored).__name__}, not an object")
    wrong = [k for k, v in info.items() if k != "path" and stored.get(k) != v]
    if wrong:
        return None, ("listing", f"its {wrong[0]} is {str(stored.get(wrong[0]))[:70]!r}, the "
                      f"corpus' is {str(info[wrong[0]])[:70]!r}")
    path = stored.get("path")
    expected = Path(info["path"])
    if not isinstance(path, str) or Path(path).parent != expected.parent or \
            not Path(path).name.startswith(expected.stem) or not path.endswith(".array_record"):
        return None, ("listing", f"it names {str(path)[:100]!r}, not the corpus' file "
                      f"{expected}")
    data, why = read_cached(Path(path), inside=expected.parent, max_bytes=2 * size + (1 << 20))
    if data is None:
        return None, ("corpus", why or "it is missing") if why else None
    if stored.get("file_sha256") != hashlib.sha256(data).hexdigest():
        return None, ("corpus", "its bytes are not the ones its listing recorded (the "
                      "file_sha256 differs)")
    return stored, None

