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
(``workbench._step.make_train_step``) differentiates with respect to the adapters only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from workbench.models._lora_spec import (
    ATTENTION_TARGETS,
    MLP_TARGETS,
    PROJECTIONS,
    LoRA,
)
from workbench.models._lora_spec import (
    lora_features as features,
)

__all__ = ["ADAPTER_KEY", "ATTENTION_TARGETS", "MLP_TARGETS", "PROJECTIONS", "LoRA",
           "ScaledLoRA", "adapter_optimizer", "combine", "is_adapter_path", "merge_params",
           "split_params"]

#: The attribute of ``Attention`` / ``MLP`` that holds the adapters (and the path part
#: that marks an adapter parameter: ``blocks.0.attn.lora.q.lora_a``).
ADAPTER_KEY = "lora"
#: The PEFT module name of each projection (Llama/Qwen ``*_proj``).
PEFT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

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
