"""Hugging Face Hub datasets by id: a split's data files in huggingface_hub's cache, at a commit.

``wb.data.Dataset(hf="org/name", split="train", field="text")`` trains on a Hub dataset.
:func:`resolve_split` finds the split's files the way the ``datasets`` library does (its
own resolver, ``datasets.load_dataset_builder``: the dataset card's ``configs``, else its
default file-name patterns such as ``data/train-*``), fetches only those files with
``huggingface_hub.snapshot_download`` into the Hub cache (``HF_HUB_CACHE``, else
``HF_HOME/hub``), and returns them with the commit they were read at. The files are then
read like local ones (:mod:`workbench.data._tokens`: Parquet row groups, JSONL lines).

Why not ``datasets.load_dataset``: it converts every split of the config into an Arrow
copy in its own cache (a second copy of the bytes on disk, written before the first token
is read), and with ``HF_HUB_OFFLINE=1`` it cannot read a Hub id from the Hub cache at all
(it looks only for that Arrow copy). The files resolved here are the same ones
``load_dataset`` reads (the same resolver, run on the snapshot folder); docs/data.md has
the measurement.

The cache is checked before it is believed: the ref must hold a commit hash, the snapshot
must be ``snapshots/<commit>`` of the repo, every file must resolve inside the cache, and
a file stored by its SHA-256 (the Hub's LFS files) must have that SHA-256
(:func:`check_blobs`). The environment (``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``, ``HF_HOME``)
is read at each call, so setting it in a notebook takes effect.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from workbench._hub import cache_dir, offline
from workbench._validate import check_str
from workbench.data._files import DataError, DataFileNotFound

__all__ = ["HubSplit", "check_blobs", "check_hub_args", "check_hub_id", "file_format",
           "resolve_split"]

#: A commit hash as ``huggingface_hub`` writes it (refs, snapshot folder names).
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: A blob named by its SHA-256 (an LFS file: the Hub's etag is the content's SHA-256).
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Data file formats read (the token cache's readers).
SUFFIXES = (".parquet", ".jsonl", ".json", ".ndjson")

_LOGIN = ("log in with `hf auth login` (or set HF_TOKEN), after accepting the dataset's "
          "conditions on its Hub page")


@dataclasses.dataclass(frozen=True)
class HubSplit:
    """A Hub dataset's split, on disk.

    Attributes:
      repo_id: ``"org/name"``.
      config: the dataset's config (subset) read, or None for its default.
      split: the split.
      commit: the commit the files were read at (40 hex digits).
      folder: the snapshot folder (``datasets--org--name/snapshots/<commit>``), or None
        when streamed.
      files: the split's data files in the snapshot, in the order ``datasets`` reads them
        (streamed: their ``hf://datasets/org/name@<commit>/...`` URLs).
      digests: streamed: each file's SHA-256 as the Hub gives it (its LFS object id).
    """

    repo_id: str
    config: str | None
    split: str
    commit: str
    folder: Path | None
    files: tuple[Path | str, ...]
    digests: tuple[str, ...] | None = None

    def name(self, path: str | Path) -> str:
        """``hf://datasets/org/name/<file>`` of a file (the commit left out, so a resume at
        another commit names the file that changed)."""
        url = f"hf://datasets/{self.repo_id}@{self.commit}/"
        if self.folder is None:
            rel = str(path)[len(url):] if str(path).startswith(url) else str(path)
        else:
            rel = Path(path).relative_to(self.folder).as_posix()
        return f"hf://datasets/{self.repo_id}/{rel}"


def check_hub_id(value: Any) -> str:
    """``Dataset.hf`` as ``huggingface_hub`` accepts a repo id (``"org/name"``).

    Raises:
      TypeError: not a string.
      ValueError: not a repo id (naming it, and the form).
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    check_str(value, "hf", where="Dataset.", example="'roneneldan/TinyStories'")
    try:
        if not value.isascii() or value != value.strip() or value.count("/") != 1:
            raise HFValidationError("it must be 'org/name' of ASCII letters, digits, '-', "
                                    "'_' and '.'")
        validate_repo_id(value)
    except HFValidationError as e:
        raise ValueError(f"Dataset.hf={value!r} is not a Hub dataset id ({e}); give "
                         "'org/name' as on the dataset's Hub page, e.g. "
                         "'roneneldan/TinyStories'") from None
    return value


def _check_name(value: Any, name: str, example: str, *, none: bool = False) -> str | None:
    """``Dataset.split`` / ``.config`` / ``.revision``: a non-empty, single-line string."""
    if value is None and none:
        return None
    check_str(value, name, where="Dataset.", example=example)
    if value != value.strip() or any(c in value for c in "\x00\n\r"):
        raise ValueError(f"Dataset.{name}={value!r} has surrounding spaces or a control "
                         f"character; give the name as the Hub shows it, e.g. {example}")
    return value


def check_hub_args(split: Any, config: Any, revision: Any) -> None:
    """Raises for a ``split``, ``config`` or ``revision`` no Hub dataset can have."""
    _check_name(split, "split", "'train'")
    _check_name(config, "config", "'sample-10BT'", none=True)
    _check_name(revision, "revision", "'main' or a commit hash", none=True)


def resolve_split(repo_id: str, *, split: str, config: str | None = None,
                  revision: str | None = None, progress: bool = True,
                  streaming: bool = False) -> HubSplit:
    """The data files of ``split`` of the Hub dataset ``repo_id``, fetched into the Hub
    cache unless there already (or ``HF_HUB_OFFLINE=1``: read from it only).

    ``streaming``: nothing is downloaded; the split's Parquet files are named by their
    ``hf://`` URLs at the commit (read row group by row group through
    ``huggingface_hub.HfFileSystem``), with the SHA-256 the Hub records for each. Offline
    there is nothing to stream from: the cached files are read.

    Raises:
      DataFileNotFound: not on the Hub, or (offline) not in the cache at that revision.
      DataError: gated, no such revision, config or split, no data file the token cache
        reads, or a cache that is not as ``huggingface_hub`` writes it; each names the id,
        the split and the fix.
    """
    where = f"Dataset(hf={repo_id!r}, split={split!r})"
    if streaming and not offline():
        return _stream(repo_id, split, config, revision, where)
    if not offline():
        revision = _fetch(repo_id, split, config, revision, progress, where)
    folder = _snapshot(repo_id, revision, where)
    files = _split_files(str(folder), split, config, where, cached=True)
    return HubSplit(repo_id=repo_id, config=config, split=split, commit=folder.name,
                    folder=folder, files=tuple(Path(f) for f in files))


def _builder(path: str, config: str | None, revision: str | None, where: str) -> Any:
    """``datasets.load_dataset_builder`` of a Hub id or a snapshot folder, its refusals
    named."""
    import datasets
    from huggingface_hub import errors

    try:
        return datasets.load_dataset_builder(path, name=config, revision=revision)
    except errors.RevisionNotFoundError:
        raise DataError(f"{where}: the dataset has no revision {revision or 'main'!r}; give a "
                        "branch, tag or commit hash from its 'Files and versions' page, or "
                        "leave revision out for 'main'") from None
    except errors.GatedRepoError:
        raise DataError(f"{where}: the dataset is gated: reading it needs a token of an "
                        f"account with access: {_LOGIN}") from None
    except ConnectionError as e:
        raise DataFileNotFound(f"{where}: the Hub could not be reached ({e}) and nothing is "
                               "read without it but a cached split: check the connection, or "
                               "set HF_HUB_OFFLINE=1 to read the cache") from None
    except datasets.exceptions.DatasetNotFoundError as e:
        if "gated" in str(e):
            raise DataError(f"{where}: the dataset is gated: reading it needs a token of an "
                            f"account with access: {_LOGIN}") from None
        raise DataFileNotFound(f"{where}: no dataset {path!r} on the Hugging Face Hub (or "
                               f"it is private: {_LOGIN}); check the id on its Hub page"
                               ) from None
    except ValueError as e:
        if "BuilderConfig" in str(e):
            raise DataError(f"{where}: config={config!r} is not a config of the dataset "
                            f"({str(e).split('. ', 1)[-1]}); pass Dataset(config=...) naming "
                            "one") from None
        raise DataError(f"{where}: the datasets library cannot read its files ({e}); "
                        "give local files with Dataset(files=...)") from None
    except FileNotFoundError as e:   # a snapshot with no data files datasets recognises
        raise DataError(f"{where}: the datasets library finds no data files in {path} "
                        f"({e}); the dataset must hold Parquet or JSONL files") from None


def _split_files(path: str, split: str, config: str | None, where: str, *,
                 revision: str | None = None, cached: bool = False) -> list[str]:
    """The split's files as ``datasets`` resolves them (hf:// URLs, or snapshot paths)."""
    data_files = _builder(path, config, revision, where).config.data_files or {}
    if split not in data_files:
        cached_only = (" in the Hugging Face cache, and HF_HUB_OFFLINE=1 reads only cached "
                   "splits: run once online to download it, or choose a cached one") \
            if cached and offline() else ""
        raise DataError(f"{where}: the dataset has no split {split!r} (splits: "
                        f"{sorted(data_files)}){cached_only}; pass Dataset(split=...) naming one")
    files = [str(f) for f in data_files[split]]
    wrong = [f for f in files if not f.lower().endswith(SUFFIXES)]
    if wrong:
        shown = [f[len(path) + 1:] if f.startswith(path + "/") else f for f in wrong]
        raise DataError(f"{where}: the split's files {shown[:3]} "
                        f"are not Parquet or JSONL ({', '.join(SUFFIXES)}), the formats read; "
                        "convert them, or use the Hub's Parquet export "
                        "(revision='refs/convert/parquet')")
    return files


def _hub_paths(repo_id: str, split: str, config: str | None, revision: str | None,
               where: str) -> tuple[str, list[str]]:
    """``(commit, paths in the repo)`` of the split's files, as ``datasets`` resolves them
    on the Hub (to ``hf://datasets/org/name@<commit>/<path>``)."""
    urls = _split_files(repo_id, split, config, where, revision=revision)
    prefix = re.compile(rf"hf://datasets/{re.escape(repo_id)}@([0-9a-f]{{40}})/(.+)")
    found = [prefix.fullmatch(u) for u in urls]
    if not all(found) or len({m.group(1) for m in found if m}) != 1:
        raise DataError(f"{where}: the datasets library resolved the split to {urls[:2]}, "
                        "not files of one commit of the repo; give revision= a commit hash")
    return found[0].group(1), [m.group(2) for m in found if m]   # type: ignore[union-attr]


def _stream(repo_id: str, split: str, config: str | None, revision: str | None,
            where: str) -> HubSplit:
    """The split's files as URLs at their commit, with the Hub's SHA-256 of each."""
    from huggingface_hub import HfApi

    commit, paths = _hub_paths(repo_id, split, config, revision, where)
    infos = {i.path: i for i in HfApi().get_paths_info(repo_id, paths, repo_type="dataset",
                                                        revision=commit)}
    plain = [p for p in paths if getattr(infos.get(p), "lfs", None) is None]
    if plain or not all(p.lower().endswith(".parquet") for p in paths):
        raise DataError(f"{where}: streaming reads the split's Parquet files stored by the Hub "
                        f"with their SHA-256 (LFS); {(plain or paths)[:2]} are not; drop "
                        "streaming=True to download the files")
    return HubSplit(repo_id=repo_id, config=config, split=split, commit=commit, folder=None,
                    files=tuple(f"hf://datasets/{repo_id}@{commit}/{p}" for p in paths),
                    digests=tuple(infos[p].lfs.sha256 for p in paths))


def _fetch(repo_id: str, split: str, config: str | None, revision: str | None,
           progress: bool, where: str) -> str:
    """Downloads the split's files (and the dataset card) into the Hub cache; returns the
    commit they were read at."""
    import huggingface_hub
    from huggingface_hub import errors
    from tqdm.auto import tqdm

    commit, paths = _hub_paths(repo_id, split, config, revision, where)

    try:
        huggingface_hub.snapshot_download(
            repo_id, repo_type="dataset", revision=commit, cache_dir=cache_dir(),
            allow_patterns=["README.md", *paths],
            tqdm_class=tqdm if progress else None)
    except errors.GatedRepoError:
        raise DataError(f"{where}: the dataset is gated: {_LOGIN}") from None
    except errors.LocalEntryNotFoundError:
        raise DataFileNotFound(f"{where}: the Hub could not be reached and the split is not "
                               f"in the cache ({cache_dir()}); check the connection") from None
    return commit


def _snapshot(repo_id: str, revision: str | None, where: str) -> Path:
    """The cached snapshot folder of ``revision`` (default "main"), checked."""
    import huggingface_hub
    from huggingface_hub import errors

    cache = cache_dir()
    repo = cache / ("datasets--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    _check_ref(repo, rev, where)
    try:
        folder = Path(huggingface_hub.snapshot_download(
            repo_id, repo_type="dataset", revision=revision, cache_dir=cache,
            local_files_only=True))
    except errors.LocalEntryNotFoundError:
        refs = sorted(p.name for p in (repo / "refs").glob("*")) if repo.is_dir() else []
        have = f" (cached: refs {refs})" if refs else ""
        raise DataFileNotFound(
            f"{where}: revision {rev!r} of the dataset is not in the Hugging Face cache "
            f"({cache}){have}, and HF_HUB_OFFLINE=1 forbids downloading it: run once online "
            f"(`hf download {repo_id} --repo-type dataset`), unset HF_HUB_OFFLINE, or give a "
            "cached revision") from None
    return _check_snapshot(folder, repo, cache, where)


def _check_ref(repo: Path, rev: str, where: str) -> None:
    """``refs/<rev>``, when cached, must hold a commit hash and nothing else."""
    if _COMMIT.fullmatch(rev):
        return
    refs = repo / "refs"
    ref = refs / rev
    if not os.path.normpath(ref).startswith(os.path.normpath(refs) + os.sep):
        raise DataError(f"{where}: revision={rev!r} leaves the repo's refs folder; give a "
                        "branch, tag or commit hash")
    if not os.path.lexists(ref):
        return
    if ref.is_symlink() or not ref.is_file():   # a directory, a FIFO (would block), a link
        raise DataError(f"{where}: the cache's {ref} is not a file holding a commit hash (as "
                        "huggingface_hub writes it); delete it and download again, or pass "
                        "the commit as revision=")
    with open(ref, "rb") as f:
        text = f.read(100).decode("utf-8", "replace")
    if not _COMMIT.fullmatch(text):
        raise DataError(f"{where}: the cache's {ref} holds {text[:60]!r}, not a commit hash "
                        "(40 lowercase hex digits, as huggingface_hub writes it); delete the "
                        "file and download again, or pass the commit as revision=")


def _check_snapshot(folder: Path, repo: Path, cache: Path, where: str) -> Path:
    """``folder`` if it is ``snapshots/<commit>`` of ``repo`` and all its files resolve to
    files inside the cache."""
    snapshots = repo / "snapshots"
    if not _COMMIT.fullmatch(folder.name) or \
            os.path.normpath(folder) != os.path.normpath(snapshots / folder.name):
        raise DataError(f"{where}: the Hugging Face cache resolved it to {folder}, not a "
                        f"snapshot folder ({snapshots}/<40-hex commit>); delete "
                        f"{repo / 'refs'} and download again")
    root = cache.resolve()
    for f in [folder, *folder.rglob("*")]:
        real = f.resolve()
        if not real.is_relative_to(root):
            raise DataError(f"{where}: the snapshot's {f.relative_to(folder.parent)} leads "
                            f"outside the Hugging Face cache ({root}) to {real}; delete that "
                            "snapshot folder and download again")
        if f.is_symlink() and not f.exists():
            raise DataError(f"{where}: the snapshot's {f.relative_to(folder)} points to a "
                            "missing blob (the cache was edited); delete that snapshot "
                            "folder and download again")
        if not (f.is_file() or f.is_dir()):   # a FIFO would block its reader
            raise DataError(f"{where}: the snapshot's {f.relative_to(folder)} is not a file "
                            "(the cache was edited); delete that snapshot folder and "
                            "download again")
    return folder


def check_blobs(digests: dict[str, str], where: str) -> None:
    """Raises :class:`DataError` for a cached file whose blob is named by a SHA-256 (an
    LFS file: the Hub names it by its content) other than the SHA-256 of its bytes
    (``digests``: ``{blob path: SHA-256}``, as the token cache hashed them)."""
    for path, digest in digests.items():
        name = Path(path).name
        if _SHA256.fullmatch(name) and digest != name:
            raise DataError(f"{where}: the cached blob {path} is not the file the Hub served "
                            f"(named by SHA-256 {name[:12]}..., its bytes hash to "
                            f"{digest[:12]}...: edited by hand?); delete the dataset's "
                            "snapshot and blobs and download again")


def file_format(files: tuple[Path | str, ...], where: str) -> str:
    """The one token-cache format of a split's files ("parquet" or "jsonl")."""
    kinds = {"parquet" if str(f).lower().endswith(".parquet") else "jsonl" for f in files}
    if len(kinds) != 1:
        raise DataError(f"{where}: the split mixes Parquet and JSONL files; give one "
                        "format's files with Dataset(files=...)")
    return kinds.pop()
