"""Named remat policies (same gradients, the named residuals kept, host offload on TPU
only), their recompute FLOPs, and the overlap flags the TPU compiler accepts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

import workbench as wb
from workbench._flops import gpt_flops
from workbench.models import GPT, GPTConfig
from workbench.models._remat import OFFLOAD_PLATFORMS, REMAT_POLICIES, remat_policy
from workbench.planning._flags import OVERLAP_FLAGS, compile_options
from workbench._step import lm_loss

from _tolerance import assert_close_at_scale

CFG = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                d_ff=32, seq_len=8)
ON_DEVICE = [n for n, p in REMAT_POLICIES.items() if not p.offloads]


def loss_and_grads(cfg):
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    f = lambda p: lm_loss(nnx.merge(graphdef, p), batch)
    return jax.value_and_grad(f)(params), f, params


@pytest.mark.parametrize("remat", ON_DEVICE)
@pytest.mark.slow
def test_policies_give_the_gradients_of_no_remat(remat):
    (l0, g0), _, _ = loss_and_grads(CFG)
    (l1, g1), _, _ = loss_and_grads(CFG.replace(remat=remat))
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        assert_close_at_scale(a, b, rtol=1e-5)   # reordered sums: at the tensor's scale


def _named(remat):
    _, f, params = loss_and_grads(CFG.replace(remat=remat))
    return " ".join(desc for _, desc in saved_residuals(f, params))


@pytest.mark.parametrize("remat,kept,dropped", [
    ("save_qkv_proj", ["query_proj", "key_proj", "value_proj"], ["out_proj", "mlpwi_0"]),
    # (the MLP output only feeds the residual add: no backward pass reads it, even named)
    ("save_dot_except_mlpwi", ["query_proj", "out_proj"], ["mlpwi_0", "mlpwi_1"]),
    ("save_dot_except_mlp", ["value_proj", "out_proj"], ["mlpwo", "mlpwi_1"]),
    ("full", [], ["query_proj", "out_proj", "mlpwo"]),
])
def test_named_policies_keep_what_they_name(remat, kept, dropped):
    """Reference: JAX's own list of the residuals the backward pass reads."""
    names = _named(remat)
    for n in kept:
        assert f"named '{n}'" in names
    for n in dropped:
        assert f"named '{n}'" not in names


def test_bad_policies_fail_before_compiling():
    with pytest.raises(ValueError, match="remat='light'; choose one of"):
        GPTConfig.preset("tiny", remat="light")
    with pytest.raises(ValueError, match="offloads activations to host memory"):
        remat_policy("qkv_proj_offloaded", "cpu")
    assert OFFLOAD_PLATFORMS == ("tpu",)
    mesh = wb.make_mesh(data=8)
    with pytest.raises(ValueError, match="this step is for cpu"):
        wb.plan(CFG.replace(remat="minimal_offloaded"), mesh=mesh, batch=8, progress=False)


def test_recompute_flops_by_policy():
    """Hand count: what each policy recomputes of the forward."""
    f = gpt_flops(CFG, batch=4)
    fwd = {k: v / 3 for k, v in f.breakdown.items()}
    full = gpt_flops(CFG.replace(remat="full"), batch=4).recompute
    assert full == pytest.approx(fwd["qkv"] + fwd["out_proj"] + fwd["attention"]
                                 + fwd["mlp"] * 2 / 3)
    mlpwi = gpt_flops(CFG.replace(remat="save_dot_except_mlpwi"), batch=4).recompute
    assert mlpwi == pytest.approx(fwd["attention"] + fwd["mlp"] * 2 / 3)
    assert gpt_flops(CFG.replace(remat="minimal"), batch=4).recompute == \
        pytest.approx(fwd["attention"])
    assert gpt_flops(CFG.replace(remat="minimal_flash"), batch=4).recompute == 0
    assert gpt_flops(CFG.replace(remat="qkv_proj_offloaded"), batch=4).recompute == \
        pytest.approx(fwd["attention"] + fwd["out_proj"] + fwd["mlp"] * 2 / 3)


CF = ("xla_tpu_enable_async_collective_fusion",
      "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
      "xla_tpu_enable_async_collective_fusion_multiple_steps",
      "xla_tpu_enable_async_collective_fusion_fuse_all_reduce")


def test_compile_options_by_platform():
    assert compile_options("tpu") == OVERLAP_FLAGS["tpu"]
    assert compile_options("cuda") == OVERLAP_FLAGS["gpu"]
    assert compile_options("tpu", False) == {} and compile_options("cpu") == {}
    assert compile_options("tpu", {"xla_enable_async_all_gather": True}) == \
        {"xla_enable_async_all_gather": True}
    with pytest.raises(TypeError, match="overlap must be"):
        compile_options("tpu", "yes")


# (what is compiled for, whether continuation fusion is in its flags): v5e's alone
# since libtpu 0.0.50, by preset, generation or JAX device kind
CF_CASES = [("v5e-4", True), ("TPU v5 lite", True), ("v5e:2x2", True), ("v5p-8", False),
            ("TPU v5p", False), ("v6e-8", False), ("tpu7x-128", False), ("TPU7x", False)]


@pytest.mark.parametrize(("device", "fused"), CF_CASES)
def test_continuation_fusion_only_where_the_compiler_runs_it(device, fused):
    flags = compile_options("tpu", device=device)
    assert all((k in flags) == fused for k in CF), flags
    assert {k: v for k, v in flags.items() if k not in CF} == \
        {k: v for k, v in OVERLAP_FLAGS["tpu"].items() if k not in CF}


TINY = GPTConfig.preset("tiny", dtype="bfloat16", seq_len=256)


@pytest.mark.tpu
@pytest.mark.parametrize("preset", ["v5e-4", "v5p-8", "v6e-4", "tpu7x-8"])
def test_tpu_overlap_flags_are_accepted(preset):
    """The TPU compiler rejects unknown option names, and (libtpu 0.0.50) continuation
    fusion off v5e, so compiling with each generation's default flags checks them."""
    mesh = wb.abstract_mesh(preset, data=-1)
    on = wb.plan(TINY, mesh=mesh, rules="fsdp", batch=8, progress=False)
    off = wb.plan(TINY, mesh=mesh, rules="fsdp", batch=8, progress=False, overlap=False)
    assert on.source == off.source == "tpu-compiler", on
    assert on.compiler_options == compile_options("tpu", device=preset)
    assert off.compiler_options == {}
    gathered = lambda p: sum(c.total_bytes for c in p.collectives if c.kind == "all-gather")
    assert gathered(on) == gathered(off)   # the same traffic, whatever the schedule
    with pytest.raises(Exception, match="No such compile option"):
        wb.plan(TINY, mesh=mesh, rules="fsdp", batch=8, progress=False,
                overlap={"xla_tpu_no_such_flag": True})


@pytest.mark.tpu
def test_host_offload_compiles_for_tpu():
    """An offloading policy compiles with the TPU compiler and moves activations to host
    memory (memory space S(5) in the HLO). (At this toy size the transfer buffers outweigh
    what leaves the device, so no memory comparison here: bench_reference has the 70B.
    Two layers, one sequence per chip: every layer's residuals are offloaded alike.)"""
    mesh = wb.abstract_mesh("v5e-4", data=-1)
    kept = wb.plan(TINY.replace(remat="minimal"), mesh=mesh, batch=4, progress=False)
    off = wb.plan(TINY.replace(remat="minimal_offloaded"), mesh=mesh, batch=4,
                  progress=False)
    assert off.source == "tpu-compiler"
    assert "S(5)" in off.compiled.as_text() and "S(5)" not in kept.compiled.as_text()
