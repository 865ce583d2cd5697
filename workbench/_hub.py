"""Hugging Face Hub ids -> local snapshot folders, through ``huggingface_hub``'s own cache:
below ``data`` (datasets by Hub id), ``hf`` (models) and ``train`` (``init=``).

``from_hf``, ``hf_config``, ``Tokenizer.from_hf`` and ``TrainConfig(init=...)`` take either
a local folder or a Hub id (``"Qwen/Qwen3-0.6B"``). :func:`resolve` decides which:

- an existing local path always wins (a folder named like an id is a folder);
- else ``org/name`` (two parts, Hub characters only) is a Hub id, fetched with
  ``huggingface_hub.snapshot_download`` into its cache (``HF_HUB_CACHE``, else
  ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), with its token discovery
  (``HF_TOKEN``, ``hf auth login``) and ``HF_HUB_OFFLINE=1`` (the cache only);
- anything else is a missing local path.

Only the files a model needs are fetched (:data:`MODEL_FILES`): config, safetensors
weights and index, tokenizer and chat template; never ``*.bin``, ``consolidated.*`` or
ONNX copies. The environment is read when called, not when ``huggingface_hub`` was
imported, so ``os.environ["HF_HUB_OFFLINE"] = "1"`` in a notebook takes effect.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from workbench._validate import check_revision, is_hub_id

__all__ = ["CONFIG_FILES", "HubError", "MODEL_FILES", "Resolved", "TOKENIZER_PATTERNS",
           "is_hub_id", "resolve"]

#: What ``hf_config`` needs.
CONFIG_FILES = ["config.json", "generation_config.json"]
#: A tokenizer and its chat template (``Tokenizer.from_hf``).
TOKENIZER_PATTERNS = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "tokenizer.model", "chat_template.jinja"]
#: Everything ``from_hf`` reads: config, safetensors weights (+ index), tokenizer.
MODEL_FILES = [*CONFIG_FILES, "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json", *TOKENIZER_PATTERNS]

#: A commit hash as ``huggingface_hub`` writes it in ``refs/`` (and names snapshots by).
_COMMIT = re.compile(r"[0-9a-f]{40}")

_LOGIN = ("log in with `hf auth login` (or set HF_TOKEN), after accepting the model's "
          "licence on its Hub page")


def cache_dir() -> Path:
    """``huggingface_hub``'s cache folder, read from the environment now."""
    from huggingface_hub import constants

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now."""
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if var in os.environ:
            return os.environ[var].strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE)


class HubError(OSError):
    """A Hub id that cannot be had: not on the Hub, gated, offline and not cached, a
    revision that does not exist. The message names the id and the fix."""


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A local folder, and the Hub id and commit it is a snapshot of (None for a folder
    given by path)."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None


def check_progress(progress: Any, where: str) -> bool:
    if not isinstance(progress, bool):
        raise TypeError(f"{where}: progress={progress!r} must be True (a download progress "
                        "bar) or False (quiet)")
    return progress


def resolve(name: Any, *, revision: str | None = None, progress: bool = True,
            files: list[str] | None = None, where: str = "from_hf",
            arg: str = "path") -> Resolved:
    """The local folder for ``name``: the path itself, or the Hub snapshot, downloaded.

    Args:
        name: a local folder (or file) path, or a Hub id ``"org/name"``.
        revision: a branch, tag or commit of the Hub repo (default "main"); only with an id.
        progress: show a progress bar while downloading (a widget in notebooks).
        files: ``allow_patterns`` (default :data:`MODEL_FILES`).
        where, arg: the entry point and the argument named in errors.

    Raises:
        HubError: the id is not on the Hub, is gated, the revision does not exist, or it
            is not cached and ``HF_HUB_OFFLINE=1`` (each naming the id and the fix).
    """
    revision = check_revision(revision, where)
    check_progress(progress, where)
    if not is_hub_id(name) and _id_shaped(name):
        _check_id(name, f"{where}: {arg}")
    if not is_hub_id(name):
        if revision is not None:
            raise ValueError(f"{where}: revision={revision!r} is for Hub ids; {arg}={name!r} is "
                             "a local path (or no Hub id): drop revision")
        return Resolved(Path(name))
    _check_id(name, f"{where}: {arg}")
    if offline():
        _check_ref(name, revision, f"{where}: {arg}")
    folder = _check_snapshot(Path(_download(name, revision, progress, files or MODEL_FILES,
                                            f"{where}: {arg}")), name, f"{where}: {arg}")
    return Resolved(folder, name, folder.name)


def _id_shaped(name: Any) -> bool:
    """``"org/name"`` in shape (one slash, relative), missing as a local path: an id."""
    return isinstance(name, str) and name.count("/") == 1 and \
        not name.startswith(("/", ".", "~")) and "" not in name.split("/") and \
        not os.path.exists(os.path.expanduser(name))


def _check_id(name: str, where: str) -> None:
    """Raises :class:`HubError` naming ``name`` unless ``huggingface_hub`` accepts it."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        if not name.isascii() or name != name.strip():
            raise HFValidationError("only ASCII letters, digits, '-', '_' and '.'")
        validate_repo_id(name)
    except HFValidationError as e:
        raise HubError(f"{where}={name!r} is neither an existing local path nor a valid Hub "
                       f"id ({e}); a Hub id is 'org/name' of ASCII letters, digits, '-', '_' "
                       "and '.', without '--' or '..', each part at most 96 characters, e.g. "
                       "'Qwen/Qwen3-0.6B'") from None


def _repo_folder(repo_id: str) -> Path:
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def _check_ref(repo_id: str, revision: str | None, where: str) -> None:
    """The cached ``refs/<revision>`` a revision name resolves through offline must hold a
    commit hash (40 lowercase hex digits, nothing else, as ``huggingface_hub`` writes it)."""
    rev = revision or "main"
    if _COMMIT.fullmatch(rev):
        return
    refs = _repo_folder(repo_id) / "refs"
    ref = refs / rev
    if not os.path.normpath(ref).startswith(os.path.normpath(refs) + os.sep):
        raise HubError(f"{where}={repo_id!r}: revision={rev!r} leaves the repo's refs folder; "
                       "give a branch, tag or commit hash")
    if not ref.is_file():
        return
    with open(ref, "rb") as f:
        data = f.read(100)
    text = data.decode("utf-8", "replace")
    if not _COMMIT.fullmatch(text):
        raise HubError(
            f"{where}={repo_id!r}: the cache's {ref} holds {text[:60]!r}, not a commit hash "
            "(40 lowercase hex digits, no whitespace, as huggingface_hub writes it); delete "
            f"the file and download again (`hf download {repo_id}`), or pass the commit as "
            "revision=")


def _check_snapshot(folder: Path, repo_id: str, where: str) -> Path:
    """``folder`` if it is ``snapshots/<commit>`` of the repo in the cache and every file
    in it resolves (symlinks followed) to a file inside the cache."""
    snapshots = _repo_folder(repo_id) / "snapshots"
    if not _COMMIT.fullmatch(folder.name) or \
            os.path.normpath(folder) != os.path.normpath(snapshots / folder.name):
        raise HubError(
            f"{where}={repo_id!r}: the Hugging Face cache resolved it to {folder}, not a "
            f"snapshot folder ({snapshots}/<40-hex commit>): its refs file is damaged; "
            f"delete {snapshots.parent / 'refs'} and download again (`hf download {repo_id}`)")
    root = cache_dir().resolve()
    outside, broken = [], []
    for f in [folder, *folder.rglob("*")]:
        real = f.resolve()
        if not real.is_relative_to(root):
            outside.append(f"{f.relative_to(folder.parent)} -> {real}")
        elif f.is_symlink() and not f.exists():
            broken.append(str(f.relative_to(folder)))
    if outside:
        raise HubError(
            f"{where}={repo_id!r}: the snapshot {folder} links outside the Hugging Face cache "
            f"({root}): {outside[:3]}; a snapshot's files are links to its repo's blobs: "
            "delete that snapshot folder and download again")
    if broken:
        raise HubError(
            f"{where}={repo_id!r}: the Hugging Face cache is damaged: {sorted(broken)[:3]} in "
            f"{folder} point to missing blobs; download again with `hf download {repo_id} "
            "--force-download` (online), or delete that snapshot folder")
    return folder


def _download(repo_id: str, revision: str | None, progress: bool, patterns: list[str],
              where: str) -> str:
    """``snapshot_download``, its errors turned into :class:`HubError` naming the fix
    (``where``: "from_hf: path", the message goes on with ``={repo_id!r}``)."""
    import huggingface_hub
    from huggingface_hub import errors

    rev = revision or "main"
    cached = cache_dir()
    try:
        return huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=cached, allow_patterns=patterns,
            local_files_only=offline(), tqdm_class=_bar(progress))
    except errors.GatedRepoError:
        raise HubError(f"{where}={repo_id!r} is a gated model: downloading it needs a token "
                       f"of an account with access: {_LOGIN}") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{where}={repo_id!r} has no revision {rev!r}; give a branch, tag or "
                       "commit hash from the repo's 'Files and versions' page, or leave "
                       "revision out for 'main'") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{where}={repo_id!r} is neither a local folder nor a model on the "
                       "Hugging Face Hub (or it is private: " + _LOGIN + "); check the "
                       "spelling, e.g. 'Qwen/Qwen3-0.6B'") from None
    except errors.LocalEntryNotFoundError:
        if offline():
            raise HubError(
                f"{where}={repo_id!r} (revision {rev!r}) is not in the Hugging Face cache "
                f"({cached}) and HF_HUB_OFFLINE=1 forbids downloading it: download it once "
                f"online (`hf download {repo_id}`), unset HF_HUB_OFFLINE, or give a local "
                "folder") from None
        raise HubError(f"{where}={repo_id!r} could not be downloaded (the Hub could not be "
                       f"reached) and is not in the cache ({cached}); check the connection, "
                       "or give a local folder") from None


def _bar(progress: bool) -> type:
    """The progress bar class for ``snapshot_download``: ``tqdm.auto`` (a widget in
    Jupyter, where huggingface_hub's own bar, which needs a TTY, stays hidden), or a
    silent one."""
    from tqdm.auto import tqdm

    if progress:
        return tqdm

    class Quiet(tqdm):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet
