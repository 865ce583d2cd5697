"""The floating-point dtype names a model config accepts (GPTConfig's and LoRA's dtypes)."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

#: Dtypes the model computes and stores parameters in (``GPTConfig.dtype``/``param_dtype``).
FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")


def float_dtype(value: Any, name: str) -> str:
    """The name of a floating-point dtype, or an error saying which ones work."""
    if name == "GPTConfig.dtype" and isinstance(value, str) and value == "auto":
        return value
    choices = ("'auto' or " if name == "GPTConfig.dtype" else "") + ", ".join(FLOAT_DTYPES)
    try:
        dt = jnp.dtype(value)
    except TypeError:
        auto = (" ('auto' is for the compute dtype, GPTConfig.dtype: parameters and "
                "optimizer state keep one dtype on every platform)"
                if name == "GPTConfig.param_dtype" and isinstance(value, str)
                and value == "auto" else "")
        raise TypeError(f"{name}={value!r} is not a dtype; use one of {choices}{auto}") \
            from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"{name}={value!r} is not a floating-point dtype: activations, matmuls, gradients "
            f"and parameters need one ({', '.join(FLOAT_DTYPES)}); for half the memory use "
            "'bfloat16'. Integer or 8-bit quantised training is not supported")
    return dt.name
