"""Hugging Face checkpoints out: a model, a train state or a run directory's checkpoint ->
config.json + safetensors shards + index, gathered one tensor at a time, written to a
temporary folder and renamed into place only when complete.

``overwrite=True`` replaces only what ``to_hf`` made (``_export_folder.check_replaceable``): a real
folder holding nothing but regular files with the names ``to_hf`` writes (config.json,
``*.safetensors``, the index, the tokenizer files of :data:`TOKENIZER_FILES`), config.json
among them, and safetensors files whose header carries ``to_hf``'s mark
(:data:`MARK`). The mark lives in the safetensors metadata, not in a file of its own, so
the folder stays exactly what Hugging Face libraries expect, and a folder that merely
looks the same (a Hub download, ``save_pretrained``'s output, a run directory, a folder
holding one) is refused by name, never deleted."""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from workbench._hf_format.families import read_config
from workbench._hf_format.tensors import INDEX, SINGLE, Mapping_, mappings
from workbench._hf_format.vocab import check_tokenizer
from workbench._validate import check_bool, check_path
from workbench.hf._export_config import check_family, export_dtype, from_gpt_config
from workbench.hf._export_folder import (
    MARK,
    TOKENIZER_FILES,
    canonical_mark,
    check_writable,
    exists_error,
    replace_folder,
)
from workbench.models._config import GPTConfig

__all__ = ["to_hf"]

DEFAULT_SHARD_BYTES = 2 << 30


def _host_block(arr: Any, stack_idx: tuple[int, ...]) -> np.ndarray:
    """``arr[stack_idx]`` on the host, assembled from the array's own shards (no
    compiled gather; only this block is ever in host memory). An array spread over
    several processes is gathered first (every process must call this, in the same
    order: it is a collective)."""
    if not getattr(arr, "is_fully_addressable", True):
        return _gathered_block(arr, stack_idx)
    if not hasattr(arr, "addressable_shards"):
        return np.asarray(arr[stack_idx] if stack_idx else arr)
    n = len(stack_idx)
    core_shape = arr.shape[n:]
    out = np.empty(core_shape, dtype=arr.dtype)
    done: set[tuple[Any, ...]] = set()
    for shard in arr.addressable_shards:
        idx = tuple(slice(*s.indices(d)[:2]) for s, d in zip(shard.index, arr.shape,
                                                             strict=True))
        if any(not s.start <= i < s.stop for s, i in zip(idx[:n], stack_idx, strict=True)):
            continue
        key = tuple((s.start, s.stop) for s in idx[n:])
        if key in done:
            continue
        done.add(key)
        local = tuple(i - s.start for s, i in zip(idx[:n], stack_idx, strict=True))
        out[idx[n:]] = np.asarray(shard.data[local] if n else shard.data)
    return out


@functools.lru_cache(maxsize=64)
def _replicator(sharding: Any, n: int) -> Any:
    """A compiled ``a[i0, ..., in-1]`` replicated on every device of ``sharding``'s mesh
    (the indices are arguments: one compile per parameter, not per layer)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.jit(lambda a, *idx: a[idx] if idx else a,
                   out_shardings=NamedSharding(sharding.mesh, PartitionSpec()))


def _gathered_block(arr: Any, stack_idx: tuple[int, ...]) -> np.ndarray:
    """``arr[stack_idx]`` of an array spread over processes: all-gathered to every device
    (one tensor at a time), then one local copy to the host."""
    sharding = arr.sharding
    if not hasattr(sharding, "mesh"):
        raise ValueError(f"exporting a multi-process array needs a NamedSharding, got "
                         f"{sharding!r}; place the parameters with wb.Rules on a mesh")
    out = _replicator(sharding, len(stack_idx))(arr, *(np.int32(i) for i in stack_idx))
    block = np.asarray(out.addressable_shards[0].data)
    del out
    return block


def _writer() -> bool:
    """Whether this process writes files (process 0 of a multi-process job)."""
    import jax

    return jax.process_index() == 0


def _sync(name: str) -> None:
    """All processes of a multi-process job reach this point (a no-op in one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _params_of(obj: Any) -> tuple[Any, GPTConfig]:
    """(pure param dict, config) of a GPT module or a TrainState + model config."""
    from flax import nnx

    if isinstance(obj, nnx.Module):
        cfg = getattr(obj, "cfg", None)
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"to_hf: obj is a {type(obj).__name__}; to_hf exports workbench "
                            "GPT models")
        return nnx.to_pure_dict(nnx.state(obj, nnx.Param)), cfg
    text = repr(obj)
    raise TypeError(f"to_hf: obj={text if len(text) <= 60 else text[:57] + '...'} is a "
                    f"{type(obj).__name__}; obj must be a GPT model, a TrainState (with "
                    "config=) or (params, config); a run directory's checkpoint: "
                    "wb.hf.export_run(run_dir, path)")


def to_hf(obj: Any, path: str | os.PathLike[str], *, config: GPTConfig | None = None,
          family: str | None = None, dtype: str | None = None,
          base: str | os.PathLike[str] | None = None,
          tokenizer: str | os.PathLike[str] | None = None,
          max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False) -> Path:
    """Writes a Hugging Face model folder.

    Args:
        obj: a ``GPT`` model; a ``TrainState`` (give ``config``); or ``(params,
            config)``. A run directory's checkpoint: ``wb.hf.export_run``.
        path: the folder to create (must not exist unless ``overwrite``).
        config: the model config of a ``TrainState``.
        family: the HF family (default: the one ``config`` belongs to:
            :func:`workbench.hf._export_config.family_for`).
        dtype: tensor dtype written (default the parameters' own).
        base: an HF folder whose config.json fields that do not change the model (token
            ids, ...) and tokenizer files are kept (default: where the model was imported
            from, if it was).
        tokenizer: a tokenizer file or folder to copy (default: ``base``'s files).
        max_shard_bytes: split into ``model-0000i-of-0000n.safetensors`` + index above
            this size.
        overwrite: replace an existing folder that ``to_hf`` wrote before (only once the
            new one is complete). Anything else is refused, never deleted: a run
            directory, a folder holding folders or other files, a model folder written by
            another tool (see :func:`check_replaceable`).

    Returns:
        The folder. It appears (renamed from a temporary sibling, config.json written
        last) only when every file is written; a failure leaves no folder behind.

    In a multi-process job (parameters spread over the processes' devices) every process
    calls ``to_hf`` with its own shards: each tensor is gathered in turn (a collective),
    process 0 writes, and all return once the folder is complete.

    Example::

        wb.hf.to_hf(trainer.model, "exported/")
        AutoModelForCausalLM.from_pretrained("exported/")      # transformers reads it
    """
    out = _out_folder(path, overwrite, max_shard_bytes)
    if base is not None:
        base = check_path(base, "base", where="to_hf: ")
    if tokenizer is not None:
        tokenizer = check_path(tokenizer, "tokenizer", where="to_hf: ")
    params, cfg, base = _weights_of(obj, config, base)
    if family is not None:   # the family must hold this model (else random weights)
        check_family(cfg, family)
    dt = export_dtype(dtype, cfg)   # a float dtype (int8 would truncate every weight)
    hf = from_gpt_config(cfg, family=family, base=read_config(base) if base else None)
    maps = mappings(cfg, hf["model_type"])
    hf["dtype"] = dt.name
    extra = _tokenizer_files(tokenizer if tokenizer is not None else base)
    check_tokenizer(extra, cfg.vocab_size, where=f"exporting to {out}")   # before any file
    if not _writer():   # another process of a job: its shards go into process 0's gathers
        _write(None, params, cfg, maps, dt, max_shard_bytes)
        _sync(f"to_hf:{out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write(tmp, params, cfg, maps, dt, max_shard_bytes)
        for f in extra:
            shutil.copy2(f, tmp / f.name)
        # config.json last: a folder without it is never taken for a model
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if os.path.lexists(out):
            replace_folder(out, tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _sync(f"to_hf:{out}")
    return out


def _out_folder(path: Any, overwrite: Any, max_shard_bytes: Any) -> Path:
    """The folder ``to_hf`` writes, checked before any gather: a path, free or one
    ``overwrite`` may replace, that this process can create (the writer's check), and a
    positive ``max_shard_bytes``."""
    out = check_path(path, "path", where="to_hf: ")
    overwrite = check_bool(overwrite, "overwrite", where="to_hf: ")
    if isinstance(max_shard_bytes, (bool, np.bool_)) or not isinstance(
            max_shard_bytes, (int, float, np.integer, np.floating)):
        raise TypeError(f"to_hf: max_shard_bytes={max_shard_bytes!r} is a "
                        f"{type(max_shard_bytes).__name__}; give a size in bytes "
                        "(max_shard_bytes=2**30)")
    if not max_shard_bytes > 0:
        raise ValueError(f"to_hf: max_shard_bytes={max_shard_bytes!r} is not a positive size; "
                         "give a size in bytes (max_shard_bytes=2**30)")
    if out.name in ("", ".", ".."):   # "." or "..": name the folder itself
        out = Path(os.path.abspath(out))
    refused = exists_error(out, overwrite)
    if refused is not None:
        raise refused
    if _writer():   # a clear error for a folder that cannot be made, before the gathers
        check_writable(out, where="to_hf: ")
    return out


def _weights_of(obj: Any, config: GPTConfig | None, base: Path | None
                ) -> tuple[Any, GPTConfig, Path | None]:
    """``(params, config, base)`` of what ``to_hf`` exports: ``(params, config)``, a
    ``TrainState`` with ``config``, or a model (``base`` defaults to where it was imported
    from); LoRA adapters merged into the weights."""
    if isinstance(obj, tuple) and len(obj) == 2:   # (params, config): wb.hf.export_run
        params, cfg = obj
    elif hasattr(obj, "params") and hasattr(obj, "opt_state"):
        if config is None:
            raise ValueError("to_hf(train_state, ...) needs config=<the model's GPTConfig>")
        params, cfg = obj.params, config
    else:
        params, cfg = _params_of(obj)
        src = getattr(obj, "hf_source", None)
        base = base if base is not None else (src.path if src is not None else None)
    if getattr(cfg, "lora", None) is not None:   # LoRA: the adapters merged into the weights
        from workbench.models._lora import merge_params

        params, cfg = merge_params(params, cfg.lora), cfg.replace(lora=None)
    return params, cfg, base


def _tokenizer_files(src: str | os.PathLike[str] | None) -> list[Path]:
    if src is None:
        return []
    p = Path(src)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer source {p} does not exist; give a tokenizer.json "
                                "or the folder holding it")
    return [p / n for n in TOKENIZER_FILES if (p / n).is_file()]


def _tensors(params: Any, cfg: GPTConfig, maps: list[Mapping_]
             ) -> list[tuple[str, Mapping_, Any, tuple[int, ...]]]:
    """(HF name, mapping, parameter array, stack index) of every HF tensor."""
    rows = []
    for m in maps:
        arr = params
        for p in m.path:
            arr = arr[p]
        arr = getattr(arr, "value", arr)
        for idx, name in m.hf_names(cfg.n_layers, cfg.n_experts):
            rows.append((name, m, arr, idx))
    return rows


def _write(folder: Path | None, params: Any, cfg: GPTConfig, maps: list[Mapping_],
           dt: np.dtype, max_shard_bytes: int) -> None:
    """The safetensors shards (+ index): tensors assigned to shards by size first, then
    each shard's tensors gathered and written, one shard in host memory at a time
    (``folder=None``: gather only, in a process that does not write)."""
    from safetensors.numpy import save_file

    rows = _tensors(params, cfg, maps)
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, m, _, _) in enumerate(rows):
        nbytes = int(np.prod(m.hf_shape)) * dt.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                     for i in range(n)]
    weight_map: dict[str, str] = {}
    total = 0
    for file, members in zip(names, shards, strict=True):
        tensors: dict[str, np.ndarray] = {}
        for i in members:
            name, m, arr, idx = rows[i]
            block = _host_block(arr, idx)
            if folder is None:
                continue
            tensors[name] = m.to_hf(block).astype(dt)
            weight_map[name] = file
            total += tensors[name].nbytes
        if folder is not None:
            save_file(tensors, str(folder / file), metadata=MARK)
            canonical_mark(folder / file)
        del tensors
    if n > 1 and folder is not None:
        (folder / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(
                weight_map.items()))}, indent=2) + "\n")

