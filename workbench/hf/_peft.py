"""LoRA adapters as PEFT writes them, and LoRA models merged for ``to_hf``.

A PEFT adapter folder is ``adapter_config.json`` (``peft_type: LORA``, ``r``,
``lora_alpha``, ``target_modules``, the base model) and ``adapter_model.safetensors``
with one ``lora_A`` / ``lora_B`` pair per adapted module, named as PEFT names them on a
``*ForCausalLM``: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
(rank, in) and ``...lora_B.weight`` (out, rank). PEFT scales by ``lora_alpha / r``, as
:mod:`workbench.models._lora` does. Ours are ``lora_a`` (in, rank) and ``lora_b`` (rank,
out) with flattened heads, whose order is the HF projections' (``n * head_dim + h``), so
PEFT's are their transposes.

``overwrite=True`` replaces only a folder ``to_peft`` wrote (:func:`check_replaceable`):
its ``adapter_model.safetensors`` carries :data:`PEFT_MARK` in its header metadata (PEFT's
loader reads the tensors and ignores the metadata), as ``to_hf``'s shards carry
``workbench.hf._export_folder.MARK``. A folder ``peft``'s own ``save_pretrained`` wrote is refused,
never deleted.

Example::

    wb.hf.to_peft(trainer.model, "adapter/", base_model="Qwen/Qwen3-0.6B")
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        "Qwen/Qwen3-0.6B"), "adapter/")
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from workbench._validate import check_bool, check_path
from workbench.models._config import GPTConfig
from workbench.models._lora import (
    ADAPTER_KEY,
    ATTENTION_TARGETS,
    PEFT_NAMES,
    merge_params,
    split_params,
)

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LORA_EXPORTS", "PEFT_MARK", "check_replaceable",
           "export_lora", "merged", "to_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: safetensors metadata that marks adapter weights written by ``to_peft`` (``overwrite``).
PEFT_MARK = {"format": "pt", "written_by": "workbench.hf.to_peft"}


def _params_and_config(obj: Any, config: GPTConfig | None, where: str) -> tuple[Any, GPTConfig]:
    from flax import nnx

    if isinstance(obj, tuple) and len(obj) == 2:
        params, cfg = obj
    elif isinstance(obj, nnx.Module) and isinstance(getattr(obj, "cfg", None), GPTConfig):
        params, cfg = nnx.to_pure_dict(nnx.state(obj, nnx.Param)), obj.cfg
    elif hasattr(obj, "params") and hasattr(obj, "opt_state") and config is not None:
        params, cfg = obj.params, config
    else:
        raise TypeError(f"{where}: obj is a {type(obj).__name__}; give a GPT with LoRA "
                        "adapters (trainer.model), (params, config) or a TrainState with "
                        "config=")
    if not isinstance(cfg, GPTConfig) or cfg.lora is None:
        raise ValueError(f"{where}: the model has no LoRA adapters (its config's lora is "
                         "None); train with TrainConfig(lora=...), or export the whole model "
                         "with wb.hf.to_hf")
    return params, cfg


def merged(obj: Any, *, config: GPTConfig | None = None) -> tuple[Any, GPTConfig]:
    """``(params, config)`` of the same model without adapters: each target weight
    ``W + alpha/rank * A @ B`` (float32 sum, stored in ``W``'s dtype), config ``lora=None``:
    what ``wb.hf.to_hf`` writes for a LoRA model."""
    params, cfg = _params_and_config(obj, config, "merged")
    return merge_params(params, cfg.lora), cfg.replace(lora=None)


def _tensors(params: Any, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """PEFT's tensor names -> arrays (float32, contiguous)."""
    _, ad = split_params(jax.device_get(params))
    out: dict[str, np.ndarray] = {}
    blocks = ad.get("blocks", {})
    layers = [(i, blocks[i]) for i in sorted(blocks)] if not cfg.scan_layers else \
        [(i, jax.tree.map(lambda x, i=i: x[i], blocks)) for i in range(cfg.n_layers)]
    for i, block in layers:
        for part, hf_part in (("attn", "self_attn"), ("mlp", "mlp")):
            for t, p in block.get(part, {}).get(ADAPTER_KEY, {}).items():
                assert (t in ATTENTION_TARGETS) == (part == "attn")
                pre = f"base_model.model.model.layers.{i}.{hf_part}.{PEFT_NAMES[t]}"
                a = np.asarray(p["lora_a"], np.float32)                    # (in, r)
                b = np.asarray(p["lora_b"], np.float32)                    # (r, out)
                out[f"{pre}.lora_A.weight"] = np.ascontiguousarray(a.T)   # (r, in)
                out[f"{pre}.lora_B.weight"] = np.ascontiguousarray(b.T)   # (out, r)
    return out


def adapter_config(cfg: GPTConfig, base_model: str | None, revision: str | None
                   ) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for ``cfg.lora``."""
    lora = cfg.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": [PEFT_NAMES[t] for t in lora.targets], "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": base_model, "revision": revision}


def check_replaceable(folder: str | os.PathLike[str]) -> str | None:
    """Why ``overwrite=True`` may not replace ``folder`` (None: it may).

    It may when it is an adapter folder ``to_peft`` wrote: a directory (not a symlink)
    holding exactly two regular files, ``adapter_config.json`` and
    ``adapter_model.safetensors``, the weights carrying :data:`PEFT_MARK`; or an empty
    directory. Anything else is refused by name: a folder ``peft.save_pretrained`` wrote
    (no mark), and a ``to_peft`` folder the user added a file to (a README, notes): the
    file is theirs, so the folder is not replaced (move the file out first).
    """
    from workbench.hf._export_folder import few, folder_entries, marked

    p = Path(folder)
    entries = folder_entries(p)
    if isinstance(entries, str):
        return entries
    if not entries:
        return None
    ours = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
    odd = [e.name for e in entries if e.name not in ours or not e.is_file(follow_symlinks=False)]
    if odd:
        return (f"{p} holds entries to_peft does not write ({few(odd)}): they are not "
                "Workbench's and would be lost; move them out of the folder, or choose a new one")
    if len(entries) != 2 or not marked(p / ADAPTER_WEIGHTS, PEFT_MARK):
        return (f"{p} is not an adapter folder wb.hf.to_peft wrote ({p / ADAPTER_WEIGHTS} "
                f"lacks the mark {PEFT_MARK}, e.g. peft's save_pretrained wrote it): it is "
                "never replaced")
    return None


def exists_error(out: Path, overwrite: bool, where: str) -> FileExistsError | None:
    """Why ``out`` may not become a PEFT adapter folder (None: it may): it exists and is
    not (with ``overwrite``) one ``to_peft`` wrote (:func:`check_replaceable`)."""
    if not os.path.lexists(out):
        return None
    why = check_replaceable(out)
    if why is not None:
        return FileExistsError(f"{where}: {why}; choose a new folder (overwrite=True replaces "
                               "only an adapter folder that wb.hf.to_peft wrote, or an empty "
                               "one)")
    if overwrite:
        return None
    return FileExistsError(f"{where}: {out} exists; choose a new folder, or pass "
                           "overwrite=True to replace it (an adapter folder wb.hf.to_peft "
                           "wrote; replaced only once the new one is complete)")


def to_peft(obj: Any, path: str | os.PathLike[str], *, config: GPTConfig | None = None,
            base_model: str | os.PathLike[str] | None = None, revision: str | None = None,
            overwrite: bool = False) -> Path:
    """Writes a LoRA model's adapters as a PEFT adapter folder.

    Args:
        obj: a GPT with adapters (``trainer.model``), ``(params, config)``, or a
            ``TrainState`` with ``config=``.
        path: the folder to create (must not exist unless ``overwrite``).
        base_model: the base's Hub id or folder (``adapter_config.json``'s
            ``base_model_name_or_path``; PEFT's ``AutoPeftModelForCausalLM`` loads it).
        revision: the base's Hub commit.
        overwrite: replace a folder ``to_peft`` wrote before, and only that (its two
            files, the weights marked with :data:`PEFT_MARK`), once the new one is
            complete. A folder ``peft.save_pretrained`` wrote, or a ``to_peft`` folder
            holding a file the user added (a README), is refused with a
            ``FileExistsError`` naming it: nothing of theirs is deleted.

    Returns:
        The folder (renamed from a temporary sibling once complete).
    """
    from safetensors.numpy import save_file

    from workbench.hf._export_folder import canonical_mark, check_writable, replace_folder

    out = check_path(path, "path", where="to_peft: ")
    overwrite = check_bool(overwrite, "overwrite", where="to_peft: ")
    if base_model is not None and not isinstance(base_model, (str, os.PathLike)):
        raise TypeError(f"to_peft: base_model={base_model!r:.60} must be a Hub id or a folder")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"to_peft: revision={revision!r:.60} must be a string")
    params, cfg = _params_and_config(obj, config, "to_peft")
    if out.name in ("", ".", ".."):   # "." or "..": name the folder itself
        out = Path(os.path.abspath(out))
    refused = exists_error(out, overwrite, "to_peft")
    if refused is not None:
        raise refused
    check_writable(out, where="to_peft: ")
    tensors = _tensors(params, cfg)
    base = None if base_model is None else os.fspath(base_model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata=PEFT_MARK)
        canonical_mark(tmp / ADAPTER_WEIGHTS, PEFT_MARK)
        (tmp / ADAPTER_CONFIG).write_text(
            json.dumps(adapter_config(cfg, base, revision), indent=2) + "\n")
        if os.path.lexists(out):
            replace_folder(out, tmp, check_replaceable)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


#: ``export_run(..., lora=...)`` for a LoRA run.
LORA_EXPORTS = ("merged", "peft")


def export_lora(restored: tuple[Any, GPTConfig, dict[str, Any]], path: str | os.PathLike[str],
                *, lora: str = "merged", **kwargs: Any) -> Path:
    """``wb.hf.export_run`` of a LoRA run: ``lora="merged"`` writes the base with the
    adapters merged in as a Hugging Face folder (``to_hf``'s ``kwargs``), ``"peft"`` the
    adapters as a PEFT folder whose ``base_model_name_or_path`` is the run's ``init``
    (the Hub id and its recorded commit, or the folder; None for a base from the seed).
    The checkpoint holds the adapters (``restored``: ``export.restore_params``'s
    ``(adapters, config, run.json)``); the base comes from ``init``, or the run's seed."""
    from workbench.hf._save import to_hf
    from workbench.models._lora import combine

    adapters, cfg, meta = restored
    init = meta.get("init") or {}
    config = meta["config"]
    if lora == "peft":
        if set(kwargs) - {"overwrite"}:
            raise TypeError(f"export_run(lora='peft') takes overwrite= only; got "
                            f"{sorted(kwargs)}")
        base = init.get("repo_id") or init.get("path") or config.get("init")
        return to_peft((adapters, cfg), path, base_model=base,
                       revision=init.get("revision"), overwrite=kwargs.get("overwrite", False))
    params = combine(_base_params(config, init, adapters), adapters)
    folder = init.get("path", config.get("init"))
    kwargs.setdefault("base", folder if folder is not None and Path(folder).is_dir() else None)
    return to_hf(merged((params, cfg)), path, **kwargs)


def _base_params(config: dict[str, Any], init: dict[str, Any], adapters: Any) -> Any:
    """A LoRA run's frozen base on the export's devices: ``init``'s weights (the recorded
    Hub commit, or the folder), else the seed's (the same bits as the run's step 0)."""
    from workbench.models._lora import split_params
    from workbench._sharding.placement import resolve_placement
    from workbench._step import seed_params
    from workbench._train_state import abstract_train_state
    from workbench.train._config import TrainConfig

    tc = TrainConfig.from_dict(config)
    cfg = tc.model_config()
    mesh, rules = resolve_placement(where="export_run")
    import optax

    a = abstract_train_state(cfg, optax.identity(), rules, mesh)
    every = jax.tree.map(lambda x: x.sharding, a.state.params)
    shardings = split_params(every)[0]
    if tc.init is None:
        def init_base(key: Any) -> Any:
            return split_params(seed_params(cfg, every, key))[0]

        return jax.jit(init_base, out_shardings=shardings)(jax.random.key(tc.seed))
    from workbench._hub import MODEL_FILES, is_hub_id, resolve
    from workbench._hf_format.load import load_params

    hub = None
    folder = init.get("path") or tc.init
    if is_hub_id(tc.init) and not (folder and Path(folder).is_dir()):
        hub = resolve(tc.init, revision=init.get("revision") or tc.init_revision,
                      files=MODEL_FILES, where="export_run", arg="init")
        folder = hub.path
    return load_params(folder, cfg.replace(lora=None), shardings, hub=hub)[0]
