"""The Hugging Face Hub's cache folder and offline switch, read from the environment at each
call (huggingface_hub reads its constants once, when imported): below both ``hf`` (models by
Hub id) and ``data`` (datasets by Hub id)."""
from __future__ import annotations

import os
from pathlib import Path


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
