"""One forward pass (issue 46, item 2): ``wb.generate`` decodes with the model's own forward.

The reference is the training forward, ``model(tokens)`` of the whole generated sequence:
the logits ``wb.generate`` samples from at every new position, and the decode-mode
forward's logits at every prompt position (the prefill), equal it for a dense GPT, a MoE
GPT (moe-tiny, dropless) and a scanned one (``scan_layers=True``), in float32 on CPU;
also on a mesh of 8 simulated CPU devices with ``fsdp_tp`` rules (parameters, batch and
cache sharded).

The tolerance is derived from the computation, not from a run: both sides compute the
same sums of products and differ only in how float32 groups them (one token against the
cache, or all tokens at once). Reordering a sum of ``n`` products changes it by at most
``n * u`` times the sum of the products' magnitudes (``u = 2**-24``, float32's unit
roundoff; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., Sec. 3.1,
the bound gamma_n). To first order, such relative errors add along the chain of
reductions that ends in a logit: each block's attention and MLP (two stages, with up to
``n`` terms each: ``d_model``, ``d_ff``, the heads' width, the keys) and the output
projection; RMSNorm rescales a row and keeps its relative error. So each logit's
difference is bounded by ``(2 * n_layers + 1) * n * u`` times the magnitude sum of its
output projection, ``(|h| @ |W_out|)``, computed here for every position and token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import workbench as wb
from workbench import _generate as gen
from workbench.models._gpt import GPT

#: (B, T): a batch the mesh's data axis (4) divides, so that the batch is sharded too
PROMPT = np.array([[5, 17, 3, 200], [9, 9, 41, 7], [1, 2, 3, 4], [250, 0, 66, 66]], np.int32)
NEW = 5
U = 2.0 ** -24   # float32 unit roundoff

CONFIGS = {
    "dense": wb.models.GPTConfig.preset("tiny"),
    "moe": wb.models.GPTConfig.preset("moe-tiny"),          # dropless (capacity_factor=None)
    "scanned": wb.models.GPTConfig.preset("tiny", scan_layers=True),
}


def _cfg(name: str) -> wb.models.GPTConfig:
    cfg = CONFIGS[name].replace(dtype="float32", param_dtype="float32")
    if name == "moe":
        assert cfg.capacity_factor is None, "the reference needs a dropless MoE"
    return cfg


def _sharded(cfg: wb.models.GPTConfig, mesh, rules) -> GPT:
    """``GPT(cfg)`` from ``nnx.Rngs(0)`` with its parameters placed by ``rules``."""
    from workbench._step import sharded_init
    from workbench._train_state import abstract_model, param_specs

    graphdef, abstract, logical = abstract_model(cfg)
    specs = param_specs(abstract, logical, rules)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
    return nnx.merge(graphdef, sharded_init(cfg, None, shardings)(jax.random.key(0)))


def _reference(model: GPT, tokens: np.ndarray, mesh=None, rules=None):
    """The training forward's logits ``(B, S, V)`` and each logit's tolerance."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens):
        m = nnx.merge(graphdef, state)
        h = m.hidden(tokens)                                              # (B, S, D)
        w = m.embed[...].T if m.lm_head is None else m.lm_head[...]      # (D, V)
        return m(tokens), jnp.abs(h) @ jnp.abs(w)                         # (B, S, V) twice

    if rules is None:
        logits, magnitude = forward(state, jnp.asarray(tokens))
    else:
        with rules.activate(mesh):
            logits, magnitude = forward(state, jnp.asarray(tokens))
    cfg = model.cfg
    n = max(cfg.d_model, cfg.d_ff, cfg.expert_d_ff, cfg.n_heads * cfg.head_dim,
            tokens.shape[1])
    tol = (2 * cfg.n_layers + 1) * n * U * np.asarray(magnitude)
    return np.asarray(logits), tol


def _generated_logits(model: GPT, monkeypatch, **kw):
    """``wb.generate``'s tokens and the logits ``(B, V)`` it sampled each new one from."""
    seen = []
    pick = gen._pick

    def record(logits, key, **how):
        seen.append(np.asarray(logits))
        return pick(logits, key, **how)

    monkeypatch.setattr(gen, "_pick", record)
    out = wb.generate(model, PROMPT, max_new_tokens=NEW, **kw)
    return out, np.stack(seen, axis=1)                                   # (B, NEW, V)


def _check(model: GPT, monkeypatch, mesh=None, rules=None) -> None:
    # sampling (not greedy) so that the continuation is not one token repeated
    out, sampled = _generated_logits(model, monkeypatch, temperature=1.0, seed=3,
                                     rules=rules)
    assert out.shape == (PROMPT.shape[0], PROMPT.shape[1] + NEW)
    full, tol = _reference(model, out, mesh, rules)
    t = PROMPT.shape[1]
    # the logits of position i predict token i + 1: positions t-1 .. t+NEW-2
    np.testing.assert_array_less(np.abs(sampled - full[:, t - 1:-1]), tol[:, t - 1:-1])
    # the prefill: the decode-mode forward of the prompt into an empty cache
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens):
        m = nnx.merge(graphdef, state)
        return m(tokens, cache=m.init_cache(tokens.shape[0], out.shape[1]))

    if rules is None:
        logits, cache = prefill(state, jnp.asarray(PROMPT))
    else:
        with rules.activate(mesh):
            logits, cache = prefill(state, jnp.asarray(PROMPT))
    assert int(cache.pos) == t
    np.testing.assert_array_less(np.abs(np.asarray(logits) - full[:, :t]), tol[:, :t])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_logits_equal_training_forward(name, monkeypatch):
    model = GPT(_cfg(name), rngs=nnx.Rngs(0))
    _check(model, monkeypatch)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_logits_equal_training_forward_sharded(name, monkeypatch):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    mesh = wb.make_mesh(data=4, model=2)
    rules = wb.Rules.preset("fsdp_tp", mesh)
    model = _sharded(_cfg(name), mesh, rules)
    assert len(model.embed[...].sharding.device_set) == 8
    _check(model, monkeypatch, mesh, rules)


def test_cache_false_is_the_training_forward(monkeypatch):
    """``cache=False`` samples from the whole buffer's training forward: the same tokens."""
    model = GPT(_cfg("dense"), rngs=nnx.Rngs(0))
    a, _ = _generated_logits(model, monkeypatch, temperature=1.0, seed=3)
    b, _ = _generated_logits(model, monkeypatch, temperature=1.0, seed=3, cache=False)
    np.testing.assert_array_equal(a, b)


def test_tolerance_catches_a_wrong_position():
    """The tolerance is tight enough to see a decoding bug: writing the prompt one position
    late (a zero key at 0 that every query may attend to) moves the logits past it."""
    from workbench.models._attention import KVCache

    model = GPT(_cfg("dense"), rngs=nnx.Rngs(0))
    full, tol = _reference(model, PROMPT)
    cache = model.init_cache(PROMPT.shape[0], PROMPT.shape[1] + 1)
    logits, _ = model(jnp.asarray(PROMPT), cache=KVCache(cache.k, cache.v, jnp.int32(1)))
    assert (np.abs(np.asarray(logits) - full) > tol).any()
