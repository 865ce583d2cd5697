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

Every TPU flag here is accepted by the installed libtpu's compiler (an unknown name is an
``INVALID_ARGUMENT: No such compile option`` error: ``tests/test_remat.py`` checks).

Continuation fusion (MaxText's CF_FOR_ALL_GATHER / CF_FOR_ALL_REDUCE: the async collective
fusion flags) is v5e's alone since libtpu 0.0.50: on v5p, v6e and Ironwood that compiler
refuses it ("FAILED_PRECONDITION: Continuation fusion for AllGather is enabled on platform
viperfish ... not supported/recommended on platforms other than TPU v5e"), so those
generations get the flags without it (``TPU_CF_GENERATIONS``). Measured with libtpu 0.0.50.1
(``small`` fsdp, 32 x 1024): v6e-8 and tpu7x-8 run 425 of 596 collectives asynchronously with
or without these flags (the compiler's default overlaps them); on v5p-8 no set tried
(continuation fusion refused, async all-gather/all-reduce, SparseCore offload) ran any
asynchronously (0 of 209), so v5p plans now count their collectives in full.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["OVERLAP_FLAGS", "RETRY_FLAGS", "TPU_CF_GENERATIONS", "compile_options",
           "retry_options"]

#: The TPU generations (catalogue names) the compiler runs continuation fusion on.
TPU_CF_GENERATIONS = frozenset({"v5e"})
#: The flags of continuation fusion (in ``OVERLAP_FLAGS["tpu"]``), left out elsewhere.
_CF_FLAGS = ("xla_tpu_enable_async_collective_fusion",
             "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
             "xla_tpu_enable_async_collective_fusion_multiple_steps",
             "xla_tpu_enable_async_collective_fusion_fuse_all_reduce")

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


def compile_options(platform: str, overlap: bool | Mapping[str, Any] = True, *,
                    device: str | None = None) -> dict[str, Any]:
    """Compile options for ``platform`` ("tpu", "gpu"/"cuda"/"rocm", "cpu").

    Args:
        platform: the platform compiled for.
        overlap: True: the platform's ``OVERLAP_FLAGS`` (on a TPU generation outside
            ``TPU_CF_GENERATIONS``, without continuation fusion); False: none; a mapping:
            exactly these options (names are checked by the compiler).
        device: what is compiled for: a preset ("v5p-256"), a generation ("tpu7x") or a
            JAX device kind ("TPU v5 lite"); None: every flag (v5e's set).
    """
    if isinstance(overlap, Mapping):
        return dict(overlap)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True, False or a dict of XLA compile options, "
                        f"got {overlap!r}")
    key = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    if not overlap:
        return {}
    flags = dict(OVERLAP_FLAGS.get(key, {}))
    if key == "tpu" and device is not None and _generation(device) not in TPU_CF_GENERATIONS:
        flags = {k: v for k, v in flags.items() if k not in _CF_FLAGS}
    return flags


def _generation(device: str) -> str | None:
    """The catalogue name of a preset, generation or JAX device kind (None: unknown)."""
    from workbench.hardware import _catalogue as catalogue

    gen = catalogue.generation(device)
    if gen is None:
        gen = next((g for g in catalogue.GENERATIONS
                    if re.search(g.pattern, device.lower().strip())), None)
    return gen.name if gen is not None else None


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
