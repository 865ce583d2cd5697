"""The layers a GPT is built from: annotated parameters, RMSNorm, RoPE, attention, MLP.

Every parameter carries its logical axes as NNX ``out_sharding`` metadata; activations
are constrained with :func:`workbench._sharding.rules.constrain`, which follows the active
``Rules``. Attention runs by ``cfg.attention`` (XLA, the Pallas splash kernel or cuDNN
flash attention: :mod:`workbench.models._attention`), or by ``cfg.context_attention`` when
the rules shard the sequence (:mod:`workbench.models._context`). The transformer block and
the model are in :mod:`workbench.models._gpt`, the mixture-of-experts layer in
:mod:`workbench.models._moe`.

Shape letters: B batch, T sequence, D d_model, N query heads, K kv heads, H head_dim,
F d_ff.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from workbench._validate import check_float, check_int, check_str
from workbench.models import _attention as attention_impl
from workbench.models import _context as context_parallel
from workbench.models import _fp8 as fp8
from workbench.models import _lora as lora_adapters
from workbench.models._attention import KVCache
from workbench.models._config import GPTConfig, _rope_scaling
from workbench._sharding import tracing
from workbench._sharding.rules import constrain

__all__ = ["MLP", "Attention", "Init", "KVCache", "Normal", "RMSNorm", "Segments", "fan_in_init",
           "param", "rope", "rope_frequencies"]

Init = Callable[..., jax.Array]
#: Packed rows: ``(segment_ids, positions)``, int32 (B, T) each (``workbench.data._packing``).
Segments = tuple[jax.Array, jax.Array]
#: The widest dimension a layer accepts (``RMSNorm(dim)``, ``MLPClassifier`` sizes): far
#: past any model's width, and a refusal instead of a multi-GiB allocation or an overflow.
MAX_DIM = 2**24


def check_layer_args(cfg: object, key: object, where: str) -> None:
    """The arguments of a layer built from a config (``Attention``, ``MLP``, ``Block``)
    checked in its constructor (Python values, before any tracing): ``cfg`` a
    ``GPTConfig``, ``key`` one PRNG key (a typed key, or a legacy raw ``uint32`` key).

    Raises:
      TypeError: naming the argument, its value and what to give instead.
    """
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"{where}: cfg={_brief(cfg)} is a {type(cfg).__name__}; give a "
                        "wb.models.GPTConfig, e.g. GPTConfig.preset('tiny')")
    fix = "give one PRNG key, e.g. key=jax.random.key(0)"
    if not isinstance(key, (jax.Array, np.ndarray)):
        raise TypeError(f"{where}: key={_brief(key)} is a {type(key).__name__}; {fix}")
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise TypeError(f"{where}: key is an array of {key.shape} keys; {fix} "
                            "(one of them: key=keys[i])")
    elif key.dtype != np.uint32 or key.ndim != 1:
        raise TypeError(f"{where}: key is an array of {key.dtype} {key.shape}, not a PRNG "
                        f"key; {fix}")


def check_dtype(value: object, name: str, where: str) -> str:
    """The name of a floating-point dtype (``"float32"``, ``jnp.bfloat16``), or an error
    naming ``name`` and the dtypes that work."""
    from workbench.models._dtypes import FLOAT_DTYPES

    want = f"give one of {', '.join(repr(d) for d in FLOAT_DTYPES)}"
    dt = None
    if value is not None and not isinstance(value, (bool, int, float, complex)):
        try:
            dt = jnp.dtype(value)
        except (TypeError, ValueError, KeyError):
            dt = None
    if dt is None:
        raise TypeError(f"{where}: {name}={_brief(value)} is not a dtype; {want}")
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{where}: {name}={_brief(value)} is not a floating-point dtype; {want}")
    return dt.name


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def param(key: jax.Array | None, init: Init, shape: Sequence[int],
          axes: tuple[str | None, ...], dtype: str) -> nnx.Param:
    """An ``nnx.Param`` annotated with logical axes (never sharded eagerly).

    Sub-modules take explicit PRNG keys: drawing from ``nnx.Rngs`` once per parameter makes
    ``nnx.eval_shape`` of a 70B model quadratic in its size.
    """
    if len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {axes} differ in rank")
    if _deferred(key, init, dtype):   # the sharded init draws it (workbench._param_init)
        return nnx.Param(jax.random.key_data(key) if jax.dtypes.issubdtype(
            key.dtype, jax.dtypes.prng_key) else key, out_sharding=axes,
            eager_sharding=False, draw=(init, tuple(shape)))
    value = init(key, tuple(shape), jnp.dtype(dtype))
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _deferred(key: jax.Array | None, init: Init, dtype: str) -> bool:
    """Whether ``param()`` keeps ``key`` for the sharded init instead of drawing: a float32
    :class:`Normal` from a threefry key while ``TraceContext.defer_draws`` is on."""
    if not (isinstance(init, Normal) and tracing.current().defer_draws) or key is None \
            or jnp.dtype(dtype) != jnp.float32:
        return False
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)) == "threefry2x32" and key.shape == ()
    return key.dtype == np.uint32 and key.shape == (2,)


@dataclasses.dataclass(frozen=True)
class Normal:
    """``stddev`` times a standard normal draw: ``nnx.initializers.normal(stddev)``, bit for
    bit, in a form the sharded init reads (``workbench._param_init`` draws every such
    parameter of a model in one random expansion, with the same values)."""

    stddev: float

    def __call__(self, key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32
                 ) -> jax.Array:
        return jax.random.normal(key, shape, dtype) * jnp.array(self.stddev, dtype)


def fan_in_init(fan_in: int) -> Init:
    return Normal(fan_in ** -0.5)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm with a learned scale (computed in float32)."""

    def __init__(self, dim: int, *, eps: float, dtype: str, param_dtype: str,
                 axis: str = "embed") -> None:
        dim = check_int(dim, "dim", maximum=MAX_DIM, where="RMSNorm: ")
        check_float(eps, "eps", minimum=0.0, where="RMSNorm: ", example="1e-5")
        check_dtype(dtype, "dtype", "RMSNorm")
        check_dtype(param_dtype, "param_dtype", "RMSNorm")
        check_str(axis, "axis", where="RMSNorm: ", example="'embed'")
        self.scale = param(None, nnx.initializers.ones, (dim,), (axis,), param_dtype)
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: tuple[float, float, float, int] | None = None) -> jax.Array:
    """RoPE's inverse frequencies ``theta ** (-2i / head_dim)``, (head_dim / 2,) float32.

    ``scaling``: Llama 3's ``(factor, low_freq_factor, high_freq_factor,
    original_max_position)`` (``GPTConfig.rope_scaling``), as transformers'
    ``_compute_llama3_parameters`` applies it: wavelengths longer than
    ``original_max_position / low_freq_factor`` are stretched by ``factor``, those shorter
    than ``original_max_position / high_freq_factor`` kept, and those between blended
    linearly in ``original_max_position / wavelength``.
    """
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, old = scaling
    wavelen = 2 * math.pi / inv_freq
    stretched = jnp.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return jnp.where(between, blended, stretched)


def rope(x: jax.Array, theta: float, positions: jax.Array | None = None, *,
         scaling: tuple[float, float, float, int] | None = None) -> jax.Array:
    """Rotary position embedding on ``x`` of shape (B, T, heads, H), rotate-half form.

    ``positions`` (T,): the global position of each row (default ``arange(T)``; the
    zig-zag order under context parallelism, :func:`workbench.models._context.positions`);
    or (B, T): each token's position within its document (packed rows). ``scaling``: Llama
    3's RoPE scaling (:func:`rope_frequencies`), None for plain RoPE.
    """
    theta = _check_rope(x, theta, positions)
    if scaling is not None:
        try:
            scaling = _rope_scaling(scaling)
        except (TypeError, ValueError) as e:
            raise type(e)(f"rope: scaling={scaling!r:.60} is not Llama 3's RoPE scaling: {e}"
                          ) from None
    _, t, _, h = x.shape
    pos = jnp.arange(t) if positions is None else positions
    inv_freq = rope_frequencies(h, theta, scaling)                            # (H/2,)
    angles = pos.astype(jnp.float32)[..., None] * inv_freq                  # ([B,] T, H/2)
    if angles.ndim == 2:
        angles = angles[None]                                                # (1, T, H/2)
    sin = jnp.sin(angles)[:, :, None, :]                                     # (B|1, T, 1, H/2)
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)                   # 2 x (B, T, n, H/2)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _check_rope(x: object, theta: object, positions: object) -> Any:
    """``theta``, after checking the arguments of :func:`rope` (on Python values and
    shapes: under ``jit`` at trace time, never in the compiled step); a Python int
    ``theta`` as a float (an int past int64 overflows where JAX converts it)."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"rope: x={_brief(x)} is a {type(x).__name__}; give an array of "
                        "shape (batch, seq, heads, head_dim)")
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope: x has shape {tuple(x.shape)}; x must be (batch, seq, heads, "
                         "head_dim) with an even head_dim")
    if positions is not None:
        t = x.shape[1]
        if not isinstance(positions, (jax.Array, np.ndarray)):
            raise TypeError(f"rope: positions={_brief(positions)} is a "
                            f"{type(positions).__name__}; give None (0..seq-1), an array "
                            f"({t},) or ({x.shape[0]}, {t})")
        if positions.ndim not in (1, 2) or positions.shape[-1] != t:
            raise ValueError(f"rope: positions has shape {tuple(positions.shape)}; x has "
                             f"{t} tokens: give positions of shape ({t},) or "
                             f"({x.shape[0]}, {t})")
    if isinstance(theta, jax.Array):   # traced, or given as an array: checked by JAX
        return theta
    check_float(theta, "theta", positive=True, where="rope: ", example="10000.0")
    return float(theta) if isinstance(theta, (int, np.integer)) else theta


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE."""

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        check_layer_args(cfg, key, "Attention")
        cfg = cfg.resolved()   # dtype "auto": for the platform built for
        d, n, k, h, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q = param(kq, fan_in_init(d), (d, n, h), ("embed", "heads", "head_dim"), pd)
        self.k = param(kk, fan_in_init(d), (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.v = param(kv, fan_in_init(d), (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.o = param(ko, fan_in_init(n * h), (n, h, d), ("heads", "head_dim", "embed"), pd)
        # cfg.lora: adapters on q/k/v/o (their own key: the weights above are unchanged)
        self.lora = lora_adapters.adapters(cfg, lora_adapters.ATTENTION_TARGETS,
                                           jax.random.fold_in(key, 1))
        zeros = nnx.initializers.zeros
        self.bias = nnx.Dict(   # Qwen2: q, k, v biases
            q=param(None, zeros, (n, h), ("heads", "head_dim"), pd),
            k=param(None, zeros, (k, h), ("kv_heads", "head_dim"), pd),
            v=param(None, zeros, (k, h), ("kv_heads", "head_dim"), pd)) if cfg.qkv_bias else None
        norm = {"eps": cfg.norm_eps, "dtype": cfg.dtype, "param_dtype": pd, "axis": "head_dim"}
        self.q_norm = RMSNorm(h, **norm) if cfg.qk_norm else None   # Qwen3: per-head norms
        self.k_norm = RMSNorm(h, **norm) if cfg.qk_norm else None
        self.window = cfg.sliding_window
        self.theta, self.dtype = cfg.rope_theta, cfg.dtype
        self.rope_scaling = cfg.rope_scaling
        self.impl, self.block_sizes = cfg.attention, cfg.attention_block_sizes
        self.context_attention, self.context_zigzag = cfg.context_attention, cfg.context_zigzag
        self.quantization = cfg.quantization

    def __call__(self, x: jax.Array, segments: Segments | None = None,
                 cache: KVCache | None = None) -> Any:
        """``x`` (B, T, D) -> (B, T, D); ``segments``: packed rows' ``(segment_ids,
        positions)`` (B, T) each: attention within each document, RoPE from its start.

        Decode mode: with ``cache`` (this layer's :class:`~workbench.models._attention.KVCache`)
        ``x`` holds the tokens at positions ``cache.pos..cache.pos+T``; their keys and values
        are written into the cache and attention runs against it
        (:func:`~workbench.models._attention.cached_attention`). Returns ``(out, cache)``.
        """
        dt = self.dtype
        self._check_window(x.shape[1] if cache is None else cache.k.shape[1])
        if cache is not None and segments is not None:
            raise ValueError("Attention: packed rows (segments) have no decode mode; give "
                             "segments or cache, not both")
        fp = self.quantization
        q = fp8.einsum("btd,dnh->btnh", x, self.q[...].astype(dt), fp)   # (B, T, N, H)
        k = fp8.einsum("btd,dkh->btkh", x, self.k[...].astype(dt), fp)   # (B, T, K, H)
        v = fp8.einsum("btd,dkh->btkh", x, self.v[...].astype(dt), fp)   # (B, T, K, H)
        if self.lora is not None:                                     # + B(A(x)) each
            q, k, v = (lora_adapters.add(self.lora, t, x, y) for t, y in
                       (("q", q), ("k", k), ("v", v)))
        if self.bias is not None:
            q, k, v = (y + self.bias[n][...].astype(dt) for y, n in ((q, "q"), (k, "k"), (v, "v")))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = checkpoint_name(q, "query_proj")
        k = checkpoint_name(k, "key_proj")
        v = checkpoint_name(v, "value_proj")
        if cache is not None:                       # the positions being written
            pos = cache.pos + jnp.arange(x.shape[1])
        else:                                       # global, or within each document
            pos = context_parallel.positions(x.shape[1], zigzag=self.context_zigzag) \
                if segments is None else segments[1]
        q = constrain(rope(q, self.theta, pos, scaling=self.rope_scaling),
                      ("batch", "seq", "heads", "head_dim"), name="q")
        k = constrain(rope(k, self.theta, pos, scaling=self.rope_scaling),
                      ("batch", "seq", "kv_heads", "head_dim"),
                      name="k")
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"), name="v")
        if cache is not None:
            y, cache = attention_impl.cached_attention(q, k, v, cache)    # (B, T, N, H)
        else:
            y = self._attend(q, k, v, segments)                          # (B, T, N, H)
        y = checkpoint_name(y, "context")
        y = constrain(y, ("batch", "seq", "heads", "head_dim"), name="attn_out")
        out = fp8.einsum("btnh,nhd->btd", y, self.o[...].astype(dt), fp)  # (B, T, D)
        out = lora_adapters.add(self.lora, "o", y, out)
        out = checkpoint_name(out, "out_proj")
        return out if cache is None else (out, cache)

    def _check_window(self, length: int) -> None:
        if self.window is not None and length > self.window:
            raise ValueError(
                f"sequence of {length} tokens is longer than the model's sliding_window="
                f"{self.window}; windowed attention is not implemented here: use sequences "
                f"of at most {self.window} tokens")

    def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
                segments: Segments | None) -> jax.Array:
        """Training-mode attention: context-parallel when the rules shard the sequence,
        else ``cfg.attention``'s implementation."""
        y = None if segments is not None else context_parallel.attend(
            q, k, v, variant=self.context_attention,
            zigzag=self.context_zigzag)                                   # None: seq not sharded
        if y is None:
            y = attention_impl.attend(
                q, k, v, impl=self.impl, block_sizes=self.block_sizes,
                segment_ids=None if segments is None else segments[0])   # (B, T, N, H)
        return y


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        check_layer_args(cfg, key, "MLP")
        cfg = cfg.resolved()   # dtype "auto": for the platform built for
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = param(kg, fan_in_init(d), (d, f), ("embed", "mlp"), pd)
        self.up = param(ku, fan_in_init(d), (d, f), ("embed", "mlp"), pd)
        self.down = param(kd, fan_in_init(f), (f, d), ("mlp", "embed"), pd)
        self.lora = lora_adapters.adapters(cfg, lora_adapters.MLP_TARGETS,
                                           jax.random.fold_in(key, 1))
        self.dtype, self.quantization = cfg.dtype, cfg.quantization

    def __call__(self, x: jax.Array) -> jax.Array:
        dt, fp = self.dtype, self.quantization
        lora = self.lora
        g = fp8.einsum("btd,df->btf", x, self.gate[...].astype(dt), fp)        # (B, T, F)
        u = fp8.einsum("btd,df->btf", x, self.up[...].astype(dt), fp)          # (B, T, F)
        g = checkpoint_name(lora_adapters.add(lora, "gate", x, g), "mlpwi_0")
        u = checkpoint_name(lora_adapters.add(lora, "up", x, u), "mlpwi_1")
        hidden = constrain(jax.nn.silu(g) * u, ("batch", "seq", "mlp"), name="mlp_hidden")
        out = fp8.einsum("btf,fd->btd", hidden, self.down[...].astype(dt), fp)  # (B, T, D)
        out = lora_adapters.add(lora, "down", hidden, out)
        return checkpoint_name(out, "mlpwo")
