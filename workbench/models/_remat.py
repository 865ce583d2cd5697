"""Rematerialisation: what a block keeps for its backward pass, named (MaxText's policies) or
custom, tensor by tensor, as MaxText's Ironwood recipes set it (``remat_policy: custom`` with
``decoder_layer_input: offload``, ``query_proj: device``, ...).

``GPTConfig.remat`` is a policy's name (``REMAT_POLICIES``) or a mapping with ``"save"`` (kept in
device memory) and ``"offload"`` (moved to host memory after the forward pass, back for the
backward pass), each a list of the model's checkpoint names (``CHECKPOINT_NAMES``); every name
given in neither is recomputed::

    cfg.replace(remat={"offload": ["decoder_layer_input"], "save": ["key_proj", "value_proj"]})

Both become a ``RematPolicy`` (``resolve_remat``), which the model (``remat_policy``: the
``jax.checkpoint`` policy) and the plans (activation memory, recomputed FLOPs, host transfers)
read alike.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

#: Names the model gives its activations (``jax.ad_checkpoint.checkpoint_name``), which
#: named remat policies save, offload to host memory or recompute (MaxText's names).
CHECKPOINT_NAMES: tuple[str, ...] = (
    "decoder_layer_input",   # a block's input (the residual stream)
    "query_proj", "key_proj", "value_proj",   # the q, k, v projections (before RoPE)
    "context",               # the attention output, before the output projection
    "out_proj",              # the attention output projection (B, T, D)
    "mlpwi_0", "mlpwi_1",    # the MLP input projections (gate, up) (B, T, F)
    "mlpwo",                 # the MLP output projection (B, T, D)
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RematPolicy:
    """What one block keeps for its backward pass.

    Attributes:
        description: one line.
        base: a ``jax.checkpoint_policies`` policy name (saves without names), or None.
        saved: checkpoint names kept in device memory.
        offloaded: checkpoint names moved to host memory (``pinned_host``) after the
            forward pass and back for the backward pass (TPU only).
        offload_dots: ``offload_dot_with_no_batch_dims``: every matmul output to host.
    """

    description: str
    base: str | None = None
    saved: tuple[str, ...] = ()
    offloaded: tuple[str, ...] = ()
    offload_dots: bool = False

    @property
    def offloads(self) -> bool:
        """Whether the policy moves activations to host memory."""
        return bool(self.offloaded) or self.offload_dots


_QKV = ("query_proj", "key_proj", "value_proj")

#: The named rematerialisation policies ``GPTConfig.remat`` accepts (MaxText's names where
#: it has them: ``maxtext/layers/decoders.py``).
REMAT_POLICIES: dict[str, RematPolicy] = {
    "none": RematPolicy(description="keep every activation (no remat)"),
    "full": RematPolicy(description="recompute the whole block in the backward pass",
                        base="nothing_saveable"),
    "dots": RematPolicy(description="keep matmul outputs without batch dims, recompute the "
                        "rest", base="dots_with_no_batch_dims_saveable"),
    "minimal": RematPolicy(description="MaxText 'minimal': keep every projection (matmuls "
                           "without batch dims), recompute norms, RoPE, attention",
                           base="dots_with_no_batch_dims_saveable"),
    "minimal_flash": RematPolicy(description="'minimal' plus the attention output (a fused "
                                 "kernel's forward is not rerun)",
                                 base="dots_with_no_batch_dims_saveable", saved=("context",)),
    "save_dot_except_mlpwi": RematPolicy(
        description="keep q/k/v/out projections and the MLP output; recompute the MLP "
        "input projections", saved=(*_QKV, "out_proj", "mlpwo")),
    "save_dot_except_mlp": RematPolicy(description="keep q/k/v/out projections",
                                       saved=(*_QKV, "out_proj")),
    "save_qkv_proj": RematPolicy(description="keep the q/k/v projections", saved=_QKV),
    "qkv_proj_offloaded": RematPolicy(description="q/k/v projections to host memory",
                                      offloaded=_QKV),
    "minimal_offloaded": RematPolicy(description="every projection to host memory",
                                     offload_dots=True),
    "qkv_input_offloaded": RematPolicy(
        description="q/k/v projections and the block input to host memory (MaxText's "
        "Llama-3.1-70B v6e 'custom')", offloaded=(*_QKV, "decoder_layer_input")),
    "qkvo_input_offloaded": RematPolicy(
        description="q/k/v/out projections and the block input to host memory (MaxText's "
        "Llama-3.1-8B v6e 'custom')", offloaded=(*_QKV, "out_proj", "decoder_layer_input")),
}

#: Platforms whose JAX backend moves activations to host memory (``pinned_host``).
OFFLOAD_PLATFORMS: tuple[str, ...] = ("tpu",)


def custom_remat(value: Mapping[str, Any]) -> RematPolicy:
    """The policy a custom mapping describes (``{"save": [...], "offload": [...]}``), checked:
    known keys, known checkpoint names, no name both saved and offloaded."""
    unknown = sorted(set(value) - {"save", "offload"}, key=str)
    if unknown:
        raise ValueError(f"remat={dict(value)!r}: unknown key(s) {unknown}; a custom policy has "
                         "'save' (kept on the device) and 'offload' (to host memory), each a "
                         f"list of checkpoint names from {list(CHECKPOINT_NAMES)}; the names in "
                         "neither are recomputed")
    parts: dict[str, tuple[str, ...]] = {}
    for key in ("save", "offload"):
        names = value.get(key, ())
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise TypeError(f"remat[{key!r}]={names!r} must be a list of checkpoint names, e.g. "
                            f"{{{key!r}: ['key_proj', 'value_proj']}}")
        bad = [n for n in names if n not in CHECKPOINT_NAMES]
        if bad:
            raise ValueError(f"remat[{key!r}] names {bad[0]!r}, which the model does not name; "
                             f"its checkpoint names are {list(CHECKPOINT_NAMES)}")
        if len(set(names)) != len(names):
            raise ValueError(f"remat[{key!r}]={list(names)} names a tensor twice")
        parts[key] = tuple(sorted(names, key=CHECKPOINT_NAMES.index))
    both = set(parts["save"]) & set(parts["offload"])
    if both:
        raise ValueError(f"remat: {sorted(both)} both saved and offloaded; a tensor is kept on "
                         "the device ('save') or moved to host memory ('offload'), not both")
    if not parts["save"] and not parts["offload"]:
        raise ValueError(f"remat={dict(value)!r} keeps nothing: that is remat='full' (recompute "
                         "the whole block); give 'save' and/or 'offload' names, or a named policy")
    return RematPolicy(description=_describe(parts["save"], parts["offload"]),
                       saved=parts["save"], offloaded=parts["offload"])


def _describe(saved: tuple[str, ...], offloaded: tuple[str, ...]) -> str:
    kept = [f"keep {', '.join(saved)}"] if saved else []
    host = [f"offload {', '.join(offloaded)} to host memory"] if offloaded else []
    return "custom: " + "; ".join(kept + host) + "; recompute the rest"


def check_remat(value: Any) -> str | RematPolicy:
    """``GPTConfig.remat`` as stored: a named policy's name, or the checked ``RematPolicy`` of a
    custom mapping (a ``RematPolicy`` itself, as ``GPTConfig.replace`` passes it, stays)."""
    if isinstance(value, str):
        if value not in REMAT_POLICIES:
            raise ValueError(f"remat={value!r}; choose one of {sorted(REMAT_POLICIES)}, or a "
                             "custom policy {'save': [...], 'offload': [...]} of the checkpoint "
                             f"names {list(CHECKPOINT_NAMES)}")
        return value
    if isinstance(value, RematPolicy):
        return custom_remat({"save": list(value.saved), "offload": list(value.offloaded)}) \
            if value.base is None and not value.offload_dots else value
    if isinstance(value, Mapping):
        return custom_remat(value)
    raise TypeError(f"remat={value!r:.80} is a {type(value).__name__}; give a policy name "
                    f"({', '.join(sorted(REMAT_POLICIES))}) or a mapping {{'save': [...], "
                    "'offload': [...]} of checkpoint names")


def resolve_remat(remat: str | RematPolicy) -> RematPolicy:
    """The ``RematPolicy`` of ``GPTConfig.remat`` (a name or a custom policy)."""
    if isinstance(remat, RematPolicy):   # as GPTConfig stores a custom policy: checked
        return remat
    checked = check_remat(remat)
    return checked if isinstance(checked, RematPolicy) else REMAT_POLICIES[checked]


def remat_json(remat: str | RematPolicy) -> str | dict[str, list[str]]:
    """``GPTConfig.remat`` as JSON: the name, or ``{"save": [...], "offload": [...]}``."""
    if isinstance(remat, str):
        return remat
    return {"save": list(remat.saved), "offload": list(remat.offloaded)}


def remat_label(remat: str | RematPolicy | Mapping[str, Any]) -> str:
    """A short label for tables and plan text: the name, or ``custom(save=...; offload=...)``."""
    remat = check_remat(remat)
    if isinstance(remat, str):
        return remat
    parts = [f"save={','.join(remat.saved)}"] if remat.saved else []
    parts += [f"offload={','.join(remat.offloaded)}"] if remat.offloaded else []
    return f"custom({'; '.join(parts)})"


def remat_policy(remat: str | RematPolicy, platform: str | None = None) -> Any:
    """The ``jax.checkpoint`` policy for ``GPTConfig.remat`` (None: no remat).

    Args:
        remat: a key of ``REMAT_POLICIES`` or a custom ``RematPolicy`` (``check_remat``).
        platform: the platform compiled for; an offloading policy elsewhere than on
            ``OFFLOAD_PLATFORMS`` raises (checked before compiling).
    """
    p = resolve_remat(remat)
    if p.offloads and platform is not None and platform not in OFFLOAD_PLATFORMS:
        raise ValueError(
            f"remat={remat_label(remat)!r} offloads activations to host memory, which this "
            f"workbench enables on {', '.join(OFFLOAD_PLATFORMS)} only (JAX's pinned_host "
            f"memory kind); this step is for {platform}. Use a policy that keeps or "
            f"recomputes them instead, e.g. 'save_qkv_proj' or 'full'")
    cp = jax.checkpoint_policies
    if remat == "none":
        return None
    if p.offload_dots:
        return cp.offload_dot_with_no_batch_dims(offload_src="device",
                                                 offload_dst="pinned_host")
    if p.offloaded:
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=list(p.saved), names_which_can_be_offloaded=list(
                p.offloaded), offload_src="device", offload_dst="pinned_host")
    named = cp.save_only_these_names(*p.saved) if p.saved else None
    base = getattr(cp, p.base) if p.base else None
    if named is not None and base is not None:
        return cp.save_from_both_policies(base, named)
    return named or base or cp.nothing_saveable
