"""Hugging Face checkpoints in: a model folder or Hub id (config.json + safetensors)
straight into a sharded GPT (``from_hf``), with the folder's tokenizer and chat template
attached. The folder is read by ``workbench._hf_format`` (its config, its weights, each
device reading only its slices), which the Trainer's ``init=`` reads through too.

Export (``to_hf``) lives in :mod:`workbench.hf._save`.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from workbench._hf_format.config import architecture, read_gpt_config
from workbench._hf_format.load import check_weights, load_params
from workbench._hub import resolve
from workbench._sharding.placement import resolve_placement
from workbench._sharding.rules import Rules
from workbench._train_state import abstract_model, param_specs
from workbench._validate import check_path

__all__ = ["from_hf"]


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
    cfg = read_gpt_config(path, ignore_fields, overrides, "from_hf")
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
        if plan.cfg is None or architecture(plan.cfg) != architecture(cfg):
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
