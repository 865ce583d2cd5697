"""LoRA memory on a teaching chip: the TPU compiler's plans of full fine-tuning and of LoRA
(rank 16 on q, k, v, o; AdamW) for a Qwen3-0.6B-shaped and a Llama-3.2-1B-shaped model
(``GPTConfig.preset("1b")``) on an abstract v5e-8 with every weight on each chip (rules
"dp": what one 16 GiB v5e chip of a teaching VM holds), batch 1 x 1024 tokens per chip.
Per plan: memory per chip (params, gradients, optimizer state, total) compiled and by
formula, and whether it fits the chip's 16 GiB.

Compiled with libtpu on this CPU (minutes per plan); nothing is timed, so the rows do not
depend on how loaded the machine is.

The laptop rows (:func:`laptop_memory`, notebook 13's table and docs/weights.md): the small
released models notebook 13 suits (Qwen3-0.6B, Llama-3.2-1B, SmolLM2-135M/360M/1.7B),
each from its real ``config.json`` values (:data:`RELEASED`) read by ``wb.hf.hf_config``
(so in the checkpoint's bfloat16), planned by formula on one CPU device (a laptop: JAX on
its CPU, the host's RAM): inference is the weights plus a KV cache of 2048 tokens (the
shape ``model.init_cache`` allocates); fine-tuning is ``wb.plan``'s total for one step of
1 x 1024 tokens with AdamW, full and LoRA (:data:`LORA`). Seconds of CPU; print them with
``python -m benchmarks.bench_lora_plans``.
"""
from __future__ import annotations

from typing import Any

#: rank 16, alpha 32 on the attention projections (PEFT's and torchtune's usual start)
LORA = {"rank": 16, "alpha": 32, "targets": ("q", "k", "v", "o")}


def qwen3_06b() -> Any:
    """Qwen3-0.6B's shape (its config.json: 28 layers, width 1024, 16/8 heads of 128, d_ff
    3072, tied embeddings, q/k norms)."""
    from workbench.models import GPTConfig

    return GPTConfig(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                     head_dim=128, d_ff=3072, seq_len=4096, tie_embeddings=True,
                     qk_norm=True, rope_theta=1e6, norm_eps=1e-6)


#: The config.json fields that set the size of each small released model notebook 13 suits
#: (as published on the Hub; the fields workbench ignores left out). All are bfloat16 with
#: tied embeddings (Llama-3.2-1B with Llama 3's RoPE scaling, which holds no weights).
RELEASED: dict[str, dict[str, Any]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16"},
    "HuggingFaceTB/SmolLM2-360M-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 960,
        "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
        "num_key_value_heads": 5, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16"},
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 130000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16"},
}


def released_config(repo_id: str) -> Any:
    """The ``GPTConfig`` ``wb.hf.hf_config`` reads from ``RELEASED[repo_id]``'s config.json."""
    import json
    import tempfile
    from pathlib import Path

    import workbench as wb

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(RELEASED[repo_id]))
        return wb.hf.hf_config(d)


def laptop_memory(models: tuple[str, ...] = tuple(RELEASED), *, seq: int = 1024,
                  context: int = 2048) -> dict[str, dict[str, int]]:
    """``{repo_id: {"params", "inference", "full", "lora", "activations"}}``: the parameter
    count, and the bytes one CPU device holds to generate (weights + a KV cache of
    ``context`` tokens), to fully fine-tune and to LoRA fine-tune (``wb.plan``'s total,
    batch 1 x ``seq``), and the step's activations (the same in both)."""
    import jax
    import optax
    from flax import nnx

    import workbench as wb

    mesh = wb.abstract_mesh(data=1)
    out = {}
    for repo_id in models:
        cfg = released_config(repo_id)
        model = nnx.eval_shape(lambda cfg=cfg: wb.models.GPT(cfg, rngs=nnx.Rngs(0)))
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        cache = jax.eval_shape(lambda model=model: model.init_cache(1, context))
        cache_bytes = sum(x.size * x.dtype.itemsize for x in (cache.k, cache.v))
        plans = {kind: wb.plan(c, mesh=mesh, rules="dp", batch=1, seq=seq,
                               optimizer=optax.adamw(1e-4), compile=False, progress=False)
                 for kind, c in (("full", cfg), ("lora", cfg.replace(lora=LORA)))}
        out[repo_id] = {"params": n_params,
                        "inference": plans["full"].memory["params"] + cache_bytes,
                        "full": plans["full"].memory["total"],
                        "lora": plans["lora"].memory["total"],
                        "activations": plans["lora"].memory["activations"]}
    return out


def lora_plans(models: tuple[str, ...] = ("qwen3-0.6b", "1b"), *, compile: bool = True,
               seq: int = 1024) -> dict[str, dict[str, Any]]:
    """``{"<model> full" | "<model> lora": {...}}``: each plan's ``source``, compiled
    ``memory`` and formula ``estimate`` (bytes per chip) and ``fits``."""
    import optax

    import workbench as wb
    from workbench.models import GPTConfig

    mesh = wb.abstract_mesh("v5e-8", data=8)
    out = {}
    for name in models:
        cfg = qwen3_06b() if name == "qwen3-0.6b" else GPTConfig.preset(name)
        for kind, c in (("full", cfg), ("lora", cfg.replace(lora=LORA))):
            p = wb.plan(c, mesh=mesh, rules="dp", batch=8, seq=seq,
                        optimizer=optax.adamw(1e-4), compile=compile, progress=False)
            out[f"{name} {kind}"] = {"source": p.source, "memory": dict(p.memory),
                                     "estimate": dict(p.report.memory_estimate), "fits": p.fits}
    return out


def _laptop_rows() -> list[dict[str, Any]]:
    rows = []
    for repo_id, m in laptop_memory().items():
        for kind in ("inference", "full", "lora"):
            what = {"inference": "inference (weights + 2048-token KV cache)",
                    "full": "full fine-tuning, AdamW, 1 x 1024 tokens",
                    "lora": "LoRA r16 qkvo fine-tuning, AdamW, 1 x 1024 tokens"}[kind]
            rows.append({"name": f"laptop memory: {repo_id.split('/')[1]} {what}, one CPU "
                                 "device, bfloat16", "value": m[kind] / 1e9, "unit": "GB",
                         "target": "", "ok": None,
                         "notes": f"{m['params'] / 1e9:.2f} B parameters; wb.plan formula "
                                  "(compile=False) from its config.json" + (
                                      f"; activations {m['activations'] / 1e9:.2f} GB"
                                      if kind != "inference" else "")})
    return rows


def laptop_table() -> str:
    """Notebook 13's table: one markdown row per model (GB = 10^9 bytes)."""
    lines = ["| model | Hub id | parameters | inference | full fine-tuning | LoRA |",
             "|---|---|---|---|---|---|"]
    for repo_id, m in laptop_memory().items():
        name = repo_id.split("/")[1].removesuffix("-Instruct")
        lines.append(f"| {name} | `{repo_id}` | {m['params'] / 1e9:.2f} B | "
                     f"{m['inference'] / 1e9:.1f} GB | {m['full'] / 1e9:.1f} GB | "
                     f"{m['lora'] / 1e9:.1f} GB |")
    return "\n".join(lines)


def _rows() -> list[dict[str, Any]]:
    plans = lora_plans()
    gib = lambda b: f"{(b or 0) / 2**30:.2f} GiB"
    rows = _laptop_rows()
    for key, r in plans.items():
        m, e = r["memory"], r["estimate"]
        name, kind = key.split(" ")
        rows.append({
            "name": f"LoRA memory: {name} {'LoRA r16 qkvo' if kind == 'lora' else 'full'} "
                    "fine-tuning per chip, v5e-8 dp, 1 x 1024 tokens/chip",
            "value": m["total"] / 2**30, "unit": "GiB",
            "target": "fits 16 GiB" if kind == "lora" else "",
            "ok": r["fits"] if kind == "lora" else None,
            "notes": f"{_source(r)}: params {gib(m['params'])}, gradients "
                     f"{gib(m['gradients'])}, optimizer {gib(m['optimizer'])}, total "
                     f"{gib(m['total'])} ({'fits' if r['fits'] else 'DOES NOT FIT'}); "
                     f"formula: gradients {gib(e['gradients'])}, total {gib(e['total'])}"})
    return rows


def _source(r: dict[str, Any]) -> str:
    """Where the numbers come from; a step the TPU compiler refused as out of memory keeps
    the formula's numbers with the compiler's temp (from its message)."""
    if r["source"] != "tpu-compiler" and r["memory"].get("temp") != r["estimate"].get("temp"):
        return "the TPU compiler refused it (out of memory; its temp, the formula's rest)"
    return r["source"]


def run() -> list[dict[str, Any]]:
    """The LoRA vs full fine-tuning plan rows (the laptop rows first)."""
    return _rows()


if __name__ == "__main__":   # the laptop table only (seconds): notebook 13, docs/weights.md
    print(laptop_table())
