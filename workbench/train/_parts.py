"""The record of what a Trainer is built from (:class:`Parts`), and the peaks and model FLOPs
its MFU is measured against. :func:`workbench.train._setup.build_parts` makes it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from workbench.data import ShardedBatches


def analytic_flops(model_config: Any, batch: int, seq: int) -> float | None:
    """Model FLOPs of one update (``workbench._flops.gpt_flops``: 3 x forward, no remat)."""
    from workbench._flops import gpt_flops
    from workbench.models._config import GPTConfig

    if not isinstance(model_config, GPTConfig):
        return None
    return gpt_flops(model_config, batch=batch, seq=seq).total


@dataclasses.dataclass
class Parts:
    """Everything a Trainer is built from (computed once per Trainer)."""

    mesh: jax.sharding.Mesh
    rules: Any
    model_config: Any
    tx: Any
    schedule: Any
    graphdef: Any
    abstract_state: Any
    shardings: Any
    batch_shardings: dict[str, Any]
    abstract_batch: dict[str, jax.ShapeDtypeStruct]
    data: ShardedBatches
    initial_data_state: bytes
    eval_data: list[dict[str, Any]]
    model_flops: float | None
    peak: float | None
    peak_source: str | None
    device_kind: str
    n_devices: int
    #: the device's fp8 peak FLOP/s (the catalogue's ``fp8_flops``) for a model with fp8
    #: matmuls (``GPTConfig.quantization``), whose MFU is given against both peaks; else None
    fp8_peak: float | None = None
    #: which attention the step runs and why (``"cudnn: auto: cuDNN flash attention on
    #: GPU"``; "" for a model that is not a wb GPT)
    attention: str = ""
    #: the XLA compile options the step is compiled with (``planning.flags``: the
    #: platform's overlap flags, as plans use)
    compile_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the compute dtype and why (``"bfloat16: auto: bfloat16 on gpu"``: ``dtype="auto"``
    #: resolved for the mesh's platform, as ``model_config.dtype`` holds it; "" for a model
    #: that is not a wb GPT)
    dtype: str = ""
    #: the rules' preset name (None for a table) and where mesh and rules came from
    #: (``workbench._sharding.placement``: given, or the default and why)
    placement: dict[str, Any] = dataclasses.field(default_factory=dict)


def device_fp8_peak(model_config: Any, kind: str) -> float | None:
    """The fp8 peak FLOP/s per device of ``kind`` when ``model_config`` runs fp8 matmuls."""
    from workbench.hardware import hardware_spec

    if getattr(model_config, "quantization", None) is None:
        return None
    spec = hardware_spec(kind)
    return spec.fp8_flops if spec is not None else None

