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
- ``"auto"``: splash on TPU, cudnn on GPU, xla on CPU (:func:`resolve`, which says why).

:func:`check` validates an implementation against a platform and shapes before anything
is traced or compiled; what a kernel computes (a compiler's ``cost_analysis()`` does not
count Pallas kernels) is counted by :func:`workbench.perf._attention_cost.kernel_flops`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from workbench.models._config import ATTENTION_IMPLEMENTATIONS, current_platform
from workbench._sharding.rules import active, constrain

__all__ = ["IMPLEMENTATIONS", "KVCache", "Resolved", "attend", "block_sizes_for",
           "cached_attention", "check", "current_platform", "resolve", "segment_mask",
           "splash_attention",
           "splash_layout_problem", "xla_attention"]

#: Values of ``GPTConfig.attention``.
IMPLEMENTATIONS: tuple[str, ...] = ATTENTION_IMPLEMENTATIONS
#: Default splash block (queries and keys per tile), capped at the sequence length.
DEFAULT_BLOCK = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resolved:
    """The implementation that runs on a platform, and why.

    Attributes:
        impl: "xla", "splash" or "cudnn".
        interpret: splash in Pallas interpret mode (CPU).
        block_q, block_kv: splash tile sizes (0 for other implementations).
        reason: one sentence: why this implementation.
    """

    impl: str
    interpret: bool = False
    block_q: int = 0
    block_kv: int = 0
    reason: str = ""


def block_sizes_for(seq: int, block_sizes: tuple[int, int] | None) -> tuple[int, int]:
    """``(block_q, block_kv)``: the configured ones, or ``min(DEFAULT_BLOCK, seq)`` each."""
    if block_sizes is None:
        b = min(DEFAULT_BLOCK, int(seq))
        return b, b
    return int(block_sizes[0]), int(block_sizes[1])


def resolve(impl: str, platform: str, *, seq: int,
            block_sizes: tuple[int, int] | None = None, head_dim: int | None = None,
            layout_problem: str | None = None, dtype: Any = None) -> Resolved:
    """Which implementation runs for ``impl`` on ``platform`` (no checks; see :func:`check`).

    Args:
        impl: one of ``IMPLEMENTATIONS``.
        platform: "tpu", "gpu"/"cuda"/"rocm" or "cpu".
        seq: sequence length (for the splash block sizes).
        block_sizes: ``GPTConfig.attention_block_sizes``.
        head_dim: the heads' width (``auto`` leaves cuDNN for XLA where cuDNN refuses it).
        layout_problem: :func:`splash_layout_problem` of the layout, when known: ``auto``
            then runs XLA attention on TPU and says why.
        dtype: the compute dtype, when known: cuDNN's kernel takes bfloat16 and float16
            only, so ``auto`` runs XLA attention on a float32 GPU step and says why.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention={impl!r}; choose one of {IMPLEMENTATIONS}")
    gpu = platform in ("gpu", "cuda", "rocm")
    if impl == "auto":
        if platform == "tpu":
            bq, bkv = block_sizes_for(seq, block_sizes)
            if seq % bq or seq % bkv:
                return Resolved(impl="xla", reason=(
                    f"auto: splash blocks ({bq}, {bkv}) do not divide seq={seq}; XLA "
                    "attention"))
            if bkv % 128 or (bq % 128 and bq != seq):
                return Resolved(impl="xla", reason=(
                    f"auto: splash tiles keys (and queries shorter than the sequence) by "
                    f"multiples of 128; blocks ({bq}, {bkv}) at seq={seq} are not: XLA "
                    "attention"))
            if layout_problem:
                return Resolved(impl="xla", reason=(
                    f"auto: XLA attention; the splash kernel cannot take this layout "
                    f"({layout_problem})"))
            return Resolved(impl="splash", block_q=bq, block_kv=bkv,
                            reason="auto: the Pallas splash kernel on TPU")
        if gpu:
            if head_dim is not None and (head_dim > 256 or head_dim % 8):
                return Resolved(impl="xla", reason=(
                    f"auto: cuDNN flash attention needs head_dim <= 256 and a multiple of 8 "
                    f"(here {head_dim}): XLA attention"))
            if _not_for_cudnn(dtype):
                return Resolved(impl="xla", reason=(
                    f"auto: cuDNN flash attention takes bfloat16 or float16; this step "
                    f"computes in {_dtype_name(dtype)}: XLA attention"))
            return Resolved(impl="cudnn", reason="auto: cuDNN flash attention on GPU")
        return Resolved(impl="xla", reason=f"auto: XLA attention on {platform} (no fused "
                        "kernel there; attention='splash' runs the TPU kernel in interpret "
                        "mode for checks)")
    if impl == "splash":
        bq, bkv = block_sizes_for(seq, block_sizes)
        interp = platform != "tpu"
        return Resolved(impl="splash", interpret=interp, block_q=bq, block_kv=bkv,
                        reason="Pallas splash kernel" + (
                            f" in interpret mode on {platform} (slow; for correctness)"
                            if interp else " (Mosaic)"))
    return Resolved(impl=impl, reason={"xla": "XLA attention (T x T scores materialized)",
                                       "cudnn": "cuDNN flash attention"}[impl])


def check(impl: str, platform: str, *, seq: int, head_dim: int, n_heads: int,
          n_kv_heads: int, block_sizes: tuple[int, int] | None = None,
          layout_problem: str | None = None, dtype: Any = None) -> Resolved:
    """:func:`resolve`, raising before tracing when the choice cannot run.

    Raises:
        ValueError: splash on a GPU, cudnn off a GPU, splash blocks that don't divide
            ``seq`` or are not multiples of 128 on TPU, an unknown implementation.
    """
    r = resolve(impl, platform, seq=seq, block_sizes=block_sizes, head_dim=head_dim,
                layout_problem=layout_problem, dtype=dtype)
    gpu = platform in ("gpu", "cuda", "rocm")
    if r.impl == "splash":
        if gpu:
            raise ValueError(
                f"attention='splash' is the Pallas TPU kernel; {platform} has none (it runs "
                "on TPU, or on CPU in interpret mode). Use attention='cudnn' or 'auto' on GPU")
        bq, bkv = r.block_q, r.block_kv
        for name, b in (("block_q", bq), ("block_kv", bkv)):
            if b <= 0 or seq % b:
                raise ValueError(
                    f"splash {name}={b} does not divide the sequence length {seq}; set "
                    f"GPTConfig(attention_block_sizes=(bq, bkv)) to divisors of {seq} "
                    f"(e.g. ({_divisor(seq)}, {_divisor(seq)}))")
            if b % 128 and (name == "block_kv" or (platform == "tpu" and b != seq)):
                raise ValueError(
                    f"splash {name}={b}: the kernel tiles keys by multiples of 128 (and, "
                    f"on TPU, queries by multiples of 128 or the whole sequence, {seq}); "
                    "set attention_block_sizes accordingly")
    if r.impl == "cudnn":
        if not gpu:
            raise ValueError(
                f"attention='cudnn' is cuDNN flash attention, GPUs only; this step is for "
                f"{platform}. Use attention='splash' on TPU, 'xla' on CPU, or 'auto'")
        if head_dim > 256 or head_dim % 8:
            raise ValueError(f"cuDNN flash attention needs head_dim <= 256 and a multiple "
                             f"of 8, got {head_dim}; use attention='xla'")
        if _not_for_cudnn(dtype):
            raise ValueError(
                f"attention='cudnn': cuDNN flash attention takes bfloat16 or float16, and "
                f"this step computes in {_dtype_name(dtype)}; use GPTConfig(dtype='auto' or "
                "'bfloat16'), or attention='xla' (or 'auto') for a float32 step")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    return r


#: The compute dtypes cuDNN's flash attention kernel takes.
CUDNN_DTYPES = ("bfloat16", "float16")


def _dtype_name(dtype: Any) -> str:
    return str(jnp.dtype(dtype))


def _not_for_cudnn(dtype: Any) -> bool:
    """Whether a known compute dtype is one cuDNN's kernel does not take (None and "auto",
    not yet resolved, are not known)."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return False
    return _dtype_name(dtype) not in CUDNN_DTYPES


def _divisor(seq: int) -> int:
    for b in (512, 256, 128):
        if seq % b == 0:
            return b
    return seq


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


def splash_layout_problem(q_shape: tuple[int, ...], n_kv_heads: int, *, rules: Any = None,
                          mesh: Any = None) -> str | None:
    """Why the splash kernel cannot run on this layout (the active rules' mesh), or None.

    The kernel runs per device inside ``shard_map`` over the batch and head axes, so it
    needs every key of its queries' sequence on the device (no mesh axis on ``seq``: the
    context-parallel module handles that layout), each device's query heads with their kv
    heads (``heads`` and ``kv_heads`` on the same mesh axes, dividing both counts) and a
    batch divisible by its mesh axes.

    Args:
        q_shape: the queries' global ``(B, T, N, H)``.
        n_kv_heads: K.
        rules, mesh: the layout (a mesh, ``MeshInfo`` or ``{axis: size}``); default the
            active rules and their mesh (while a step is traced).
    """
    if rules is None or mesh is None:
        ctx = active()
        if ctx is None:
            return None
        rules, mesh = ctx
    shape = mesh if isinstance(mesh, dict) else dict(mesh.shape)
    seq_axes = rules.axes("seq", mesh)
    if seq_axes:
        return (f"sequence sharded over {seq_axes}: the kernel needs every key of its "
                "queries' sequence on the device; use the context-parallel attention "
                "(workbench.models._context) or rules with seq=None")
    batch, heads, kv_heads = (rules.axes(a, mesh) for a in ("batch", "heads", "kv_heads"))
    n = q_shape[2]
    size = lambda axes: math.prod(shape[a] for a in axes)
    if heads != kv_heads or n % size(heads) or n_kv_heads % size(kv_heads):
        return (f"query heads are sharded over {heads or 'nothing'} and kv heads over "
                f"{kv_heads or 'nothing'} ({n} and {n_kv_heads} heads): each device needs the "
                "kv heads of its query heads, so map heads and kv_heads to the same mesh "
                "axes, dividing both counts")
    if q_shape[0] % size(batch):
        return f"batch {q_shape[0]} is not divisible by its mesh axes {batch}"
    return None


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
