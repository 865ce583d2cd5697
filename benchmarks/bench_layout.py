"""Layouts + widget payload for every parameter of a Llama-2-70B-shaped decoder on 2048 devices."""
from __future__ import annotations

import json
import statistics
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from workbench._sharding.layouts import layout
from workbench._sharding.mesh import abstract_mesh
from workbench._sharding.pytrees import tree_layouts
from workbench.widgets._payload import layout_payload
from workbench.widgets._tree_payload import tree_payload

# Llama-2-70B (Touvron et al. 2023, table 1 / the released params.json): d_model 8192,
# 80 layers, 64 query heads and 8 KV heads of 128 (wk/wv: 8192 x 1024), SwiGLU d_ff 28672,
# vocab 32000, untied embeddings.
D, F, V, KV, LAYERS = 8192, 28672, 32000, 1024, 80
IN_PROJ, OUT_PROJ = P("fsdp", "tp"), P("tp", "fsdp")  # FSDP x tensor parallel


def llama70b() -> tuple[dict[str, Any], dict[str, Any]]:
    """(params as bf16 ShapeDtypeStructs, matching PartitionSpecs): 723 tensors."""
    def sds(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jax.numpy.bfloat16)

    params: dict[str, Any] = {"tok_embeddings": sds(V, D), "layers": [], "norm": sds(D),
                              "output": sds(D, V)}
    specs: dict[str, Any] = {"tok_embeddings": OUT_PROJ, "layers": [], "norm": P(None),
                             "output": IN_PROJ}
    for _ in range(LAYERS):
        params["layers"].append({
            "attention": {"wq": sds(D, D), "wk": sds(D, KV), "wv": sds(D, KV), "wo": sds(D, D)},
            "feed_forward": {"w1": sds(D, F), "w3": sds(D, F), "w2": sds(F, D)},
            "attention_norm": sds(D), "ffn_norm": sds(D)})
        specs["layers"].append({
            "attention": {"wq": IN_PROJ, "wk": IN_PROJ, "wv": IN_PROJ, "wo": OUT_PROJ},
            "feed_forward": {"w1": IN_PROJ, "w3": IN_PROJ, "w2": OUT_PROJ},
            "attention_norm": P(None), "ffn_norm": P(None)})
    return params, specs


def _tree_payload_bytes(params: Any, specs: Any, mesh: Any) -> tuple[int, int, int]:
    tl = tree_layouts(params, mesh, specs=specs)
    text = json.dumps(tree_payload(tl, title="Llama-2-70B"))
    return len(text), len(tl.layouts), tl.distinct


def _timed(fn: Any, repeat: int) -> tuple[float, list[float], Any]:
    """(first call's seconds, later calls' seconds, first result)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    later = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        later.append(time.perf_counter() - t0)
    return first, later, out


def run() -> list[dict]:
    params, specs = llama70b()
    mesh = abstract_mesh(fsdp=256, tp=8)
    first, later, (size, n_tensors, n_layouts) = _timed(
        lambda: _tree_payload_bytes(params, specs, mesh), repeat=3)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))

    flat = list(zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))))
    def one_by_one() -> None:
        for x, spec in flat:
            layout(x.shape, spec, mesh, dtype=x.dtype)
    raw_first, raw_later, _ = _timed(one_by_one, repeat=1)

    w1 = layout((D, F), IN_PROJ, mesh, dtype="bfloat16", name="layers.0.feed_forward.w1")
    click_first, click_later, click_payload = _timed(lambda: json.dumps(layout_payload(w1)), repeat=3)
    where = f"{n_tensors} tensors ({n_params / 1e9:.1f}B params) on abstract fsdp=256 x tp=8"
    worst, raw_worst, click_worst = max(first, *later), max(raw_first, *raw_later), max(click_first, *click_later)
    return [
        {"name": "Llama-2-70B: Layouts + tree widget payload + json.dumps (2048 devices)",
         "value": round(worst, 4), "unit": "s", "target": "< 1 s", "ok": worst < 1.0,
         "notes": f"{where}; slowest of 4 calls (first, cold: {first:.3f} s; median "
                  f"{statistics.median([first, *later]):.3f} s); {n_layouts} distinct layouts "
                  "built, identical ones shared"},
        {"name": "Llama-2-70B: tree widget payload size", "value": round(size / 1e6, 3),
         "unit": "MB", "target": "< 2 MB", "ok": size < 2e6,
         "notes": "per-tensor summaries + per-device memory; blocks are built when a row is clicked"},
        {"name": "Llama-2-70B: every Layout built one by one (no sharing)",
         "value": round(raw_worst, 4), "unit": "s", "target": "< 1 s", "ok": raw_worst < 1.0,
         "notes": f"{n_tensors} wb.layout calls on 2048 devices; slowest of 2 runs"},
        {"name": "click a row: one 2048-block layout payload (w1 8192x28672)",
         "value": round(click_worst, 4), "unit": "s", "target": "< 0.25 s", "ok": click_worst < 0.25,
         "notes": f"{len(click_payload) / 1e3:.0f} kB JSON; slowest of 4 calls"},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
