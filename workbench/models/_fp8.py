"""fp8 matmuls of the blocks (``GPTConfig.quantization="fp8"``) through qwix's
quantized-training dot_general, as MaxText's ``quantization=fp8_full``.

The forward quantizes both operands to float8_e4m3fn, the backward quantizes the incoming
gradient to float8_e5m2 (both gradient matmuls), each with *current* absmax scaling
computed from the tensor at hand (qwix's default calibration: one scale per row of the
activations and per output channel of the weights, the contracted axes shared). No scale
is state: nothing is added to the parameters, the optimizer state or the checkpoint.

Only the projections call :func:`einsum` (q, k, v, o and the SwiGLU's gate, up, down);
attention's own score and value matmuls, the embedding and the logits stay in the
compute dtype. qwix's model-level entry (``qwix.quantize_model``) intercepts every
``jnp.einsum`` of a module by its path and guesses which operand is the weight; the
layers call the library's QT op by name instead, so exactly these matmuls are fp8.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


@functools.cache
def _qt() -> tuple[Any, Any]:
    """qwix's ``dot_general_qt`` module and MaxText's ``fp8_full`` QtRule (e4m3 weights and
    activations, e5m2 gradients, absmax calibration) as qwix's QtProvider turns it into a
    dot_general config (imported on first use: qwix brings Flax linen and Pallas)."""
    try:
        from qwix._src.core import dot_general_qt
    except ImportError as e:
        raise ImportError(f"GPTConfig.quantization='fp8' runs on qwix, which is not "
                          f"installed ({e}); pip install qwix") from None
    config = dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn,
        lhs_calibration_method="absmax", rhs_calibration_method="absmax",
        dlhs_grad_qtype=jnp.float8_e5m2, drhs_grad_qtype=jnp.float8_e5m2,
        dlhs_grad_calibration_method="absmax", drhs_grad_calibration_method="absmax")
    return dot_general_qt, config


def _dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                 precision: Any = None, preferred_element_type: Any = None,
                 **_: Any) -> jax.Array:
    """jnp.einsum's dot_general, quantized (the output in the operands' dtype)."""
    del precision, preferred_element_type
    qt, config = _qt()
    return qt.dot_general_qt(lhs, rhs, dimension_numbers, config)


def einsum(spec: str, x: jax.Array, w: jax.Array, quantization: str | None) -> jax.Array:
    """``jnp.einsum(spec, x, w)``, in fp8 when ``quantization == "fp8"``.

    Example:
        >>> x, w = jnp.ones((2, 8, 64)), jnp.ones((64, 32))
        >>> einsum("btd,df->btf", x, w, "fp8").shape
        (2, 8, 32)
    """
    if quantization is None:
        return jnp.einsum(spec, x, w)
    with jax.disable_jit():   # as qwix's QtProvider.einsum: the custom dot_general inlined
        return jnp.einsum(spec, x, w, _dot_general=_dot_general)
