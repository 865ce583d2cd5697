"""What attention costs by formula: a fused kernel's FLOPs, context parallelism's K/V bytes.

Hand counts the plan uses where the compiler's numbers miss something: XLA's cost analysis
does not look inside a Pallas kernel (:func:`kernel_flops`), and the K/V blocks a device
holds and receives under context parallelism follow from the layout alone
(:func:`kv_bytes_per_device`). The implementations they count are in
:mod:`workbench.models._attention` and :mod:`workbench.models._context`.
"""
from __future__ import annotations

from workbench.models import _attention_choice as attention_choice, _context as context

__all__ = ["kernel_flops", "kv_bytes_per_device"]


def kernel_flops(impl: str, platform: str, *, batch: int, seq: int, n_heads: int,
                 head_dim: int, n_layers: int, block_sizes: tuple[int, int] | None = None,
                 recompute_forward: bool = False) -> float:
    """FLOPs a fused attention kernel runs in one training step, all devices (the
    hardware count, for predictions: XLA's cost analysis does not see inside a Pallas
    kernel). 0 for XLA attention, which the cost analysis counts itself.

    Splash computes only the blocks on or below the causal diagonal: with ``nb = T/block``
    blocks per side, a fraction ``(nb + 1) / (2 nb)`` of the T x T products. Forward: 2
    matmuls (scores, values), ``4·T²·N·H`` per sequence over that fraction; backward
    (separate dq and dkv kernels, as configured here): 7 matmuls (scores and dP again in
    each, dq, dk, dv); ``recompute_forward`` (a remat policy that does not save the
    kernel's output) adds the forward again. cuDNN is counted the same way with an exact
    causal half.
    """
    r = attention_choice.resolve(impl, platform, seq=seq, block_sizes=block_sizes)
    if r.impl == "xla":
        return 0.0
    if r.impl == "splash":
        nb = seq // max(r.block_q, 1)
        frac = (nb + 1) / (2 * nb) if nb else 0.5
        bwd_matmuls = 7
    else:
        frac, bwd_matmuls = 0.5, 5
    per_matmul = 2.0 * seq * seq * n_heads * head_dim * frac * batch * n_layers
    fwd = 2 * per_matmul
    return fwd * (2 if recompute_forward else 1) + bwd_matmuls * per_matmul


def kv_bytes_per_device(*, batch: int, seq: int, n_kv_heads: int, head_dim: int,
                        itemsize: int, size: int, variant: str, batch_shards: int = 1,
                        head_shards: int = 1) -> dict[str, int]:
    """Hand count of the K/V bytes one device holds and receives per layer.

    Returns:
        ``block``: one K/V block (K and V of ``T/n`` positions of the local batch rows and
        kv heads); ``held``: K/V a device holds at once (allgather: the whole sequence;
        ring: its own block and the one in flight); ``received``: K/V bytes that arrive
        per layer in the forward pass ((n - 1) blocks either way); ``received_backward``
        (ring): the backward ring's (n - 1) K/V blocks and n dK/dV blocks (float32
        accumulators: ``block * 4 / itemsize`` each).
    """
    if variant not in context.VARIANTS:
        raise ValueError(f"variant={variant!r}; choose one of {context.VARIANTS}")
    context.check_sequence(seq, size)
    block = 2 * (batch // batch_shards) * (seq // size) * (n_kv_heads // head_shards) \
        * head_dim * itemsize
    held = block * size if variant == "allgather" else 2 * block
    back = (size - 1) * block + size * block * 4 // itemsize if size > 1 else 0
    return {"block": block, "held": held, "received": block * (size - 1),
            "received_backward": back if variant == "ring" else 0}
