"""A Hugging Face model's ``GPTConfig`` from its folder or Hub id (``hf_config``), and the
check that a config is the model of a folder (``check_matches``: what ``TrainConfig.check``
asks of ``init=``). The mapping of each ``config.json`` field is :mod:`.families`'."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workbench._hf_format.families import read_config, to_gpt_config
from workbench._hub import CONFIG_FILES, resolve
from workbench._validate import check_path
from workbench.models._config import GPTConfig

#: The ``GPTConfig`` fields that decide a checkpoint's tensors and math, in
#: :func:`architecture`'s order (runtime fields such as ``scan_layers`` may differ).
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                       "head_dim", "d_ff", "tie_embeddings", "rope_theta", "norm_eps",
                       "n_experts", "experts_per_token", "moe_d_ff", "n_shared_experts",
                       "router_norm_topk", "qkv_bias", "qk_norm", "shared_expert_gate",
                       "rope_scaling")


def hf_config(path: str | Path, *, revision: str | None = None, progress: bool = True,
              ignore_fields: Iterable[str] = (), **overrides: Any) -> GPTConfig:
    """The ``GPTConfig`` of a Hugging Face model (reads config.json only).

    Args:
        path: the folder (or its config.json), or a Hub id ``"org/name"`` (only its
            config.json is downloaded; an existing local path wins over an id).
        revision: the Hub repo's branch, tag or commit (default "main"); ids only.
        progress: a progress bar while downloading.
        ignore_fields: config fields unknown here that do not change the model.
        **overrides: ``GPTConfig`` fields to set (``scan_layers=True``, ``dtype=...``,
            ``seq_len=...``); the architecture fields must stay as the checkpoint's.

    Example::

        cfg = wb.hf.hf_config("Qwen/Qwen3-0.6B", scan_layers=True)
        plan = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=8, seq=512)
    """
    check_path(path, "path", where="hf_config: ")
    where = resolve(path, revision=revision, progress=progress, files=CONFIG_FILES,
                    where="hf_config")
    return read_gpt_config(where.path, ignore_fields, overrides, "hf_config")


def read_gpt_config(path: Any, ignore_fields: Any, overrides: dict[str, Any],
                    where: str) -> GPTConfig:
    """``hf_config``'s work on a local folder, its arguments checked and named as
    ``where`` (the entry point: ``hf_config``, ``from_hf``)."""
    p = check_path(path, "path", where=f"{where}: ")
    fields = _field_names(ignore_fields, where)
    return to_gpt_config(read_config(p), where=str(p if p.is_file() else p / "config.json"),
                         ignore_fields=fields, **overrides)


def _field_names(ignore_fields: Any, where: str) -> tuple[str, ...]:
    """``ignore_fields`` as a tuple of names: a list (or other iterable) of strings, not a
    string alone (whose characters are no field names)."""
    fix = "give a list of config.json field names, e.g. ignore_fields=['rope_scaling']"
    if isinstance(ignore_fields, (str, bytes)) or not isinstance(ignore_fields, Iterable):
        raise TypeError(f"{where}: ignore_fields={ignore_fields!r} is a "
                        f"{type(ignore_fields).__name__}; {fix}")
    names = tuple(ignore_fields)
    for i, n in enumerate(names):
        if not isinstance(n, str):
            raise TypeError(f"{where}: ignore_fields[{i}]={n!r} is a {type(n).__name__}, not "
                            f"a field name; {fix}")
    return names


def architecture(cfg: GPTConfig) -> tuple[Any, ...]:
    """The values of :data:`ARCHITECTURE_FIELDS` (the dense width without experts, the
    expert width with them)."""
    return (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
            cfg.head_dim, cfg.d_ff if not cfg.n_experts else None, cfg.tie_embeddings,
            cfg.rope_theta, cfg.norm_eps, cfg.n_experts, cfg.experts_per_token,
            cfg.moe_d_ff if cfg.n_experts else None, cfg.n_shared_experts,
            cfg.router_norm_topk, cfg.qkv_bias, cfg.qk_norm, cfg.shared_expert_gate,
            cfg.rope_scaling)


def check_matches(path: str | Path, cfg: GPTConfig) -> None:
    """Raise if ``cfg`` is not the model of the checkpoint at ``path`` (architecture
    fields; runtime fields such as ``scan_layers``, ``remat``, ``dtype`` may differ)."""
    want = hf_config(path)
    for a, b, name in zip(architecture(cfg), architecture(want), ARCHITECTURE_FIELDS,
                          strict=True):
        if a != b:
            raise ValueError(f"the model config has a different architecture than {path}: "
                             f"checkpoint vs config differ (first: {name}); use "
                             f"model=wb.hf.hf_config({str(path)!r}, ...)")
