"""Mixture of experts: step time with expert parallelism vs unsharded, and the all-to-all
bytes of the compiled program vs the hand count.

- Step time: ``moe-tiny`` (8 experts, top-2, dropless) with the same batch, trained with
  the one train step (``workbench._step``) on one device and with expert parallelism on 8
  simulated CPU devices (``expert=4 x data=2``, rules ``ep``; all-to-all and all-gather
  dispatch). Windows of steps alternate between the layouts (drift on a shared machine
  cancels); the ratio is the median over windows of EP / unsharded. Simulated devices
  share the host's cores, so this measures overhead (dispatch, collectives through
  memory), not a speed-up.
- Bytes: ``wb.plan`` compiles the EP step; the all-to-alls over the ``expert`` axis in its
  optimized HLO (``plan.collectives``), bytes x count per step, against
  ``workbench.perf._analytic_collectives.moe_collectives`` (4 per MoE layer of the ``(E, C, D)``
  buffer; all-gather dispatch: 2 gathers of ``n*G*D`` and 2 reduce-scatters of ``G*D``).

The TPU plans of grouped MoE at Mixtral's shapes are ``bench_moe_plans``.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any

BATCH, SEQ = 16, 64
WINDOW, REPS = 10, 5


def _step(cfg: Any, axes: dict[str, int], rules: str) -> Any:
    import jax
    import optax

    from workbench._sharding.mesh import make_mesh
    from workbench._sharding.rules import Rules
    from workbench._step import init_state, jit_train_step, make_train_step
    from workbench._train_state import batch_shardings, state_shardings

    n = 1
    for v in axes.values():
        n *= v
    mesh = make_mesh(axes, devices=jax.devices()[:n])
    r = Rules.preset(rules, mesh)
    tx = optax.adamw(1e-3)
    graphdef, state = init_state(cfg, tx, r, mesh, seed=0)
    bsh = batch_shardings(r, mesh)
    fn = jit_train_step(make_train_step(graphdef, tx, rules=r, mesh=mesh),
                        state_shardings(cfg, tx, r, mesh), bsh)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, cfg.vocab_size)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, bsh)

    class Runner:
        def __init__(self) -> None:
            self.state = state
            self.time(2)   # compile + warm-up

        def time(self, k: int) -> float:
            t0 = time.perf_counter()
            m = None
            for _ in range(k):
                self.state, m = fn(self.state, batch)
            jax.block_until_ready((self.state, m))
            return (time.perf_counter() - t0) / k

    return Runner()


def _step_times(cfg: Any) -> dict[str, Any]:
    ref = _step(cfg, {"data": 1}, "dp")
    layouts = {"all_to_all": _step(cfg, {"expert": 4, "data": 2}, "ep"),
               "all_gather": _step(cfg.replace(moe_dispatch="all_gather"),
                                   {"expert": 4, "data": 2}, "ep")}
    ratios: dict[str, list[float]] = {k: [] for k in layouts}
    base: list[float] = []
    for _ in range(REPS):
        for k, runner in layouts.items():
            before = ref.time(WINDOW)
            t = runner.time(WINDOW)
            after = ref.time(WINDOW)
            base.append((before + after) / 2)
            ratios[k].append(t / ((before + after) / 2))
    return {"ref": statistics.median(base),
            **{k: statistics.median(v) for k, v in ratios.items()},
            "windows": {k: [round(x, 3) for x in v] for k, v in ratios.items()}}


def _bytes(cfg: Any) -> dict[str, Any]:
    import workbench as wb
    from workbench.perf._analytic_collectives import moe_collectives

    out = {}
    for dispatch in ("all_to_all", "all_gather"):
        c = cfg.replace(moe_dispatch=dispatch)
        p = wb.plan(c, mesh=wb.make_mesh(expert=4, data=2), rules="ep", batch=BATCH, seq=SEQ,
                    progress=False)
        hand = moe_collectives(c, p.rules, p.mesh, BATCH, SEQ)
        kinds = {h.kind for h in hand}
        sizes = {(h.kind, h.bytes) for h in hand}
        hlo = sum(x.bytes * x.count for x in p.collectives
                  if x.kind in kinds and x.axes == ("expert",) and (x.kind, x.bytes) in sizes)
        other = sum(x.bytes * x.count for x in p.collectives
                    if x.kind in kinds and x.axes == ("expert",)
                    and (x.kind, x.bytes) not in sizes)
        out[dispatch] = {"hlo": hlo, "hand": sum(h.bytes * h.count for h in hand),
                         "other": other, "source": p.source,
                         "detail": [(h.kind, h.bytes, h.count) for h in hand]}
    return out


def run() -> list[dict[str, Any]]:
    """The MoE benchmark rows."""
    from workbench.models import GPTConfig

    cfg = GPTConfig.preset("moe-tiny", seq_len=SEQ)
    times = _step_times(cfg)
    nbytes = _bytes(cfg)
    ms = lambda s: f"{1e3 * s:.1f} ms"
    rows = []
    for k in ("all_to_all", "all_gather"):
        rows.append({
            "name": f"moe: step time EP expert=4 x data=2 ({k}) / unsharded, moe-tiny",
            "value": times[k], "unit": "x", "target": "", "ok": None,
            "notes": f"unsharded {ms(times['ref'])}/step on 1 device, batch {BATCH} x seq "
                     f"{SEQ}, dropless; EP on 8 simulated CPU devices sharing the host's "
                     f"cores; windows of {WINDOW} steps interleaved: "
                     f"{times['windows'][k]}"})
    for k, b in nbytes.items():
        rows.append({
            "name": f"moe: {k} bytes per step, compiled HLO / hand count",
            "value": b["hlo"] / b["hand"], "unit": "x", "target": "== 1.0",
            "ok": b["hlo"] == b["hand"],
            "notes": f"{b['hlo']} B in the {b['source']} program vs {b['hand']} B by hand "
                     f"(kind, bytes, count per step: {b['detail']}); other {k} collectives "
                     f"over 'expert' (the routes): {b['other']} B"})
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
