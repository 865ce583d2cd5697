"""The reference workloads: MaxText's published TPU runs, planned with the TPU compiler.

Each row is a published run (MaxText's own configs: ``benchmarks/maxtext_v5p_model_configs.py``
``llama2_70b_v5p_128`` and the v6e ``llama3_1_8b_8192`` / ``llama3_1_70b_8192`` tiering
entries) at its per-chip batch and sequence length, with splash attention and a remat
policy no heavier than the reference's, compiled for the whole slice by the TPU compiler
(libtpu, compile-only): memory per chip and fit are the compiler's. Predicted step time
and MFU come from the plan's roofline (``Plan.predicted``: analytic model FLOPs + remat
recompute + the splash kernel's FLOPs, since the compiler's cost analysis counts a scan
body once and no Pallas kernel); MFU is quoted in both FLOP conventions: causal-halved
attention (workbench / MaxText v5p table) and full attention (MaxText's v6e tables).

The first run compiles each 70B step for minutes; the plan cache on disk makes later runs
fast. ``python -m benchmarks bench_reference``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import workbench as wb
from workbench.planning.flags import OVERLAP_FLAGS
from workbench.flops import gpt_flops
from workbench.models import GPTConfig

LLAMA2_70B = GPTConfig.preset("70b", vocab_size=32000, rope_theta=10000.0, seq_len=4096)
LLAMA31_8B = GPTConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                       n_kv_heads=8, head_dim=128, d_ff=14336, seq_len=8192,
                       dtype="bfloat16", rope_theta=500000.0)
LLAMA31_70B = GPTConfig.preset("70b", seq_len=8192)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reference:
    """One published run and how we plan it."""

    name: str
    cfg: GPTConfig
    hardware: str          # our abstract_mesh preset
    chips: int
    per_chip_batch: int
    seq: int
    remat: str             # ours (no heavier than the reference's)
    reference_remat: str
    blocks: tuple[int, int] | None
    mfu: float             # published
    mfu_causal_halved: bool
    tokens_per_chip: float | None
    source: str
    flags: tuple[tuple[str, Any], ...] = ()   # compile options beside the overlap flags
    loss_chunks: int = 1   # GPTConfig.loss_chunks: the float32 logits 1/loss_chunks at a time


#: MaxText's v6e LIBTPU_INIT_ARGS raise the kernels' scoped VMEM (the splash dkv kernel
#: with 2048 blocks needs 32.5 MiB of the default 32 MiB).
V6E_FLAGS = (("xla_tpu_scoped_vmem_limit_kib", 98304),)

REFERENCES = (
    Reference(name="Llama-2-70B v5p-512", cfg=LLAMA2_70B, hardware="v5p-512", chips=256,
              per_chip_batch=4, seq=4096, remat="save_dot_except_mlpwi",
              reference_remat="save_dot_except_mlpwi", blocks=None, mfu=0.654,
              mfu_causal_halved=True, tokens_per_chip=692,
              source="MaxText benchmarks/maxtext_v5p_model_configs.py llama2_70b_v5p_128"),
    Reference(name="Llama-3.1-8B v6e-256", cfg=LLAMA31_8B, hardware="v6e-256", chips=256,
              per_chip_batch=4, seq=8192, remat="qkvo_input_offloaded",
              reference_remat="custom: q/k/v/out proj + layer input offloaded",
              blocks=(2048, 2048), mfu=0.4546, mfu_causal_halved=False,
              tokens_per_chip=7207, source="MaxText v6e llama3_1_8b_8192", flags=V6E_FLAGS),
    Reference(name="Llama-3.1-70B v6e-256", cfg=LLAMA31_70B, hardware="v6e-256", chips=256,
              per_chip_batch=5, seq=8192, remat="qkv_input_offloaded",
              reference_remat="custom: q/k/v proj + layer input offloaded",
              blocks=(2048, 2048), mfu=0.5033, mfu_causal_halved=False,
              tokens_per_chip=960, source="MaxText v6e llama3_1_70b_8192", flags=V6E_FLAGS,
              loss_chunks=8),
)


def plan_reference(ref: Reference, *, attention: str = "splash", remat: str | None = None,
                   overlap: bool = True, progress: bool = True) -> wb.Plan:
    """The TPU-compiled plan of ``ref`` (fsdp over every chip, scanned layers)."""
    cfg = ref.cfg.replace(attention=attention, attention_block_sizes=ref.blocks,
                          remat=remat or ref.remat, scan_layers=True, seq_len=ref.seq,
                          loss_chunks=ref.loss_chunks)
    return wb.plan(cfg, mesh=wb.abstract_mesh(ref.hardware, fsdp=-1), rules="fsdp",
                   batch=ref.per_chip_batch * ref.chips, seq=ref.seq, name=ref.name,
                   progress=progress,
                   overlap=dict(OVERLAP_FLAGS["tpu"], **dict(ref.flags)) if overlap else False)


def mfu_both(p: wb.Plan) -> tuple[float, float]:
    """Predicted MFU in the causal-halved and the full-attention FLOP conventions."""
    pred = p.predicted
    full = gpt_flops(p.cfg, p.batch, p.seq, causal=False).total
    return pred.mfu, pred.mfu * full / p.model_flops


def row(ref: Reference, p: wb.Plan, seconds: float) -> dict[str, Any]:
    pred = p.predicted
    halved, full = mfu_both(p)
    ours = halved if ref.mfu_causal_halved else full
    conv = "causal-halved" if ref.mfu_causal_halved else "full attention"
    gib = p.memory["total"] / 2**30
    tok_chip = pred.tokens_per_s / ref.chips if pred.tokens_per_s else None
    overlapped = sum(c.count for c in p.collectives if c.overlapped)
    notes = (f"{p.source}; {ref.per_chip_batch}x{ref.seq}/chip, {p.attention.split(':')[0]} "
             f"attention, remat {p.cfg.remat} (reference: {ref.reference_remat}); memory "
             f"{gib:.1f} of {p.memory['limit'] / 2**30:.1f} GiB/chip "
             f"({'fits' if p.fits else 'DOES NOT FIT'}); predicted {pred.step_seconds:.2f} "
             f"s/step, {tok_chip:,.0f} tokens/s/chip (published {ref.tokens_per_chip:,}), "
             f"{pred.bound}-bound; MFU {halved:.1%} causal-halved / {full:.1%} full "
             f"attention FLOPs; published {ref.mfu:.1%} ({conv}); "
             f"{overlapped} of {sum(c.count for c in p.collectives)} collectives async; "
             f"TPU compiler's own estimate {p.predicted.compiler_seconds or 0:.2f} s "
             f"(counts the scan body once); plan {seconds:.0f} s; {ref.source}")
    return {"name": f"reference: {ref.name} predicted MFU ({conv})", "value": round(ours * 100, 1),
            "unit": "%", "target": f"fits and within 10 points of {ref.mfu:.1%}",
            "ok": bool(p.fits) and ours >= ref.mfu - 0.10, "notes": notes}


def logits_gib(ref: Reference) -> float:
    """Per chip: the float32 logits of the per-chip tokens, for scale (the step does not
    tile the vocabulary; MaxText can)."""
    return ref.per_chip_batch * ref.seq * ref.cfg.vocab_size * 4 / 2**30


def run() -> list[dict[str, Any]]:
    rows = []
    for ref in REFERENCES:
        t0 = time.perf_counter()
        try:
            p = plan_reference(ref)
        except Exception as err:  # noqa: BLE001 - a compiler refusal is this row's result
            rows.append({"name": f"reference: {ref.name} memory/chip", "value": None,
                         "unit": "GiB", "target": "fits", "ok": False,
                         "notes": f"the TPU compiler failed: {str(err).splitlines()[0][:300]}"
                                  f" ({time.perf_counter() - t0:.0f} s)"})
            continue
        rows.append(row(ref, p, time.perf_counter() - t0))
        rows.append({"name": f"reference: {ref.name} memory/chip", "value":
                     round(p.memory["total"] / 2**30, 2), "unit": "GiB",
                     "target": f"<= {p.memory['limit'] / 2**30:.1f} GiB (fits)",
                     "ok": bool(p.fits), "notes": (
                         f"{p.source}: {p.source_reason}; for scale: float32 logits of "
                         f"{ref.per_chip_batch}x{ref.seq} tokens x vocab {ref.cfg.vocab_size}"
                         f" are {logits_gib(ref):.1f} GiB/chip (the step does not tile the "
                         "vocabulary; MaxText can)")})
    return rows


if __name__ == "__main__":
    for r in run():
        print(r)
