"""Which attention implementation runs, and whether it can: decided before anything is traced.

``GPTConfig(attention=...)`` names one of :data:`IMPLEMENTATIONS`; :func:`resolve` says
which runs on a platform and why (``"auto"``: splash on TPU, cudnn on GPU, xla on CPU, with
the reasons it falls back to XLA), and :func:`check` raises with the fix where the choice
cannot run there (splash on a GPU, cudnn off one, blocks that do not tile the sequence,
a dtype cuDNN does not take). :func:`splash_layout_problem` says why the splash kernel
cannot take a layout. Pure Python over shapes, names and the platform: the plan, the
formulas (:mod:`workbench.perf._analytic`) and the step resolver ask these without
tracing; :mod:`workbench.models._attention` runs the choice.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from workbench.models._config import ATTENTION_IMPLEMENTATIONS
from workbench._sharding.rules import active

__all__ = ["CUDNN_DTYPES", "DEFAULT_BLOCK", "IMPLEMENTATIONS", "Resolved", "block_sizes_for",
           "check", "resolve", "splash_layout_problem"]

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
    if impl == "auto":
        return _resolve_auto(platform, seq=seq, block_sizes=block_sizes, head_dim=head_dim,
                             layout_problem=layout_problem, dtype=dtype)
    if impl == "splash":
        bq, bkv = block_sizes_for(seq, block_sizes)
        interp = platform != "tpu"
        return Resolved(impl="splash", interpret=interp, block_q=bq, block_kv=bkv,
                        reason="Pallas splash kernel" + (
                            f" in interpret mode on {platform} (slow; for correctness)"
                            if interp else " (Mosaic)"))
    return Resolved(impl=impl, reason={"xla": "XLA attention (T x T scores materialized)",
                                       "cudnn": "cuDNN flash attention"}[impl])


def _resolve_auto(platform: str, *, seq: int, block_sizes: tuple[int, int] | None,
                  head_dim: int | None, layout_problem: str | None, dtype: Any) -> Resolved:
    """What ``attention="auto"`` runs on ``platform`` (:func:`resolve`'s arguments)."""
    gpu = platform in ("gpu", "cuda", "rocm")
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

