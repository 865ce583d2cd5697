"""The token cache: documents tokenized once, through Grain, into an ArrayRecord of token ids.

Documents are read in units (:mod:`workbench.data._files`), mapped to token ids by a
``grain.MapDataset`` (in ``workers`` Grain worker processes when asked, in order either
way) and written as one stream of int32 ids in records of ``RECORD_TOKENS`` tokens
(``tokens.array_record``, ``group_size:1`` for random access) with the document lengths
beside it (``lengths.npy``) and a description (``info.json``). The folder is named by the
SHA-256 of the files' bytes, the format, the field and the tokenizer's fingerprint, under
``$WORKBENCH_CACHE/data`` (default ``~/.cache/workbench/data``). Every call reads the files
to hash them (SHA-256 runs at about 1 GB/s, tokenizing at a few MB/s): a key of paths,
sizes and mtimes would serve stale tokens after an edit that keeps the size and the
mtime (``touch -d``, a copy with ``cp -p``, a second edit within the clock's
resolution). The per-file hashes also say which file changed when a run resumes
(``workbench.train._setup.check_data``). The folder is written under a temporary name and
renamed, so no process sees half a cache.

Why once, ahead of time, rather than in the training pipeline: packing needs every
document's length to give each row a fixed place (a ``MapDataset`` with a global shuffle,
an exact position to checkpoint and per-process slices), every epoch would otherwise
tokenize the corpus again, and several processes of a job share one cache (benchmarks/
bench_data.py measures both sides).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

from workbench._cache import cache_root
from workbench._validate import check_int, check_path, check_str
from workbench.data._files import (DataError, Unit, check_format, check_patterns, file_format,
                                  list_files, read_unit, units)
from workbench.data._tokenizer import Tokenizer

__all__ = ["RECORD_TOKENS", "TokenCache", "build_token_cache"]

#: Tokens per ArrayRecord record (8 KiB of int32).
RECORD_TOKENS = 2048

#: The most Grain worker processes that tokenize (each one is a Python process).
MAX_WORKERS = 1024


@dataclasses.dataclass(frozen=True)
class TokenCache:
    """A tokenized corpus on disk.

    Attributes:
      folder: the cache folder.
      lengths: tokens of each document, in file order (int64, ``(documents,)``).
      info: the description (``sha256``, ``files``, ``documents``, ``tokens``, ...).
    """

    folder: Path
    lengths: np.ndarray
    info: dict[str, Any]

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Start of each document in the stream, and the end: ``(documents + 1,)`` int64."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    @property
    def path(self) -> Path:
        """The ArrayRecord file of token ids."""
        return self.folder / "tokens.array_record"


def _tokenize_unit(unit: Unit, *, field: str, tokenizer: Tokenizer
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, lengths)`` of one unit's documents (empty texts dropped)."""
    texts = [t for t in read_unit(unit, field) if t]
    docs = tokenizer.documents(texts) if texts else []
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    flat = np.fromiter((i for d in docs for i in d), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def _content_key(files: Sequence[Path], fmt: str, field: str, tokenizer: Tokenizer
                 ) -> tuple[str, dict[str, str]]:
    """``(key, {path: SHA-256 of its bytes})``: the key hashes the format, field, tokenizer
    fingerprint and every file's name, size and bytes (one read of each file)."""
    h = hashlib.sha256(json.dumps([fmt, field, tokenizer.fingerprint]).encode())
    each = {}
    for path in files:
        one = hashlib.sha256()
        h.update(f"{path.name}|{path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                one.update(block)
        each[str(path)] = one.hexdigest()
    return h.hexdigest(), each


def _read(folder: Path) -> TokenCache:
    try:
        info = json.loads((folder / "info.json").read_text())
        lengths = np.load(folder / "lengths.npy")
    except (OSError, ValueError) as err:   # a damaged cache: say where, never guess
        raise DataError(f"the token cache {folder} cannot be read ({err}); delete that "
                        "folder and run again (it is rebuilt from the files)") from None
    if not isinstance(info, dict):
        raise DataError(f"{folder / 'info.json'} is not a JSON object; delete {folder} and "
                        "run again (it is rebuilt from the files)")
    return TokenCache(folder=folder, lengths=lengths, info=info)


def build_token_cache(patterns: Sequence[str], *, tokenizer: Tokenizer, field: str = "text",
                      fmt: str = "auto", workers: int = 0,
                      cache_dir: str | os.PathLike[str] | None = None) -> TokenCache:
    """Tokenizes the documents of ``patterns`` once and returns the cache.

    Args:
      patterns: globs, folders or files.
      tokenizer: the tokenizer (each document is ``tokenizer.document(text)``).
      field: the JSONL field / Parquet column holding the text.
      fmt: a format of ``files.FORMATS`` ("auto": by extension).
      workers: Grain worker processes that tokenize (0: in this process).
      cache_dir: where caches live (default ``cache_root() / "data"``).

    Raises:
      DataError: an empty file, bad JSON, a missing field or column, non-UTF-8 text, or
        no documents at all (the message names the file and line).
      DataFileNotFound: a pattern matches no file.
      TypeError, ValueError: an argument of the wrong type or out of range (named).
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    patterns = check_patterns(patterns, "patterns")
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer={tokenizer!r} is a {type(tokenizer).__name__}; give a "
                        "wb.data.Tokenizer (wb.data.Tokenizer() for byte-level tokens)")
    check_str(field, "field", example="'text'")
    check_format(fmt, "fmt")
    check_int(workers, "workers", minimum=0, maximum=MAX_WORKERS,
              fix="0 tokenizes in this process")
    root = (check_path(cache_dir, "cache_dir") if cache_dir is not None
            else cache_root() / "data").absolute()
    files = list_files(patterns)
    digest, each = _content_key(files, fmt, field, tokenizer)
    folder = root / f"tokens-{digest[:16]}-{tokenizer.fingerprint}"
    if not (folder / "info.json").exists():
        work = [u for p in files for u in units(p, file_format(p, fmt))]   # checks empty files
        root.mkdir(parents=True, exist_ok=True)
        # a folder of our own (never one found there: nothing deletes what it did not make)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=root))
        try:
            info = _write(tmp, work, field=field, tokenizer=tokenizer, workers=workers,
                          writer_cls=ArrayRecordWriter)
            info.update(sha256=digest, files=[str(p) for p in files], format=fmt,
                        field=field, tokenizer=tokenizer.to_dict(),
                        tokenizer_fingerprint=tokenizer.fingerprint)
            (tmp / "info.json").write_text(json.dumps(info, indent=1))
            try:
                os.rename(tmp, folder)
            except OSError:   # another process finished first: use its copy
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    cache = _read(folder)
    if cache.info.get("sha256") != digest:
        raise DataError(f"the token cache {folder} does not hold the files' tokens (its "
                        f"info.json says sha256={cache.info.get('sha256')!r}, the files hash "
                        f"to {digest!r}); delete that folder and run again")
    # the same bytes may sit at other paths than the ones that built the cache
    info = {**cache.info, "files": [str(p) for p in files], "file_sha256": each}
    return dataclasses.replace(cache, info=info)


def _write(folder: Path, work: list[Unit], *, field: str, tokenizer: Tokenizer, workers: int,
           writer_cls: Any) -> dict[str, Any]:
    """Tokenizes ``work`` through Grain into ``folder``; returns the counts."""
    ds = grain.MapDataset.source(work).map(
        functools.partial(_tokenize_unit, field=field, tokenizer=tokenizer))
    it: Any = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if workers > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():   # Grain's workers read absl flags (defaults here)
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    writer = writer_cls(str(folder / "tokens.array_record"), "group_size:1")
    lengths: list[np.ndarray] = []
    pending = np.zeros(0, np.int32)
    total = 0
    try:
        for flat, lens in it:
            lengths.append(lens)
            total += int(flat.size)
            pending = np.concatenate([pending, flat])
            full = pending.size // RECORD_TOKENS * RECORD_TOKENS
            for a in range(0, full, RECORD_TOKENS):
                writer.write(pending[a:a + RECORD_TOKENS].tobytes())
            pending = pending[full:]
        if pending.size:
            writer.write(pending.tobytes())
    finally:
        writer.close()
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if all_lengths.size == 0:
        names = sorted({u[1] for u in work})
        raise DataError(f"no documents in {names[:4]}{' ...' if len(names) > 4 else ''}: every "
                        f"document's {field!r} text is empty")
    np.save(folder / "lengths.npy", all_lengths)
    return {"documents": int(all_lengths.size), "tokens": total,
            "record_tokens": RECORD_TOKENS, "units": len(work)}
