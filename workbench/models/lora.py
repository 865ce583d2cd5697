"""LoRA: low-rank adapters on a GPT's projections, trained while the base stays frozen.

``W x`` becomes ``W x + (alpha / rank) * B(A(x))`` for each target projection (Hu et al.
2021, "LoRA", eq. 3; PEFT's ``scaling = lora_alpha / r``). The adapters are Flax NNX's own
``nnx.LoRA`` modules (their parameters are ``nnx.LoRAParam``, a subclass of
``nnx.Param``), so a GPT with adapters is still one ``nnx.Module`` and the train step,
the plan and the checkpoints see ordinary parameters. They live under a ``lora`` entry of
each ``Attention`` / ``MLP``: ``blocks.0.attn.lora.q.lora_a`` (in, rank) and ``lora_b``
(rank, out), where in/out are the projection's input and output features flattened
(q: D -> N*H, o: N*H -> D). ``B = 0`` at init, so a fresh adapter changes nothing.

Sharding: ``A`` (in, rank) names the logical axis of the projection's input dim, ``B``
(rank, out) that of its output dim, and the rank dim none (replicated). Under tensor
parallelism ``B``'s output is then split across the model axis exactly like the frozen
projection's, so ``W x + B(A x)`` adds two equally sharded activations with no
resharding; under FSDP the (small: ``rank * (in + out)`` each) adapters and their
optimizer state are split like everything else and gathered like the base weights.

What trains: :func:`adapter_optimizer` wraps any optax transformation in
``optax.multi_transform`` over the adapters only (the base gets ``optax.set_to_zero``),
so the optimizer state exists for adapter leaves only; the train step
(``workbench.step.make_train_step``) differentiates with respect to the adapters only.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["ADAPTER_KEY", "ATTENTION_TARGETS", "MLP_TARGETS", "PROJECTIONS", "LoRA",
           "ScaledLoRA", "adapter_optimizer", "combine", "is_adapter_path", "merge_params",
           "split_params"]

#: The attention projections an adapter can target (``Attention.q/k/v/o``).
ATTENTION_TARGETS: tuple[str, ...] = ("q", "k", "v", "o")
#: The SwiGLU projections (``MLP.gate/up/down``; dense blocks only).
MLP_TARGETS: tuple[str, ...] = ("gate", "up", "down")
#: Every projection name ``LoRA.targets`` accepts.
PROJECTIONS: tuple[str, ...] = ATTENTION_TARGETS + MLP_TARGETS
#: The attribute of ``Attention`` / ``MLP`` that holds the adapters (and the path part
#: that marks an adapter parameter: ``blocks.0.attn.lora.q.lora_a``).
ADAPTER_KEY = "lora"
#: The PEFT module name of each projection (Llama/Qwen ``*_proj``).
PEFT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

_WHERE = "LoRA: "


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRA:
    """Low-rank adapters for fine-tuning (``TrainConfig(lora=...)``).

    Example::

        wb.TrainConfig(init="Qwen/Qwen3-0.6B", lora={"rank": 16, "alpha": 32})
        wb.TrainConfig(model="tiny", lora=wb.train.LoRA(rank=8, alpha=16,
                                                        targets=("q", "v")))

    Attributes:
      rank: the adapters' rank r (a positive int, at most the smaller feature size of
        every target).
      alpha: the scale numerator: adapters add ``alpha / rank * B(A(x))`` (> 0).
      targets: the projections that get an adapter, a non-empty subset of
        :data:`PROJECTIONS` ("q", "k", "v", "o", "gate", "up", "down").
      dropout: dropout on the adapters' input; only 0.0 (the train step draws no
        dropout keys yet).
      base_dtype: the frozen base's parameter dtype (None: the model's ``param_dtype``,
        float32 by default; "bfloat16" halves the base's memory). The adapters are
        float32 either way.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] = ATTENTION_TARGETS
    dropout: float = 0.0
    base_dtype: str | None = None

    def __post_init__(self) -> None:
        from workbench._validate import check_int

        set_ = object.__setattr__
        set_(self, "rank", check_int(self.rank, "rank", where=_WHERE,
                                     fix="the rank is the adapters' inner size, e.g. 16"))
        set_(self, "alpha", _positive(self.alpha, "alpha", "e.g. alpha=2 * rank"))
        set_(self, "targets", _targets(self.targets))
        d = self.dropout
        if isinstance(d, (bool, np.bool_)) or not isinstance(
                d, (int, float, np.integer, np.floating)) or not math.isfinite(d):
            raise TypeError(f"{_WHERE}dropout={d!r} must be a number; use 0.0")
        if d != 0:
            raise ValueError(f"{_WHERE}dropout={d!r}: adapter dropout is not implemented "
                             "(the train step draws no dropout keys); use dropout=0.0")
        set_(self, "dropout", float(d))
        if self.base_dtype is not None:
            from workbench.models.layers import check_dtype

            set_(self, "base_dtype", check_dtype(self.base_dtype, "base_dtype", "LoRA"))

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``B(A(x))``."""
        return self.alpha / self.rank

    @classmethod
    def of(cls, value: Any) -> LoRA | None:
        """None, a ``LoRA``, or a mapping of its fields (``{"rank": 16, "alpha": 32}``)."""
        if value is None or isinstance(value, LoRA):
            return value
        if isinstance(value, Mapping):
            known = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise ValueError(f"{_WHERE}unknown field(s) {unknown}; known: {known}")
            missing = [k for k in ("rank", "alpha") if k not in value]
            if missing:
                raise ValueError(f"{_WHERE}{missing} missing; give at least rank and alpha, "
                                 "e.g. {'rank': 16, 'alpha': 32}")
            return cls(**dict(value))
        raise TypeError(f"lora={value!r:.80} is a {type(value).__name__}; give None, a "
                        "wb.train.LoRA or a dict like {'rank': 16, 'alpha': 32, 'targets': "
                        "('q', 'k', 'v', 'o')}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (``LoRA.of`` inverts it)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "dropout": self.dropout, "base_dtype": self.base_dtype}

    def replace(self, **changes: Any) -> LoRA:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_model(self, cfg: Any) -> None:
        """Raise unless every target exists in ``cfg``'s blocks and ``rank`` fits its dims.

        Raises:
          ValueError: an MLP target on a mixture-of-experts model (its experts have no
            adapters), or ``rank`` larger than a target's input or output features.
        """
        if getattr(cfg, "n_experts", 0):
            bad = [t for t in self.targets if t in MLP_TARGETS]
            if bad:
                raise ValueError(f"{_WHERE}targets {bad} are MLP projections; this model's "
                                 f"MLPs are mixtures of {cfg.n_experts} experts, which take "
                                 f"no adapters. Use attention targets "
                                 f"{list(ATTENTION_TARGETS)}")
        for t in self.targets:
            fin, fout = features(cfg, t)
            if self.rank > min(fin, fout):
                raise ValueError(
                    f"{_WHERE}rank={self.rank} is larger than projection {t!r} ({fin} -> "
                    f"{fout} features): a rank past min(in, out)={min(fin, fout)} adds "
                    f"nothing a full update would not; use rank <= {min(fin, fout)}")


def _positive(value: Any, name: str, example: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{_WHERE}{name}={value!r:.80} is a {type(value).__name__}; give a "
                        f"positive number, {example}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_WHERE}{name}={value!r} must be a positive finite number, "
                         f"{example}")
    return float(value)


def _targets(value: Any) -> tuple[str, ...]:
    choices = ", ".join(repr(p) for p in PROJECTIONS)
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(t, str) for t in value):
        raise TypeError(f"{_WHERE}targets={value!r:.80} must be a tuple of projection names "
                        f"from {choices}")
    if not value:
        raise ValueError(f"{_WHERE}targets=() is empty; give at least one of {choices}")
    bad = [t for t in value if t not in PROJECTIONS]
    if bad:
        raise ValueError(f"{_WHERE}targets {bad} are not projections of the model; choose "
                         f"from {choices}")
    if len(set(value)) != len(value):
        raise ValueError(f"{_WHERE}targets={tuple(value)!r} names a projection twice")
    return tuple(t for t in PROJECTIONS if t in value)   # canonical order


def features(cfg: Any, target: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of projection ``target`` (flattened heads)."""
    d, f = cfg.d_model, cfg.d_ff
    nh, kh = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": (d, nh), "k": (d, kh), "v": (d, kh), "o": (nh, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}[target]


#: Logical axes of each projection's (input, output) features, as the frozen weight names
#: them (flattened heads take the ``heads`` / ``kv_heads`` axis: contiguous head blocks).
_AXES = {"q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
         "o": ("heads", "embed"), "gate": ("embed", "mlp"), "up": ("embed", "mlp"),
         "down": ("mlp", "embed")}


class ScaledLoRA(nnx.LoRA):
    """``nnx.LoRA`` times ``alpha / rank``: ``scale * (x @ lora_a @ lora_b)``, in the
    model's compute dtype; ``lora_a`` (in, rank), ``lora_b`` (rank, out), float32."""

    def __init__(self, in_features: int, rank: int, out_features: int, *, scale: float,
                 axes: tuple[str, str], dtype: str, key: jax.Array) -> None:
        meta = {"eager_sharding": False}
        super().__init__(in_features, rank, out_features, dtype=jnp.dtype(dtype),
                         param_dtype=jnp.float32, rngs=nnx.Rngs(params=key),
                         a_metadata={"out_sharding": (axes[0], None), **meta},
                         b_metadata={"out_sharding": (None, axes[1]), **meta})
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:                     # (B, T, in)
        return super().__call__(x) * jnp.asarray(self.scale, x.dtype)  # (B, T, out)


def adapters(cfg: Any, group: tuple[str, ...], key: jax.Array) -> nnx.Dict | None:
    """The adapters of one ``Attention`` (``group=ATTENTION_TARGETS``) or ``MLP``, or None
    when ``cfg.lora`` targets none of them. ``key``: their own key (folded from the layer's,
    so the base weights are drawn exactly as without adapters)."""
    lora = getattr(cfg, "lora", None)
    names = [t for t in group if lora is not None and t in lora.targets]
    if not names:
        return None
    keys = jax.random.split(key, len(names))
    return nnx.Dict({t: ScaledLoRA(*_io(cfg, t, lora.rank), scale=lora.scale, axes=_AXES[t],
                                   dtype=cfg.dtype, key=k) for t, k in zip(names, keys)})


def _io(cfg: Any, target: str, rank: int) -> tuple[int, int, int]:
    fin, fout = features(cfg, target)
    return fin, rank, fout


def add(lora: nnx.Dict | None, target: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``y`` (the frozen projection of ``x``) plus adapter ``target``'s ``B(A(x))``, with
    ``x`` (B, T, ...) and ``y`` (B, T, ...) flattened past their first two dims."""
    if lora is None or target not in lora:
        return y
    b, t = x.shape[:2]
    delta = lora[target](x.reshape(b, t, -1))                          # (B, T, out)
    return y + delta.reshape(y.shape).astype(y.dtype)


# ------------------------------------------------------------------ parameter trees
def is_adapter_path(path: Any) -> bool:
    """Whether a parameter path (a JAX key path, a tuple or ``"a.b.c"``) is an adapter's."""
    if isinstance(path, str):
        parts = path.split(".")
    else:
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                 for k in path]
    return ADAPTER_KEY in parts


def split_params(params: Mapping[Any, Any]) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``(base, adapters)``: a pure parameter dict cut in two nested dicts (empty
    branches dropped), :func:`combine` joins them again."""
    base: dict[Any, Any] = {}
    ad: dict[Any, Any] = {}
    for k, v in params.items():
        if k == ADAPTER_KEY:
            ad[k] = v
        elif isinstance(v, Mapping):
            b, a = split_params(v)
            if b:
                base[k] = b
            if a:
                ad[k] = a
        else:
            base[k] = v
    return base, ad


def combine(base: Mapping[Any, Any], adapters_: Mapping[Any, Any]) -> dict[Any, Any]:
    """The inverse of :func:`split_params`: the two nested dicts merged."""
    out = dict(base)
    for k, v in adapters_.items():
        out[k] = combine(out[k], v) if k in out and isinstance(v, Mapping) else v
    return out


def has_adapters(params: Any) -> bool:
    """Whether a pure parameter dict holds adapter parameters."""
    return isinstance(params, Mapping) and bool(split_params(params)[1])


def labels(params: Any) -> Any:
    """``"adapter"`` / ``"frozen"`` per leaf (``optax.multi_transform``'s labels)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: "adapter" if is_adapter_path(p) else "frozen", params)


class _AdapterOnly(tuple):
    """Marks a transformation made by :func:`adapter_optimizer` (so it is never wrapped
    twice)."""


def adapter_optimizer(tx: Any) -> Any:
    """``tx`` applied to the adapters only, the base frozen: optax's own
    ``multi_transform({"adapter": tx, "frozen": set_to_zero()}, labels)``. Its state holds
    ``tx``'s state for the adapter leaves only (``optax.masked`` puts an empty
    ``MaskedNode`` where the base is; ``set_to_zero`` keeps none). Idempotent."""
    import optax

    if getattr(tx, "_workbench_adapter_only", False):
        return tx
    out = optax.multi_transform({"adapter": tx, "frozen": optax.set_to_zero()}, labels)
    return _mark(out)


def _mark(tx: Any) -> Any:
    import optax

    cls = type(tx)
    marked = type(f"AdapterOnly{cls.__name__}", (cls,), {"_workbench_adapter_only": True})
    if issubclass(cls, optax.GradientTransformationExtraArgs):
        return marked(tx.init, tx.update)
    return marked(tx.init, tx.update)


def for_params(tx: Any, params: Any) -> Any:
    """``tx``, or :func:`adapter_optimizer` of it when ``params`` hold adapters."""
    return adapter_optimizer(tx) if has_adapters(params) else tx


# ------------------------------------------------------------------ merging
def delta_weight(adapter_params: Mapping[str, Any], scale: float, shape: tuple[int, ...]
                 ) -> jax.Array:
    """``scale * A @ B`` in float32, reshaped to the frozen weight's ``shape``."""
    a = jnp.asarray(adapter_params["lora_a"], jnp.float32)               # (..., in, r)
    b = jnp.asarray(adapter_params["lora_b"], jnp.float32)               # (..., r, out)
    d = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST) * scale    # (..., in, out)
    return d.reshape(shape)


def merge_params(params: Mapping[Any, Any], lora: LoRA) -> dict[Any, Any]:
    """A pure GPT parameter dict with adapters -> the same model's parameters without
    them: each target weight ``W + alpha/rank * A @ B`` (computed in float32, stored in
    ``W``'s dtype). Works for unrolled and stacked (``scan_layers``) blocks."""
    base, ad = split_params(params)

    def walk(b: Any, a: Any) -> Any:
        if ADAPTER_KEY in a:
            out = dict(b)
            for t, p in a[ADAPTER_KEY].items():
                w = b[t]
                out[t] = (jnp.asarray(w, jnp.float32)
                          + delta_weight(p, lora.scale, w.shape)).astype(w.dtype)
            return out
        return {k: walk(b[k], a[k]) if k in a else b[k] for k in b}

    return walk(base, ad)


def saved_state(state: Any) -> Any:
    """What a LoRA run's checkpoint holds: the ``TrainState`` with its params cut to the
    adapters (the optimizer state holds nothing else); the base is found again from the
    run's ``init`` (recorded in ``run.json``) or its seed."""
    return state._replace(params=split_params(state.params)[1])
