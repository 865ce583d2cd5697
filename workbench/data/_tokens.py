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
renamed, so no process sees half a cache. A cache is believed only when its ``info.json``
says the key it was looked up by (files' hash, format, field, tokenizer) and its files
have the SHA-256 it recorded (read with the safe reader); otherwise the documents are
tokenized again and the folder replaced, with a ``CacheWarning`` naming it.

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
import io
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

from workbench._cache import cache_root, doubted, hash_cached, read_cached
from workbench._validate import check_int, check_path, check_str
from workbench.data._files import (DataError, Unit, check_format, check_patterns, file_format,
                                  holds_messages, list_files, read_unit, units)
from workbench.data._tokenizer import Tokenizer

__all__ = ["RECORD_TOKENS", "TokenCache", "build_token_cache", "hub_token_cache"]

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


def _tokenize_unit(unit: Unit, *, field: str, tokenizer: Tokenizer, chat: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, lengths)`` of one unit's documents (empty texts dropped). ``chat``: each
    row is a list of messages, rendered by the tokenizer's chat template and encoded as
    transformers' ``apply_chat_template(messages, tokenize=True)`` does (the template
    writes the special tokens; none are added)."""
    rows = [t for t in read_unit(unit, field, chat) if t]
    if chat:
        docs = tokenizer.encode_batch([_render(unit, i, m, tokenizer)
                                       for i, m in enumerate(rows)])
    else:
        docs = tokenizer.documents(rows) if rows else []
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    flat = np.fromiter((i for d in docs for i in d), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def _render(unit: Unit, row: int, messages: Any, tokenizer: Tokenizer) -> str:
    """A chat row's text in the tokenizer's chat template (errors name the file)."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    except ValueError as e:
        raise DataError(f"{unit[1]} (a row of unit {unit[2]}, chat row {row}): {e}") from None


def _chat_template(files: Sequence[Path], fmt: str, field: str, tokenizer: Tokenizer
                   ) -> str | None:
    """The SHA-256 of the chat template the rows are rendered with when ``field`` holds
    messages (in every file, or in none), else None."""
    chat = {p: holds_messages(p, file_format(p, fmt), field) for p in files}
    if len(set(chat.values())) > 1:
        text = [str(p) for p, c in chat.items() if not c][:2]
        raise DataError(f"field {field!r} holds chat messages in some files and text in "
                        f"others ({text}); give files of one kind")
    if not any(chat.values()):
        return None
    if tokenizer.chat_template is None:
        raise DataError(f"field {field!r} of {files[0]} holds chat messages, and the tokenizer "
                        f"({tokenizer.path or 'byte-level'}) has no chat template to render "
                        "them; use the model's own tokenizer (Tokenizer.from_hf(...)), or a "
                        "field of text")
    return hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()


def _content_key(files: Sequence[Path], fmt: str, field: str, tokenizer: Tokenizer,
                 chat: str | None = None) -> tuple[str, dict[str, str]]:
    """``(key, {path: SHA-256 of its bytes})``: the key hashes the format, field, tokenizer
    fingerprint (and the chat template, for chat rows) and every file's name, size and
    bytes (one read of each file)."""
    h = hashlib.sha256(json.dumps([fmt, field, tokenizer.fingerprint]
                                  + (["chat", chat] if chat else [])).encode())
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


def _load(folder: Path, root: Path, expect: dict[str, Any]) -> tuple[TokenCache | None, str]:
    """The token cache in ``folder`` when it holds what ``expect`` says (its key fields)
    and its files are the ones it recorded (SHA-256, read with the safe reader); else
    ``(None, why)``, ``why`` "" when there is no cache."""
    raw, why = read_cached(folder / "info.json", inside=root, max_bytes=64 << 20)
    if raw is None:
        return None, why and f"its info.json is not read: {why}"
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return None, f"its info.json is not JSON ({str(e)[:80]})"
    if not isinstance(info, dict):
        return None, f"its info.json holds a JSON {type(info).__name__}, not an object"
    wrong = next((k for k, v in expect.items() if info.get(k) != v), None)
    if wrong is not None:
        return None, (f"its info.json says {wrong}={str(info.get(wrong))[:70]!r}, the files "
                      f"give {str(expect[wrong])[:70]!r}")
    tokens, documents = info.get("tokens"), info.get("documents")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in (tokens, documents)):
        return None, f"its tokens={tokens!r} and documents={documents!r} are not counts"
    raw, why = read_cached(folder / "lengths.npy", inside=root, max_bytes=8 * documents + 4096)
    if raw is None or hashlib.sha256(raw).hexdigest() != info.get("lengths_sha256"):
        return None, _file_problem("lengths.npy", raw is not None, why)
    digest, why = hash_cached(folder / "tokens.array_record", inside=root,
                              max_bytes=8 * tokens + (1 << 24))
    if digest is None or digest != info.get("tokens_sha256"):
        return None, _file_problem("tokens.array_record", digest is not None, why)
    try:
        lengths = np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as e:
        return None, f"its lengths.npy is not a numpy array ({e})"
    if lengths.ndim != 1 or lengths.dtype != np.int64 or len(lengths) != documents or \
            int(lengths.sum()) != tokens or (lengths < 0).any():
        return None, "its lengths.npy does not hold the documents' token counts"
    return TokenCache(folder=folder, lengths=lengths, info=info), ""


def _file_problem(name: str, read: bool, why: str) -> str:
    if read:
        return f"its {name} is not the one it recorded (another SHA-256)"
    return f"its {name} is not read: {why}" if why else f"its {name} is missing"


def _set_aside(folder: Path) -> str:
    """Moves whatever is at ``folder`` out of the way (renamed beside it); removes what a
    token cache holds from it. Returns where anything else was left ("" if nowhere)."""
    aside = folder.with_name(f".{folder.name}.{os.getpid()}.{time.time_ns()}.stale")
    os.rename(folder, aside)
    if aside.is_symlink() or not aside.is_dir():
        if aside.is_symlink() or not aside.is_file():   # a link, a pipe: nothing of yours
            aside.unlink()
            return ""
        return str(aside)
    for name in ("info.json", "lengths.npy", "tokens.array_record"):
        p = aside / name
        if p.is_symlink() or p.is_file():
            p.unlink()
    try:
        aside.rmdir()
        return ""
    except OSError:
        return str(aside)


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
    chat = _chat_template(files, fmt, field, tokenizer)
    digest, each = _content_key(files, fmt, field, tokenizer, chat)
    cache = _obtain(root, files, digest, fmt, field, chat, tokenizer=tokenizer,
                    workers=workers)
    # the same bytes may sit at other paths than the ones that built the cache
    info = {**cache.info, "files": [str(p) for p in files], "file_sha256": each}
    return dataclasses.replace(cache, info=info)


def hub_token_cache(files: Sequence[str], names: Sequence[str], *, tokenizer: Tokenizer,
                    field: str, fmt: str, digests: Sequence[str] | None = None,
                    workers: int = 0, cache_dir: str | os.PathLike[str] | None = None
                    ) -> TokenCache:
    """The token cache of a Hub split's ``files``: snapshot paths (hashed here), or URLs
    read through ``fsspec`` (row group by row group) with the SHA-256 the Hub gives
    (``digests``). Either way the key is the files' ``names`` (``hf://datasets/...``) and
    SHA-256s, so a split streamed once and downloaded later is the same cache (and the
    same data to a resumed run). ``info["file_sha256"]`` is by name."""
    root = (check_path(cache_dir, "cache_dir") if cache_dir is not None
            else cache_root() / "data").absolute()
    paths: list[Any] = list(files) if digests is not None else [Path(f) for f in files]
    chat = _chat_template(paths, fmt, field, tokenizer)
    shas = list(digests) if digests is not None else [_sha256(p) for p in paths]
    h = hashlib.sha256(json.dumps(["hub", fmt, field, tokenizer.fingerprint]
                                  + (["chat", chat] if chat else [])).encode())
    for name, sha in zip(names, shas, strict=True):
        h.update(f"{name}|{sha}\n".encode())
    cache = _obtain(root, paths, h.hexdigest(), fmt, field, chat, tokenizer=tokenizer,
                    workers=workers)
    info = {**cache.info, "files": list(names), "file_sha256": dict(zip(names, shas))}
    return dataclasses.replace(cache, info=info)


def _obtain(root: Path, files: list[Any], digest: str, fmt: str, field: str,
            chat: str | None, *, tokenizer: Tokenizer, workers: int) -> TokenCache:
    """The cache keyed by ``digest``, believed if it checks out, else built (again)."""
    folder = root / f"tokens-{digest[:16]}-{tokenizer.fingerprint}"
    expect = {"sha256": digest, "format": fmt, "field": field,
              "tokenizer_fingerprint": tokenizer.fingerprint, "record_tokens": RECORD_TOKENS,
              **({"chat_template_sha256": chat} if chat else {})}
    cache, doubt = _load(folder, root, expect)
    if cache is None:
        cache, left = _build(folder, root, files, expect, tokenizer=tokenizer,
                             workers=workers)
        if doubt:
            doubted(folder, doubt, "the documents were tokenized again and the cache "
                    "replaced" + (f" (what else it held is now in {left})" if left else ""),
                    stacklevel=4)
    return cache


def _build(folder: Path, root: Path, files: list[Path], expect: dict[str, Any], *,
           tokenizer: Tokenizer, workers: int) -> tuple[TokenCache, str]:
    """Tokenizes ``files`` into a folder of our own, renamed to ``folder`` (whatever was
    there set aside first: where what was not a token cache's went, or "")."""
    from array_record.python.array_record_module import ArrayRecordWriter

    work = [u for p in files for u in units(p, file_format(p, expect["format"]))]
    root.mkdir(parents=True, exist_ok=True)
    # a folder of our own (never one found there: nothing deletes what it did not make)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=root))
    try:
        info = _write(tmp, work, field=expect["field"], tokenizer=tokenizer, workers=workers,
                      writer_cls=ArrayRecordWriter, chat="chat_template_sha256" in expect)
        info.update(expect, files=[str(p) for p in files], tokenizer=tokenizer.to_dict(),
                    lengths_sha256=_sha256(tmp / "lengths.npy"),
                    tokens_sha256=_sha256(tmp / "tokens.array_record"))
        (tmp / "info.json").write_text(json.dumps(info, indent=1))
        left = _set_aside(folder) if os.path.lexists(folder) else ""
        try:
            os.rename(tmp, folder)
        except OSError:   # another process finished first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
            cache, why = _load(folder, root, expect)
            if cache is None:
                raise DataError(f"the token cache {folder} cannot be used ({why}); delete "
                                "that folder and run again") from None
            return cache, left
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    lengths = np.load(folder / "lengths.npy", allow_pickle=False)
    return TokenCache(folder=folder, lengths=lengths, info=info), left


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write(folder: Path, work: list[Unit], *, field: str, tokenizer: Tokenizer, workers: int,
           writer_cls: Any, chat: bool = False) -> dict[str, Any]:
    """Tokenizes ``work`` through Grain into ``folder``; returns the counts."""
    ds = grain.MapDataset.source(work).map(
        functools.partial(_tokenize_unit, field=field, tokenizer=tokenizer, chat=chat))
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
