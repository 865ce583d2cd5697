"""The router statistics of a mixture-of-experts layer, and what the train step makes of them.

Each MoE layer returns :data:`STAT_KEYS` beside its output (:func:`router_stats`, plus
``router_loss`` and ``dropped``); the GPT passes them out of its blocks, remat, scan and
pipeline as values (``GPT.hidden_and_stats``), and the train step
(:func:`workbench._step.make_train_step`) adds ``router_loss`` to the loss and reports the
rest (:func:`summarize`). A pipeline runs each layer once per micro-batch;
:func:`merge_microbatches` turns those into the statistics of the whole batch (the
load-balance loss is a product of two token averages, so each layer also returns its mean
router probability per expert, ``router_prob``).
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from workbench.models._config import GPTConfig

#: Per-layer statistics a MoE layer returns (each a scalar except ``tokens_per_expert`` and
#: ``router_prob``, both ``(E,)``).
STAT_KEYS: tuple[str, ...] = ("router_loss", "aux_loss", "z_loss", "tokens_per_expert",
                              "dropped", "entropy", "router_prob")


def summarize(stats: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Step metrics from per-layer statistics stacked over layers (``{}`` for a dense
    model: ``GPT.hidden_and_stats``).

    ``router_loss``: the mean over MoE layers of ``router_aux_loss * aux_loss +
    router_z_loss * z_loss`` (what the step adds to the loss); ``aux_loss``, ``z_loss``,
    ``entropy``: means over layers; ``dropped``: dropped (token, expert) assignments summed
    over layers; ``tokens_per_expert``: int32 ``(layers, E)`` assignments per expert
    before capacity (``router_prob`` is kept for :func:`merge_microbatches`, not
    reported).
    """
    s = stats
    if not s:
        return {}
    return {"router_loss": jnp.mean(s["router_loss"]), "aux_loss": jnp.mean(s["aux_loss"]),
            "z_loss": jnp.mean(s["z_loss"]), "entropy": jnp.mean(s["entropy"]),
            "dropped": jnp.sum(s["dropped"]),
            "tokens_per_expert": s["tokens_per_expert"].astype(jnp.int32)}


def merge_microbatches(stats: Mapping[str, jax.Array], cfg: GPTConfig) -> dict[str, jax.Array]:
    """The statistics of a batch from those of its ``M`` equal micro-batches.

    Args:
        stats: :data:`STAT_KEYS` with a leading micro-batch axis, ``(M, ...)``, each
            micro-batch as many tokens (a pipeline's micro-batches through the same layers).
        cfg: the MoE config (its router loss weights).

    Returns:
        The same keys without the micro-batch axis, as one run over the whole batch
        records them: per-token means (``z_loss``, ``entropy``, ``router_prob``) averaged,
        counts (``tokens_per_expert``, ``dropped``) summed, and ``aux_loss`` and
        ``router_loss`` recomputed from those (``aux_loss`` is not the mean of the
        micro-batches' ones). ``dropped`` equals the unpipelined count when dropless;
        with a capacity factor each micro-batch's groups have their own capacity.
    """
    counts = jnp.sum(stats["tokens_per_expert"], axis=0)
    out = {"tokens_per_expert": counts, "dropped": jnp.sum(stats["dropped"], axis=0),
           **{k: jnp.mean(stats[k], axis=0) for k in ("z_loss", "entropy", "router_prob")}}
    out["aux_loss"] = aux_loss(counts, out["router_prob"])
    out["router_loss"] = router_loss(cfg, out["aux_loss"], out["z_loss"])
    return out


def router_stats(logits: jax.Array, probs: jax.Array, idx: jax.Array,
                 n_experts: int) -> dict[str, jax.Array]:
    """Load-balance statistics over all tokens (global: the same under any sharding).

    - ``aux_loss``: ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``B*T*k``
      assignments routed to expert ``e`` and ``P_e`` its mean router probability (Switch
      Transformer, Fedus et al. 2021, eq. 4, with k choices per token); 1.0 when balanced.
    - ``z_loss``: mean of ``logsumexp(logits)^2`` (ST-MoE, Zoph et al. 2022, eq. 5).
    - ``tokens_per_expert``: (E,) assignments per expert, before capacity.
    - ``entropy``: mean over tokens of the router distribution's entropy (nats; ``log E``
      is uniform, 0 is one expert).
    - ``router_prob``: (E,) ``P_e``, the mean router probability of each expert.
    """
    counts = jnp.sum(jax.nn.one_hot(idx, n_experts, dtype=jnp.float32), axis=(0, 1, 2))
    mean_prob = jnp.mean(probs, axis=(0, 1))
    z = jax.nn.logsumexp(logits, axis=-1)
    return {"aux_loss": aux_loss(counts, mean_prob), "z_loss": jnp.mean(z * z),
            "tokens_per_expert": counts, "router_prob": mean_prob,
            "entropy": jnp.mean(jnp.sum(jax.scipy.special.entr(probs), axis=-1))}


def aux_loss(counts: jax.Array, mean_prob: jax.Array) -> jax.Array:
    """Load-balance loss ``E * sum_e f_e * P_e`` of assignments ``counts`` (..., E) and mean
    router probabilities ``mean_prob`` (..., E) (:func:`router_stats`)."""
    frac = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    return counts.shape[-1] * jnp.sum(frac * mean_prob, axis=-1)


def router_loss(cfg: GPTConfig, aux: jax.Array, z: jax.Array) -> jax.Array:
    """What a MoE layer adds to the loss: ``router_aux_loss * aux + router_z_loss * z``."""
    return cfg.router_aux_loss * aux + cfg.router_z_loss * z

