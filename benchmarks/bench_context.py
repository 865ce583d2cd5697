"""Context parallelism: memory per device vs sequence length and context axis (compiled),
step time of the all-gather and ring variants (with and without zig-zag), and the ring's
collective-permute bytes in the compiled step against the hand count.

Memory: ``wb.plan`` of GPT "tiny" (fsdp_cp, batch 1, float32) compiled by XLA for
``context = 1, 2, 4, 8`` of the 8 simulated devices; ``memory["total"]`` per device from
``memory_analysis()``. The T x T attention scores dominate at these lengths, so the
all-gather variant (each device: T/n queries x T keys) falls ~linearly with the context
axis, and the ring (T/n x T/n per step, K/V of two blocks) faster than linearly.

Step time: data=2 x context=4, tiny at 2048 tokens, batch 2, median of 5 steps after 2
warm-up steps; the baseline is the same mesh with ``seq`` unsharded (the context axis
then repeats work). Simulated devices share the host's cores, so these are CPU numbers
that rank the variants, not accelerator predictions.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from typing import Any

SEQS = (2048, 8192)
CONTEXTS = (1, 2, 4, 8)


def _memory_rows() -> list[dict[str, Any]]:
    import jax

    import workbench as wb
    from workbench.models import GPTConfig

    rows = []
    for seq in SEQS:
        base = None
        for variant in ("allgather", "ring"):
            mem = {}
            for c in CONTEXTS:
                if c == 1 and base is not None:
                    mem[1] = base
                    continue
                mesh = wb.make_mesh(context=c, devices=jax.devices()[:c])
                cfg = GPTConfig.preset("tiny", seq_len=seq, context_attention=variant)
                p = wb.plan(cfg, mesh=mesh, rules="fsdp_cp", batch=1, seq=seq, progress=False)
                mem[c] = int(p.memory["total"])
            base = mem[1]
            ratios = {c: mem[1] / mem[c] for c in CONTEXTS}
            ok = all(ratios[c] >= 0.75 * c for c in CONTEXTS)
            rows.append({
                "name": f"memory per device, tiny at {seq} tokens, {variant} (context=8)",
                "value": round(mem[8] / 2**20, 1), "unit": "MiB",
                "target": "mem(1)/mem(c) >= 0.75 c (falls ~linearly)", "ok": ok,
                "notes": ("compiled total per device for context=" + ", ".join(
                    f"{c}: {mem[c] / 2**20:.1f} MiB (x{ratios[c]:.1f})" for c in CONTEXTS)
                    + "; fsdp_cp, batch 1, float32")})
    return rows


def _permute_bytes(hlo: str) -> int:
    sizes = {"f32": 4, "bf16": 2, "f16": 2}
    return sum(sizes[m.group(1)] * math.prod(int(d) for d in m.group(2).split(",") if d)
               for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? collective-permute\(", hlo))


def _step_rows() -> list[dict[str, Any]]:
    import jax
    import optax

    import workbench as wb
    from workbench import _step as S
    from workbench.models import GPTConfig
    from workbench.models import _context as C

    mesh = wb.make_mesh(data=2, context=4)
    seq, batch = 2048, 2
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, 256)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    cp = wb.Rules.preset("cp", mesh)
    cases = [("no context parallelism (seq unsharded)", "allgather", False, cp.replace(seq=None)),
             ("allgather", "allgather", False, cp), ("allgather + zig-zag", "allgather", True, cp),
             ("ring", "ring", False, cp), ("ring + zig-zag", "ring", True, cp)]
    times: dict[str, float] = {}
    perm: dict[str, int] = {}
    tx = optax.adamw(1e-3)
    for label, variant, zz, rules in cases:
        cfg = GPTConfig.preset("tiny", seq_len=seq, context_attention=variant,
                               context_zigzag=zz)
        graphdef, state = S.init_state(cfg, tx, rules, mesh, seed=0)
        sh = S.state_shardings(cfg, tx, rules, mesh)
        step = S.jit_train_step(S.make_train_step(graphdef, tx, rules=rules, mesh=mesh), sh,
                                S.batch_shardings(rules, mesh, example=data))
        compiled = step.lower(state, data).compile()
        perm[label] = _permute_bytes(compiled.as_text())
        for _ in range(2):
            state, m = compiled(state, data)
        jax.block_until_ready(m)
        dts = []
        for _ in range(5):
            t0 = time.perf_counter()
            state, m = compiled(state, data)
            jax.block_until_ready(m)
            dts.append(time.perf_counter() - t0)
        times[label] = statistics.median(dts)
    rows = [{"name": f"step time, tiny at {seq} tokens, data=2 x context=4, {label}",
             "value": round(times[label] * 1e3, 1), "unit": "ms", "target": "recorded",
             "ok": True, "notes": f"batch {batch}, median of 5 steps (CPU, simulated devices)"}
            for label, *_ in cases]
    cfg = GPTConfig.preset("tiny")
    hand = C.kv_bytes_per_device(batch=batch, seq=seq, n_kv_heads=cfg.n_kv_heads,
                                 head_dim=cfg.head_dim, itemsize=4, size=4, variant="ring",
                                 batch_shards=2)
    want = cfg.n_layers * (hand["received"] + hand["received_backward"])
    rows.append({
        "name": "ring: collective-permute bytes per device in the compiled step",
        "value": perm["ring"], "unit": "B", "target": f"= hand count {want}",
        "ok": perm["ring"] == want,
        "notes": (f"per layer: forward (n-1)={3} K/V blocks of {hand['block']} B, backward "
                  f"{3} K/V blocks + {4} float32 dK/dV blocks; allgather step: "
                  f"{perm['allgather']} B of permutes")})
    crit = {z: max(C.blocks_per_device(4, zigzag=z)) for z in (False, True)}
    rows.append({
        "name": "ring: zig-zag critical path (score blocks on the busiest device, n=4)",
        "value": crit[True], "unit": "blocks", "target": f"< contiguous {crit[False]}",
        "ok": crit[True] < crit[False],
        "notes": (f"per device contiguous {C.blocks_per_device(4, zigzag=False)}, zig-zag "
                  f"{C.blocks_per_device(4, zigzag=True)}; measured step ring "
                  f"{times['ring'] * 1e3:.0f} ms vs ring + zig-zag "
                  f"{times['ring + zig-zag'] * 1e3:.0f} ms (CPU: the simulated devices share "
                  "the host's cores)")})
    return rows


def run() -> list[dict[str, Any]]:
    """Benchmark rows: memory vs sequence length and context axis, step times, HLO bytes."""
    return _memory_rows() + _step_rows()
