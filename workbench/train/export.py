"""A run directory's checkpoint -> a Hugging Face model folder (``wb.models.to_hf``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax

from workbench import runs

__all__ = ["export_run", "restore_params"]


def export_run(run_dir: str | os.PathLike[str], path: str | os.PathLike[str], *,
               step: int | None = None, **kwargs: Any) -> Path:
    """Writes the parameters of a run's checkpoint as a Hugging Face folder.

    The checkpoint is restored read-only onto all of ``jax.devices()`` (parameters sharded
    over them, "fsdp"), then written tensor by tensor by ``wb.models.to_hf``. In one
    process (a notebook) that is this machine's devices. In a multi-process job (``python
    -m workbench export`` with ``jax.distributed``, e.g. as many processes as trained)
    each process restores only its shards, every tensor is gathered in turn and process 0
    writes the folder: the files are the same bytes as a one-process export. A run that
    started from a Hugging Face folder (``TrainConfig.init``) keeps that folder's config
    fields (token ids) and tokenizer files.

    Args:
        run_dir: the run directory (``run.json`` + ``checkpoints/``).
        path: the folder to create.
        step: the checkpoint step (default the newest readable one).
        **kwargs: passed to ``wb.models.to_hf`` (``dtype``, ``family``, ``tokenizer``,
            ``max_shard_bytes``, ``overwrite``).

    Example::

        wb.train.export_run("runs/ft", "exported/", step=200)
    """
    from workbench.models.hf_export import to_hf

    params, cfg, meta = restore_params(run_dir, step=step)
    config = meta["config"]
    init = (meta.get("init") or {}).get("path", config.get("init"))   # absolute when recorded
    kwargs.setdefault("base", init if init is None or Path(init).is_dir() else None)
    return to_hf((params, cfg), path, **kwargs)


def restore_params(run_dir: str | os.PathLike[str], *, step: int | None = None
                   ) -> tuple[Any, Any, dict[str, Any]]:
    """The model parameters of a run's checkpoint, restored read-only onto all of
    ``jax.devices()`` ("fsdp"), whatever mesh and process count wrote them.

    Returns:
        ``(params, model config, run.json)``; ``nnx.merge(graphdef, params)`` with the
        graphdef of ``workbench.step.abstract_model(cfg)`` is the model.
    """
    from workbench.mesh import make_mesh
    from workbench.models.config import GPTConfig
    from workbench.rules import Rules
    from workbench.step import abstract_state
    from workbench.train.checkpoint import Checkpoints
    from workbench.train.config import TrainConfig

    run_dir = Path(run_dir)
    meta = runs.read_run(run_dir)
    if "config" not in meta:
        raise ValueError(f"{run_dir / runs.RUN_JSON} has no 'config'; export a run written by "
                         "wb.Trainer")
    config = TrainConfig.from_dict(meta["config"])
    cfg = config.model_config()
    if not isinstance(cfg, GPTConfig):
        raise ValueError(f"run {run_dir} trains {type(cfg).__name__}, not a workbench GPT; "
                         "only GPT models export to Hugging Face folders")
    mesh = make_mesh(data=-1)
    rules = Rules.preset("fsdp", mesh)
    tx = config.optimizer.build(config.steps)
    _, abstract = abstract_state(cfg, tx, rules, mesh)
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype,
                               sharding=jax.sharding.NamedSharding(mesh,
                                                                   jax.sharding.PartitionSpec()))
    ckpts = Checkpoints(run_dir / "checkpoints", read_only=True)
    try:
        restored = ckpts.restore({"train": abstract, "rng": rng}, step=step)
    finally:
        ckpts.close()
    return restored.state["train"].params, cfg, meta
