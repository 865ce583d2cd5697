"""GPTConfig: the frozen description of a decoder-only GPT, with named presets."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from workbench._validate import check_int

#: Rematerialisation policies accepted by ``GPTConfig.remat`` -> jax.checkpoint_policies name.
REMAT_POLICIES: dict[str, str | None] = {
    "none": None,                      # keep every activation
    "full": "nothing_saveable",        # recompute the whole block in the backward pass
    "dots": "dots_with_no_batch_dims_saveable",  # keep matmul outputs, recompute the rest
}


#: Dtypes the model computes and stores parameters in (``GPTConfig.dtype``/``param_dtype``).
FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")


def _float_dtype(value: Any, name: str) -> str:
    """The name of a floating-point dtype, or an error saying which ones work."""
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} is not a dtype; use one of "
                        f"{', '.join(FLOAT_DTYPES)}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"{name}={value!r} is not a floating-point dtype: activations, matmuls, gradients "
            f"and parameters need one ({', '.join(FLOAT_DTYPES)}); for half the memory use "
            "'bfloat16'. Integer or 8-bit quantised training is not supported")
    return dt.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A Llama-style decoder-only transformer.

    Every size is a positive ``int`` (not a bool, a string or a float: ``d_model="64"``
    or ``64.5`` is refused with the fix), checked when the config is made.

    Attributes:
        vocab_size: number of token ids.
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention; divides ``n_heads``).
        head_dim: width of one head.
        d_ff: hidden width of the SwiGLU MLP.
        seq_len: training sequence length (RoPE works for any length).
        dtype: compute dtype of activations and matmuls: a floating-point dtype (one of
            ``FLOAT_DTYPES``; stored as its name, e.g. "bfloat16").
        param_dtype: storage dtype of parameters (a floating-point dtype, as ``dtype``).
        tie_embeddings: reuse the embedding table as the output projection.
        remat: rematerialisation policy per block: "none", "dots" or "full" (the same per
            scanned block with ``scan_layers``).
        scan_layers: hold the blocks as one stacked module (each parameter gets a leading
            ``"layers"`` axis of size ``n_layers``; paths ``blocks.attn.q`` instead of
            ``blocks.0.attn.q``) and apply them with ``jax.lax.scan``, so XLA compiles one block
            body instead of ``n_layers`` copies: compile time several times shorter for deep
            models (MaxText's ``scan_layers``). Same initial weights, logits and gradients
            as the unrolled model; ``workbench.models.gpt.stack_blocks`` / ``unstack_blocks``
            convert parameter dicts between the two layouts. Rules map ``"layers"`` to None
            (every device holds all layers of its shard). The compiled step can need more
            temporary memory than the unrolled one (XLA schedules inside a loop body less
            freely): compare ``wb.plan`` of both.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    seq_len: int
    dtype: str = "float32"
    param_dtype: str = "float32"
    tie_embeddings: bool = False
    remat: str = "none"
    scan_layers: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "d_ff", "seq_len"):
            set_(self, f, check_int(getattr(self, f), f"GPTConfig.{f}"))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                f"grouped-query attention shares each kv head among n_heads/n_kv_heads heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        for f in ("tie_embeddings", "scan_layers"):
            if not isinstance(getattr(self, f), (bool, np.bool_)):
                raise TypeError(f"GPTConfig.{f}={getattr(self, f)!r} must be True or False")
            set_(self, f, bool(getattr(self, f)))
        if not isinstance(self.remat, str) or self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; choose one of {sorted(REMAT_POLICIES)}")
        for f in ("rope_theta", "norm_eps"):
            value = getattr(self, f)
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                    value, (int, float, np.integer, np.floating)) or not 0 < value < math.inf:
                raise ValueError(f"GPTConfig.{f}={value!r} must be a positive finite number")
        for f in ("dtype", "param_dtype"):
            set_(self, f, _float_dtype(getattr(self, f), f"GPTConfig.{f}"))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration: tiny, small, 1b, 7b or 70b (then ``overrides``).

        - ``tiny``: byte-level, 2 layers of width 64; trains on CPU in seconds.
        - ``small``: GPT-2-small class (~124M parameters: 12 layers, width 768, GPT-2 vocab
          padded to 50304 as in nanoGPT, tied embeddings).
        - ``1b``: Llama 3.2 1B (Meta, ``config.json`` of meta-llama/Llama-3.2-1B).
        - ``7b``: Llama 2 7B (Touvron et al. 2023, Table 1 / ``params.json``).
        - ``70b``: Llama 3 70B (Meta, ``config.json`` of meta-llama/Meta-Llama-3-70B).
        """
        try:
            base = _PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown GPT preset {name!r}; choose one of {sorted(_PRESETS)}") from None
        return dataclasses.replace(base, **overrides)

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of the fields."""
        return dataclasses.asdict(self)

    @property
    def n_params(self) -> int:
        """Parameter count (embeddings included)."""
        d, f, h, k, hd = self.d_model, self.d_ff, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * k * hd * 2        # q, o + k, v
        block = attn + 3 * d * f + 2 * d               # + SwiGLU + two norms
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * block + d + head


_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=16, d_ff=256, seq_len=128),
    "small": GPTConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                       head_dim=64, d_ff=2048, seq_len=1024, tie_embeddings=True),
    "1b": GPTConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                    head_dim=64, d_ff=8192, seq_len=2048, dtype="bfloat16",
                    tie_embeddings=True, rope_theta=500000.0),
    "7b": GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                    head_dim=128, d_ff=11008, seq_len=4096, dtype="bfloat16"),
    "70b": GPTConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                     head_dim=128, d_ff=28672, seq_len=8192, dtype="bfloat16",
                     rope_theta=500000.0),
}

PRESETS: tuple[str, ...] = tuple(_PRESETS)
