"""FLOPs of a training step: analytic model FLOPs (MaxText convention), 6N, FLOPs counted
in a jaxpr or read from a compiled executable, and MFU.

Convention (MaxText ``calculate_tflops_training_per_device``; PaLM appendix B):
a matmul of (m, k) by (k, n) costs 2·m·k·n FLOPs; training = 3 × forward (backward is
twice the forward); the logits matmul is counted; the embedding lookup costs 0; causal
attention counts half of the T² score and value matmuls; norms, softmax and elementwise
ops are ignored; rematerialisation is *not* counted (these are model FLOPs, not hardware
FLOPs; ``FlopCount.recompute`` says what remat adds). Per layer and per token, with N query
heads, K kv heads, head dim H, width D, MLP width F, sequence T::

    qkv   = 2·D·(N + 2K)·H         out-proj = 2·N·H·D
    mlp   = 2·3·D·F (SwiGLU)       attn     = 4·T·N·H  (× 1/2 if causal)
    logits = 2·D·V (once, after the last layer)

Mixture of experts (``cfg.n_experts``): only the *active* experts count, as in MaxText
(``calculate_routed_and_shared_ffn_tflops_per_device``) and the 6·N_active convention of
Switch Transformer / DeepSeek-V3: per token and layer ``mlp = 2·3·D·Fe·k`` (k routed
experts of width Fe) ``+ 2·3·D·Fe·S`` (S shared experts) ``+ 2·D·E`` (the router);
capacity padding, dropped tokens and the dispatch's gathers are not model FLOPs.
``six_n`` uses ``cfg.n_active_params``. Memory (``wb.plan``) counts every expert.

MFU = model FLOPs / (step time × devices × peak FLOP/s per device).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jax_core

from workbench.models._config import GPTConfig
from workbench.models._remat import remat_label, resolve_remat

__all__ = ["FlopCount", "compiled_cost", "compiled_flops", "dot_flops", "gpt_flops",
           "jaxpr_step_flops", "mfu", "remat_recompute"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlopCount:
    """Model FLOPs of one step, all devices together.

    Attributes:
        total: FLOPs of the step (3 × forward for training).
        forward: FLOPs of one forward pass.
        breakdown: per component (qkv, out_proj, attention, mlp, logits), same scale as total.
        six_n: the 6·N·tokens estimate (N = all parameters; attention excluded).
        tokens: tokens per step (batch × seq).
        causal: whether attention counted half of T².
        formula: the formula, in words.
        recompute: FLOPs that rematerialisation adds to the step (hardware FLOPs, not
            model FLOPs: MFU never counts them); 0 without remat.
        fp8: the part of ``total`` that runs in fp8 (``cfg.quantization="fp8"``: the
            q/k/v, out and MLP projections; attention and the logits stay in the compute
            dtype); 0 otherwise. The roofline times it at the chip's fp8 peak.
    """

    total: float
    forward: float
    breakdown: dict[str, float]
    six_n: float
    tokens: int
    causal: bool
    formula: str
    recompute: float = 0.0
    fp8: float = 0.0

    def __float__(self) -> float:
        return float(self.total)

    def per_token(self) -> float:
        """FLOPs per token."""
        return self.total / self.tokens

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / self.total:.0%}" for k, v in self.breakdown.items())
        return (f"model FLOPs/step {self.total:.4g} ({parts}); 6N·tokens {self.six_n:.4g}; "
                f"{self.formula}")


def gpt_flops(cfg: GPTConfig, batch: int, seq: int | None = None, *, causal: bool = True,
              training: bool = True) -> FlopCount:
    """Analytic FLOPs of a step of ``GPT(cfg)`` on ``batch`` sequences of length ``seq``.

    Example:
        >>> gpt_flops(GPTConfig.preset("tiny"), batch=8, seq=128).total
        956301312.0
    """
    t = int(seq or cfg.seq_len)
    tokens = int(batch) * t
    d, n, k, h, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                        cfg.vocab_size)
    per_token_layer = {
        "qkv": 2 * d * (n + 2 * k) * h,
        "out_proj": 2 * n * h * d,
        "attention": 4 * t * n * h * (0.5 if causal else 1.0),
        "mlp": 2 * 3 * d * f,
    }
    if cfg.n_experts:   # active experts only (module docstring)
        fe = cfg.moe_d_ff
        per_token_layer["mlp"] = 2 * 3 * d * fe * (cfg.experts_per_token
                                                   + cfg.n_shared_experts)
        per_token_layer["router"] = 2 * d * cfg.n_experts
    mult = 3 if training else 1
    breakdown = {name: float(x) * cfg.n_layers * tokens * mult
                 for name, x in per_token_layer.items()}
    breakdown["logits"] = float(2 * d * v) * tokens * mult
    forward = sum(breakdown.values()) / mult
    mlp = "6DFe(k+S) + 2DE (active experts)" if cfg.n_experts else "6DF"
    formula = (f"3 x forward; per token per layer 2D(N+2K)H + 2NHD + {mlp} + 4TNH"
               + ("/2 (causal)" if causal else " (full attention)")
               + "; + 2DV logits; embedding lookup 0")
    # Remat reruns in the backward pass the forward matmuls whose outputs the policy
    # neither saves nor offloads, except the MLP down projection (only its input is
    # needed). remat="full": the whole forward but that matmul; "dots"/"minimal": the
    # attention only (its dots have batch dims; a fused kernel's output is unnamed).
    recompute = remat_recompute(cfg, {k: v / mult for k, v in breakdown.items()}) \
        if training else 0.0
    if recompute:
        what = [f"remat={remat_label(cfg.remat)!r} adds the forward matmuls it does not keep"] \
            if cfg.remat != "none" else []
        if getattr(cfg, "loss_chunks", 1) > 1:
            what.append(f"loss_chunks={cfg.loss_chunks} recomputes the logits")
        formula += f"; {' and '.join(what)} ({recompute / forward:.0%} of the forward)"
    return FlopCount(total=forward * mult, forward=forward, breakdown=breakdown,
                     six_n=6.0 * cfg.n_active_params * tokens, tokens=tokens, causal=causal,
                     formula=formula if training else formula.replace("3 x forward", "forward"),
                     recompute=recompute, fp8=_fp8_flops(cfg, breakdown))


def _fp8_flops(cfg: GPTConfig, breakdown: dict[str, float]) -> float:
    """The FLOPs of ``breakdown`` that ``cfg.quantization`` runs in fp8 (the projections)."""
    if getattr(cfg, "quantization", None) is None:
        return 0.0
    return breakdown["qkv"] + breakdown["out_proj"] + breakdown["mlp"]


_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1",
                "mlpwo")


def remat_recompute(cfg: GPTConfig, forward: dict[str, float]) -> float:
    """Forward FLOPs that ``cfg.remat`` runs again in the backward pass.

    Args:
        cfg: the model (its ``remat`` policy, head counts).
        forward: forward FLOPs by component (``qkv, out_proj, attention, mlp, logits``).
    """
    # loss_chunks: the backward pass recomputes each slice's logits (step.chunked_token_losses)
    logits = forward.get("logits", 0.0) if getattr(cfg, "loss_chunks", 1) > 1 else 0.0
    if cfg.remat == "none":
        return logits
    p = resolve_remat(cfg.remat)
    kept = set(p.saved) | set(p.offloaded)
    if p.offload_dots or p.base == "dots_with_no_batch_dims_saveable":
        kept |= set(_PROJECTIONS)
    n, k = cfg.n_heads, cfg.n_kv_heads
    qkv = (n * ("query_proj" not in kept) + k * ("key_proj" not in kept)
           + k * ("value_proj" not in kept)) / (n + 2 * k)
    return (forward["qkv"] * qkv
            + forward["attention"] * ("context" not in kept)
            + forward["out_proj"] * ("out_proj" not in kept)
            + forward["mlp"] / 3 * (("mlpwi_0" not in kept) + ("mlpwi_1" not in kept))
            + logits)


def jaxpr_step_flops(loss: Callable[[Any, Any], Any], params: Any, batch: Any,
                     n_examples: int) -> FlopCount:
    """Matmul FLOPs of one training step, counted in the jaxpr of ``loss``'s value-and-grad
    (for models without a closed formula).

    Not 3 x forward: the first layer needs no gradient with respect to its input, so a
    small model's backward pass is well under 2 x forward, and the 3 x convention would
    make devices look as if they skipped work (replicated compute factor above 1).

    Args:
        loss: ``(params, batch) -> scalar``.
        params, batch: pytrees of arrays or ShapeDtypeStructs.
        n_examples: examples in ``batch`` (the ``tokens`` of the count).
    """
    fwd = dot_flops(loss, params, batch)
    step = dot_flops(jax.value_and_grad(loss), params, batch)
    n = sum(x.size for x in jax.tree.leaves(params))
    return FlopCount(total=step, forward=fwd, breakdown={"forward": fwd, "backward": step - fwd},
                     six_n=6.0 * n * n_examples, tokens=n_examples, causal=False,
                     formula=(f"forward + backward matmul FLOPs counted in the jaxpr of the "
                              f"loss's value-and-grad ({step / fwd:.2f} x forward; the "
                              f"3 x forward convention would give {3 * fwd:.3g})"))


def dot_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """FLOPs of the matmuls (``dot_general``) in the jaxpr of ``fn(*args)``: 2·∏(batch, free,
    contracted dims). Scans and nested jaxprs are followed; a scan multiplies by its length.

    Used for models without a closed formula: their model FLOPs are 3 × this forward count.
    """
    jaxpr = jax.make_jaxpr(fn)(*args, **kwargs)
    return _jaxpr_dot_flops(jaxpr.jaxpr)


def _jaxpr_dot_flops(jaxpr: Any) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            out = eqn.outvars[0].aval.shape
            contracted = math.prod(lhs[i] for i in lc)
            total += 2.0 * math.prod(out) * contracted
            del rhs, lb
        mult = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in jax_core.jaxprs_in_params(eqn.params):
            total += mult * _jaxpr_dot_flops(sub)
    return total


def compiled_cost(compiled: Any) -> dict[str, float]:
    """``compiled.cost_analysis()`` as one dict per device (``flops``, ``bytes accessed``,
    and on TPU the compiler's own ``optimal_seconds``); empty when the backend has none."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else None
    return {k: float(v) for k, v in (cost or {}).items() if isinstance(v, (int, float))}


def compiled_flops(compiled: Any) -> float | None:
    """FLOPs per device of an AOT-compiled executable (``compiled.cost_analysis()``), or
    None when the backend reports none. Pallas/custom kernels are not counted by XLA."""
    flops = compiled_cost(compiled).get("flops")
    return None if flops is None or flops <= 0 else float(flops)


def mfu(model_flops: float, step_time: float, n_devices: int, peak: float) -> float:
    """Model FLOPs utilisation: ``model_flops / (step_time × n_devices × peak)``.

    Args:
        model_flops: analytic FLOPs of one step, all devices (e.g. ``FlopCount.total``).
        step_time: seconds per step.
        n_devices: devices the step ran on.
        peak: peak FLOP/s of one device.
    """
    if step_time <= 0 or n_devices <= 0 or peak <= 0:
        raise ValueError(f"mfu needs positive step_time, n_devices and peak; got "
                         f"step_time={step_time}, n_devices={n_devices}, peak={peak}")
    return float(model_flops) / (step_time * n_devices * peak)
