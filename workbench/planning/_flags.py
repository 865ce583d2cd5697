"""XLA compile options that overlap collectives with compute, chosen per platform.

FSDP all-gathers every layer's weights before its matmuls and reduce-scatters the
gradients after; run synchronously, each blocks the program. The reference runs (MaxText's
``benchmarks/maxtext_v5p_model_configs.py`` and v6e configs) compile with flags that make
the TPU compiler run them as *async collective fusions* beside independent compute, and
GPU runs enable XLA's latency-hiding scheduler. :func:`compile_options` gives the set for
a platform; ``wb.plan(..., overlap=...)`` and the Trainer pass them to ``jax.jit``
(``compiler_options``), the plan shows them (``Plan.compiler_options``) and its
collectives say which ones the compiled program runs asynchronously
(``Collective.overlapped``).

Every TPU flag here is accepted by libtpu 0.0.42's compiler (an unknown name is an
``INVALID_ARGUMENT: No such compile option`` error: ``tests/test_remat.py`` checks).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["OVERLAP_FLAGS", "RETRY_FLAGS", "compile_options", "retry_options"]

#: Overlap flags by platform (MaxText's LIBTPU_INIT_ARGS for FSDP on v5p/v6e:
#: DATA_PARALLEL_OVERLAP, CF_FOR_ALL_GATHER and CF_FOR_ALL_REDUCE; XLA's GPU
#: latency-hiding scheduler and pipelined collectives).
OVERLAP_FLAGS: dict[str, dict[str, bool]] = {
    "tpu": {
        "xla_tpu_enable_async_collective_fusion": True,
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
        "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
        "xla_tpu_overlap_compute_collective_tc": True,
        "xla_enable_async_all_gather": True,
        "xla_enable_async_collective_permute": True,
        "xla_tpu_enable_data_parallel_all_reduce_opt": True,
        "xla_tpu_data_parallel_opt_different_sized_ops": True,
        # MaxText's CF_FOR_ALL_REDUCE: on large 3D slices the TPU compiler gathers FSDP
        # weights as all-reduces of zero-padded shards, which the all-gather fusion flags
        # above leave synchronous (Llama-2-70B on v5p-512: BENCHMARKS.md, reference rows)
        "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
        "xla_enable_async_all_reduce": True,
    },
    "gpu": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
    },
    "cpu": {},
}


def compile_options(platform: str, overlap: bool | Mapping[str, Any] = True
                    ) -> dict[str, Any]:
    """Compile options for ``platform`` ("tpu", "gpu"/"cuda"/"rocm", "cpu").

    Args:
        platform: the platform compiled for.
        overlap: True: the platform's ``OVERLAP_FLAGS``; False: none (collectives run
            synchronously, the compiler's default); a mapping: exactly these options
            (names are checked by the compiler).
    """
    if isinstance(overlap, Mapping):
        return dict(overlap)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True, False or a dict of XLA compile options, "
                        f"got {overlap!r}")
    key = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    return dict(OVERLAP_FLAGS.get(key, {})) if overlap else {}


#: TPU compiler failures that a compile option avoids: a fragment of the error message ->
#: the options a plan's compile is retried with, once (``measure.compile_step``; the plan
#: then says "compiled with <options> after <error>" and shows them in
#: ``Plan.compiler_options``). Memory space assignment (MSA) places buffers in the
#: on-chip alternate memory (VMEM); a program whose VMEM-pinned buffers outgrow what the
#: scoped-VMEM reservation leaves fails with "requires allocation in the alternate
#: memory, which could not be satisfied". Both options are accepted by libtpu 0.0.42:
#: ``xla_tpu_msa_reduce_scoped_vmem_limit`` lets MSA shrink the scoped reservation, and
#: ``xla_vf_vmem_memory_space_assignment=False`` stops MSA placing its own (optional)
#: buffers in the v5p's VMEM, leaving it to the pinned ones.
RETRY_FLAGS: dict[str, dict[str, Any]] = {
    "requires allocation in the alternate memory": {
        "xla_tpu_msa_reduce_scoped_vmem_limit": True,
        "xla_vf_vmem_memory_space_assignment": False,
    },
}


def retry_options(message: str) -> tuple[str, dict[str, Any]] | None:
    """``(the matched fragment, the options that avoid it)`` for a TPU compiler failure
    ``RETRY_FLAGS`` knows, else None."""
    low = message.lower()
    return next(((frag, dict(opts)) for frag, opts in RETRY_FLAGS.items()
                 if frag.lower() in low), None)
