"""Custom remat, tensor by tensor, as MaxText's Ironwood recipes set it (issue 57, item 4):
``remat={"save": [...], "offload": [...]}`` of the model's checkpoint names, the rest
recomputed.

References: JAX's own list of the residuals the backward pass reads (``saved_residuals``), the
gradients without remat, the named policy with the same names (the same program, hence the same
TPU-compiled plan), and a hand count of the bytes an offloading policy moves to host memory.
"""
from __future__ import annotations

import dataclasses
import jax
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

import workbench as wb
from workbench._step import lm_loss
from workbench.models import GPT, GPTConfig
from workbench.models._remat import CHECKPOINT_NAMES, REMAT_POLICIES, remat_label, resolve_remat
from workbench.perf._host import host_traffic

from _tolerance import assert_close_at_scale
from _tpu import tpu

CFG = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                d_ff=32, seq_len=8)
TINY = GPTConfig.preset("tiny")
KIB = 1024


def _loss(cfg):
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    return (lambda p: lm_loss(nnx.merge(graphdef, p), batch)), params


def _residual_names(cfg) -> set[str]:
    f, params = _loss(cfg)
    found = set()
    for _, desc in saved_residuals(f, params):
        for name in CHECKPOINT_NAMES:
            if f"named '{name}'" in desc:
                found.add(name)
    return found


@pytest.mark.parametrize("save", [
    ["key_proj", "value_proj"],                     # no named policy keeps exactly these
    ["query_proj", "context"],
    ["out_proj", "mlpwi_0", "mlpwi_1"],
])
def test_a_custom_policy_keeps_exactly_what_it_names(save) -> None:
    """JAX's residual list holds the saved names and no other checkpoint name."""
    assert _residual_names(CFG.replace(remat={"save": save})) == set(save)


def test_it_gives_the_gradients_of_no_remat() -> None:
    f0, p0 = _loss(CFG)
    f1, p1 = _loss(CFG.replace(remat={"save": ["key_proj", "value_proj", "mlpwi_1"]}))
    (l0, g0), (l1, g1) = jax.value_and_grad(f0)(p0), jax.value_and_grad(f1)(p1)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        assert_close_at_scale(a, b, rtol=1e-5)   # reordered sums: at the tensor's scale


@pytest.mark.parametrize("named", ["save_qkv_proj", "save_dot_except_mlp", "qkv_input_offloaded"])
def test_the_same_names_as_a_named_policy_are_that_policy(named) -> None:
    """A custom mapping of a named policy's names resolves to the same saved and offloaded
    sets, so the formulas count it alike."""
    p = REMAT_POLICIES[named]
    custom = CFG.replace(remat={"save": list(p.saved), "offload": list(p.offloaded)}).remat
    assert (set(custom.saved), set(custom.offloaded)) == (set(p.saved), set(p.offloaded))
    assert resolve_remat(custom) is custom and remat_label(custom).startswith("custom(")
    as_given = resolve_remat({"save": list(p.saved), "offload": list(p.offloaded)})
    assert (as_given.saved, as_given.offloaded) == (custom.saved, custom.offloaded)


def test_the_plan_counts_it_as_the_named_policy_with_the_same_names() -> None:
    """The formula's activation memory and recompute FLOPs: custom = named, name for name."""
    mesh = wb.abstract_mesh("v5e-8", data=-1)
    opts = dict(mesh=mesh, batch=8, seq=128, progress=False, compile=False)
    named = wb.plan(TINY.replace(remat="save_qkv_proj"), **opts)
    custom = wb.plan(TINY.replace(remat={"save": ["query_proj", "key_proj", "value_proj"]}),
                     **opts)
    numbers = lambda f: {k: v for k, v in dataclasses.asdict(f).items() if k != "formula"}
    assert custom.memory == named.memory
    assert numbers(custom.report.flops) == numbers(named.report.flops)
    assert "remat custom(save=query_proj,key_proj,value_proj)" in str(custom)


@tpu
def test_an_offloading_custom_policy_moves_the_hand_counted_bytes() -> None:
    """tiny on v5e-4, one 128-token sequence per chip, compiled by the TPU compiler: the block
    input (128 x 64) and k, v (128 x 2 x 16 each) go to host memory, q stays on the device:
    16 + 8 + 8 KiB per layer, 2 layers: 64 KiB per chip each way."""
    cfg = TINY.replace(remat={"offload": ["decoder_layer_input", "key_proj", "value_proj"],
                              "save": ["query_proj"]})
    plan = wb.plan(cfg, mesh=wb.abstract_mesh("v5e-4", data=-1), batch=4, seq=128,
                   progress=False)
    assert plan.source == "tpu-compiler"
    hand = (64 + 2 * 16 + 2 * 16) * 128 * 2 * TINY.n_layers
    assert hand == 64 * KIB
    traffic = host_traffic(plan.compiled.as_text())
    assert traffic.to_host_bytes == traffic.to_device_bytes == hand
    assert plan.report.memory_estimate is not None


@tpu
def test_two_tensorcores_share_a_tpu7x_chips_host_link() -> None:
    """On tpu7x each JAX device is one of a chip's 2 TensorCores: the HLO's transfers are one
    device's, and both devices' cross the chip's one host link, so the link is busy for twice
    one device's bytes at the chip's bandwidth."""
    from workbench.hardware import hardware_spec

    cfg = TINY.replace(remat={"offload": ["decoder_layer_input"]})
    plan = wb.plan(cfg, mesh=wb.abstract_mesh("tpu7x-8", data=-1), batch=8, seq=128,
                   progress=False)
    assert plan.source == "tpu-compiler"
    per_device = 64 * 128 * 2 * TINY.n_layers      # the block input, 128 tokens per device
    traffic = host_traffic(plan.compiled.as_text())
    assert traffic.to_host_bytes == per_device
    spec = hardware_spec("TPU7x")
    link = plan.predicted.breakdown["host_link"]
    assert link == pytest.approx(2 * per_device / spec.host_bandwidth, rel=1e-9)


@pytest.mark.parametrize(("value", "error", "match"), [
    ({"save": ["bogus"]}, ValueError, r"names 'bogus', which the model does not name; its "
                                      r"checkpoint names are \['decoder_layer_input'"),
    ({"save": ["mlpwi"]}, ValueError, r"'mlpwi_0', 'mlpwi_1'"),
    ({"keep": ["key_proj"]}, ValueError, r"unknown key\(s\) \['keep'\]"),
    ({"save": "key_proj"}, TypeError, r"must be a list of checkpoint names"),
    ({"save": ["key_proj"], "offload": ["key_proj"]}, ValueError, r"both saved and offloaded"),
    ({"save": ["key_proj", "key_proj"]}, ValueError, r"names a tensor twice"),
    ({}, ValueError, r"keeps nothing: that is remat='full'"),
    (5, TypeError, r"remat=5 is a int; give a policy name"),
    ("custom", ValueError, r"remat='custom'; choose one of"),
])
def test_a_bad_policy_is_refused_with_the_names(value, error, match) -> None:
    with pytest.raises(error, match=match):
        CFG.replace(remat=value)


def test_it_round_trips_through_json_and_the_train_config() -> None:
    remat = {"offload": ["decoder_layer_input"], "save": ["value_proj", "key_proj"]}
    cfg = CFG.replace(remat=remat)
    assert cfg.to_dict()["remat"] == {"save": ["key_proj", "value_proj"],
                                      "offload": ["decoder_layer_input"]}
    assert GPTConfig(**cfg.to_dict()) == cfg and hash(GPTConfig(**cfg.to_dict())) == hash(cfg)
    tc = wb.TrainConfig(model="tiny", model_overrides={"remat": remat})
    assert wb.TrainConfig.from_json(tc.to_json()) == tc
