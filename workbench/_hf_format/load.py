"""A Hugging Face folder's safetensors weights into the shardings given (``load_params``):
every tensor's name, shape and dtype checked against the config first, then each device's
block read from its shard with ``get_slice`` (only those bytes), one tensor at a time.
``from_hf`` (a model) and the Trainer's ``init=`` (a run's parameters) both load through it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from workbench._hf_format.families import family_of, read_config
from workbench._hf_format.tensors import (CheckpointError, Folder, Mapping_, mappings,
                                          normalize, read_core)
from workbench._hf_format.vocab import check_tokenizer
from workbench._hub import HubError, Resolved, offline
from workbench.models._config import GPTConfig

__all__ = ["HFSource", "check_weights", "load_params"]

#: safetensors dtypes a float parameter can be loaded from.
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
# Buffers older checkpoints carry that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFSource:
    """Where an imported model came from (recorded by the Trainer in ``run.json``).

    Attributes:
        path: the model folder (absolute; for a Hub id, its snapshot in the HF cache).
        family: its family (``llama``, ``qwen2_moe``, ...).
        files: the safetensors files read.
        dtype: the checkpoint's float dtype(s), e.g. "bfloat16".
        repo_id: the Hub id it was loaded by (None for a local folder).
        revision: the commit hash of that snapshot (None for a local folder).
        eos_ids: the model's end-of-sequence ids, from ``generation_config.json`` (else
            ``config.json``) ``eos_token_id``; ``wb.generate`` stops at them.
    """

    path: str
    family: str
    files: tuple[str, ...]
    dtype: str
    repo_id: str | None = None
    revision: str | None = None
    eos_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {"format": "huggingface", **dataclasses.asdict(self), "files": list(self.files),
             "eos_ids": list(self.eos_ids)}
        return {k: v for k, v in d.items() if v is not None}


def eos_ids(path: Path) -> tuple[int, ...]:
    """``eos_token_id`` of ``generation_config.json`` (else ``config.json``): one id or a
    list; () when absent or unreadable (the tokenizer's EOS still applies)."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        try:
            value = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids = value if isinstance(value, list) else [value]
        if value is not None and all(isinstance(i, int) and not isinstance(i, bool)
                                     and i >= 0 for i in ids):
            return tuple(ids)
    return ()


def _expected(folder: Folder, cfg: GPTConfig, family: str
              ) -> list[tuple[Mapping_, list[tuple[tuple[int, ...], str]]]]:
    """Every mapping with its HF tensors, checked against the folder (before reading)."""
    plan = [(m, list(m.hf_names(cfg.n_layers, cfg.n_experts))) for m in mappings(cfg, family)]
    used: set[str] = set()
    for m, names in plan:
        for _, name in names:
            used.add(name)
            if name not in folder:
                raise CheckpointError(
                    f"tensor {name!r} (for parameter {m.name}) is not in {folder.path}; the "
                    f"checkpoint does not match its config.json ({family}): a missing shard, "
                    "or a config from another model")
            shape, dt = folder.shape(name), folder.dtype(name)
            if shape != m.hf_shape:
                hint = " (the vocabulary size differs from config.json's vocab_size)" \
                    if m.path[0] in ("embed", "lm_head") else ""
                raise CheckpointError(
                    f"tensor {name!r} in {folder.files[name].name} has shape {list(shape)}, "
                    f"but config.json implies {list(m.hf_shape)}{hint}; fix config.json or "
                    "use the checkpoint it belongs to")
            if dt not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"tensor {name!r} is {dt}; parameters load from "
                    f"{', '.join(FLOAT_DTYPES)} (quantised checkpoints are not supported: "
                    "dequantise to bfloat16 first)")
    extra = sorted(n for n in folder.names() if n not in used and not n.endswith(
        _IGNORED_SUFFIXES) and not (cfg.tie_embeddings and n == "lm_head.weight"))
    if extra:
        raise CheckpointError(
            f"{folder.path} holds tensors the {family} model has no place for: {extra[:4]}"
            f"{' ...' if len(extra) > 4 else ''}; config.json may not describe this "
            "checkpoint (a bias, a different block type)")
    return plan


def load_params(path: str | Path, cfg: GPTConfig, shardings: Any, *,
                hub: Resolved | None = None) -> tuple[Any, HFSource]:
    """The parameters of ``GPT(cfg)`` from an HF folder, each built in its sharding.

    Args:
        path: the HF model folder (a Hub id: :func:`workbench._hub.resolve` it first).
        cfg: the model's config (``hf_config(path, ...)``).
        shardings: the params' pure dict of ``NamedSharding`` (a plan's or Trainer's).
        hub: the resolved Hub id the folder is a snapshot of (recorded in the source).

    Returns:
        ``(params, source)``: the pure dict of sharded ``jax.Array`` and its
        :class:`HFSource`.
    """
    path = Path(path).resolve()
    family = family_of(read_config(path), str(path / "config.json"))
    try:
        check_tokenizer([path / n for n in ("tokenizer.json", "tokenizer.model")
                         if (path / n).is_file()], cfg.vocab_size, where=f"loading {path}",
                        fix="the tokenizer belongs to another model, or config.json's "
                            "vocab_size is wrong: copy the model's own tokenizer files",
                        unreadable_ok=True)   # the weights load without a tokenizer
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    folder = Folder(path)
    try:
        plan = _expected(folder, cfg, family)
        for m, names in plan:
            _check_divides(m, _get(shardings, m.path), cfg)
        params: dict[str, Any] = {}
        for m, names in plan:
            sharding = _get(shardings, m.path)
            arr = _load_one(folder, m, dict(names), sharding, np.dtype(cfg.param_dtype))
            _set(params, m.path, arr)
            folder.close()   # release the memory-mapped pages of the files read
    finally:
        folder.close()
    dts = sorted({FLOAT_DTYPES[folder.dtype(n)] for n in folder.names()
                  if folder.dtype(n) in FLOAT_DTYPES})
    files = tuple(sorted({f.name for f in folder.files.values()}))
    return params, HFSource(path=str(path), family=family, files=files, dtype="+".join(dts),
                            repo_id=hub.repo_id if hub else None,
                            revision=hub.revision if hub else None, eos_ids=eos_ids(path))


def _check_divides(m: Mapping_, sharding: Any, cfg: GPTConfig) -> None:
    """Raise (before reading) if a mesh axis does not divide the dim it shards."""
    stack = tuple(cfg.n_layers if s == "layers" else cfg.n_experts for s in m.stack)
    shape = stack + m.core_shape
    mesh = sharding.mesh
    for dim, (size, axes) in enumerate(zip(shape, tuple(sharding.spec) + (None,) * len(
            shape), strict=False)):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if size % n:
            raise ValueError(
                f"dim {dim} of {m.name!r} (size {size}) is not divisible by mesh axis "
                f"{axes[0] if len(axes) == 1 else axes!r} (size {n}); use a mesh whose axis "
                f"divides {size}, or rules that map this dim to None")


def _load_one(folder: Folder, m: Mapping_, names: dict[tuple[int, ...], str],
              sharding: Any, dtype: np.dtype) -> jax.Array:
    """One parameter, each device's block read from disk (shared blocks read once)."""
    n_stack = len(m.stack)
    shape = tuple(max(i + 1 for i in (idx[a] for idx in names)) for a in range(n_stack)) \
        + m.core_shape
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def block(index: tuple[slice, ...]) -> np.ndarray:
        idx = normalize(index, shape)
        key = tuple((s.start, s.stop) for s in idx)
        if key not in blocks:
            stack, core = idx[:n_stack], idx[n_stack:]
            ranges = [range(s.start, s.stop) for s in stack]
            parts = [_finite(read_core(folder, m, names[i], core).astype(dtype), folder,
                             names[i], m) for i in _product(ranges)]
            lens = [len(r) for r in ranges]
            blocks[key] = np.stack(parts).reshape(lens + list(parts[0].shape)) \
                if n_stack else parts[0]
        return blocks[key]

    return jax.make_array_from_callback(shape, sharding, block, dtype=dtype)


def _finite(block: np.ndarray, folder: Folder, name: str, m: Mapping_) -> np.ndarray:
    """``block`` (a slice of HF tensor ``name``, as it streams in) if every value is finite.

    One pass over bytes just read (memory bandwidth, next to the disk read); NaN or inf
    weights would load silently and give NaN logits (``generate`` then emits token 0).

    Raises:
      CheckpointError: naming the tensor, its file, how many values and the fix.
    """
    finite = np.isfinite(block)
    if finite.all():
        return block
    bad = block[~finite]
    kinds = ", ".join(k for k, n in (("NaN", np.isnan(bad).sum()),
                                     ("inf", np.isinf(bad).sum())) if n)
    raise CheckpointError(
        f"tensor {name!r} in {folder.files[name]} (parameter {m.name}) holds {bad.size} "
        f"non-finite value(s) ({kinds}) in the block read; the checkpoint is damaged or "
        "was saved after training diverged: download or copy it again, or export it from "
        "an earlier good step. Nothing was loaded")


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    """Every index of the stacked ranges, row-major."""
    return [tuple(r[j] for r, j in zip(ranges, i, strict=True))
            for i in np.ndindex(*[len(r) for r in ranges])]


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def check_weights(resolved: Resolved, where: str, arg: str = "path") -> None:
    """Raises if a Hub snapshot holds no safetensors weights (a PyTorch ``.bin``-only or
    GGUF repo), naming the id."""
    if resolved.repo_id is None:
        return
    p = resolved.path
    if (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file():
        return
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
