"""The analytic plan's context-parallel collectives
(``_analytic_collectives.context_collectives``) against the compiled step's: ring
attention's K/V and dK/dV permutes, the all-gather variant's gathers and reduce-scatters,
and the zig-zag reorders, per step and per device.

References: the same config compiled for 8 CPU devices (``plan.collectives``, read from
the HLO with ``parse_collectives``), the TPU compiler's HLO where it is installed, and the
K/V bytes of ``perf.attention_cost.kv_bytes_per_device``.
"""
import collections
import re

import pytest

import workbench as wb
from workbench.models import GPTConfig
from workbench.models import _context as C
from workbench.perf import _attention_cost as attention_cost
from workbench.perf._analytic_collectives import context_collectives
from workbench._sharding.topology import tpu_compiler_available

pytestmark = pytest.mark.usefixtures("wb_cache")

TINY = GPTConfig.preset("tiny")     # float32: the CPU compiler keeps every dtype as is
BATCH, SEQ = 4, 64
CONTEXT_KINDS = ("collective-permute", "all-gather", "reduce-scatter")


def _context_collectives(plan, dtype=True):
    """{(kind, bytes, shape): instructions per step} over the ``context`` axis alone."""
    out = collections.Counter()
    for c in plan.collectives:
        if c.axes == ("context",) and c.kind in CONTEXT_KINDS:
            shape = c.shapes[0] if dtype else re.sub(r"^\w+", "", c.shapes[0])
            out[(c.kind, c.bytes if dtype else None, shape)] += c.count
    return dict(out)


def _both(cfg, mesh, rules="cp"):
    compiled = wb.plan(cfg, mesh=mesh, rules=rules, batch=BATCH, seq=SEQ, progress=False)
    estimate = wb.plan(cfg, mesh=mesh, rules=rules, batch=BATCH, seq=SEQ, compile=False,
                       progress=False)
    assert compiled.source == "cpu-compiler" and estimate.source == "estimate"
    return compiled, estimate


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.slow
def test_ring_permutes_equal_the_compiled_ones(zigzag, scan):
    cfg = TINY.replace(context_attention="ring", context_zigzag=zigzag, scan_layers=scan)
    compiled, estimate = _both(cfg, wb.make_mesh(data=2, context=4))
    got = _context_collectives(compiled)
    assert _context_collectives(estimate) == got
    n, L = 4, cfg.n_layers
    block = (BATCH // 2) * (SEQ // n) * cfg.n_kv_heads * cfg.head_dim * 4   # K or V, f32
    # forward K, V; backward dK, dV (float32) and K/V stacked, per layer
    assert got[("collective-permute", block, "f32[2,16,2,16]")] == (2 * (n - 1) + 2 * n) * L
    assert got[("collective-permute", 2 * block, "f32[2,2,16,2,16]")] == (n - 1) * L
    assert got.get(("collective-permute", 4096, "f32[2,8,64]"), 0) == (8 if zigzag else 0)
    # the K/V bytes a device receives per layer, as context.py's hand count has them
    hand = attention_cost.kv_bytes_per_device(batch=BATCH, seq=SEQ, n_kv_heads=cfg.n_kv_heads,
                                 head_dim=cfg.head_dim, itemsize=4, size=n, variant="ring",
                                 batch_shards=2)
    ring = sum(c.total_bytes for c in context_collectives(
        cfg, estimate.rules, estimate.mesh, BATCH, SEQ) if "ring" in c.names[0])
    assert ring == L * (hand["received"] + hand["received_backward"])


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("variant", C.VARIANTS)
@pytest.mark.slow
def test_remat_reruns_the_forward_collectives(variant, scan):
    cfg = TINY.replace(context_attention=variant, remat="full", scan_layers=scan,
                       context_zigzag=variant == "allgather")
    compiled, estimate = _both(cfg, wb.make_mesh(data=2, context=4))
    got = _context_collectives(compiled)
    assert _context_collectives(estimate) == got
    kind = "collective-permute" if variant == "ring" else "all-gather"
    hand = context_collectives(cfg, estimate.rules, estimate.mesh, BATCH, SEQ)
    forward = sum(c.count for c in hand if c.kind == kind
                  and "forward" in c.names[0] and "zig-zag" not in c.names[0])
    per_layer = 2 * 3 if variant == "ring" else 2      # K and V, (n - 1) steps or gathered
    assert forward == 2 * per_layer * cfg.n_layers     # the forward, and again in remat


def test_allgather_variant_gathers_and_scatters_k_and_v():
    cfg = TINY.replace(context_attention="allgather")
    compiled, estimate = _both(cfg, wb.make_mesh(data=2, context=4))
    got = _context_collectives(compiled)
    assert _context_collectives(estimate) == got == {
        ("all-gather", 2 * SEQ * 2 * 16 * 4, "f32[2,64,2,16]"): 2 * cfg.n_layers,
        ("reduce-scatter", 2 * (SEQ // 4) * 2 * 16 * 4, "f32[2,16,2,16]"): 2 * cfg.n_layers}


@pytest.mark.slow
def test_heads_over_a_model_axis_and_two_context_shards():
    # kv heads split over 'model' inside the ring; with 2 context shards one permute of
    # each zig-zag reorder keeps its chunks home and XLA drops it
    cfg = TINY.replace(context_attention="ring", context_zigzag=True, scan_layers=True)
    compiled, estimate = _both(cfg, wb.make_mesh(data=2, context=2, model=2))
    got = _context_collectives(compiled)
    assert _context_collectives(estimate) == got
    assert got[("collective-permute", 4096, "f32[2,32,1,16]")] == (2 + 4) * cfg.n_layers
    assert got[("collective-permute", 8192, "f32[2,16,64]")] == 4


@pytest.mark.tpu
@pytest.mark.skipif(not tpu_compiler_available(), reason="the TPU compiler is not installed")
def test_ring_permute_counts_equal_the_tpu_compilers():
    # The TPU compiler moves some float32 permutes to bfloat16 (the default matmul
    # precision), so shapes are compared without dtype, and counts.
    cfg = TINY.replace(context_attention="ring", context_zigzag=True, scan_layers=True)
    mesh = wb.abstract_mesh("v5e-8", data=2, context=4)
    compiled = wb.plan(cfg, mesh=mesh, rules="cp", batch=BATCH, seq=SEQ, progress=False)
    estimate = wb.plan(cfg, mesh=mesh, rules="cp", batch=BATCH, seq=SEQ, compile=False,
                       progress=False)
    assert compiled.source == "tpu-compiler"
    got = _context_collectives(compiled, dtype=False)
    assert _context_collectives(estimate, dtype=False) == got
    assert sum(got.values()) == (2 * 3 + 3 + 2 * 4) * cfg.n_layers + 8


def test_no_context_axis_no_context_collectives():
    mesh = wb.make_mesh(data=8)
    cfg = TINY.replace(context_attention="ring", context_zigzag=True)
    p = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=8, seq=SEQ, compile=False,
                progress=False)
    assert context_collectives(cfg, p.rules, p.mesh, 8, SEQ) == []
    assert not [c for c in p.collectives if c.kind == "collective-permute"]
