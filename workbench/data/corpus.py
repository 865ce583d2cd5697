"""The offline text corpus: local files -> one byte stream -> fixed windows in ArrayRecord.

The default corpus is built from files already on every machine: the ``.py`` sources of
the Python standard library (``sysconfig.get_paths()["stdlib"]``), code and docstrings,
without its test suites, ``idlelib`` and ``site-packages``. Files are read in sorted
order and joined, each after a ``# ==== <relative path> ====`` header line, into one byte
stream (tokens are bytes, vocabulary 256). The stream is cut into overlapping windows of
``seq + 1`` bytes at stride ``seq`` (inputs and next-byte targets) and written once as
an ArrayRecord file (``group_size:1`` for random access), named by the stream's SHA-256
and ``seq``, under the cache directory (``$WORKBENCH_CACHE`` or
``~/.cache/workbench``)/``data``. Later runs read it through Grain's
``ArrayRecordDataSource``. A different Python version gives a different corpus; its hash
is recorded with every run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Any

#: Directory names never read into the default corpus.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextData:
    """Byte-level language modelling on local text files (offline).

    Attributes:
      root: directory to read; ``None`` is the Python standard library.
      patterns: glob patterns, relative to ``root``, of the files to read.
      exclude: directory names skipped anywhere below ``root``.
      max_bytes: keep only the first ``max_bytes`` bytes of the stream (``None``: all).
    """

    root: str | None = None
    patterns: tuple[str, ...] = ("**/*.py",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", tuple(self.patterns))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if self.max_bytes is not None and self.max_bytes < 2:
            raise ValueError(f"TextData.max_bytes={self.max_bytes} must be at least 2 bytes")

    @property
    def vocab_size(self) -> int:
        """Byte-level tokens: 256."""
        return 256

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form with ``"kind": "text"``."""
        d = dataclasses.asdict(self)
        return {"kind": "text", **{k: list(v) if isinstance(v, tuple) else v
                                   for k, v in d.items()}}


def cache_root() -> Path:
    """Workbench's cache directory: ``$WORKBENCH_CACHE`` or ``~/.cache/workbench``."""
    root = os.environ.get("WORKBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "workbench")
    return Path(root)


def corpus_root(spec: TextData) -> Path:
    """The directory a ``TextData`` reads (the stdlib when ``spec.root`` is None)."""
    return Path(spec.root) if spec.root is not None else Path(sysconfig.get_paths()["stdlib"])


def corpus_files(spec: TextData) -> list[Path]:
    """The files of the corpus, sorted by relative path (the stream's order)."""
    root = corpus_root(spec)
    if not root.is_dir():
        raise FileNotFoundError(f"text corpus root {str(root)!r} is not a directory; "
                                "pass TextData(root=...) pointing at a folder of text files")
    found: set[Path] = set()
    for pattern in spec.patterns:
        for path in root.glob(pattern):
            rel = path.relative_to(root)
            if path.is_file() and not any(part in spec.exclude for part in rel.parts[:-1]):
                found.add(path)
    if not found:
        raise FileNotFoundError(f"no files match {list(spec.patterns)} under {root} "
                                f"(excluding directories {list(spec.exclude)})")
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def corpus_bytes(spec: TextData) -> bytes:
    """The corpus as one byte stream: a header line, then each file's bytes."""
    root = corpus_root(spec)
    parts: list[bytes] = []
    total = 0
    for path in corpus_files(spec):
        chunk = f"# ==== {path.relative_to(root).as_posix()} ====\n".encode() + path.read_bytes()
        if not chunk.endswith(b"\n"):
            chunk += b"\n"
        parts.append(chunk)
        total += len(chunk)
        if spec.max_bytes is not None and total >= spec.max_bytes:
            break
    stream = b"".join(parts)
    return stream[: spec.max_bytes] if spec.max_bytes is not None else stream


def build_text_corpus(spec: TextData, seq: int, cache_dir: str | os.PathLike[str] | None = None
                      ) -> tuple[Path, dict[str, Any]]:
    """Writes the corpus as ArrayRecord windows of ``seq + 1`` bytes (once) and returns it.

    Args:
      spec: which files.
      seq: tokens per training sequence; each record holds ``seq + 1`` bytes.
      cache_dir: where to write (default ``cache_root() / "data"``).

    Returns:
      ``(path, info)``: the ArrayRecord file and a description (``sha256``, ``bytes``,
      ``files``, ``records``, ``root``) also stored beside it as ``<file>.json``.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    if seq < 1:
        raise ValueError(f"seq={seq} must be at least 1")
    stream = corpus_bytes(spec)
    n_records = (len(stream) - 1) // seq
    if n_records < 1:
        raise ValueError(f"text corpus of {len(stream)} bytes is too short for one sequence "
                         f"of seq+1={seq + 1} bytes; raise TextData.max_bytes or lower seq")
    digest = hashlib.sha256(stream).hexdigest()
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "data"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"text-{digest[:16]}-seq{seq}.array_record"
    info = {"sha256": digest, "bytes": len(stream), "records": n_records, "seq": seq,
            "root": str(corpus_root(spec)), "files": len(corpus_files(spec)),
            "path": str(path)}
    if path.exists() and path.with_suffix(".json").exists():
        return path, info
    # Written under a temporary name and renamed: concurrent processes never see half a file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        writer = ArrayRecordWriter(str(tmp), "group_size:1")
        for i in range(n_records):
            writer.write(stream[i * seq: i * seq + seq + 1])  # (seq + 1,) bytes
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    meta_tmp = path.with_name(f".{path.name}.{os.getpid()}.json.tmp")
    meta_tmp.write_text(json.dumps(info, indent=1))
    os.replace(meta_tmp, path.with_suffix(".json"))
    return path, info
