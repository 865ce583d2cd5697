"""Hugging Face checkpoints in: a model folder or Hub id (config.json + safetensors)
straight into a sharded GPT, each device reading only its slices, one tensor at a time;
the folder's tokenizer and chat template attached to the model.

Export (``to_hf``) lives in :mod:`workbench.hf._save`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from workbench._hub import CONFIG_FILES, HubError, Resolved, offline, resolve
from workbench._validate import check_path
from workbench.hf._families import HFConfigError, family_of, read_config, to_gpt_config
from workbench.hf._save import check_tokenizer
from workbench.hf._tensors import (CheckpointError, Folder, Mapping_, mappings, normalize,
                                  read_core)
from workbench.models._config import GPTConfig
from workbench._sharding.placement import resolve_placement
from workbench._sharding.rules import Rules
from workbench._step import abstract_model, param_specs

__all__ = ["CheckpointError", "HFConfigError", "HFSource", "check_weights", "from_hf",
           "hf_config", "load_params"]

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
    return _read_config(where.path, ignore_fields, overrides, "hf_config")


def _read_config(path: Any, ignore_fields: Any, overrides: dict[str, Any],
                 where: str) -> GPTConfig:
    """``hf_config``'s work, its arguments checked and named as ``where`` (the entry point)."""
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


def _default_layout(mesh: Any, rules: Any) -> tuple[Any, Any]:
    """The mesh and rules to load onto: the given ones, else ``workbench._sharding.placement``'s
    default (every device on one ``data`` axis; "fsdp_tp" with one model axis > 1, else
    "fsdp")."""
    return tuple(resolve_placement(mesh, rules, where="from_hf"))


def from_hf(path: str | Path, *, revision: str | None = None, progress: bool = True,
            mesh: Any = None, rules: Any = None, plan: Any = None,
            ignore_fields: Iterable[str] = (), **overrides: Any) -> Any:
    """A sharded ``GPT`` with the weights of a Hugging Face model: a local folder or a
    Hub id, with the model's own tokenizer and chat template attached.

    Reads ``config.json`` (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE),
    checks every tensor's name, shape and dtype against it, then builds each parameter
    with ``jax.make_array_from_callback``: every device asks for its own block, which is
    read from its safetensors shard with ``get_slice`` (only those bytes), so no device
    and no host buffer ever holds more than one tensor of the model.

    Args:
        path: the folder: config.json + model.safetensors, or sharded
            ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``;
            float32, bfloat16 or float16 tensors. Or a Hub id ``"org/name"``: downloaded
            into the Hugging Face cache (config, safetensors, tokenizer files only) or
            taken from it (``HF_HUB_OFFLINE=1``: the cache only). An existing local
            path always wins over an id.
        revision: the Hub repo's branch, tag or commit hash (default "main"); ids only.
        progress: a progress bar while downloading (False: quiet).
        mesh: the devices (default ``wb.make_mesh(data=-1)``: all of them).
        rules: a ``wb.Rules`` or preset name (default ``workbench._sharding.placement``'s, as
            ``wb.plan`` and the Trainer: "fsdp_tp" on a mesh with one model axis larger
            than 1, else "fsdp").
        plan: a ``wb.plan`` of this model: its mesh and rules are used (the plan's model
            must be this checkpoint's).
        ignore_fields: config.json fields unknown here that do not change the model.
        **overrides: ``GPTConfig`` fields (``scan_layers``, ``dtype``, ``param_dtype``,
            ``remat``, ``seq_len``...); parameters are converted to ``param_dtype``.

    Returns:
        ``GPT`` (an ``nnx.Module``) whose parameters are sharded by the rules. Its
        ``hf_source`` attribute says where it came from (folder, Hub id and commit, EOS
        ids); its ``tokenizer`` attribute is the folder's ``wb.data.Tokenizer``
        (``tokenizer.json`` with ``tokenizer_config.json``'s special tokens and chat
        template), or None when the folder has no ``tokenizer.json``. ``wb.generate``
        uses both: ``wb.generate(model, "text")`` or ``messages=[...]``.

    Raises:
        HubError: a Hub id not on the Hub, gated without a token, a revision that does
            not exist, or not cached with ``HF_HUB_OFFLINE=1``.
        CheckpointError: the folder (or Hub repo) has no safetensors weights, or they do
            not match config.json.

    Example::

        model = wb.hf.from_hf("Qwen/Qwen3-0.6B", mesh=wb.make_mesh(data=4, model=2),
                              rules="fsdp_tp")
        wb.generate(model, messages=[{"role": "user", "content": "Hi!"}])
    """
    from workbench.planning._handle import Plan   # the plan pipeline loads only when called

    check_path(path, "path", where="from_hf: ")
    where = resolve(path, revision=revision, progress=progress, where="from_hf")
    check_weights(where, "from_hf")
    path = where.path
    cfg = _read_config(path, ignore_fields, overrides, "from_hf")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"from_hf: mesh={mesh!r} is a {type(mesh).__name__}, not a mesh of "
                        "devices; give wb.make_mesh(...) (or leave mesh out for all devices)")
    if rules is not None and not isinstance(rules, (str, Rules)):
        raise TypeError(f"from_hf: rules={rules!r} is a {type(rules).__name__}; give a "
                        "wb.Rules or a preset name (rules='fsdp'), or leave rules out")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"from_hf: plan={plan!r} is a {type(plan).__name__}, not a wb.Plan; "
                        "give wb.plan(wb.hf.hf_config(path), mesh=...), or leave plan out")
    if plan is not None:
        if plan.cfg is None or _arch(plan.cfg) != _arch(cfg):
            raise ValueError(f"the plan is of another model ({plan.cfg}); plan "
                             f"wb.hf.hf_config({str(path)!r}) instead")
        cfg, mesh, rules = plan.cfg, plan.mesh.jax_mesh, plan.rules
        if mesh is None:
            raise ValueError(f"the plan is on {plan.mesh.describe()} (no real devices); plan "
                             "on wb.make_mesh(...) to load weights")
    mesh, rules = _default_layout(mesh, rules)
    graphdef, abstract, logical = abstract_model(cfg)
    specs = param_specs(abstract, logical, rules)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
    params, source = load_params(path, cfg, shardings, hub=where)
    model = nnx.merge(graphdef, params)
    model.hf_source = source
    model.tokenizer = model_tokenizer(path)
    return model


def model_tokenizer(path: Path) -> Any:
    """The folder's ``wb.data.Tokenizer`` (None without a ``tokenizer.json``)."""
    from workbench.data._tokenizer import Tokenizer

    if not (Path(path) / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer(path)
    except (OSError, ValueError) as e:   # the weights load without a tokenizer
        import warnings

        warnings.warn(f"from_hf: the model's tokenizer was not attached (model.tokenizer is "
                      f"None): {e}. Generation then needs tokenizer= or token ids",
                      stacklevel=3)
        return None


def eos_ids(path: Path) -> tuple[int, ...]:
    """``eos_token_id`` of ``generation_config.json`` (else ``config.json``): one id or a
    list; () when absent or unreadable (the tokenizer's EOS still applies)."""
    import json

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


def _arch(cfg: GPTConfig) -> tuple[Any, ...]:
    """The fields that decide a checkpoint's tensors and math."""
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
    names = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
             "d_ff", "tie_embeddings", "rope_theta", "norm_eps", "n_experts",
             "experts_per_token", "moe_d_ff", "n_shared_experts", "router_norm_topk",
             "qkv_bias", "qk_norm", "shared_expert_gate", "rope_scaling")
    for a, b, name in zip(_arch(cfg), _arch(want), names, strict=False):
        if a != b:
            raise ValueError(f"the model config has a different architecture than {path}: "
                             f"checkpoint vs config differ (first: {name}); use "
                             f"model=wb.hf.hf_config({str(path)!r}, ...)")


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
