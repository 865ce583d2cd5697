"""A run directory's checkpoint -> a Hugging Face model folder: the run's parameters
restored onto this process's devices, then written by :func:`workbench.hf._save.to_hf`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax

from workbench import _runs as runs
from workbench._validate import check_bool, check_path
from workbench.hf._export_folder import check_writable, exists_error
from workbench.hf._save import to_hf
from workbench.models._config import GPTConfig
from workbench._sharding.placement import resolve_placement
from workbench._train_state import abstract_state
from workbench.train._checkpoint import CheckpointError, Checkpoints
from workbench.train._config import TrainConfig

__all__ = ["export_run", "restore_params"]


def export_run(run_dir: str | os.PathLike[str], path: str | os.PathLike[str], *,
               step: int | None = None, **kwargs: Any) -> Path:
    """Writes the parameters of a run's checkpoint as a Hugging Face folder.

    The checkpoint is restored read-only onto all of ``jax.devices()`` (parameters sharded
    over them, "fsdp"), then written tensor by tensor by ``wb.hf.to_hf``. In one
    process (a notebook) that is this machine's devices. In a multi-process job (``python
    -m workbench export`` with ``jax.distributed``, e.g. as many processes as trained)
    each process restores only its shards, every tensor is gathered in turn and process 0
    writes the folder: the files are the same bytes as a one-process export. A run that
    started from a Hugging Face folder (``TrainConfig.init``) keeps that folder's config
    fields (token ids) and tokenizer files.

    Args:
        run_dir: the run directory (``run.json`` + ``checkpoints/``).
        path: the folder to create. Never the run directory, a folder holding it, or a
            folder inside its ``checkpoints/``: those are refused before anything is read.
        step: the checkpoint step (default the newest readable one); a step without a
            checkpoint is refused with the steps that have one.
        **kwargs: ``lora=`` for a LoRA run (``TrainConfig(lora=...)``): "merged" (the
            default: the adapters merged into the weights, an ordinary model folder) or
            "peft" (the adapters in PEFT's layout, ``workbench.hf._peft``); the rest are
            passed to ``wb.hf.to_hf`` (``dtype``, ``family``, ``tokenizer``,
            ``max_shard_bytes``, ``overwrite``: replaces only a folder ``to_hf`` wrote
            before, see ``workbench.hf._export_folder.check_replaceable``; with ``lora="peft"``
            only an adapter folder ``wb.hf.to_peft`` wrote, see
            ``workbench.hf._peft.check_replaceable``; ``overwrite`` must be a bool).

    Raises:
        FileExistsError: ``path`` exists and may not be replaced (the message says why).
        PermissionError: ``path``'s folder cannot be written (before anything is read).
        ValueError: ``path`` is the run, holds it, or lies in its checkpoints.
        CheckpointError: no checkpoint at ``step`` (the message lists those there are).

    Example::

        wb.hf.export_run("runs/ft", "exported/", step=200)
    """
    run_dir = check_path(run_dir, "run_dir", where="export_run: ")
    path = check_path(path, "path", where="export_run: ")
    _check_destination(run_dir, path)
    lora = kwargs.pop("lora", None)
    overwrite = check_bool(kwargs.get("overwrite", False), "overwrite", where="export_run: ")
    if lora == "peft" and cfg_lora(run_dir) is not None:   # a PEFT adapter folder
        from workbench.hf._peft import exists_error as adapter_exists_error

        refused = adapter_exists_error(Path(path), overwrite, "export_run")
    else:
        refused = exists_error(Path(path), overwrite)
    if refused is not None:   # before the (long) restore, not after it
        raise refused
    if jax.process_index() == 0:   # process 0 writes: a folder it cannot make, said now
        check_writable(Path(path), where="export_run: ")
    if cfg_lora(run_dir) is None and lora is not None:
        raise ValueError(f"export_run: lora={lora!r:.60}, but run {run_dir} trained no LoRA "
                         "adapters (its config's lora is None): leave lora out")
    if cfg_lora(run_dir) is not None:   # a LoRA run: merged weights, or PEFT's adapters
        from workbench.hf._peft import LORA_EXPORTS, export_lora

        lora = "merged" if lora is None else lora

        if not isinstance(lora, str) or lora not in LORA_EXPORTS:   # before the restore
            raise ValueError(f"export_run: lora={lora!r:.60}; a LoRA run exports as "
                             f"{' or '.join(map(repr, LORA_EXPORTS))} (merged weights, or "
                             "the adapters in PEFT's layout)")
        return export_lora(restore_params(run_dir, step=step), path, lora=lora, **kwargs)
    params, cfg, meta = restore_params(run_dir, step=step)
    config = meta["config"]
    init = (meta.get("init") or {}).get("path", config.get("init"))   # absolute when recorded
    kwargs.setdefault("base", init if init is None or Path(init).is_dir() else None)
    return to_hf((params, cfg), path, **kwargs)


def cfg_lora(run_dir: str | os.PathLike[str]) -> Any:
    """The ``lora`` of a run's recorded config (None: not a LoRA run, or unreadable)."""
    try:
        config = runs.read_run(Path(run_dir)).get("config") or {}
        model = config.get("model")
        return config.get("lora") or (model.get("lora") if isinstance(model, dict) else None)
    except (OSError, ValueError, AttributeError):
        return None


def _check_destination(run_dir: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Refuses an export folder that is the run, holds it, or lies in its checkpoints."""
    src = Path(os.path.realpath(run_dir))
    dst = Path(os.path.realpath(path))
    fix = f"export to a new folder beside the run, e.g. {src.parent / (src.name + '-hf')}"
    if dst == src:
        raise ValueError(f"{path} is the run directory being exported ({run_dir}: run.json, "
                         f"metrics, checkpoints); it is never replaced: {fix}")
    if dst in src.parents:
        raise ValueError(f"{path} holds the run directory being exported ({run_dir}); it is "
                         f"never replaced: {fix}")
    ckpts = src / "checkpoints"
    if dst == ckpts or ckpts in dst.parents:
        raise ValueError(f"{path} lies in the checkpoints of the run being exported "
                         f"({ckpts}, where only Orbax writes): {fix}")


def restore_params(run_dir: str | os.PathLike[str], *, step: int | None = None
                   ) -> tuple[Any, Any, dict[str, Any]]:
    """The model parameters of a run's checkpoint, restored read-only onto all of
    ``jax.devices()`` ("fsdp": ``workbench._sharding.placement``'s default), whatever mesh and
    process count wrote them.

    Returns:
        ``(params, model config, run.json)``; ``nnx.merge(graphdef, params)`` with the
        graphdef of ``workbench._step.abstract_model(cfg)`` is the model.
    """
    run_dir = Path(run_dir)
    meta = runs.read_run(run_dir)
    if "config" not in meta:
        raise ValueError(f"{run_dir / runs.RUN_JSON} has no 'config'; export a run written by "
                         "wb.Trainer")
    try:
        config = TrainConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"run_dir={str(run_dir)!r}: its {runs.RUN_JSON} 'config' is not a "
                         f"wb.Trainer's ({e}); export a run written by wb.Trainer") from None
    cfg = config.model_config()
    if not isinstance(cfg, GPTConfig):
        raise ValueError(f"run {run_dir} trains {type(cfg).__name__}, not a workbench GPT; "
                         "only GPT models export to Hugging Face folders")
    mesh, rules = resolve_placement(where="export_run")   # every device, "fsdp"
    tx = config.optimizer.build(config.steps)
    _, abstract = abstract_state(cfg, tx, rules, mesh)
    if cfg.lora is not None:   # the checkpoint holds the adapters (workbench.hf._peft)
        from workbench.models._lora import saved_state

        abstract = saved_state(abstract)
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype,
                               sharding=jax.sharding.NamedSharding(mesh,
                                                                   jax.sharding.PartitionSpec()))
    ckpts = Checkpoints(run_dir / "checkpoints", read_only=True)
    try:
        if step is not None:
            have = ckpts.all_steps()
            if step not in have:
                there = (f"its checkpoints are at step{'s' if len(have) > 1 else ''} "
                         f"{', '.join(map(str, have))}" if have else "it has no checkpoint")
                raise CheckpointError(
                    f"run {run_dir} has no checkpoint at step {step}; {there} (in "
                    f"{run_dir / 'checkpoints'}): give one of them, or leave step out for "
                    "the newest")
        restored = ckpts.restore({"train": abstract, "rng": rng}, step=step)
    finally:
        ckpts.close()
    return restored.state["train"].params, cfg, meta
