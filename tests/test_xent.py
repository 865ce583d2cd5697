"""The training loss's cross-entropy (workbench/models/_xent.py) against optax's, the
reference: values and gradients, float32 and bf16 logits, sharded vocabularies, and the
compiled backward that has no scatter over the (B, T, V) logits."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from workbench.models._xent import token_cross_entropy

EPS32 = float(jnp.finfo(jnp.float32).eps)


def reference(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def case(dtype: str, b: int = 3, t: int = 5, v: int = 301, scale: float = 4.0, seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    logits = (scale * jax.random.normal(k1, (b, t, v))).astype(dtype)
    targets = jax.random.randint(k2, (b, t), 0, v)
    weights = jax.random.uniform(k2, (b, t))      # a non-uniform cotangent per token
    return logits, targets, weights


def grad_of(loss, logits, targets, weights):
    return jax.grad(lambda x: jnp.sum(loss(x, targets) * weights))(logits)


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_float32_values_and_gradients_equal_optax(scale):
    logits, targets, weights = case("float32", scale=scale)
    ours, ref = token_cross_entropy(logits, targets), reference(logits, targets)
    # both are logsumexp - logit in float32: a few roundings of numbers of size |logits|
    tol = 8 * EPS32 * (float(jnp.max(jnp.abs(logits))) + np.log(logits.shape[-1]))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)
    g_ours = grad_of(token_cross_entropy, logits, targets, weights)
    g_ref = grad_of(reference, logits, targets, weights)
    assert g_ours.dtype == jnp.float32
    # softmax - onehot: exp of (x - lse), whose rounding is relative to |x|
    np.testing.assert_allclose(g_ours, g_ref, rtol=0, atol=tol)
    # the gradient of a token's loss sums to zero over the vocabulary
    np.testing.assert_allclose(jnp.sum(g_ours, -1), 0.0, atol=tol * logits.shape[-1] ** 0.5)


def test_bf16_logits_give_float32_losses_and_bf16_gradients():
    logits, targets, weights = case("bfloat16")
    ours, ref = token_cross_entropy(logits, targets), reference(logits, targets)
    assert ours.dtype == jnp.float32
    tol = 8 * EPS32 * (float(jnp.max(jnp.abs(logits.astype(jnp.float32)))) + np.log(301))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)
    g_ours = grad_of(token_cross_entropy, logits, targets, weights)
    g_ref = grad_of(reference, logits, targets, weights)        # float32 math, cast to bf16
    assert g_ours.dtype == jnp.bfloat16
    # the same float32 gradient rounded once to bf16: at most one bf16 step apart
    a, b = np.asarray(g_ours, np.float32), np.asarray(g_ref, np.float32)
    step = np.maximum(np.abs(b), 1e-30) * float(jnp.finfo(jnp.bfloat16).eps)
    assert np.all(np.abs(a - b) <= step + 1e-38), np.max(np.abs(a - b) / step)


def test_sharded_vocabulary_and_batch_equal_unsharded():
    devs = np.array(jax.devices()[:8])
    if devs.size < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.sharding.Mesh(devs.reshape(2, 4), ("data", "model"))
    logits, targets, weights = case("float32", b=4, t=6, v=512)
    fn = jax.jit(jax.value_and_grad(
        lambda x, t, w: jnp.sum(token_cross_entropy(x, t) * w)))
    want = fn(logits, targets, weights)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    got = fn(put(logits, P("data", None, "model")), put(targets, P("data", None)),
             put(weights, P("data", None)))
    tol = 8 * EPS32 * float(jnp.sum(jnp.abs(reference(logits, targets))))
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=tol)
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=64 * EPS32)
    assert got[1].sharding.spec == P("data", None, "model")


def test_targets_outside_the_vocabulary_pick_no_word():
    logits, targets, _ = case("float32")
    bad = targets.at[0, 0].set(logits.shape[-1]).at[0, 1].set(-1)
    lse = jax.nn.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(token_cross_entropy(logits, bad)[0, :2], lse[0, :2], rtol=1e-6)


def test_compiled_backward_has_no_scatter_or_gather_over_the_logits():
    """The reference's backward scatter-adds the one-hot into a float32 (B, T, V) buffer;
    this one computes ``softmax - onehot`` in one elementwise pass."""
    logits, targets, weights = case("bfloat16", v=1024)
    text = jax.jit(lambda x: grad_of(token_cross_entropy, x, targets, weights)
                   ).lower(logits).compile().as_text()
    ops = lambda hlo: set(re.findall(r"= \S+ (scatter|gather)\(", hlo))  # noqa: E731
    assert not ops(text)
    ref = jax.jit(lambda x: grad_of(reference, x, targets, weights)
                  ).lower(logits).compile().as_text()
    assert ops(ref)                               # the shape of the test still means something
