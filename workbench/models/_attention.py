"""Causal grouped-query attention by implementation: XLA, the Pallas splash kernel, cuDNN.

``GPTConfig(attention=...)`` picks one; :func:`attend` runs it on ``q (B, T, N, H)``,
``k, v (B, T, K, H)`` (RoPE applied, unscaled) and returns ``(B, T, N, H)``:

- ``"xla"``: ``jax.nn.dot_product_attention(implementation="xla")``: the T x T scores are
  materialized (float32), on every platform.
- ``"splash"``: the Pallas TPU splash-attention kernel
  (``jax.experimental.pallas.ops.tpu.splash_attention``): blocks of ``block_q`` queries
  against ``block_kv`` keys in VMEM, causal blocks above the diagonal skipped, never the
  T x T scores. On a TPU it is compiled by Mosaic; on CPU it runs in Pallas *interpret
  mode* (the same kernel, evaluated op by op: slow, for correctness checks on a laptop);
  a GPU has no splash kernel (use "cudnn"). Under active rules the kernel runs inside
  ``jax.shard_map`` over the batch and head axes (a Pallas call cannot be partitioned by
  XLA); a sequence sharded over a mesh axis (context parallelism) is not handled here.
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``: cuDNN's fused
  flash attention, GPUs only.
- ``"auto"``: splash on TPU, cudnn on GPU, xla on CPU.

Which one runs and why, and whether it can (checked before anything is traced or
compiled), is :mod:`workbench.models._attention_choice`; what a kernel computes (a
compiler's ``cost_analysis()`` does not count Pallas kernels) is counted by
:func:`workbench.perf._attention_cost.kernel_flops`. Decode mode attends new tokens to a
:class:`KVCache` (:func:`cached_attention`).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from workbench.models._attention_choice import Resolved, check, splash_layout_problem
from workbench.models._config import current_platform
from workbench._sharding.rules import active, constrain

__all__ = ["KVCache", "attend", "cached_attention", "current_platform", "segment_mask",
           "splash_attention", "xla_attention"]


# -- implementations -------------------------------------------------------------------------

def segment_mask(segment_ids: jax.Array | None) -> jax.Array | None:
    """``(B, 1, T, T)`` bool: query ``i`` may see key ``j`` of the same segment (packed
    rows); None for None."""
    if segment_ids is None:
        return None
    return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                  segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention by XLA (``jax.nn.dot_product_attention``, scale 1/sqrt(H));
    with ``segment_ids`` (B, T) also never across segments."""
    return jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segment_ids),
                                        is_causal=True, implementation="xla")


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                    segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention by cuDNN's fused flash kernel (GPU)."""
    return jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segment_ids),
                                        is_causal=True, implementation="cudnn")


@functools.lru_cache(maxsize=64)
def _splash_kernel(n_heads: int, seq: int, block_q: int, block_kv: int,
                   interpret: bool) -> Any:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.CausalMask(shape=(seq, seq)) for _ in range(n_heads)])
    sizes = sa.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                          block_q_dkv=block_q, block_kv_dkv=block_kv,
                          block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                          block_kv_dq=block_kv)
    with jax.ensure_compile_time_eval():   # concrete mask tables, safe to cache across traces
        return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     segment_ids: jax.Array | None = None, *, block_q: int,
                     block_kv: int, interpret: bool) -> jax.Array:
    """Causal GQA attention by the splash kernel on local (unsharded) arrays.

    Args:
        q: (B, T, N, H) queries, RoPE applied, not scaled.
        k, v: (B, T, K, H) keys and values (K divides N).
        segment_ids: (B, T) int32 or None: attention stays inside each segment (the
            kernel's ``SegmentIds``; packed rows).
        block_q, block_kv: tile sizes (divide T).
        interpret: Pallas interpret mode (any platform; slow).

    Returns:
        (B, T, N, H) in q's dtype. Use inside ``shard_map`` for sharded arrays (the
        context-parallel module calls this per shard).
    """
    _, t, n, h = q.shape
    kernel = _splash_kernel(n, t, block_q, block_kv, bool(interpret))
    qt = jnp.swapaxes(q * jnp.asarray(h ** -0.5, q.dtype), 1, 2)      # (B, N, T, H)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)             # (B, K, T, H)
    if segment_ids is None:
        out = jax.vmap(kernel)(qt, kt, vt)
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

        seg = SegmentIds(q=segment_ids, kv=segment_ids)                   # (B, T) each
        out = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=s))(qt, kt, vt, seg)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def _sharded_splash(q: jax.Array, k: jax.Array, v: jax.Array, r: Resolved,
                    segment_ids: jax.Array | None = None) -> jax.Array:
    """Splash under the active rules: ``shard_map`` over batch and head axes."""
    fn = functools.partial(splash_attention, block_q=r.block_q, block_kv=r.block_kv,
                           interpret=r.interpret)
    ctx = active()
    if ctx is None:
        return fn(q, k, v, segment_ids)
    problem = splash_layout_problem(q.shape, k.shape[2])
    if problem is not None:
        raise ValueError(f"attention='splash': {problem}")
    rules, mesh = ctx
    batch = rules.axes("batch", mesh)
    heads = rules.axes("heads", mesh)
    b_spec = batch if len(batch) != 1 else batch[0]
    h_spec = heads if len(heads) != 1 else heads[0]
    spec = PartitionSpec(b_spec or None, None, h_spec or None, None)
    if segment_ids is not None:
        seg_spec = PartitionSpec(b_spec or None, None)                      # (B, T)
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, seg_spec),
                             out_specs=spec, check_vma=False)(q, k, v, segment_ids)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q, k, v)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "xla",
           block_sizes: tuple[int, int] | None = None,
           platform: str | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention by ``impl`` (see the module docstring).

    Args:
        q: (B, T, N, H) queries after RoPE.
        k, v: (B, T, K, H).
        segment_ids: (B, T) int32 of packed rows: a query sees only keys of its own
            segment (a mask for XLA and cuDNN, the kernel's segment ids for splash).
        impl: one of ``IMPLEMENTATIONS``.
        block_sizes: splash ``(block_q, block_kv)``; default ``min(512, T)`` each.
        platform: the platform traced for (default :func:`current_platform`).
    """
    platform = platform or current_platform()
    problem = splash_layout_problem(q.shape, k.shape[2]) if impl == "auto" else None
    r = check(impl, platform, seq=q.shape[1], head_dim=q.shape[3], n_heads=q.shape[2],
              n_kv_heads=k.shape[2], block_sizes=block_sizes, layout_problem=problem,
              dtype=q.dtype)
    if r.impl == "splash":
        return _sharded_splash(q, k, v, r, segment_ids)
    if r.impl == "cudnn":
        return cudnn_attention(q, k, v, segment_ids)
    return xla_attention(q, k, v, segment_ids)


# -- decode mode: attention against a key/value cache ----------------------------------------

class KVCache(NamedTuple):
    """The keys and values of the positions decoded so far, and where the next go.

    The decode state of :class:`workbench.models._layers.Attention` (one layer: ``k, v``
    ``(B, S, K, H)``) and of :class:`workbench.models._gpt.GPT` (every layer stacked:
    ``(L, B, S, K, H)``, :meth:`~workbench.models._gpt.GPT.init_cache`); ``S`` is the
    longest sequence it holds. ``pos`` (int32 scalar): the position of the first token of
    the next call (0 for the prompt); a call on ``t`` tokens returns the cache with their
    keys and values written at ``pos..pos+t`` and ``pos + t``.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache
                     ) -> tuple[jax.Array, KVCache]:
    """Causal GQA attention of ``t`` new tokens at positions ``cache.pos..cache.pos+t``.

    Args:
        q: (B, t, N, H) queries after RoPE.
        k, v: (B, t, K, H) the new tokens' keys (after RoPE) and values.
        cache: one layer's :class:`KVCache`.

    Returns:
        ``(B, t, N, H)``: each query attends to every cached key up to its own position
        (XLA attention with a mask over the cache's ``S`` positions), and the cache with
        ``k, v`` written.
    """
    t, s = q.shape[1], cache.k.shape[1]
    positions = cache.pos + jnp.arange(t)                                     # (t,)
    ck = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, cache.pos, 0, 0))
    cv = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, cache.pos, 0, 0))
    ck = constrain(ck, ("batch", None, "kv_heads", "head_dim"), name="k_cache")  # (B, S, K, H)
    cv = constrain(cv, ("batch", None, "kv_heads", "head_dim"), name="v_cache")
    mask = jnp.arange(s)[None, :] <= positions[:, None]                      # (t, S)
    y = jax.nn.dot_product_attention(q, ck.astype(q.dtype), cv.astype(q.dtype),
                                     mask=mask[None, None], implementation="xla")
    return y, KVCache(ck, cv, cache.pos + t)
