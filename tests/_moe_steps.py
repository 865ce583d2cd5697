"""One train step of moe-tiny on a CPU mesh, and the dense dropless reference steps that
test_moe_grouped (``ragged_dot``) and test_moe_gmm (megablox) both compare against: the same
config, mesh, rules and batch in both files, so each reference is computed once per process
(a dense step costs about as much as the grouped one it checks)."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import workbench as wb
from workbench import _step as S, _train_state as TS
from workbench.models import GPTConfig
from workbench._sharding.rules import Rules

#: both files' model: 16-token sequences (G = 32 tokens per device on 8 devices)
TINY = GPTConfig.preset("moe-tiny", seq_len=16)
BATCH = 16
MOE_KEYS = ("moe_router_loss", "moe_aux_loss", "moe_z_loss", "moe_entropy")


def mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
    return wb.make_mesh(axes, devices=jax.devices()[:math.prod(axes.values())])


def keep_grads() -> optax.GradientTransformation:
    """An optimizer whose state is the last gradients and whose updates are zero."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def one_step(cfg: GPTConfig, axes: dict[str, int], rules: str, pipeline=None):
    """Metrics and gradients of one train step of ``cfg`` on a fixed batch (host arrays)."""
    opt, m = keep_grads(), mesh(axes)
    rules = Rules.preset(rules, m)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, cfg.seq_len + 1), 0,
                                cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    graphdef, state = S.init_state(cfg, opt, rules, m, seed=0)
    step = S.jit_train_step(
        S.make_train_step(graphdef, opt, rules=rules, mesh=m, pipeline=pipeline),
        TS.state_shardings(cfg, opt, rules, m), TS.batch_shardings(rules, m))
    state, metrics = step(state, batch)
    return jax.device_get(metrics), jax.device_get(state.opt_state)


def dense_step(cfg: GPTConfig, axes: dict[str, int], rules: str):
    """:func:`one_step` of ``cfg`` with ``moe_matmul="dense"`` (dropless: a slot per expert
    and token), no pipeline: computed once per process for each config, mesh and rules
    (its arrays are shared between tests, so read-only)."""
    return _dense_step(cfg.replace(moe_matmul="dense"), tuple(axes.items()), rules)


@functools.cache
def _dense_step(cfg: GPTConfig, axes: tuple[tuple[str, int], ...], rules: str):
    out = one_step(cfg, dict(axes), rules)
    for a in jax.tree.leaves(out):   # shared between tests: a write raises
        if isinstance(a, np.ndarray):
            a.setflags(write=False)
    return out
