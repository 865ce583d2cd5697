"""GPTConfig: the frozen description of a decoder-only GPT, with named presets.

One class, one file: ``GPTConfig``'s fields, their documentation (most of the file) and
checks, and the presets are one frozen description; LoRA's is ``_lora_spec``, the dtype
names ``_dtypes``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from workbench._validate import check_float, check_int
from workbench.models._dtypes import float_dtype
from workbench.models._lora_spec import LoRA
from workbench.models._remat import check_remat, remat_json

#: Values of ``GPTConfig.attention`` (:mod:`workbench.models._attention` implements them).
ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("xla", "splash", "cudnn", "auto")
#: Values of ``GPTConfig.context_attention`` (:mod:`workbench.models._context`).
CONTEXT_VARIANTS: tuple[str, ...] = ("allgather", "ring")
#: Values of ``GPTConfig.moe_dispatch`` (:mod:`workbench.models._moe`).
MOE_DISPATCH: tuple[str, ...] = ("all_to_all", "all_gather")
#: Values of ``GPTConfig.moe_matmul`` (:mod:`workbench.models._moe`).
MOE_MATMUL: tuple[str, ...] = ("auto", "grouped", "dense")
#: Values of ``GPTConfig.moe_kernel`` (:func:`workbench.models._moe_choice.grouped_kernel`).
MOE_KERNEL: tuple[str, ...] = ("auto", "megablox", "ragged_dot")
#: Values of ``GPTConfig.quantization`` besides None (:mod:`workbench.models._fp8`).
QUANTIZATIONS: tuple[str, ...] = ("fp8",)
#: ``GPTConfig.experts_per_token`` by default: the one value a dense config
#: (``n_experts=0``) takes, since it routes to no experts.
DEFAULT_TOP_K = 2


#: ``GPTConfig.dtype="auto"`` per platform: bfloat16 where the matrix units run it at full
#: rate (TPU MXUs, GPU tensor cores: float32 matmuls run several times slower there, or
#: through TF32 passes); float32 elsewhere (CPU has no bfloat16 matmul units, and the
#: CPU numbers stay as they were). Parameters and optimizer state keep ``param_dtype``.
AUTO_DTYPES: dict[str, str] = {"tpu": "bfloat16", "gpu": "bfloat16", "cuda": "bfloat16",
                               "rocm": "bfloat16"}


def resolve_dtype(dtype: str, platform: str) -> tuple[str, str]:
    """``(compute dtype, why)`` of ``GPTConfig.dtype`` on ``platform``: "auto" becomes
    :data:`AUTO_DTYPES`' entry (float32 on a platform not listed), a dtype stays itself.

    Example:
        >>> resolve_dtype("auto", "gpu")
        ('bfloat16', 'auto: bfloat16 on gpu')
    """
    if dtype != "auto":
        return dtype, f"{dtype} as configured"
    dt = AUTO_DTYPES.get(platform, "float32")
    return dt, f"auto: {dt} on {platform}"


def _rope_scaling(value: Any) -> tuple[float, float, float, int] | None:
    """``GPTConfig.rope_scaling`` checked: None, or Llama 3's ``(factor, low_freq_factor,
    high_freq_factor, original_max_position)`` as a tuple (a list from JSON accepted)."""
    if value is None:
        return None
    fix = ("give None (plain RoPE) or Llama 3's (factor, low_freq_factor, high_freq_factor, "
           "original_max_position), e.g. (32.0, 1.0, 4.0, 8192)")
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (tuple, list)) or \
            len(value) != 4:
        raise TypeError(f"GPTConfig.rope_scaling={value!r:.80} is not four numbers; {fix}")
    factor, low, high = (check_float(v, n, positive=True, where="GPTConfig.rope_scaling: ")
                         for v, n in zip(value[:3], ("factor", "low_freq_factor",
                                                     "high_freq_factor"), strict=True))
    old = check_int(value[3], "GPTConfig.rope_scaling original_max_position")
    if not high > low:
        raise ValueError(f"GPTConfig.rope_scaling={tuple(value)!r}: high_freq_factor={high} "
                         f"must be larger than low_freq_factor={low}; {fix}")
    return (float(factor), float(low), float(high), old)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A Llama-style decoder-only transformer.

    Every size is a positive ``int`` (not a bool, a string or a float: ``d_model="64"``
    or ``64.5`` is refused with the fix), checked when the config is made.

    Attributes:
        vocab_size: number of token ids.
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention; divides ``n_heads``).
        head_dim: width of one head.
        d_ff: hidden width of the SwiGLU MLP.
        seq_len: training sequence length (RoPE works for any length).
        dtype: compute dtype of activations and matmuls: "auto" (the default: bfloat16
            on GPU and TPU, float32 on CPU; :data:`AUTO_DTYPES`, resolved for the platform
            the step runs or is planned for, an abstract TPU slice's included: plans,
            ``run.json`` and the Trainer's compile line say which and why) or a
            floating-point dtype (one of ``FLOAT_DTYPES``; stored as its name, e.g.
            "bfloat16"), used as given on every platform. :meth:`resolved` gives the
            concrete config; a ``GPT`` built from an "auto" config resolves it for the
            platform it is built for (the active rules' mesh, else JAX's default backend).
        param_dtype: storage dtype of parameters (a floating-point dtype, as ``dtype``;
            not "auto"): the master weights, and the optimizer state kept in their dtype.
            Default float32, also when ``dtype`` is bfloat16 (mixed precision: each
            matmul casts its weight to ``dtype``).
        tie_embeddings: reuse the embedding table as the output projection.
        remat: rematerialisation policy per block: a key of ``REMAT_POLICIES``, "none",
            "full", "dots"/"minimal", named policies that keep chosen projections
            ("save_qkv_proj", "save_dot_except_mlp", "save_dot_except_mlpwi",
            "minimal_flash") and, on TPU, ones that offload them to host memory
            ("qkv_proj_offloaded", "minimal_offloaded", "qkv_input_offloaded",
            "qkvo_input_offloaded"), or a custom policy tensor by tensor, as MaxText's
            Ironwood recipes set it: ``{"save": [...], "offload": [...]}`` of checkpoint names
            (``workbench.models._remat.CHECKPOINT_NAMES``), the rest recomputed. The same per
            scanned block with ``scan_layers``.
        attention: "auto" (the default: the Pallas splash kernel on TPU, cuDNN flash
            attention on GPU, XLA attention on CPU, and XLA attention wherever the fused
            kernel cannot take the shapes or the layout; plans and runs say which ran and
            why), "xla" (the T x T scores materialized), "splash" (Pallas TPU kernel;
            interpret mode on CPU) or "cudnn" (GPU); see :mod:`workbench.models._attention`.
            A fused kernel never holds the T x T scores (docs/performance.md).
        attention_block_sizes: splash ``(block_q, block_kv)`` tile sizes, dividing the
            sequence length (default ``min(512, seq)`` each).
        context_attention: attention when the rules shard ``seq`` over a mesh axis
            (context parallelism, rules presets ``cp`` / ``fsdp_cp``): "allgather" (gather
            K/V along the sequence) or "ring" (K/V blocks passed around the ring by
            collective permutes, causal blocks skipped); see
            :mod:`workbench.models._context`. Ignored when ``seq`` is not sharded.
        context_zigzag: under context parallelism, hold the sequence in zig-zag order
            (shard ``i`` gets chunks ``i`` and ``2n-1-i`` of ``2n``) so causal attention
            work is equal on every device; the sequence must divide into ``2n`` chunks.
        scan_layers: hold the blocks as one stacked module (each parameter gets a leading
            ``"layers"`` axis of size ``n_layers``; paths ``blocks.attn.q`` instead of
            ``blocks.0.attn.q``) and apply them with ``jax.lax.scan``, so XLA compiles one block
            body instead of ``n_layers`` copies: compile time several times shorter for deep
            models (MaxText's ``scan_layers``). Same initial weights, logits and gradients
            as the unrolled model; ``workbench.models._gpt.stack_blocks`` / ``unstack_blocks``
            convert parameter dicts between the two layouts. Rules map ``"layers"`` to None
            (every device holds all layers of its shard). The compiled step can need more
            temporary memory than the unrolled one (XLA schedules inside a loop body less
            freely): compare ``wb.plan`` of both. Default False; the presets above
            "small" (1b, 7b, 70b, moe-small and the public MoE shapes) set True (tiny,
            small and moe-tiny stay unrolled): pass ``scan_layers=False`` to
            :meth:`preset` for their unrolled form (paths ``blocks.0...``).
        rope_theta: RoPE base frequency.
        rope_scaling: None (plain RoPE), or Llama 3's RoPE scaling as four numbers
            ``(factor, low_freq_factor, high_freq_factor, original_max_position)``
            (``config.json``'s ``rope_scaling`` with ``rope_type: "llama3"``, e.g.
            Llama 3.1 / 3.2: ``(32.0, 1.0, 4.0, 8192)``): the low frequencies are divided
            by ``factor``, the high ones kept, those between blended
            (:func:`workbench.models._layers.rope_frequencies`).
        norm_eps: RMSNorm epsilon.
        n_experts: routed experts per MoE block (0: a dense SwiGLU MLP in every block);
            :mod:`workbench.models._moe`.
        experts_per_token: experts each token is routed to (top-k, <= ``n_experts``).
        expert_d_ff: hidden width of one expert (0: ``d_ff``).
        n_shared_experts: always-on shared experts (DeepSeekMoE / Qwen-MoE), one dense
            SwiGLU of width ``n_shared_experts * expert_d_ff`` added to the routed output.
        capacity_factor: slots per expert and group as a multiple of the balanced share
            ``group * k / n_experts`` (assignments past it are dropped); None: dropless
            (room for every token of the group).
        router_aux_loss: weight of the load-balance loss (Switch Transformer) in the loss.
        router_z_loss: weight of the router z-loss (ST-MoE) in the loss.
        router_norm_topk: renormalise the k routing weights to sum to 1 (Mixtral, Qwen3).
        moe_dispatch: "all_to_all" or "all_gather" token dispatch over the expert axis.
        moe_matmul: how the routed experts compute: "grouped" (the assignments sorted by
            expert, one ``jax.lax.ragged_dot`` per projection over exactly the routed
            rows: no padding, dropless; refused with a ``capacity_factor``), "dense"
            (each expert's ``(capacity, D)`` buffer of slots, empty ones included: with
            ``capacity_factor=None`` every expert has a slot for every token of its
            group, ``E/k`` times the routed work) or "auto" (the default): "grouped" when
            ``capacity_factor`` is None, "dense" otherwise, so configs with a capacity
            factor keep their behaviour. :attr:`moe_matmul_resolved` says which runs.
        moe_kernel: the grouped matmul's kernel: "megablox" (the Pallas ``gmm``, its weight
            gradient its own ``tgmm`` over the routed rows; interpret mode off TPU: slow,
            for tests), "ragged_dot" (``jax.lax.ragged_dot``; on TPU its weight gradient
            is expanded over every expert) or "auto" (the default): "megablox" on TPU,
            "ragged_dot" on GPU and CPU. Only with grouped matmuls.
        qkv_bias: learned biases on the q, k and v projections (Qwen2, Qwen1.5/2-MoE).
        qk_norm: an RMSNorm over ``head_dim`` on each query and key head before RoPE
            (Qwen3, Qwen3-MoE).
        shared_expert_gate: scale the shared experts' output by ``sigmoid(x @ w)`` with a
            learned ``w`` (D,) (Qwen1.5/2-MoE).
        sliding_window: attention window of the imported model (Mistral's
            ``sliding_window``), or None; sequences longer than it are refused (this
            workbench attends causally over the whole sequence, which equals windowed
            attention up to the window's length).
        loss_chunks: compute the output projection and the cross-entropy over this many
            slices of the sequence, one at a time, recomputing each slice's logits in the
            backward pass (``workbench._step.chunked_token_losses``; MaxText's vocabulary
            tiling): the float32 logits take ``1/loss_chunks`` of the memory for one extra
            logits matmul. Must divide the training sequence length. Default 1 (whole).
        lora: None, or low-rank adapters on the blocks' projections
            (``workbench.models._lora.LoRA``, or a dict of its fields): ``TrainConfig(lora=
            ...)`` sets it; the train step then trains the adapters only.
        quantization: None (every matmul in ``dtype``) or "fp8": the blocks' projections
            (q, k, v, o, gate, up, down) run in fp8 through qwix, as MaxText's
            ``quantization=fp8_full``: e4m3 operands forward, e5m2 gradients backward,
            current absmax scales (no scale state; :mod:`workbench.models._fp8`).
            Attention's score and value matmuls, the embedding and the logits stay in
            ``dtype``. Dense models without LoRA only (refused with the fix otherwise).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    seq_len: int
    dtype: str = "auto"
    param_dtype: str = "float32"
    tie_embeddings: bool = False
    remat: Any = "none"
    attention: str = "auto"
    attention_block_sizes: tuple[int, int] | None = None
    context_attention: str = "allgather"
    context_zigzag: bool = False
    scan_layers: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0
    experts_per_token: int = DEFAULT_TOP_K
    expert_d_ff: int = 0
    n_shared_experts: int = 0
    capacity_factor: float | None = None
    router_aux_loss: float = 0.01
    router_z_loss: float = 0.001
    router_norm_topk: bool = True
    moe_dispatch: str = "all_to_all"
    moe_matmul: str = "auto"
    moe_kernel: str = "auto"
    loss_chunks: int = 1
    qkv_bias: bool = False
    qk_norm: bool = False
    shared_expert_gate: bool = False
    sliding_window: int | None = None
    lora: Any = None
    rope_scaling: tuple[float, float, float, int] | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "lora", LoRA.of(self.lora))
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "d_ff", "seq_len"):
            set_(self, f, check_int(getattr(self, f), f"GPTConfig.{f}"))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                f"grouped-query attention shares each kv head among n_heads/n_kv_heads heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        for f in ("tie_embeddings", "scan_layers", "qkv_bias", "qk_norm", "shared_expert_gate",
                  "router_norm_topk"):
            if not isinstance(getattr(self, f), (bool, np.bool_)):
                raise TypeError(f"GPTConfig.{f}={getattr(self, f)!r} must be True or False")
            set_(self, f, bool(getattr(self, f)))
        set_(self, "remat", check_remat(self.remat))
        for f in ("rope_theta", "norm_eps"):
            value = getattr(self, f)
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                    value, (int, float, np.integer, np.floating)) or not 0 < value < math.inf:
                raise ValueError(f"GPTConfig.{f}={value!r} must be a positive finite number")
        for f in ("dtype", "param_dtype"):
            set_(self, f, float_dtype(getattr(self, f), f"GPTConfig.{f}"))
        self._check_attention()
        object.__setattr__(self, "loss_chunks", check_int(self.loss_chunks,
                                                          "GPTConfig.loss_chunks"))
        if self.sliding_window is not None:
            set_(self, "sliding_window", check_int(self.sliding_window,
                                                   "GPTConfig.sliding_window"))
        self._check_moe()
        set_(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        if self.lora is not None:
            self.lora.check_model(self)
        self._check_quantization()

    def _check_attention(self) -> None:
        """``attention``, ``context_attention``, ``context_zigzag`` and
        ``attention_block_sizes`` (made a tuple) are values the attention runs."""
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention={self.attention!r}; choose one of "
                             f"{ATTENTION_IMPLEMENTATIONS}")
        if self.context_attention not in CONTEXT_VARIANTS:
            raise ValueError(f"context_attention={self.context_attention!r}; choose one of "
                             f"{CONTEXT_VARIANTS}")
        if not isinstance(self.context_zigzag, bool):
            raise TypeError(f"context_zigzag must be True or False, got "
                            f"{self.context_zigzag!r}")
        if self.attention_block_sizes is not None:
            bs = tuple(self.attention_block_sizes) if isinstance(
                self.attention_block_sizes, (tuple, list)) else (self.attention_block_sizes,)
            if len(bs) != 2 or not all(isinstance(b, int) and not isinstance(b, bool)
                                       and b > 0 for b in bs):
                raise ValueError(f"attention_block_sizes={self.attention_block_sizes!r} must "
                                 "be two positive ints (block_q, block_kv), e.g. (128, 128)")
            object.__setattr__(self, "attention_block_sizes", bs)

    def _check_quantization(self) -> None:
        """``quantization`` None or one of :data:`QUANTIZATIONS`, on a model it runs on."""
        q = self.quantization
        if q is None:
            return
        choose = f"choose None (matmuls in dtype) or one of {list(QUANTIZATIONS)}"
        if not isinstance(q, str):
            raise TypeError(f"GPTConfig.quantization={q!r:.80} is a {type(q).__name__}; "
                            f"{choose}")
        if q not in QUANTIZATIONS:
            raise ValueError(f"GPTConfig.quantization={q!r:.80}; {choose}")
        if self.n_experts:
            raise ValueError(
                f"GPTConfig.quantization={q!r} with n_experts={self.n_experts}: the experts' "
                "grouped and dense matmuls have no fp8 path yet; set quantization=None for "
                "a mixture of experts, or n_experts=0 for a dense model in fp8")
        if self.lora is not None:
            raise ValueError(
                f"GPTConfig.quantization={q!r} with lora={self.lora.to_dict()}: fp8 here is "
                "quantized training of the full weights, not a frozen quantized base; set "
                "quantization=None to train adapters, or lora=None to train in fp8")

    def _check_moe(self) -> None:
        """Validate the mixture-of-experts fields (before anything is built), whatever the
        model: a dense config's MoE fields are checked too, never ignored in silence."""
        for f in ("n_experts", "expert_d_ff", "n_shared_experts"):
            object.__setattr__(self, f, check_int(getattr(self, f), f"GPTConfig.{f}", minimum=0))
        object.__setattr__(self, "experts_per_token", check_int(
            self.experts_per_token, "GPTConfig.experts_per_token", minimum=1))
        if self.capacity_factor is not None:
            object.__setattr__(self, "capacity_factor", check_float(
                self.capacity_factor, "GPTConfig.capacity_factor", positive=True,
                example="1.25 slots per expert as a multiple of its balanced share; None "
                        "for dropless routing"))
        for f in ("router_aux_loss", "router_z_loss"):
            object.__setattr__(self, f, check_float(getattr(self, f), f"GPTConfig.{f}",
                                                    minimum=0.0, example="0.01"))
        if not isinstance(self.moe_dispatch, str) or self.moe_dispatch not in MOE_DISPATCH:
            raise ValueError(f"GPTConfig.moe_dispatch={self.moe_dispatch!r}; choose one of "
                             f"{MOE_DISPATCH}")
        if not isinstance(self.moe_matmul, str) or self.moe_matmul not in MOE_MATMUL:
            raise ValueError(f"GPTConfig.moe_matmul={self.moe_matmul!r}; choose one of "
                             f"{MOE_MATMUL}")
        if self.moe_matmul == "grouped" and self.capacity_factor is not None:
            raise ValueError(
                f"moe_matmul='grouped' is dropless (every routed token is computed, no "
                f"capacity), but capacity_factor={self.capacity_factor}; set "
                f"capacity_factor=None, or moe_matmul='dense' to drop past the capacity")
        if not isinstance(self.moe_kernel, str) or self.moe_kernel not in MOE_KERNEL:
            raise ValueError(f"GPTConfig.moe_kernel={self.moe_kernel!r}; choose one of "
                             f"{MOE_KERNEL}")
        if self.moe_kernel != "auto" and self.moe_matmul_resolved != "grouped":
            raise ValueError(
                f"moe_kernel={self.moe_kernel!r} is a grouped matmul's kernel, but the "
                f"experts run dense buffers (moe_matmul={self.moe_matmul!r}, "
                f"capacity_factor={self.capacity_factor}); set moe_matmul='grouped' and "
                f"capacity_factor=None, or moe_kernel='auto'")
        self._check_top_k()

    def _check_top_k(self) -> None:
        """``experts_per_token`` within ``1..n_experts``; a dense config (``n_experts=0``)
        routes nothing, so it keeps the field's default."""
        k, default = self.experts_per_token, DEFAULT_TOP_K
        if not self.n_experts and k != default:
            raise ValueError(
                f"GPTConfig.experts_per_token={k} on a dense config (n_experts=0): there are "
                f"no experts to route to; set n_experts >= {k} for a mixture of experts, or "
                f"leave experts_per_token at {default}")
        if self.n_experts and not 1 <= k <= self.n_experts:
            raise ValueError(
                f"experts_per_token={k} must be between 1 and "
                f"n_experts={self.n_experts} (top-k picks k distinct experts); lower "
                f"experts_per_token or raise n_experts")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration: tiny, small, 1b, 7b or 70b (then ``overrides``).

        - ``tiny``: byte-level, 2 layers of width 64; trains on CPU in seconds.
        - ``small``: GPT-2-small class (~124M parameters: 12 layers, width 768, GPT-2 vocab
          padded to 50304 as in nanoGPT, tied embeddings).
        - ``1b``: Llama 3.2 1B (Meta, ``config.json`` of meta-llama/Llama-3.2-1B).
        - ``7b``: Llama 2 7B (Touvron et al. 2023, Table 1 / ``params.json``).
        - ``70b``: Llama 3 70B (Meta, ``config.json`` of meta-llama/Meta-Llama-3-70B).
        - ``moe-tiny``: ``tiny`` with 8 experts (top-2, dropless); trains on CPU in seconds.
        - ``moe-small``: 8 layers of width 512, 16 experts (top-2) plus one shared expert,
          capacity factor 1.25 (~0.25B parameters, ~0.07B active).
        - ``mixtral-8x7b``: Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1;
          ``config.json`` of mistralai/Mixtral-8x7B-v0.1): 8 experts, top-2, 46.7B
          parameters, 12.9B active.
        - ``qwen3-30b-a3b``: Qwen3-30B-A3B, fine-grained (``config.json`` of
          Qwen/Qwen3-30B-A3B; Qwen3 technical report 2025, Table 2): 128 experts of width
          768, top-8, 30.5B parameters, 3.3B active (its q/k RMSNorms, 0.1M, are omitted).
        - ``qwen1.5-moe-a2.7b``: Qwen1.5-MoE-A2.7B, fine-grained with shared experts
          (``config.json`` of Qwen/Qwen1.5-MoE-A2.7B): 60 experts of width 1408, top-4, a
          shared expert of width 5632 (= 4 experts; its sigmoid gate, 2048 weights per
          layer, is omitted), 14.3B parameters, 2.7B active.

        Compute dtype: tiny, small, moe-tiny and moe-small have ``dtype="auto"`` (bfloat16
        on GPU and TPU, float32 on CPU); 1b, 7b, 70b and the public MoE shapes set
        "bfloat16". All keep float32 parameters (``param_dtype``).

        Remat: ``1b`` recomputes with ``remat="minimal"`` (MaxText's name: the projections'
        outputs are saved, the rest of each block is recomputed). On an H200 at 8 x 2048
        tokens that step took 252.7 ms and 21 GB of temporaries, against 274.2 ms and 50
        GB with no remat (BENCHMARKS.md, gpu_vs_torch). The others keep every activation
        (``remat="none"``) unless told.

        The public MoE shapes use ``capacity_factor=1.25`` (GShard/Switch's common
        setting) so plans of them have bounded dispatch buffers; their reference
        implementations route dropless (set ``capacity_factor=None``).

        Scanned layers are on for the presets above "small": 1b, 7b, 70b, moe-small,
        mixtral-8x7b, qwen3-30b-a3b and qwen1.5-moe-a2.7b have ``scan_layers=True`` (one
        compiled block body: compile time flat in depth); tiny, small and moe-tiny stay
        unrolled. ``preset("7b", scan_layers=False)`` gives the unrolled model (same
        weights, logits and gradients; parameter paths ``blocks.0.attn.q``).
        """
        try:
            base = _PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown GPT preset {name!r}; choose one of {sorted(_PRESETS)}") from None
        return dataclasses.replace(base, **overrides)

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of the fields (``lora`` only when set: configs without
        adapters keep their hash)."""
        d = dataclasses.asdict(self)
        d["remat"] = remat_json(self.remat)
        if self.lora is None:
            del d["lora"]
        else:
            d["lora"] = self.lora.to_dict()
        if self.rope_scaling is None:   # likewise: plain-RoPE configs keep their hash
            del d["rope_scaling"]
        else:
            d["rope_scaling"] = list(self.rope_scaling)
        if self.quantization is None:   # likewise: configs without fp8 keep their hash
            del d["quantization"]
        return d

    @property
    def n_params(self) -> int:
        """Parameter count (embeddings included; every expert counted)."""
        return self._count(self.n_experts)

    @property
    def n_active_params(self) -> int:
        """Parameters one token uses (embeddings included): the dense parts, the router,
        the shared experts and ``experts_per_token`` routed experts (``n_params`` for a
        dense model)."""
        return self._count(self.experts_per_token if self.n_experts else 0)

    def compute_dtype(self, platform: str | None = None) -> str:
        """The dtype activations and matmuls run in on ``platform`` ("cpu", "gpu",
        "tpu"): ``dtype``, with "auto" resolved (:func:`resolve_dtype`). Default platform:
        the one being traced for (the active rules' mesh, else JAX's default backend)."""
        if self.dtype != "auto":
            return self.dtype
        return resolve_dtype(self.dtype, platform or current_platform())[0]

    def resolved(self, platform: str | None = None) -> GPTConfig:
        """This config with ``dtype`` concrete for ``platform`` (:meth:`compute_dtype`):
        itself when it already is. The Trainer and ``wb.plan`` resolve for the mesh's
        platform (an abstract TPU slice: "tpu") before they build the model.

        Example:
            >>> GPTConfig.preset("small").resolved("tpu").dtype
            'bfloat16'
        """
        if self.dtype != "auto":
            return self
        return dataclasses.replace(self, dtype=self.compute_dtype(platform))

    @property
    def moe_matmul_resolved(self) -> str:
        """The expert matmul that runs: ``moe_matmul``, with "auto" resolved ("grouped"
        when dropless, ``capacity_factor=None``; "dense" with a capacity factor)."""
        if self.moe_matmul != "auto":
            return self.moe_matmul
        return "grouped" if self.capacity_factor is None else "dense"

    @property
    def moe_d_ff(self) -> int:
        """Hidden width of one expert (``expert_d_ff``, or ``d_ff`` when 0)."""
        return self.expert_d_ff or self.d_ff

    def _count(self, experts: int) -> int:
        d, f, h, k, hd = self.d_model, self.d_ff, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * k * hd * 2        # q, o + k, v
        attn += (h + 2 * k) * hd * self.qkv_bias + 2 * hd * self.qk_norm
        if self.n_experts:                             # router + experts + shared experts
            fe = self.moe_d_ff
            mlp = d * self.n_experts + experts * 3 * d * fe + 3 * d * self.n_shared_experts * fe
            mlp += d * (self.shared_expert_gate and self.n_shared_experts > 0)
        else:
            mlp = 3 * d * f                            # SwiGLU
        block = attn + mlp + 2 * d                     # + two norms
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * block + d + head


def current_platform() -> str:
    """The platform being traced for: the active rules' mesh devices (a plan's TPU
    slice, the Trainer's devices), else JAX's default backend."""
    from workbench._sharding.rules import active  # rules imports no models module

    ctx = active()
    if ctx is not None:
        mesh = ctx[1]
        try:
            devices = getattr(mesh, "devices", None)
        except ValueError:   # JAX 0.12's AbstractMesh raises it: it has no devices
            devices = None
        if devices is not None and getattr(devices, "size", 0):
            return str(devices.flat[0].platform)
        abstract = getattr(mesh, "abstract_device", None)
        if abstract is not None and getattr(abstract, "platform", None):
            return str(abstract.platform)
    return jax.default_backend()


_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=16, d_ff=256, seq_len=128),
    "small": GPTConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                       head_dim=64, d_ff=2048, seq_len=1024, tie_embeddings=True),
    "1b": GPTConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                    head_dim=64, d_ff=8192, seq_len=2048, dtype="bfloat16",
                    tie_embeddings=True, rope_theta=500000.0, scan_layers=True,
                    remat="minimal"),
    "7b": GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                    head_dim=128, d_ff=11008, seq_len=4096, dtype="bfloat16",
                    scan_layers=True),
    "70b": GPTConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                     head_dim=128, d_ff=28672, seq_len=8192, dtype="bfloat16",
                     rope_theta=500000.0, scan_layers=True),
    "moe-tiny": GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          head_dim=16, d_ff=256, seq_len=128, n_experts=8,
                          experts_per_token=2, expert_d_ff=128),
    "moe-small": GPTConfig(vocab_size=50304, d_model=512, n_layers=8, n_heads=8,
                           n_kv_heads=8, head_dim=64, d_ff=1024, seq_len=1024,
                           tie_embeddings=True, n_experts=16, experts_per_token=2,
                           expert_d_ff=1024, n_shared_experts=1, capacity_factor=1.25,
                           scan_layers=True),
    "mixtral-8x7b": GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, head_dim=128, d_ff=14336, seq_len=4096,
                              dtype="bfloat16", rope_theta=1e6, n_experts=8,
                              experts_per_token=2, capacity_factor=1.25, scan_layers=True),
    "qwen3-30b-a3b": GPTConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                               n_kv_heads=4, head_dim=128, d_ff=6144, seq_len=4096,
                               dtype="bfloat16", rope_theta=1e6, norm_eps=1e-6,
                               n_experts=128, experts_per_token=8, expert_d_ff=768,
                               capacity_factor=1.25, scan_layers=True),
    "qwen1.5-moe-a2.7b": GPTConfig(vocab_size=151936, d_model=2048, n_layers=24, n_heads=16,
                                   n_kv_heads=16, head_dim=128, d_ff=5632, seq_len=4096,
                                   dtype="bfloat16", rope_theta=1e6, norm_eps=1e-6,
                                   n_experts=60, experts_per_token=4, expert_d_ff=1408,
                                   n_shared_experts=4, router_norm_topk=False,
                                   capacity_factor=1.25, scan_layers=True),
}

PRESETS: tuple[str, ...] = tuple(_PRESETS)
