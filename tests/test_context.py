"""Context parallelism: attention with the sequence sharded over a ``context`` mesh axis.

References: ``jax.nn.dot_product_attention`` on the whole sequence (outputs and
gradients), the same model trained with the sequence unsharded (losses), a hand count
of K/V bytes against the compiled HLO's collective permutes, and ``x[:, order]``.
"""
from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import workbench as wb
import workbench._sharding.mesh  # noqa: F401 - wb._sharding.mesh below
from workbench import _step as S, _train_state as TS
from workbench.models import GPTConfig
from workbench.models import _context as C
from workbench.perf import _attention_cost as attention_cost

from _tolerance import assert_close_at_scale

B, T, N, K, H = 2, 32, 4, 2, 8


def _qkvw():
    ks = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, T, K, H)),
            jax.random.normal(ks[2], (B, T, K, H)), jax.random.normal(ks[3], (B, T, N, H)))


def _sharded(mesh, variant, zigzag):
    spec = P("data", "context")
    fn = functools.partial(C.local_attention, variant=variant, axes="context",
                           size=mesh.shape["context"], zigzag=zigzag)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=False)


@pytest.mark.parametrize("variant", C.VARIANTS)
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.slow
def test_attention_and_gradients_match_plain_attention_on_the_gathered_sequence(variant,
                                                                                 zigzag):
    mesh = wb.make_mesh(data=2, context=4)
    q, k, v, w = _qkvw()
    order = C._order(T, 4, zigzag)     # the rows each device holds, in the model's order
    fn = _sharded(mesh, variant, zigzag)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    got = jax.jit(fn)(q[:, order], k[:, order], v[:, order])
    # ring / all-gather attention sums the key blocks in another order: at the tensor's scale
    assert_close_at_scale(got, ref(q, k, v)[:, order], rtol=1e-5)

    grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w[:, order]), argnums=(0, 1, 2)))(
        q[:, order], k[:, order], v[:, order])
    want = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, want, strict=True):
        assert_close_at_scale(g, r[:, order], rtol=1e-5)


def test_zigzag_reorder_is_the_permutation_and_its_inverse():
    mesh = wb.make_mesh(data=2, context=4)
    rules = wb.Rules.preset("cp", mesh)
    x = jnp.arange(2 * T * 3, dtype=jnp.float32).reshape(2, T, 3)
    order = C.zigzag_order(T, 4)
    assert sorted(order.tolist()) == list(range(T))

    @jax.jit
    def both(x):
        with rules.activate(mesh):
            z = C.to_model_order(x, zigzag=True)
            return z, C.to_token_order(z, zigzag=True), C.positions(T, zigzag=True)

    z, back, pos = both(x)
    np.testing.assert_array_equal(z, x[:, order])
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(pos, order)
    # device i holds chunks i and 2n-1-i of 2n: equal causal work per device
    c = T // 8
    assert order[: 2 * c].tolist() == [*range(0, c), *range(7 * c, 8 * c)]
    assert C.blocks_per_device(4, zigzag=True) == [2.5] * 4
    assert max(C.blocks_per_device(4, zigzag=False)) == 4


def _train(cfg, mesh, rules, batch, steps=2):
    tx = optax.adamw(1e-2)
    graphdef, state = S.init_state(cfg, tx, rules, mesh, seed=0)
    shardings = TS.state_shardings(cfg, tx, rules, mesh)
    step = S.jit_train_step(S.make_train_step(graphdef, tx, rules=rules, mesh=mesh),
                            shardings, TS.batch_shardings(rules, mesh, example=batch))
    losses = []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return losses


@pytest.fixture(scope="module")
def lm_batch():
    tokens = jax.random.randint(jax.random.key(1), (4, 65), 0, 256)
    # a loss mask that ends mid-shard: the per-shard mask must stay aligned with its tokens
    lengths = jnp.array([[64], [40], [17], [63]])
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "mask": (jnp.arange(64)[None, :] < lengths).astype(jnp.float32)}


@pytest.fixture(scope="module")
def unsharded_losses(lm_batch):
    cfg = GPTConfig.preset("tiny", seq_len=64)
    one = wb.make_mesh(data=1, devices=jax.devices()[:1])
    return _train(cfg, one, wb.Rules.preset("dp", one), lm_batch)


@pytest.mark.parametrize("variant,zigzag,preset,scan,axes", [
    ("allgather", False, "cp", False, {"data": 2}),
    ("allgather", True, "fsdp_cp", False, {"model": 2}),   # heads over model, seq over context
    ("ring", False, "fsdp_cp", False, {"data": 2}),
    ("ring", True, "cp", True, {"data": 2})])
@pytest.mark.slow
def test_context4_trains_like_context1(variant, zigzag, preset, scan, axes, lm_batch,
                                       unsharded_losses):
    # scan: the blocks stacked and scanned, each rematerialized (same function as unrolled)
    cfg = GPTConfig.preset("tiny", seq_len=64, context_attention=variant,
                           context_zigzag=zigzag, scan_layers=scan,
                           remat="full" if scan else "none")
    mesh = wb.make_mesh(**axes, context=4)   # data/model major, context minor
    rules = wb.Rules.preset(preset, mesh)
    assert rules["seq"] == "context"
    got = _train(cfg, mesh, rules, lm_batch)
    # context-sharded attention sums in another order: the first loss and the loss after
    # one AdamW step, which normalises each reordered gradient: 80 eps (see _tolerance)
    np.testing.assert_allclose(got, unsharded_losses, rtol=1e-5, atol=0)


def _permute_bytes(hlo: str) -> list[int]:
    """Result bytes of each collective-permute instruction in a compiled HLO module (read
    per instruction: every shard_map permute on CPU carries channel_id=1)."""
    sizes = {"f32": 4, "bf16": 2, "f16": 2}
    out = []
    for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? collective-permute\(", hlo):
        out.append(sizes[m.group(1)] * math.prod(int(d) for d in m.group(2).split(",") if d))
    return out


def test_ring_kv_bytes_in_the_compiled_hlo_match_the_hand_count():
    mesh = wb.make_mesh(data=2, context=4)
    q, k, v, _ = _qkvw()
    fn = _sharded(mesh, "ring", False)
    hand = attention_cost.kv_bytes_per_device(batch=B, seq=T, n_kv_heads=K, head_dim=H, itemsize=4,
                                 size=4, variant="ring", batch_shards=2)
    # per device: (n - 1) K/V blocks of (B/2) x (T/4) x K x H float32, K and V
    assert hand["block"] == 2 * (B // 2) * (T // 4) * K * H * 4
    assert hand["held"] == 2 * hand["block"]
    forward = _permute_bytes(jax.jit(fn).lower(q, k, v).compile().as_text())
    assert len(forward) == 2 * 3 and sum(forward) == hand["received"] == 3 * hand["block"]
    # forward and backward: the backward ring passes K/V again (stacked, so XLA cannot
    # merge it with the forward's) and n dK/dV blocks (float32)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2)))
    both = _permute_bytes(grad.lower(q, k, v).compile().as_text())
    assert sum(both) == hand["received"] + hand["received_backward"]
    assert hand["received_backward"] == (3 + 4) * hand["block"]
    gathered = attention_cost.kv_bytes_per_device(batch=B, seq=T, n_kv_heads=K, head_dim=H, itemsize=4,
                                     size=4, variant="allgather", batch_shards=2)
    assert gathered["held"] == 4 * hand["block"]


def test_context_axis_not_dividing_the_sequence_fails_before_compiling(tmp_path):
    with pytest.raises(ValueError, match=r"sequence length 30 .* context axis 'context' of "
                                         r"size 4.*seq=28 or 32"):
        wb.TrainConfig(model="tiny", mesh={"data": 2, "context": 4}, rules="cp", seq=30)
    with pytest.raises(ValueError, match="8 zig-zag chunks.*context_zigzag=False"):
        wb.TrainConfig(model="tiny", model_overrides={"context_zigzag": True},
                       mesh={"data": 2, "context": 4}, rules="cp", seq=36)
    with pytest.raises(ValueError, match="context_attention='ringg'"):
        GPTConfig.preset("tiny", context_attention="ringg")
    mesh = wb.make_mesh(data=2, context=4)
    with pytest.raises(ValueError, match="sequence length 30 is not divisible"):
        wb.plan(GPTConfig.preset("tiny"), mesh=mesh, rules="cp", batch=2, seq=30,
                progress=False)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="needs one mesh axis named 'context'"):
        wb.Rules.preset("cp", wb.make_mesh(data=8))


def test_plan_lints_name_uneven_context_and_ring_over_slow_links():
    big = wb.abstract_mesh("v5p-128", data=16, context=4)
    cfg = GPTConfig.preset("1b", context_attention="ring")
    p = wb.plan(cfg, mesh=big, rules="fsdp_cp", batch=16, seq=8190, compile=False,
                progress=False)
    assert [w.kind for w in p.warnings if w.severity == "error"] == ["context_uneven"]
    info = wb._sharding.mesh.mesh_info(big)
    slow = wb._sharding.mesh.MeshInfo(axis_names=info.axis_names, axis_sizes=info.axis_sizes,
                            device_ids=info.device_ids, dcn_axis_sizes=(1, 2))
    from workbench.planning import _parallel_lints as lints

    kinds = [w.kind for w in lints.context_parallel(cfg, wb.Rules.preset("cp", big), slow,
                                                    8192, 16)]
    assert kinds == ["ring_slow_links", "context_kv"]
    kinds = [w.kind for w in lints.context_parallel(
        cfg.replace(context_attention="allgather"), wb.Rules.preset("cp", big), slow,
        8192, 16)]
    assert kinds == ["context_kv"]


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    """The same training with the sequence unsharded: 8 devices, data parallel."""
    from workbench.train import TrainConfig, Trainer

    cfg = TrainConfig(model="tiny", mesh={"data": 8}, rules="dp", batch=8, seq=32, steps=4,
                      checkpoint_every=4, keep=1, seed=0, data="text")
    t = Trainer(cfg, run_dir=tmp_path_factory.mktemp("cp") / "dp8", progress=None)
    t.run()
    return t.losses


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("variant,zigzag", [("ring", True)])   # allgather: in-process tests
def test_launch_two_processes_with_context4_trains_like_context1(variant, zigzag, tmp_path,
                                                                 dense_reference):
    from workbench import _runs as runs
    from workbench.jobs import launch
    from workbench.train import TrainConfig

    cfg = TrainConfig(model="tiny", model_overrides={"context_attention": variant,
                                                     "context_zigzag": zigzag},
                      mesh={"data": 2, "context": 4}, rules="cp", batch=8, seq=32, steps=4,
                      checkpoint_every=4, keep=1, seed=0, data="text")
    # `python -m workbench train` in 2 processes x 4 CPU devices, joined over gloo
    job = launch(cfg, processes=2, devices_per_process=4, run_dir=tmp_path / "cp",
                 platform="cpu")
    assert job.wait(600) == "finished", job.tail()
    got = [r["loss"] for r in runs.read_metrics(tmp_path / "cp")]
    assert got == pytest.approx(dense_reference, rel=1e-5, abs=0)


def test_exercise_reference_is_the_traced_ring_and_equals_the_hand_count():
    from workbench.exercises._context import ring_permute_bytes

    got, count = ring_permute_bytes(batch=1, seq=131072, n_heads=64, n_kv_heads=8,
                                    head_dim=128, dtype="bfloat16", context=8)
    hand = attention_cost.kv_bytes_per_device(batch=1, seq=131072, n_kv_heads=8, head_dim=128,
                                 itemsize=2, size=8, variant="ring")
    assert (got, count) == (hand["received"], 2 * 7)
    assert wb.exercise("ring_kv_bytes").check(f"{got / 2**20} MiB").correct


def test_layout_widget_draws_a_seq_sharded_activation_as_jax_places_it():
    from jax.sharding import NamedSharding

    from workbench.widgets._payload import layout_payload

    mesh = wb.make_mesh(data=2, context=4)
    spec = wb.Rules.preset("cp", mesh).spec(("batch", "seq", None))
    lay = wb.layout((4, 4096, 64), spec, mesh, name="residual",
                    logical_axes=("batch", "seq", None))
    payload = layout_payload(lay)
    assert payload["spec"] == [["data"], ["context"], []]
    assert payload["shard_shape"] == [2, 1024, 64] and len(payload["blocks"]) == 8
    want = NamedSharding(mesh, spec).devices_indices_map((4, 4096, 64))
    ids = mesh.devices.reshape(-1)
    for block in payload["blocks"]:
        for pos in block["positions"]:
            idx = want[ids[pos]]
            assert [(s.start or 0, s.stop if s.stop is not None else n) for s, n in
                    zip(idx, (4, 4096, 64))] == list(zip(block["start"], block["stop"]))


def test_search_ranks_context_parallel_layouts():
    cfg = GPTConfig.preset("1b", remat="full", scan_layers=True, context_attention="ring")
    r = wb.search(cfg, "v5p-128", batch=8, seq=131072, strategies=("fsdp_cp",),
                  remat=("full",), mesh_shapes=[{"data": 8, "context": 8},
                                                {"data": 4, "context": 16}, {"data": 64}],
                  exact=False, progress=False)
    assert r.best.mesh.shape == {"data": 4, "context": 16} and r.best.rules["seq"] == "context"
    assert "needs one mesh axis named 'context'" in r.table()
