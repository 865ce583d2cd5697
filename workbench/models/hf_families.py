"""Hugging Face ``config.json`` <-> ``GPTConfig`` for the Llama, Mistral, Qwen2, Qwen3,
Mixtral, Qwen2-MoE and Qwen3-MoE families (fields that change the math are mapped or
refused by name; nothing is guessed)."""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from workbench.models.config import GPTConfig

#: ``architectures[0]`` -> family (the ``model_type``) this module reads and writes.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
FAMILIES: dict[str, str] = {v: k for k, v in ARCHITECTURES.items()}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")

#: Default training length of an imported model: its ``max_position_embeddings``, capped
#: (a 128k-token default would make every plan of it a long-context plan).
MAX_DEFAULT_SEQ = 4096

# Fields that do not change the forward pass (ids, bookkeeping, training-only switches).
_HARMLESS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
    "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "attention_dropout", "pretraining_tp", "output_router_logits", "router_jitter_noise",
    "max_window_layers", "tokenizer_class", "_attn_implementation_autoset",
})
# Fields read by the mapping below (their values are checked).
_READ = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings",
    "hidden_act", "attention_bias", "mlp_bias", "qkv_bias", "sliding_window",
    "use_sliding_window", "layer_types", "num_local_experts", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
})


class HFConfigError(ValueError):
    """A ``config.json`` this workbench cannot represent (names the field and the fix)."""


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model folder (or the file itself)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist; give a local Hugging Face model folder "
                                "(config.json + *.safetensors)")
    if not file.is_file():
        raise FileNotFoundError(
            f"{p} has no config.json: a Hugging Face model folder holds config.json and "
            "model.safetensors (or model-0000x-of-0000n.safetensors with "
            "model.safetensors.index.json); save one with save_pretrained(folder)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{file} is not valid JSON ({e}); re-save the model") from None


def family_of(hf: Mapping[str, Any], where: str = "config.json") -> str:
    """The family (``model_type``) of an HF config, from ``architectures``."""
    archs = hf.get("architectures") or []
    if not archs:
        mt = hf.get("model_type")
        if mt in FAMILIES:
            return str(mt)
        raise HFConfigError(f"{where} names no 'architectures' (model_type={mt!r}); this "
                            f"workbench reads {', '.join(ARCHITECTURES)}")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise HFConfigError(
            f"{where}: architecture {arch!r} is not supported; this workbench reads "
            f"{', '.join(ARCHITECTURES)} (decoder-only, RMSNorm, RoPE, SwiGLU)")
    return ARCHITECTURES[arch]


def _rope_theta(hf: Mapping[str, Any], where: str) -> float:
    rp = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = rp.get("rope_type", "default") if rp else scaling.get(
        "rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise HFConfigError(
            f"{where}: rope_type={kind!r} (RoPE scaling) is not implemented here; only plain "
            "RoPE ('default') is. Use a checkpoint without rope scaling")
    return float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _refuse(where: str, field: str, value: Any, why: str) -> None:
    raise HFConfigError(f"{where}: {field}={value!r} is not supported: {why}")


def to_gpt_config(hf: Mapping[str, Any], *, where: str = "config.json",
                  ignore_fields: Iterable[str] = (), **overrides: Any) -> GPTConfig:
    """The ``GPTConfig`` of an HF ``config.json`` dict.

    Args:
        hf: the parsed config.
        where: its file name, for errors.
        ignore_fields: fields not known here that you know do not change the model.
        **overrides: ``GPTConfig`` fields set on top (``scan_layers``, ``dtype``,
            ``seq_len``, ``remat``...).

    Raises:
        HFConfigError: an unsupported architecture, or a field whose value changes the
            math in a way ``GPTConfig`` cannot express (named, with the fix).
    """
    fam = family_of(hf, where)
    unknown = sorted(set(hf) - _HARMLESS - _READ - set(ignore_fields))
    if unknown:
        raise HFConfigError(
            f"{where}: fields {unknown} are unknown to this importer ({fam}); if they do not "
            f"change the forward pass, pass from_hf(..., ignore_fields={unknown!r})")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], "the MLP is SwiGLU (silu)")
    for f in ("mlp_bias", "attention_bias"):
        if hf.get(f):
            _refuse(where, f, hf[f], "the model has no MLP or output-projection biases "
                    "(Qwen2's q/k/v biases are supported)")
    types = set(hf.get("layer_types") or ["full_attention"])
    if types != {"full_attention"}:
        _refuse(where, "layer_types", sorted(types), "only full attention layers are built")
    window = hf.get("sliding_window") if fam in ("mistral", "mixtral") or hf.get(
        "use_sliding_window") else None
    d, n = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or d // n
    moe = _moe_fields(hf, fam, where)
    dt = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    max_pos = int(hf.get("max_position_embeddings", MAX_DEFAULT_SEQ))
    fields: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=int(hf["num_hidden_layers"]),
        n_heads=n, n_kv_heads=int(hf.get("num_key_value_heads") or n),
        head_dim=int(head_dim), d_ff=int(hf.get("intermediate_size", 0)) or moe["expert_d_ff"],
        seq_len=min(max_pos, MAX_DEFAULT_SEQ, window or max_pos),
        dtype=dt, param_dtype=dt,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=_rope_theta(hf, where), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=fam == "qwen2" or (fam == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        qk_norm=fam in ("qwen3", "qwen3_moe"),
        sliding_window=int(window) if window else None, **moe)
    fields.update(overrides)
    return GPTConfig(**fields)


def _moe_fields(hf: Mapping[str, Any], fam: str, where: str) -> dict[str, Any]:
    if fam not in MOE_FAMILIES:
        return {}
    e = hf.get("num_local_experts") or hf.get("num_experts")
    out: dict[str, Any] = dict(n_experts=int(e), experts_per_token=int(hf["num_experts_per_tok"]),
                               capacity_factor=None,   # HF routes dropless
                               router_aux_loss=float(hf.get("router_aux_loss_coef", 0.01)))
    if fam == "mixtral":
        out.update(expert_d_ff=int(hf["intermediate_size"]), router_norm_topk=True)
        return out
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        _refuse(where, "decoder_sparse_step/mlp_only_layers",
                (hf.get("decoder_sparse_step"), hf.get("mlp_only_layers")),
                "every block must be a MoE block (mixed dense and MoE blocks are not built)")
    fe = int(hf["moe_intermediate_size"])
    out.update(expert_d_ff=fe, router_norm_topk=bool(hf.get("norm_topk_prob", False)))
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if fam == "qwen2_moe" else 0
    if shared:
        if shared % fe:
            _refuse(where, "shared_expert_intermediate_size", shared,
                    f"the shared expert must be a whole number of experts of width {fe}")
        out.update(n_shared_experts=shared // fe, shared_expert_gate=True)
    return out


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
    keep = {k: v for k, v in (base or {}).items() if k in _HARMLESS} if \
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
    if fam in ("llama", "qwen3", "qwen3_moe"):
        hf["attention_bias"] = False
    if fam == "mistral" or fam == "mixtral":
        hf["sliding_window"] = cfg.sliding_window
    elif fam != "llama":
        hf["use_sliding_window"] = False
    if fam == "qwen2_moe":
        hf["qkv_bias"] = cfg.qkv_bias
    if fam in MOE_FAMILIES:
        hf.update(num_experts_per_tok=cfg.experts_per_token,
                  router_aux_loss_coef=cfg.router_aux_loss)
        if fam == "mixtral":
            hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.moe_d_ff)
        else:
            hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.moe_d_ff,
                      norm_topk_prob=cfg.router_norm_topk, decoder_sparse_step=1,
                      mlp_only_layers=[])
            if fam == "qwen3_moe":
                hf["num_local_experts"] = cfg.n_experts
            if cfg.n_shared_experts:
                hf["shared_expert_intermediate_size"] = cfg.n_shared_experts * cfg.moe_d_ff
    return hf
