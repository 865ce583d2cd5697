"""Hugging Face ``config.json`` -> ``GPTConfig`` for the Llama, Mistral, Qwen2, Qwen3,
Mixtral, Qwen2-MoE and Qwen3-MoE families (fields that change the math are mapped or
refused by name; nothing is guessed). The way out is ``workbench.hf._export_config``."""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from workbench.models._config import GPTConfig

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
HARMLESS = frozenset({
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


class ModelFolderNotFound(FileNotFoundError):
    """A Hugging Face model folder (or its config.json) that is not there (a
    ``FileNotFoundError``; the message names the path and what a folder holds)."""


class HFConfigError(ValueError):
    """A ``config.json`` this workbench cannot represent (names the field and the fix)."""


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model folder (or the file itself)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise ModelFolderNotFound(f"path={str(p)!r} does not exist; give a local Hugging Face "
                                  "model folder (config.json + *.safetensors), or a Hub id "
                                  "(org/name) that is cached or can be downloaded")
    if not file.is_file():
        raise ModelFolderNotFound(
            f"{p} has no config.json: a Hugging Face model folder holds config.json and "
            "model.safetensors (or model-0000x-of-0000n.safetensors with "
            "model.safetensors.index.json); save one with save_pretrained(folder)")
    try:
        data = json.loads(file.read_bytes())
    except UnicodeDecodeError as e:
        raise HFConfigError(f"{file} is not UTF-8 text (byte {e.start}; binary?); it is not "
                            "a config.json: re-save the model (save_pretrained)") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise HFConfigError(f"{file} is not valid JSON ({e}); re-save the model") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{file} holds a JSON {type(data).__name__}, not an object of "
                            "config fields; re-save the model (save_pretrained)")
    return data


def _field(hf: Mapping[str, Any], name: str, where: str, kind: str, *,
           default: Any = ..., minimum: float | None = None) -> Any:
    """``hf[name]`` checked: "int" (a whole number: 64 or 64.0, never 64.9 or true),
    "float" (finite), "bool", "str", "list" or "dict"; None reads as ``default``.

    Raises:
      HFConfigError: missing (without a default) or of the wrong type or range, naming
        the file, the field and the value.
    """
    value = hf.get(name)
    if value is None:
        if default is ...:
            raise HFConfigError(f"{where}: field {name!r} is missing; a {kind} is needed "
                                "(re-save the model with save_pretrained)")
        return default
    ok = True
    if kind in ("int", "float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value) and (kind == "float" or float(value).is_integer())
        if ok:
            value = int(value) if kind == "int" else float(value)
    else:
        ok = isinstance(value, {"bool": bool, "str": str, "list": list, "dict": dict}[kind])
    what = {"int": "a whole number", "float": "a finite number", "bool": "true or false",
            "str": "a string", "list": "a list", "dict": "an object"}[kind]
    if not ok:
        raise HFConfigError(f"{where}: field {name!r} is {value!r} "
                            f"({type(value).__name__}), not {what}; fix config.json")
    if minimum is not None and value < minimum:
        raise HFConfigError(f"{where}: field {name!r} is {value!r}, below {minimum:g}; "
                            "fix config.json")
    return value


def family_of(hf: Mapping[str, Any], where: str = "config.json") -> str:
    """The family (``model_type``) of an HF config, from ``architectures``."""
    archs = _field(hf, "architectures", where, "list", default=[])
    if not all(isinstance(a, str) for a in archs):
        raise HFConfigError(f"{where}: field 'architectures' is {archs!r}, not a list of "
                            "class names such as ['LlamaForCausalLM']; fix config.json")
    if not archs:
        mt = _field(hf, "model_type", where, "str", default=None)
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
    rp = _field(hf, "rope_parameters", where, "dict", default={})
    theta = _field(hf, "rope_theta", where, "float", default=10000.0, minimum=0)
    return _field(rp, "rope_theta", f"{where} rope_parameters", "float", default=theta,
                  minimum=0)


#: The ``rope_scaling`` fields of Llama 3's RoPE scaling, in ``GPTConfig.rope_scaling``'s order.
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")


def _rope_scaling(hf: Mapping[str, Any], where: str) -> tuple[Any, ...] | None:
    """``GPTConfig.rope_scaling`` of a config.json: None for plain RoPE, Llama 3's four
    numbers for ``rope_type: "llama3"`` (``rope_parameters`` in transformers 5,
    ``rope_scaling`` before); any other scaling is refused by name."""
    rp = _field(hf, "rope_parameters", where, "dict", default={})
    scaling = _field(hf, "rope_scaling", where, "dict", default={})
    src, name = (rp, "rope_parameters") if rp.get("rope_type", "default") != "default" \
        else (scaling, "rope_scaling")
    kind = src.get("rope_type", src.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise HFConfigError(
            f"{where}: rope_type={kind!r} (RoPE scaling) is not implemented here; plain RoPE "
            "('default') and Llama 3's ('llama3') are. Use a checkpoint without this scaling")
    missing = [f for f in LLAMA3_ROPE if src.get(f) is None]
    if missing:
        raise HFConfigError(f"{where}: {name} has rope_type 'llama3' without {missing}; "
                            f"Llama 3's RoPE scaling needs {list(LLAMA3_ROPE)}")
    return tuple(src[f] for f in LLAMA3_ROPE)


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
    _refuse_unbuilt(hf, fam, where, ignore_fields)
    window = _window(hf, fam, where)
    d = _field(hf, "hidden_size", where, "int", minimum=1)
    n = _field(hf, "num_attention_heads", where, "int", minimum=1)
    head_dim = _field(hf, "head_dim", where, "int", default=None, minimum=1) or d // n
    moe = _moe_fields(hf, fam, where)
    dt = _dtype(hf, where)
    max_pos = _field(hf, "max_position_embeddings", where, "int", default=MAX_DEFAULT_SEQ,
                     minimum=1)
    d_ff = _field(hf, "intermediate_size", where, "int", default=0, minimum=0)
    fields: dict[str, Any] = dict(
        vocab_size=_field(hf, "vocab_size", where, "int", minimum=1), d_model=d,
        n_layers=_field(hf, "num_hidden_layers", where, "int", minimum=1),
        n_heads=n, n_kv_heads=_field(hf, "num_key_value_heads", where, "int", default=n,
                                     minimum=1),
        head_dim=head_dim, d_ff=d_ff or moe["expert_d_ff"],
        seq_len=min(max_pos, MAX_DEFAULT_SEQ, window or max_pos),
        dtype=dt, param_dtype=dt,
        tie_embeddings=_field(hf, "tie_word_embeddings", where, "bool", default=False),
        rope_theta=_rope_theta(hf, where), rope_scaling=_rope_scaling(hf, where),
        norm_eps=_field(hf, "rms_norm_eps", where, "float", default=1e-6, minimum=0),
        qkv_bias=fam == "qwen2" or (fam == "qwen2_moe" and _field(
            hf, "qkv_bias", where, "bool", default=True)),
        qk_norm=fam in ("qwen3", "qwen3_moe"),
        sliding_window=window or None, **moe)
    fields.update(overrides)
    try:
        return GPTConfig(**fields)
    except (TypeError, ValueError) as e:   # a value GPTConfig refuses (heads, sizes, ...)
        raise HFConfigError(f"{where}: {e}") from None


def _window(hf: Mapping[str, Any], fam: str, where: str) -> int | None:
    """The sliding window a family's config asks for (Mistral's and Mixtral's always),
    or None."""
    use_window = fam in ("mistral", "mixtral") or _field(hf, "use_sliding_window", where,
                                                           "bool", default=False)
    return _field(hf, "sliding_window", where, "int", default=None, minimum=0) \
        if use_window else None


def _refuse_unbuilt(hf: Mapping[str, Any], fam: str, where: str,
                    ignore_fields: Iterable[str]) -> None:
    """Refuses, by field, what the importer does not know (unless ``ignore_fields`` names
    it) and what the model does not build: another activation than SwiGLU's silu, MLP or
    output-projection biases, layers other than full attention."""
    unknown = sorted(set(hf) - HARMLESS - _READ - set(ignore_fields))
    if unknown:
        raise HFConfigError(
            f"{where}: fields {unknown} are unknown to this importer ({fam}); if they do not "
            f"change the forward pass, pass from_hf(..., ignore_fields={unknown!r})")
    if _field(hf, "hidden_act", where, "str", default="silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], "the MLP is SwiGLU (silu)")
    for f in ("mlp_bias", "attention_bias"):
        if _field(hf, f, where, "bool", default=False):
            _refuse(where, f, hf[f], "the model has no MLP or output-projection biases "
                    "(Qwen2's q/k/v biases are supported)")
    types = _field(hf, "layer_types", where, "list", default=None) or ["full_attention"]
    if not all(isinstance(t, str) for t in types) or set(types) != {"full_attention"}:
        _refuse(where, "layer_types", types, "only full attention layers are built")


#: config.json ``dtype`` / ``torch_dtype`` values a model's parameters may have.
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _dtype(hf: Mapping[str, Any], where: str) -> str:
    name = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    dt = _field(hf, name, where, "str", default="float32")
    if dt not in DTYPES:
        raise HFConfigError(f"{where}: field {name!r} is {dt!r}; the parameters must be one "
                            f"of {', '.join(DTYPES)} (quantised checkpoints are not read)")
    return dt


def _moe_fields(hf: Mapping[str, Any], fam: str, where: str) -> dict[str, Any]:
    if fam not in MOE_FAMILIES:
        return {}
    key = "num_local_experts" if hf.get("num_local_experts") is not None else "num_experts"
    out: dict[str, Any] = dict(
        n_experts=_field(hf, key, where, "int", minimum=1),
        experts_per_token=_field(hf, "num_experts_per_tok", where, "int", minimum=1),
        capacity_factor=None,   # HF routes dropless
        router_aux_loss=_field(hf, "router_aux_loss_coef", where, "float", default=0.01,
                               minimum=0))
    if fam == "mixtral":
        out.update(expert_d_ff=_field(hf, "intermediate_size", where, "int", minimum=1),
                   router_norm_topk=True)
        return out
    step = _field(hf, "decoder_sparse_step", where, "int", default=1)
    if step != 1 or _field(hf, "mlp_only_layers", where, "list", default=None):
        _refuse(where, "decoder_sparse_step/mlp_only_layers",
                (hf.get("decoder_sparse_step"), hf.get("mlp_only_layers")),
                "every block must be a MoE block (mixed dense and MoE blocks are not built)")
    fe = _field(hf, "moe_intermediate_size", where, "int", minimum=1)
    out.update(expert_d_ff=fe, router_norm_topk=_field(hf, "norm_topk_prob", where, "bool",
                                                       default=False))
    shared = _field(hf, "shared_expert_intermediate_size", where, "int", default=0,
                    minimum=0) if fam == "qwen2_moe" else 0
    if shared:
        if shared % fe:
            _refuse(where, "shared_expert_intermediate_size", shared,
                    f"the shared expert must be a whole number of experts of width {fe}")
        out.update(n_shared_experts=shared // fe, shared_expert_gate=True)
    return out


