"""A Hugging Face cache holding a tiny model (or a small dataset) under a real Hub id, for
tests that run code written for that id (notebook 13 names "Qwen/Qwen3-0.6B", notebook 12
the dataset "Salesforce/wikitext") without the network.

The model is Qwen3-shaped (q/k norms, grouped kv heads, tied embeddings, bfloat16 as the
release is) but 2 layers of width 64 with random weights, written by ``wb.hf.to_hf``; its
tokenizer is tests/_chat_models.py's Qwen3-style one (its special tokens and chat
template, one token per character). The cache is laid out as ``huggingface_hub`` writes
it (``models--Qwen--Qwen3-0.6B/blobs``, ``snapshots/<commit>``, ``refs/main``), so with
``HF_HUB_CACHE`` pointing at it and ``HF_HUB_OFFLINE=1`` the id resolves to the snapshot
and nothing is downloaded.
"""
from __future__ import annotations

import os
from pathlib import Path

from tests._chat_models import hub_cache, write_tokenizer

#: The id notebook 13 names, and the commit the fake snapshot is filed under.
QWEN3_ID = "Qwen/Qwen3-0.6B"
COMMIT = "c0ffee" + "0" * 34


def tiny_qwen3_folder(folder: str | Path, *, seed: int = 0) -> Path:
    """A tiny Qwen3-style model folder (config.json, model.safetensors, tokenizer files)."""
    from flax import nnx

    import workbench as wb

    cfg = wb.models.GPTConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4,
                              n_kv_heads=2, head_dim=16, d_ff=128, seq_len=256,
                              qk_norm=True, tie_embeddings=True, norm_eps=1e-6,
                              rope_theta=1e6, dtype="bfloat16", param_dtype="bfloat16")
    model = wb.models.GPT(cfg, rngs=nnx.Rngs(seed))
    tok = write_tokenizer(Path(folder).with_name(Path(folder).name + "-tokenizer"), "qwen3")
    return wb.hf.to_hf(model, folder, tokenizer=tok)


def hub_cache_with(cache: str | Path, repo_id: str = QWEN3_ID, *, seed: int = 0) -> Path:
    """``cache`` (an ``HF_HUB_CACHE`` folder) holding a tiny Qwen3-style model filed under
    ``repo_id`` at :data:`COMMIT` (``refs/main``). Returns the snapshot folder."""
    cache = Path(cache)
    src = tiny_qwen3_folder(cache.parent / f".{cache.name}-src", seed=seed)
    hub_cache(cache, repo_id, {COMMIT: src}, {"main": COMMIT})
    return cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / COMMIT


#: The Hub dataset notebook 12 names (its config), and the commit its snapshot is filed under.
WIKITEXT_ID, WIKITEXT_CONFIG = "Salesforce/wikitext", "wikitext-2-raw-v1"


def hub_dataset_with(cache: str | Path, repo_id: str = WIKITEXT_ID,
                     config: str = WIKITEXT_CONFIG) -> Path:
    """``cache`` holding a small dataset filed as ``repo_id`` at :data:`COMMIT`, laid out as
    that repo is: ``<config>/{train,validation,test}-00000-of-00001.parquet`` with a
    ``text`` column (one line per row, as WikiText's), the splits named in the dataset
    card's ``configs:``. The rows are lines of the standard library's ``.py`` files."""
    import sysconfig

    import pyarrow as pa
    import pyarrow.parquet as pq

    cache = Path(cache)
    src = cache.parent / f".{cache.name}-dataset-src"
    lines = [ln for name in ("textwrap.py", "shlex.py", "fnmatch.py")
             for ln in (Path(sysconfig.get_paths()["stdlib"]) / name).read_text().splitlines()]
    card = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for i, split in enumerate(("train", "validation", "test")):
        part = lines[i::3] if split == "train" else lines[i::12]
        (src / config).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": part}), src / config / f"{split}-00000-of-00001.parquet")
        card += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    (src / "README.md").write_text("\n".join([*card, "---", f"# {repo_id} (a test stand-in)"]))
    hub_cache(cache, repo_id, {COMMIT: src}, {"main": COMMIT}, repo_type="dataset")
    return cache / ("datasets--" + repo_id.replace("/", "--")) / "snapshots" / COMMIT


def offline_env(hf_home: str | Path) -> dict[str, str]:
    """The environment that reads ``hf_home``'s cache and never the network (``HF_HOME``,
    its ``hub`` as ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``), for a kernel or subprocess."""
    hf_home = Path(hf_home)
    return {"HF_HOME": os.fspath(hf_home), "HF_HUB_CACHE": os.fspath(hf_home / "hub"),
            "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
