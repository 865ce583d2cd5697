"""LoRA memory on a teaching chip: the TPU compiler's plans of full fine-tuning and of LoRA
(rank 16 on q, k, v, o; AdamW) for a Qwen3-0.6B-shaped and a Llama-3.2-1B-shaped model
(``GPTConfig.preset("1b")``) on an abstract v5e-8 with every weight on each chip (rules
"dp": what one 16 GiB v5e chip of a teaching VM holds), batch 1 x 1024 tokens per chip.
Per plan: memory per chip (params, gradients, optimizer state, total) compiled and by
formula, and whether it fits the chip's 16 GiB.

Compiled with libtpu on this CPU (minutes per plan); nothing is timed, so the rows do not
depend on how loaded the machine is.
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
                                     "estimate": dict(p.memory_estimate), "fits": p.fits}
    return out


def _rows() -> list[dict[str, Any]]:
    plans = lora_plans()
    gib = lambda b: f"{(b or 0) / 2**30:.2f} GiB"
    rows = []
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
    """The LoRA vs full fine-tuning plan rows."""
    return _rows()
