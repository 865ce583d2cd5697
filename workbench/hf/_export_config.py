"""``GPTConfig`` -> Hugging Face ``config.json``: the family a config belongs to, the check
that it fits one, the dtype written, and the config itself (the way in is
``workbench._hf_format.families``)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workbench._hf_format.families import (
    FAMILIES,
    HARMLESS,
    LLAMA3_ROPE,
    MOE_FAMILIES,
    HFConfigError,
    family_of,
    to_gpt_config,
)
from workbench.models._config import GPTConfig


def family_for(cfg: GPTConfig) -> str:
    """The HF family that holds ``cfg`` exactly (raises if none does)."""
    if cfg.n_experts:
        if cfg.n_shared_experts:
            if not cfg.shared_expert_gate or cfg.qk_norm:
                raise HFConfigError(
                    "a MoE with shared experts exports as Qwen2-MoE, which gates them "
                    "(shared_expert_gate=True) and has no q/k norms; this config has "
                    f"shared_expert_gate={cfg.shared_expert_gate}, qk_norm={cfg.qk_norm}")
            return "qwen2_moe"
        if cfg.qk_norm:
            return "qwen3_moe"
        if cfg.qkv_bias or not cfg.router_norm_topk:
            raise HFConfigError(
                "no supported HF MoE family has q/k/v biases without shared experts, or "
                "un-normalised top-k weights without q/k norms (Mixtral normalises); "
                f"qkv_bias={cfg.qkv_bias}, router_norm_topk={cfg.router_norm_topk}")
        return "mixtral"
    if cfg.qk_norm and cfg.qkv_bias:
        raise HFConfigError("qk_norm with qkv_bias has no HF family here (Qwen3 has no "
                            "q/k/v biases, Qwen2 no q/k norms)")
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


#: ``GPTConfig`` fields that decide the tensors and the math of an exported model.
_ARCH_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps", "n_experts",
                "experts_per_token",
                "n_shared_experts", "router_norm_topk", "qkv_bias", "qk_norm",
                "shared_expert_gate", "sliding_window")


def check_family(cfg: GPTConfig, family: str) -> None:
    """Raises unless ``family`` holds ``cfg`` exactly: its ``config.json`` read back gives
    the same architecture (else transformers builds another model and initialises the
    tensors it does not find at random).

    Raises:
      HFConfigError: an unknown family, or one that cannot hold this model, naming the
        fields that would change and the family that fits.
    """
    if not isinstance(family, str) or family not in FAMILIES:
        raise HFConfigError(f"family={family!r}; choose one of {sorted(FAMILIES)}")
    try:
        fits = family_for(cfg)
    except HFConfigError as e:
        fits = f"none ({e})"
    if (family in MOE_FAMILIES) != bool(cfg.n_experts):
        kinds = ("a mixture-of-experts family", "dense") if family in MOE_FAMILIES else \
            ("a dense family", f"a mixture of {cfg.n_experts} experts")
        raise HFConfigError(f"family={family!r} cannot hold this model: it is {kinds[0]} "
                            f"and the model is {kinds[1]}; use family={fits!r} (or leave "
                            "family out)")
    try:
        back = to_gpt_config(from_gpt_config(cfg, family=family), where=family)
    except (HFConfigError, ValueError, TypeError) as e:
        raise HFConfigError(f"family={family!r} cannot hold this model ({e}); use "
                            f"family={fits!r} (or leave family out)") from None
    names = ["d_ff"] if not cfg.n_experts else ["moe_d_ff"]
    diff = [f"{k}: {getattr(cfg, k)!r} -> {getattr(back, k)!r}"
            for k in (*_ARCH_FIELDS, *names) if getattr(cfg, k) != getattr(back, k)]
    if diff:
        raise HFConfigError(
            f"family={family!r} cannot hold this model: read back as {family}, it would have "
            f"{'; '.join(diff)} (transformers would initialise the missing tensors at "
            f"random); use family={fits!r} (or leave family out)")


#: Tensor dtypes an export may write (floats: integer dtypes would truncate the weights).
EXPORT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def export_dtype(dtype: Any, cfg: GPTConfig) -> Any:
    """The numpy dtype ``to_hf(dtype=...)`` writes (default: the parameters' own).

    Raises:
      ValueError: not a float dtype of :data:`EXPORT_DTYPES` (``"int8"`` would truncate
        every weight), naming the value.
    """
    import numpy as np

    name = cfg.param_dtype if dtype is None else dtype
    try:
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if dt is None or dt.name not in EXPORT_DTYPES:
        raise ValueError(f"to_hf dtype={dtype!r} cannot hold the weights; use one of "
                         f"{', '.join(EXPORT_DTYPES)} (integer dtypes would truncate them: "
                         "quantise with a tool made for it after exporting)")
    return dt


def from_gpt_config(cfg: GPTConfig, *, family: str | None = None,
                    base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` dict for ``cfg``.

    Args:
        cfg: the model's config.
        family: the HF family (default :func:`family_for`).
        base: a config.json to keep unrelated fields of (token ids, ...), e.g. the one
            the model was imported from.
    """
    fam = family or family_for(cfg)
    if fam not in FAMILIES:
        raise HFConfigError(f"family={fam!r}; choose one of {sorted(FAMILIES)}")
    if cfg.shared_expert_gate and not cfg.n_shared_experts:
        raise HFConfigError("shared_expert_gate=True without shared experts")
    keep = {k: v for k, v in (base or {}).items() if k in HARMLESS} if \
        base and family_of(base) == fam else {}
    hf: dict[str, Any] = {**keep, "architectures": [FAMILIES[fam]], "model_type": fam,
                          "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
                          "num_hidden_layers": cfg.n_layers,
                          "num_attention_heads": cfg.n_heads,
                          "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                          "intermediate_size": cfg.d_ff, "hidden_act": "silu",
                          "max_position_embeddings": max(cfg.seq_len,
                                                         int((base or {}).get(
                                                             "max_position_embeddings", 0))),
                          "rms_norm_eps": cfg.norm_eps,
                          "rope_parameters": {"rope_theta": cfg.rope_theta,
                                              "rope_type": "default"},
                          "rope_theta": cfg.rope_theta,
                          "tie_word_embeddings": cfg.tie_embeddings,
                          "dtype": cfg.param_dtype}
    if cfg.rope_scaling is not None:   # Llama 3's, as transformers 5 and 4 read it
        llama3 = {"rope_type": "llama3", **dict(zip(LLAMA3_ROPE, cfg.rope_scaling, strict=True))}
        hf["rope_parameters"] = {"rope_theta": cfg.rope_theta, **llama3}
        hf["rope_scaling"] = llama3
    if fam in ("llama", "qwen3", "qwen3_moe"):
        hf["attention_bias"] = False
    if fam == "mistral" or fam == "mixtral":
        hf["sliding_window"] = cfg.sliding_window
    elif fam != "llama":
        hf["use_sliding_window"] = False
    if fam == "qwen2_moe":
        hf["qkv_bias"] = cfg.qkv_bias
    if fam in MOE_FAMILIES:
        hf.update(_moe_config(cfg, fam))
    return hf


def _moe_config(cfg: GPTConfig, fam: str) -> dict[str, Any]:
    """The mixture-of-experts fields of family ``fam``'s config.json for ``cfg``."""
    out: dict[str, Any] = {"num_experts_per_tok": cfg.experts_per_token,
                           "router_aux_loss_coef": cfg.router_aux_loss}
    if fam == "mixtral":
        return {**out, "num_local_experts": cfg.n_experts, "intermediate_size": cfg.moe_d_ff}
    out.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.moe_d_ff,
               norm_topk_prob=cfg.router_norm_topk, decoder_sparse_step=1, mlp_only_layers=[])
    if fam == "qwen3_moe":
        out["num_local_experts"] = cfg.n_experts
    if cfg.n_shared_experts:
        out["shared_expert_intermediate_size"] = cfg.n_shared_experts * cfg.moe_d_ff
    return out
