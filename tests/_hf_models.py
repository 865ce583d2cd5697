"""Small Hugging Face models made by ``transformers`` itself (random weights, no download),
for the import/export/generation tests and the notebook.

Run as a script to write reference fixtures (the folder, plus ``reference.npz`` with
transformers' float32 logits and greedy tokens) for a machine without transformers::

    python -m tests._hf_models /tmp/hf-fixtures            # every family
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
PROMPT = np.array([[3, 17, 42, 99, 5, 60], [71, 2, 8, 33, 90, 14]], np.int32)   # (2, 6)
VOCAB = 128


def hf_config(family: str, **overrides: Any) -> Any:
    """A tiny transformers config of ``family``: 2 layers, width 64, 4 heads / 2 kv heads."""
    import transformers as t

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_theta=5000.0, tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=48)
    cls, extra = {
        "llama": (t.LlamaConfig, {}),
        "mistral": (t.MistralConfig, {"sliding_window": 256}),
        "qwen2": (t.Qwen2Config, {}),
        "qwen3": (t.Qwen3Config, {}),
        "mixtral": (t.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "qwen2_moe": (t.Qwen2MoeConfig, {"num_experts": 4, "shared_expert_intermediate_size":
                                         96, "norm_topk_prob": False, **moe}),
        "qwen3_moe": (t.Qwen3MoeConfig, {"num_experts": 4, "norm_topk_prob": True, **moe}),
    }[family]
    cfg = cls(**{**common, **extra, **overrides})
    if family == "qwen3_moe":   # transformers 5 names it num_local_experts
        cfg.num_local_experts = 4
    return cfg


def make_model(family: str, *, seed: int = 0, **overrides: Any) -> Any:
    """A float32 ``transformers`` model of ``family`` whose every weight (norm scales and
    biases included) is drawn at random, so each tensor's mapping shows in the logits."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.08)
    model.generation_config.eos_token_id = None   # greedy runs for max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def save(model: Any, folder: str | Path, *, dtype: str = "float32",
         shard: str | None = None) -> Path:
    """``save_pretrained`` in ``dtype``, sharded into files of ``shard`` (e.g. "20KB")."""
    import torch

    folder = Path(folder)
    m = model.to(getattr(torch, dtype))
    m.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    model.to(torch.float32)
    return folder


def reference(model: Any, tokens: np.ndarray = PROMPT, new: int = 8
              ) -> tuple[np.ndarray, np.ndarray]:
    """transformers' float32 logits ``(B, T, V)`` and greedy tokens ``(B, T + new)``."""
    import torch

    with torch.no_grad():
        x = torch.tensor(tokens, dtype=torch.long)
        logits = model(x).logits.float().numpy()
        greedy = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                do_sample=False).numpy()
    return logits, greedy


def main(out: str) -> None:
    for fam in FAMILIES:
        model = make_model(fam)
        folder = save(model, Path(out) / fam)
        logits, greedy = reference(model)
        np.savez(folder / "reference.npz", prompt=PROMPT, logits=logits, greedy=greedy)
        print(folder)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "hf-fixtures")
