"""What a mixture-of-experts layer's config and rules decide before anything is traced.

The mesh axes the experts are split over and the check that they can be
(:func:`check_layout`, called before anything is compiled or written), the slots per expert
of a capacity factor (:func:`capacity`), which grouped matmul runs (:func:`grouped_kernel`)
and in how many slices a large group's experts run under remat (:func:`expert_chunks`).
Pure functions of the config, the rules and sizes: the layer
(:mod:`workbench.models._moe`) asks them while it is traced, and the plan's lints, the
formulas (:mod:`workbench.perf._analytic`) and the step resolver ask them without tracing.
"""
from __future__ import annotations

import math
from typing import Any

from workbench.models._config import GPTConfig, current_platform
from workbench.models._remat import resolve_remat
from workbench._sharding.rules import Rules


def capacity(cfg: GPTConfig, group: int) -> int:
    """Slots per expert for a group of ``group`` tokens: the group itself when dropless
    (``capacity_factor=None``), else ``ceil(capacity_factor * group * k / E)`` (at most
    ``group``: a token picks an expert once)."""
    if cfg.capacity_factor is None:
        return group
    c = math.ceil(cfg.capacity_factor * group * cfg.experts_per_token / cfg.n_experts)
    return max(1, min(group, c))


def expert_axes(rules: Rules) -> tuple[str, ...]:
    """Mesh axes the ``experts`` logical axis is sharded over (empty: unsharded)."""
    return rules.axes("experts")


def check_layout(cfg: GPTConfig, rules: Rules, mesh: Any) -> None:
    """Raise ``ValueError`` if ``rules`` on ``mesh`` cannot run ``cfg``'s experts (called
    before anything is compiled or written).

    Raises:
        ValueError: the experts are not divisible by their mesh axes, or the experts'
            hidden dim is sharded over a mesh axis that also shards the tokens.
    """
    if not cfg.n_experts:
        return
    shape = dict(mesh.shape)
    ea = tuple(a for a in expert_axes(rules) if a in shape)
    n = math.prod(shape[a] for a in ea)
    if cfg.n_experts % n:
        fits = [d for d in range(1, cfg.n_experts + 1) if cfg.n_experts % d == 0]
        raise ValueError(
            f"n_experts={cfg.n_experts} is not divisible by the expert mesh axes {ea} (size "
            f"{n}): each device must hold a whole number of experts. Use an expert axis "
            f"size in {fits}, or n_experts a multiple of {n}")
    tokens = set(rules.axes("batch")) | set(rules.axes("seq"))
    both = sorted(set(rules.axes("expert_mlp")) & tokens)
    if both:
        raise ValueError(
            f"expert_mlp is sharded over mesh axes {both}, which also shard the tokens "
            f"(batch/seq rules); the experts' hidden dim can only be split over an axis "
            f"whose devices hold the same tokens. Map expert_mlp to the model axis or None")


def grouped_kernel(cfg: GPTConfig, platform: str | None = None) -> str:
    """The grouped matmul of ``cfg`` on ``platform`` (default: the one traced for,
    :func:`~workbench.models._config.current_platform`): ``cfg.moe_kernel``, "auto"
    resolving to "megablox" on TPU where d_model and the experts' width are multiples of
    128 (the kernel's lane tiles), and to "ragged_dot" elsewhere.

    On TPU, ``ragged_dot``'s weight gradient (ragged contracting dim) is expanded by XLA
    into a masked dense matmul over every expert, E times its routed FLOPs (libtpu
    0.0.42.1: "fall through to ragged_dot_expander"); megablox's ``tgmm`` computes it
    over the routed rows (docs/performance.md). On GPU and CPU ``ragged_dot`` is XLA's own
    grouped GEMM; megablox there runs in Pallas' interpret mode (tests only: slow)."""
    if cfg.moe_kernel != "auto":
        return cfg.moe_kernel
    if (platform or current_platform()) != "tpu":
        return "ragged_dot"
    # the kernel's blocks are whole (8, 128) tiles or whole dims: an expert of widths that
    # are not multiples of 128 (moe-tiny's 64) is left to ragged_dot
    lanes = all(n % 128 == 0 for n in (cfg.d_model, cfg.moe_d_ff))
    return "megablox" if lanes else "ragged_dot"


#: The most routed rows (k * tokens) one pass of the grouped experts holds when the block's
#: remat recomputes them: a larger group runs in :func:`expert_chunks` slices.
GROUPED_CHUNK_ROWS = 65536


#: The checkpoint names of the expert projections (a remat policy that keeps or offloads one
#: of them keeps what chunks would recompute: such groups run whole).
_EXPERT_NAMES = ("mlpwi_0", "mlpwi_1", "mlpwo")


def expert_chunks(cfg: GPTConfig, group: int) -> int:
    """Slices of a ``group``-token group that the experts run one after another: 1 unless
    the experts are grouped (dropless), the block's remat recomputes them, and the
    ``k * group`` routed rows exceed :data:`GROUPED_CHUNK_ROWS`; then the fewest slices of
    equal size (a divisor of ``group``) with at most that many rows each, or 1 if no
    divisor up to 8 times the fewest needed has them (slices of a few tokens would pad
    every expert's rows to the kernel's tiles).

    Under remat the backward pass recomputes a whole layer, and a group's grouped experts
    hold several ``(k*G, F)`` tensors at once (gate, up, their product, its gradient):
    7.9 GiB each for Mixtral-8x7B at 147,456 tokens per chip. A token's output depends on
    its own routes only, so dropless slices compute exactly the whole group's outputs, and
    under :func:`workbench.models._moe.in_chunks` the backward holds one slice's tensors at
    a time. (Dense experts with a capacity factor run whole: a slice would get its own
    capacity.)
    """
    p = resolve_remat(cfg.remat)
    recomputed = cfg.remat != "none" and not set(_EXPERT_NAMES) & set(p.saved + p.offloaded)
    rows = cfg.experts_per_token * group
    if cfg.moe_matmul_resolved != "grouped" or not recomputed or rows <= GROUPED_CHUNK_ROWS:
        return 1
    need = -(-rows // GROUPED_CHUNK_ROWS)
    return next((c for c in range(need, 8 * need + 1) if group % c == 0), 1)

