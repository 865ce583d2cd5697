"""Measured MFU of the workbench train step on NVIDIA GPUs (cuDNN flash attention).

Not a ``bench_*`` module: ``python -m benchmarks`` never runs it; it needs GPUs::

    python benchmarks/gpu_mfu.py                 # every shape that fits the GPUs present
    python benchmarks/gpu_mfu.py --only 1b --gpus 1

Shapes: "1b" (Llama 3.2 1B, 8 x 2048 tokens per GPU, remat "minimal") on one GPU
(target >= 55% MFU on one H100) and on 8; "7b" (MaxText's Llama-2-7B A3 row: 4 x 4096 per
GPU, remat "minimal", cuDNN flash attention, fsdp over 8 GPUs; published 492 TFLOP/s per
H100, about 50%). Each runs ``attention="cudnn"``, bf16 compute, fp32 parameters and
AdamW, the Trainer's step (``workbench._step``) compiled with the GPU overlap flags, and
times ``STEPS`` steps after ``WARMUP``. MFU = model FLOPs (causal-halved attention,
``workbench._flops.gpt_flops``) / (step time x GPUs x the GPU's peak bf16 FLOP/s from
``workbench.hardware``). Writes one JSON line per run to stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

WARMUP, STEPS = 3, 10
SHAPES = {"1b": {"preset": "1b", "per_gpu": 8, "seq": 2048, "remat": "minimal"},
          "7b": {"preset": "7b", "per_gpu": 4, "seq": 4096, "remat": "minimal"}}
#: ``--smoke``: the same code path on CPU devices (XLA attention), to check the script
#: itself where no GPU is (tests/test_fit_and_speed.py)
SMOKE = {"preset": "tiny", "per_gpu": 4, "seq": 64, "remat": "minimal"}


def run_one(name: str, n_gpus: int, platform: str = "gpu") -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import workbench as wb
    from workbench._flops import gpt_flops
    from workbench.hardware import cpu_spec, hardware_spec
    from workbench.models import GPTConfig
    from workbench.planning._flags import compile_options
    from workbench._sharding.rules import Rules
    from workbench._step import init_state, jit_train_step, make_train_step
    from workbench._train_state import batch_shardings, state_shardings

    shape = SHAPES[name] if platform == "gpu" else SMOKE
    cfg = GPTConfig.preset(shape["preset"], remat=shape["remat"], dtype="bfloat16",
                           attention="cudnn" if platform == "gpu" else "xla",
                           seq_len=shape["seq"], scan_layers=True)
    devices = jax.devices(platform)[:n_gpus]
    mesh = wb.make_mesh(data=len(devices), devices=devices)
    rules = Rules.preset("fsdp", mesh)
    opt = optax.adamw(3e-4)
    batch_size = shape["per_gpu"] * len(devices)
    graphdef, state = init_state(cfg, opt, rules, mesh, seed=0)
    step = jit_train_step(make_train_step(graphdef, opt, rules=rules, mesh=mesh),
                          state_shardings(cfg, opt, rules, mesh),
                          batch_shardings(rules, mesh), compiler_options=compile_options("gpu"))
    toks = jax.random.randint(jax.random.key(0), (batch_size, cfg.seq_len + 1), 0,
                              cfg.vocab_size, dtype=jnp.int32)
    batch = jax.device_put({"inputs": toks[:, :-1], "targets": toks[:, 1:]},
                           batch_shardings(rules, mesh))
    for _ in range(WARMUP):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - t0) / STEPS
    spec = hardware_spec(devices[0].device_kind) if platform == "gpu" else cpu_spec(n_gpus)
    flops = gpt_flops(cfg, batch_size, cfg.seq_len)
    mfu = flops.total / (seconds * len(devices) * spec.peak_flops)
    return {"shape": name, "gpus": len(devices), "device": devices[0].device_kind,
            "batch": batch_size, "seq": cfg.seq_len, "step_seconds": seconds,
            "mfu_causal_halved": mfu,
            "tflops_per_gpu": flops.total / seconds / len(devices) / 1e12,
            "tokens_per_s_per_gpu": batch_size * cfg.seq_len / seconds / len(devices),
            "loss": float(metrics["loss"]), "peak_flops": spec.peak_flops,
            "peak_source": spec.source}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(SHAPES), action="append")
    ap.add_argument("--gpus", type=int, action="append", help="GPU counts (default 1 and 8)")
    ap.add_argument("--smoke", action="store_true",
                    help="run the tiny model on 2 CPU devices instead (checks the script)")
    args = ap.parse_args(argv)
    import jax

    if args.smoke:
        print(json.dumps(run_one("smoke", 2, platform="cpu")), flush=True)
        return 0
    try:
        n = len(jax.devices("gpu"))
    except RuntimeError:
        print("gpu_mfu: no GPU here; nothing to measure", file=sys.stderr)
        return 0
    for name in args.only or sorted(SHAPES):
        for g in args.gpus or (1, 8):
            if g > n:
                print(f"gpu_mfu: {name} on {g} GPUs skipped: {n} present", file=sys.stderr)
                continue
            if name == "7b" and g == 1:
                print("gpu_mfu: 7b on 1 GPU skipped: fp32 params + AdamW (~112 GB) exceed "
                      "one GPU", file=sys.stderr)
                continue
            print(json.dumps(run_one(name, g)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
