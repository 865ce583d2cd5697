"""MoE all-to-alls in TPU-compiled plans: 4 per layer (dispatch and combine, forward and
backward), with scanned layers too.

Scanned layers put the forward's all-to-alls in one while body and the backward's in
another, and shard_map gives every all-to-all ``channel_id=1``: a dedupe by channel across
computations (meant for the TPU compiler's async collective fusion clones) used to drop
the backward's, so the plan showed 2 per layer. Reference: the all-to-all instructions in
the HLO text, each counted once per run of its loop (``/while/body/`` in its op name: the
layer scan, ``n_layers`` trips), and the hand count ``_analytic_collectives.moe_collectives``.
"""
import re

import pytest

import workbench as wb
from workbench.models import GPTConfig
from workbench.perf._analytic_collectives import moe_collectives
from workbench._compiled.hlo import parse_collectives
from workbench._sharding.topology import tpu_compiler_available

pytestmark = [
    pytest.mark.tpu,                 # every test compiles for an abstract TPU slice
    pytest.mark.usefixtures("wb_cache"),
    pytest.mark.skipif(not tpu_compiler_available(),
                       reason="the TPU compiler (libtpu) is not installed"),
]

#: moe-small's routing (16 experts, top-2, a shared expert, capacity 1.25), small widths;
#: in float32 (the preset's "auto" is bfloat16 on TPU), whose buffers the bytes check
#: below tells apart from the compiler's bfloat16 copies
SMALL = GPTConfig.preset("moe-small").replace(
    n_layers=2, d_model=128, n_heads=4, n_kv_heads=4, head_dim=32, d_ff=256,
    expert_d_ff=128, vocab_size=512, seq_len=128, dtype="float32")
_A2A = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+all-to-all(?:-start)?\("
                  r".*?op_name=\"(?P<op>[^\"]*)\"", re.M)


def _instructions(hlo_text):
    """(result type, op name) of every all-to-all instruction in the module."""
    return [(m.group("type"), m.group("op")) for m in _A2A.finditer(hlo_text)]


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("rules,axes", [("ep", {"expert": 4}),
                                        ("fsdp_ep", {"expert": 2, "data": 2})])
def test_four_all_to_alls_per_layer_as_in_the_hlo(scan, rules, axes):
    cfg = SMALL.replace(scan_layers=scan)
    batch, seq = 8, cfg.seq_len
    p = wb.plan(cfg, mesh=wb.abstract_mesh("v5p-8", **axes), rules=rules, batch=batch,
                seq=seq, progress=False)
    assert p.source == "tpu-compiler"
    text = p.compiled.as_text()
    found = _instructions(text)
    # one array each: no variadic (tuple) all-to-all carries two buffers at once
    assert found and all(not t.startswith("(") for t, _ in found)
    runs = lambda op: cfg.n_layers if "/while/body/" in op else 1
    forward = sum(runs(op) for _, op in found if "transpose(" not in op)
    backward = sum(runs(op) for _, op in found if "transpose(" in op)
    assert forward == backward == 2 * cfg.n_layers           # dispatch + combine, each way
    if scan:   # the layers' all-to-alls sit in the scans' bodies, 2 instructions each
        assert len(found) == 4 and all("/while/body/" in op for _, op in found)
    parsed = [c for c in p.collectives if c.kind == "all-to-all"]
    assert sum(c.count for c in parsed) == forward + backward == 4 * cfg.n_layers
    assert all(c.axes == ("expert",) and c.in_loop == scan for c in parsed)
    direct = parse_collectives(text, p.mesh.axis_names, p.mesh.axis_sizes)
    assert [(c.count, c.bytes) for c in direct if c.kind == "all-to-all"] == \
        [(c.count, c.bytes) for c in parsed]
    hand = moe_collectives(cfg, p.rules, p.mesh, batch, seq)
    assert [c.count for c in hand] == [4 * cfg.n_layers]
    # the (E, C, D) buffer: float32 where the hand count has it; the TPU compiler sends
    # one of each pair already converted to bfloat16 for its matmul (half the bytes)
    assert {c.bytes for c in parsed} == {hand[0].bytes, hand[0].bytes // 2}
