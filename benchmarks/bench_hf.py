"""Hugging Face import: peak host memory and time of wb.hf.from_hf against a plain
safetensors read, and generation tokens/s with and without the KV cache.

The checkpoint is a Llama-shaped folder (~200M parameters, bfloat16, ~100 MB shards)
written here with numpy + safetensors; each measurement runs in a fresh interpreter so
``ru_maxrss`` (the process's peak resident memory) is the import's own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# vocab 32000, width 1024, 8 layers, 16 heads of 64 (8 kv heads), SwiGLU 4096, untied.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
          "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
          "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16"}
SHARD_BYTES = 100 << 20
FIXED_OVERHEAD = 256 << 20   # the interpreter's own allocations while importing (budget)


def _tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n, k, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "lm_head.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (n * h, d),
                   p + "self_attn.k_proj.weight": (k * h, d),
                   p + "self_attn.v_proj.weight": (k * h, d),
                   p + "self_attn.o_proj.weight": (d, n * h),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)}
    return shapes


def write_checkpoint(folder: Path) -> tuple[int, int]:
    """A sharded bf16 folder; returns (total bytes, largest tensor bytes)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(0)
    shard, size, n, weight_map, total = {}, 0, 0, {}, 0
    largest = 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            n += 1
            save_file(shard, str(folder / f"part-{n}.safetensors"))
            for k in shard:
                weight_map[k] = f"part-{n}.safetensors"
            shard, size = {}, 0

    for name, shape in _tensors(CONFIG).items():
        x = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if size + x.nbytes > SHARD_BYTES:
            flush()
        shard[name], size = x, size + x.nbytes
        total += x.nbytes
        largest = max(largest, x.nbytes)
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total, largest


_CHILD = r"""
import json, resource, sys, time
mode, folder = sys.argv[1], sys.argv[2]
import jax, numpy as np
import workbench as wb
jax.devices()
mesh = wb.make_mesh(data=8)
def rss():   # resident now (ru_maxrss is a peak: it may hold JAX's start-up transients)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = rss()
t0 = time.perf_counter()
if mode == "from_hf":
    model = wb.hf.from_hf(folder, mesh=mesh, rules="fsdp")
    jax.block_until_ready(jax.tree.leaves(model))
    held = sum(x.nbytes for x in jax.tree.leaves(model) if hasattr(x, "nbytes"))
else:   # every tensor read whole by safetensors, one file at a time
    from pathlib import Path
    from safetensors.numpy import load_file
    held = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        held += sum(x.nbytes for x in load_file(str(f)).values())
secs = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"secs": secs, "base": base, "peak": peak, "held": held}))
"""


def _child(mode: str, folder: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(folder)],
                         capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _generation() -> tuple[float, float, str]:
    """tokens/s of greedy generation with and without the cache (compiled first)."""
    import time

    import jax
    from flax import nnx

    import workbench as wb
    from workbench.models import GPTConfig
    from workbench._step import sharded_init
    from workbench._train_state import abstract_model, param_specs

    cfg = GPTConfig(vocab_size=32000, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4,
                    head_dim=64, d_ff=2048, seq_len=256)
    mesh = wb.make_mesh(data=4, model=2)
    graphdef, abstract, logical = abstract_model(cfg)
    specs = param_specs(abstract, logical, wb.Rules.preset("fsdp_tp", mesh))
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
    model = nnx.merge(graphdef, sharded_init(cfg, None, shardings)(jax.random.key(0)))
    prompt = np.random.default_rng(0).integers(0, 32000, (8, 64))
    rates = []
    for cache in (True, False):
        wb.generate(model, prompt, max_new_tokens=4, cache=cache)       # compile
        t0 = time.perf_counter()
        wb.generate(model, prompt, max_new_tokens=64, cache=cache)
        rates.append(8 * 64 / (time.perf_counter() - t0))
    return rates[0], rates[1], "batch 8, prompt 64, 64 new tokens, 4 layers x 512, data=4 x model=2"


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama-200m"
        total, largest = write_checkpoint(folder)
        hf = _child("from_hf", folder)
        plain = _child("plain", folder)
    extra = hf["peak"] - hf["base"] - hf["held"]   # beyond what the devices now hold
    budget = 1.5 * largest + FIXED_OVERHEAD
    with_cache, without, how = _generation()
    mb = lambda b: f"{b / 2**20:.0f} MiB"
    return [
        {"name": "from_hf peak host memory beyond the loaded parameters", "value":
            round(extra / 2**20, 1), "unit": "MiB",
         "target": f"< 1.5 x largest tensor + {mb(FIXED_OVERHEAD)} = {mb(budget)}",
         "ok": extra < budget,
         "notes": f"checkpoint {mb(total)} bf16 in {SHARD_BYTES >> 20} MiB shards, largest "
                  f"tensor {mb(largest)}; peak RSS {mb(hf['peak'])} - resident before "
                  f"{mb(hf['base'])} "
                  f"- parameters held by the 8 CPU devices {mb(hf['held'])}"},
        {"name": "from_hf time / plain safetensors read of the same files",
         "value": round(hf["secs"] / plain["secs"], 2), "unit": "x",
         "target": "< 3 x", "ok": hf["secs"] / plain["secs"] < 3,
         "notes": f"from_hf {hf['secs']:.2f} s (sliced reads + device placement, fsdp over 8 "
                  f"devices); load_file per shard {plain['secs']:.2f} s"},
        {"name": "generate tokens/s with KV cache", "value": round(with_cache, 1),
         "unit": "tok/s", "target": "", "ok": None, "notes": how},
        {"name": "generate tokens/s without cache (recompute)", "value": round(without, 1),
         "unit": "tok/s", "target": "< with cache", "ok": without < with_cache, "notes": how},
    ]
