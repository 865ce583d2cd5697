"""``wb.data.Dataset``: your text or a Hub dataset, tokenized, packed, split into train and eval.

Example::

    tok = wb.data.Tokenizer("tokenizer.json")
    data = wb.data.Dataset(files="docs/*.jsonl", field="text", tokenizer=tok,
                           eval_fraction=0.05)
    data = wb.data.Dataset(hf="roneneldan/TinyStories", split="train", field="text",
                           tokenizer=tok)            # a Hub dataset (workbench.data._hub_dataset)
    cfg = wb.TrainConfig(model="small", data=data, eval_every=50, eval_batches=4,
                         model_overrides={"vocab_size": tok.vocab_size})

The files are tokenized once into a cache (:mod:`workbench.data._tokens`); documents are
split into train and eval (a seeded choice of ``eval_fraction`` of them, or the documents
of ``eval_files``) and each part is packed into rows (:mod:`workbench.data._packing`). The
train rows are globally shuffled by the run's seed, reshuffled every epoch, repeated
forever; the eval rows are read in order, the same ones at every evaluation.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import grain
import numpy as np

from workbench._validate import check_bool, check_int, check_path
from workbench.data._files import FORMATS, DataError
from workbench.data._hub_dataset import (check_blobs, check_hub_args, check_hub_id,
                                         file_format, resolve_split)
from workbench.data._packing import PackedRows, pack
from workbench.data._tokenizer import Tokenizer, check_vocab
from workbench.data._tokens import TokenCache, build_token_cache, hub_token_cache

__all__ = ["Dataset", "Prepared", "prepare"]


def _patterns(value: Any, name: str) -> tuple[str, ...]:
    """Absolute globs (a launched job's processes may start in another directory).

    Raises:
      ValueError: no pattern, or an empty one (``""`` would mean every file below the
        working directory).
    """
    absolute = lambda v: os.path.abspath(os.path.expanduser(os.fspath(v)))
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, os.PathLike))
                                                       for v in value):
        raise TypeError(f"Dataset.{name}={value!r} must be a glob, a folder, a file or a "
                        "list of them")
    if not value:
        raise ValueError(f"Dataset({name}={value!r}) was given no files; pass a glob like "
                         "'data/*.jsonl', a folder, a file, or a list of them")
    if any(not os.fspath(v).strip() for v in value):
        raise ValueError(f"Dataset({name}={value!r}) holds an empty path, which would "
                         "read every file below the working directory; name the files")
    return tuple(absolute(v) for v in value)


def _tokenizer(value: Any) -> Tokenizer:
    """``Dataset.tokenizer`` as a ``Tokenizer``: one, a path, ``to_dict()``'s form or None."""
    if isinstance(value, Tokenizer):
        return value
    if isinstance(value, dict):
        unknown = sorted(map(str, set(value) - {"path", "bos", "eos", "pad"}))
        if unknown:
            raise ValueError(f"Dataset.tokenizer={value!r} has unknown keys {unknown}; a dict "
                             "is Tokenizer.to_dict()'s form: 'path', 'bos', 'eos', 'pad'")
        return Tokenizer.from_dict(value)
    if value is not None and (isinstance(value, bytes)
                              or not isinstance(value, (str, os.PathLike))):
        raise TypeError(f"Dataset.tokenizer={value!r} is a {type(value).__name__}; give a "
                        "wb.data.Tokenizer, the path of a tokenizer.json or .model file, or "
                        "None for byte-level tokens")
    return Tokenizer(None if value is None else check_path(value, "Dataset.tokenizer"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dataset:
    """Documents as packed, tokenized training rows (and a held-out eval split): local
    files, or a Hugging Face Hub dataset's split.

    Attributes:
      files: globs (``"data/*.jsonl"``, ``**`` recursive), folders or files.
      hf: instead, a Hub dataset id (``"org/name"``); its split's Parquet or JSONL files
        are fetched into the Hugging Face cache (``HF_HUB_OFFLINE=1``: read from it).
      split: the Hub split (default "train"); ``hf`` only.
      config: the Hub dataset's config (subset), None for its default; ``hf`` only.
      revision: the Hub branch, tag or commit (default "main"); the commit read is
        recorded in ``run.json``; ``hf`` only.
      streaming: read the split's Parquet files from the Hub row group by row group into
        the token cache, downloading none of them (for splits larger than the disk should
        hold twice); offline, the cached files are read. ``hf`` only.
      field: the JSONL field or Parquet column holding each document's text.
      tokenizer: a ``wb.data.Tokenizer``, a path to a ``tokenizer.json`` / ``.model``, or
        None (byte-level).
      format: "auto" (by extension: ``.jsonl``, ``.parquet``, ``.array_record``, else
        plain text, one document per file), or one of ``files.FORMATS``.
      eval_fraction: the fraction of documents held out for evaluation (chosen by
        ``split_seed``); 0 for none.
      eval_files: instead, the documents of these files are the eval split.
      split_seed: which documents are held out, and the packing order.
      workers: Grain worker processes that tokenize when the cache is built (0: this
        process). Not part of what the run computes.
    """

    files: str | tuple[str, ...] = ()
    hf: str | None = None
    split: str | None = None
    config: str | None = None
    revision: str | None = None
    streaming: bool = False
    field: str = "text"
    tokenizer: Tokenizer | str | None = None
    format: str = "auto"
    eval_fraction: float = 0.0
    eval_files: str | tuple[str, ...] = ()
    split_seed: int = 0
    workers: int = 0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.hf is None:
            set_(self, "files", _patterns(self.files, "files"))
            given = [k for k in ("split", "config", "revision") if getattr(self, k) is not None]
            given += ["streaming"] if self.streaming is not False else []
            if given:
                raise ValueError(f"Dataset({given[0]}={getattr(self, given[0])!r}) is for Hub "
                                 "datasets; give Dataset(hf='org/name', ...) or drop it")
        else:
            check_hub_id(self.hf)
            if self.files:
                raise ValueError(f"give Dataset(files=...) or Dataset(hf={self.hf!r}), not "
                                 "both")
            set_(self, "files", ())
            set_(self, "split", "train" if self.split is None else self.split)
            check_hub_args(self.split, self.config, self.revision)
            check_bool(self.streaming, "streaming", where="Dataset.")
            if self.format != "auto":
                raise ValueError(f"Dataset(hf={self.hf!r}, format={self.format!r}): a Hub "
                                 "dataset's format is its files'; drop format")
        set_(self, "eval_files", _patterns(self.eval_files, "eval_files")
             if self.eval_files else ())
        set_(self, "tokenizer", _tokenizer(self.tokenizer))
        if self.format not in FORMATS:
            raise ValueError(f"Dataset.format={self.format!r}; choose one of {FORMATS}")
        if not isinstance(self.field, str) or not self.field:
            raise ValueError(f"Dataset.field={self.field!r} must name the text field/column")
        frac = self.eval_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
            raise ValueError(f"Dataset.eval_fraction={frac!r} must be a number in [0, 1), "
                             "e.g. 0.05 holds out 5% of the documents")
        if frac and self.eval_files:
            raise ValueError("give Dataset(eval_fraction=...) or Dataset(eval_files=...), "
                             "not both")
        for name in ("split_seed", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Dataset.{name}={v!r} must be an integer >= 0")

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary."""
        assert isinstance(self.tokenizer, Tokenizer)
        return self.tokenizer.vocab_size

    @property
    def has_eval(self) -> bool:
        """Whether there is a held-out split."""
        return bool(self.eval_fraction or self.eval_files)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form with ``"kind": "dataset"`` (``workers`` left out)."""
        assert isinstance(self.tokenizer, Tokenizer)
        where = {"files": list(self.files)} if self.hf is None else \
            {"hf": self.hf, "split": self.split, "config": self.config,
             "revision": self.revision, "streaming": self.streaming}
        return {"kind": "dataset", **where, "field": self.field,
                "tokenizer": self.tokenizer.to_dict(), "format": self.format,
                "eval_fraction": self.eval_fraction, "eval_files": list(self.eval_files),
                "split_seed": self.split_seed}

    def __hash__(self) -> int:
        return hash(str(self.to_dict()))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A dataset ready to read: its train rows and eval rows (random access) and facts.

    Attributes:
      train: a ``grain.MapDataset`` of train rows (dicts of int32 ``(seq + 1,)``).
      eval: the same for eval rows, or None.
      info: tokens, documents, rows, split documents, padding, cache folder.
    """

    train: grain.MapDataset
    eval: grain.MapDataset | None
    info: dict[str, Any]


def _cache(spec: Dataset, patterns: tuple[str, ...], cache_dir: Any, fmt: str | None = None
           ) -> TokenCache:
    assert isinstance(spec.tokenizer, Tokenizer)
    return build_token_cache(patterns, tokenizer=spec.tokenizer, field=spec.field,
                             fmt=fmt or spec.format, workers=spec.workers, cache_dir=cache_dir)


def _hub_cache(spec: Dataset, cache_dir: Any) -> tuple[TokenCache, dict[str, Any]]:
    """The token cache of a Hub split, and what ``run.json`` records of it: the id, split,
    config, revision and commit, and each file's SHA-256 by its ``hf://`` name."""
    assert spec.hf is not None and spec.split is not None
    hub = resolve_split(spec.hf, split=spec.split, config=spec.config, revision=spec.revision,
                        streaming=spec.streaming)
    where = f"Dataset(hf={spec.hf!r}, split={spec.split!r})"
    names = [hub.name(f) for f in hub.files]
    try:
        cache = hub_token_cache([str(f) for f in hub.files], names, tokenizer=spec.tokenizer,
                                field=spec.field, fmt=file_format(hub.files, where),
                                digests=hub.digests, workers=spec.workers, cache_dir=cache_dir)
    except DataError as e:   # name the dataset's file, not the snapshot's path
        text = str(e)
        for f, name in zip(hub.files, names):
            text = text.replace(str(f), name)
        raise DataError(f"{where}: {text}") from None
    each = cache.info["file_sha256"]
    if hub.digests is None:   # a cached blob must be the file the Hub served
        check_blobs({str(Path(f).resolve()): each[n] for f, n in zip(hub.files, names)}, where)
    record = {"id": hub.repo_id, "split": hub.split, "config": hub.config,
              "revision": spec.revision, "commit": hub.commit}
    return cache, {"hf": record, **({"file_sha256": each}
                                    if len(each) <= MAX_RECORDED_FILES else {})}


def _rows(cache: TokenCache, docs: np.ndarray, *, seq: int, seed: int, pad: int
          ) -> tuple[grain.MapDataset, dict[str, Any]]:
    packing = pack(cache.lengths, docs, seq=seq, seed=seed)
    src = grain.sources.ArrayRecordDataSource(str(cache.path))
    reader = PackedRows(src, cache.offsets, packing, seq=seq,
                        record_tokens=int(cache.info["record_tokens"]), pad_id=pad)
    return grain.MapDataset.range(packing.rows).map(reader), packing.info


#: Files whose SHA-256 the run records one by one (``run.json``'s ``data.file_sha256``),
#: so a resume names the file that changed; past this, the combined hash alone.
MAX_RECORDED_FILES = 64


def _file_hashes(cache: TokenCache, prefix: str = "") -> dict[str, Any]:
    """``{"file_sha256": {path: sha256}}`` of a cache's files, when there are few."""
    each = cache.info.get("file_sha256") or {}
    return {f"{prefix}file_sha256": each} if len(each) <= MAX_RECORDED_FILES else {}


def prepare(spec: Dataset, *, seq: int, vocab_size: int,
            cache_dir: str | os.PathLike[str] | None = None) -> Prepared:
    """Tokenizes (once, cached), splits and packs ``spec`` for sequences of ``seq`` tokens.

    Raises:
      ValueError: the tokenizer's vocabulary exceeds ``vocab_size``; no train rows.
      DataError: bad files (see :mod:`workbench.data._files`).
    """
    if not isinstance(spec, Dataset):
        raise TypeError(f"spec={spec!r} is a {type(spec).__name__}; prepare needs a "
                        "wb.data.Dataset(files=...)")
    check_int(seq, "seq", fix="give the tokens per training sequence")
    check_int(vocab_size, "vocab_size", fix="give the model's vocabulary size")
    if cache_dir is not None:
        cache_dir = check_path(cache_dir, "cache_dir")
    tok = spec.tokenizer
    assert isinstance(tok, Tokenizer)
    check_vocab(tok, vocab_size)
    pad = tok.pad_id if tok.pad_id is not None else 0
    if spec.hf is None:
        cache = _cache(spec, spec.files, cache_dir)
        hashes = _file_hashes(cache)
    else:
        cache, hashes = _hub_cache(spec, cache_dir)
    n = cache.lengths.size
    docs = np.arange(n)
    eval_ds, eval_info, eval_sha = None, None, None
    if spec.eval_fraction:
        n_eval = max(1, math.ceil(spec.eval_fraction * n))
        if n_eval >= n:
            raise ValueError(
                f"eval_fraction={spec.eval_fraction} of {n} documents leaves none to train "
                "on; lower eval_fraction or add documents")
        held = np.sort(np.random.default_rng(spec.split_seed).permutation(n)[:n_eval])
        docs = np.setdiff1d(docs, held)
        eval_ds, eval_info = _rows(cache, held, seq=seq, seed=spec.split_seed, pad=pad)
    elif spec.eval_files:
        ecache = _cache(spec, spec.eval_files, cache_dir)
        eval_sha = {"eval_sha256": ecache.info["sha256"]} | _file_hashes(ecache, "eval_")
        eval_ds, eval_info = _rows(ecache, np.arange(ecache.lengths.size), seq=seq,
                                   seed=spec.split_seed, pad=pad)
    train, train_info = _rows(cache, docs, seq=seq, seed=spec.split_seed, pad=pad)
    if not len(train):
        raise ValueError(f"{spec.hf or spec.files}: no document has 2 or more tokens to "
                         "train on")
    info = {"kind": "dataset", "cache": str(cache.folder), "sha256": cache.info["sha256"],
            **hashes, **(eval_sha or {}),
            "tokenizer": tok.to_dict(), "tokenizer_fingerprint": tok.fingerprint,
            "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size,
            "corpus_documents": int(n), "corpus_tokens": int(cache.info["tokens"]),
            "train": train_info, "eval": eval_info, "seq": seq}
    if train_info["split_documents"]:
        info["note"] = (f"{train_info['split_documents']} document(s) longer than seq+1="
                        f"{seq + 1} tokens were split into rows (none dropped)")
    return Prepared(train=train, eval=eval_ds, info=info)
