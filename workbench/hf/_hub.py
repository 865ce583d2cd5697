"""Hugging Face Hub ids -> local snapshot folders, through ``huggingface_hub``'s own cache.

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

_LOGIN = ("log in with `hf auth login` (or set HF_TOKEN), after accepting the model's "
          "licence on its Hub page")


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
    if not is_hub_id(name):
        if revision is not None:
            raise ValueError(f"{where}: revision={revision!r} is for Hub ids; {arg}={name!r} is "
                             "a local path (or no Hub id): drop revision")
        return Resolved(Path(name))
    folder = Path(_download(name, revision, progress, files or MODEL_FILES,
                            f"{where}: {arg}"))
    broken = sorted(str(f.relative_to(folder)) for f in folder.rglob("*")
                    if f.is_symlink() and not f.exists())
    if broken:
        raise HubError(
            f"{where}: {arg}={name!r}: the Hugging Face cache is damaged: {broken[:3]} in "
            f"{folder} point to missing blobs; download again with `hf download {name} "
            "--force-download` (online), or delete that snapshot folder")
    return Resolved(folder, name, folder.name)


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


def check_weights(resolved: Resolved, where: str, arg: str = "path") -> None:
    """Raises if a Hub snapshot holds no safetensors weights (a PyTorch ``.bin``-only or
    GGUF repo), naming the id."""
    if resolved.repo_id is None:
        return
    p = resolved.path
    if (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file():
        return
    from workbench.hf._tensors import CheckpointError

    weights = [f.name for f in p.iterdir() if f.suffix in (".bin", ".pth", ".pt", ".gguf")]
    if offline() and not weights:
        raise HubError(
            f"{where}: {arg}={resolved.repo_id!r} is in the Hugging Face cache (commit "
            f"{resolved.revision}) without its weights (only its config was downloaded), and "
            "HF_HUB_OFFLINE=1 forbids downloading them: load it once online, or unset "
            "HF_HUB_OFFLINE")
    raise CheckpointError(
        f"{where}: {arg}={resolved.repo_id!r} (commit {resolved.revision}) has no "
        "safetensors weights (model.safetensors or model.safetensors.index.json): only "
        "safetensors checkpoints are read. Use a repo that has them (most do; look for a "
        "'safetensors' tag), or convert the .bin files with transformers' "
        "save_pretrained(..., safe_serialization=True) and pass that folder")
