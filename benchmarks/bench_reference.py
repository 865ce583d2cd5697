"""The reference workloads: MaxText's published TPU runs, planned with the TPU compiler.

Each row is a published run (MaxText's own configs: ``benchmarks/maxtext_v5p_model_configs.py``
``llama2_70b_v5p_128`` and the v6e ``llama3_1_8b_8192`` / ``llama3_1_70b_8192`` tiering
entries) at its per-chip batch and sequence length, with splash attention and a remat
policy no heavier than the reference's, compiled for the whole slice by the TPU compiler
(libtpu, compile-only): memory per chip and fit are the compiler's. Predicted step time:
the TPU compiler's own cycle estimates of every fusion it scheduled (loop bodies x trip
count) at the chip's clock, plus the splash kernel's FLOPs at the efficiency those cycles
give the rest of the step (the compiler does not model Pallas kernels), plus the collectives the compiled program does not overlap,
plus the offloaded activations' host transfers the compute scheduled beside them does not
hide (read from the compiled HLO, timed at the chip's host-link bandwidth:
``workbench.perf._host``) (``Plan.predicted``); the roofline (FLOPs at peak) is quoted
beside it as the ideal. MFU
is model FLOPs over that time, quoted in both FLOP conventions: causal-halved attention
(workbench / MaxText v5p table) and full attention (MaxText's v6e tables); against the bf16
peak, as the Ironwood tables quote their fp8 rows' TFLOP/s (the fp8 row's notes add its MFU
against the fp8 peak). The fp8 row (``quantization=fp8_full``) plans
``GPTConfig(quantization="fp8")``: the projections through qwix, timed by the compiler's
cycles of its fp8 matmuls. The 70B v6e
row computes its loss over 8 slices of the sequence (``GPTConfig.loss_chunks``): whole,
its float32 logits (19.6 GiB/chip) do not fit beside the rest.

Each row's predicted / published tokens/s (= published / predicted step time) is also
written to ``workbench/perf/reference_rows.json`` (:func:`write_reference_rows`): the error
band of an uncalibrated prediction for that generation (``workbench.perf._band``;
``tests/test_band.py`` checks the file against BENCHMARKS.md's rows).

The first run compiles each 70B step for minutes; the plan cache on disk makes later runs
fast. ``python -m benchmarks bench_reference``; ``WB_BENCH_REFERENCE="Llama-3.1-70B tpu7x-128"``
plans only the rows named (comma-separated) and keeps the others' rows from results.json.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import optax

import workbench as wb
from workbench.models._remat import remat_label, resolve_remat
from workbench.planning._flags import compile_options
from workbench._flops import gpt_flops
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
    remat: Any             # ours (no heavier than the reference's): a name or a custom policy
    reference_remat: str
    blocks: tuple[int, int] | None
    mfu: float             # published
    mfu_causal_halved: bool
    tokens_per_chip: float | None
    source: str
    flags: tuple[tuple[str, Any], ...] = ()   # compile options beside the overlap flags
    loss_chunks: int = 1   # GPTConfig.loss_chunks: the float32 logits 1/loss_chunks at a time
    mu_dtype: str | None = None   # AdamW's first moment (MaxText's mu_dtype), None: float32


#: MaxText's v6e LIBTPU_INIT_ARGS raise the kernels' scoped VMEM (the splash dkv kernel
#: with 2048 blocks needs 32.5 MiB of the default 32 MiB).
V6E_FLAGS = (("xla_tpu_scoped_vmem_limit_kib", 98304),)

#: MaxText's Ironwood LIBTPU_INIT_ARGS (tpu-recipes training/ironwood/llama3.1-70b/
#: 8k-bf16-tpu7x-4x4x4): scoped VMEM, native bf16 emission, collectives offloaded to the
#: SparseCores (the installed libtpu accepts each).
TPU7X_FLAGS = (("xla_tpu_scoped_vmem_limit_kib", 61440),
               ("xla_tpu_bf16_emission_mode", "NATIVE_EMISSION"),
               ("xla_tpu_enable_sparse_core_collective_offload_all_reduce", True),
               ("xla_tpu_use_single_sparse_core_for_all_gather_offload", True))
#: The recipe's remat_policy=custom: the block input, q, k, v and the attention output kept
#: on the device ('device'), the rest recomputed.
TPU7X_REMAT = {"save": ["decoder_layer_input", "query_proj", "key_proj", "value_proj",
                        "context"]}

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
    Reference(name="Llama-3.1-70B tpu7x-128", cfg=LLAMA31_70B, hardware="tpu7x-128", chips=64,
              per_chip_batch=4, seq=8192, remat=TPU7X_REMAT,
              reference_remat="custom: layer input, q/k/v proj and context on the device",
              blocks=(2048, 2048), mfu=1207.05e12 / 2307e12, mfu_causal_halved=False,
              tokens_per_chip=2686.98, mu_dtype="bfloat16",
              source="tpu-recipes training/ironwood/README.md (llama3.1-70b, 64 chips, GBS 256, "
                     "8192, bf16: 12.20 s, 1,207.05 TFLOP/s/chip, 2,686.98 tokens/s/chip) and "
                     "8k-bf16-tpu7x-4x4x4/xpk/run_recipe.sh (per_device_batch_size=2, fsdp, "
                     "mu_dtype=bfloat16, remat custom, splash blocks 2048)",
              flags=TPU7X_FLAGS, loss_chunks=8),
    Reference(name="Llama-3.1-70B tpu7x-128 fp8", cfg=LLAMA31_70B.replace(quantization="fp8"),
              hardware="tpu7x-128", chips=64, per_chip_batch=4, seq=8192, remat=TPU7X_REMAT,
              reference_remat="custom: layer input, q/k/v proj and context on the device",
              blocks=(1024, 1024), mfu=1854.19e12 / 2307e12, mfu_causal_halved=False,
              tokens_per_chip=4127.56, mu_dtype="bfloat16",
              source="tpu-recipes training/ironwood/README.md (llama3.1-70b, 64 chips, GBS 256, "
                     "8192, fp8_full: 7.93 s, 1,854.19 TFLOP/s/chip, 4,127.56 tokens/s/chip) and "
                     "8k-fp8-tpu7x-4x4x4/xpk/run_recipe.sh (per_device_batch_size=2, fsdp, "
                     "mu_dtype=bfloat16, remat custom, quantization=fp8_full through qwix, "
                     "weight and activation calibration 'fixed,-224,224' (ours: absmax), "
                     "splash blocks 1024 (dkv 2048))",
              flags=TPU7X_FLAGS, loss_chunks=8),
)


def plan_reference(ref: Reference, *, attention: str = "splash", remat: str | None = None,
                   overlap: bool = True, progress: bool = True) -> wb.Plan:
    """The TPU-compiled plan of ``ref`` (fsdp over every chip, scanned layers)."""
    cfg = ref.cfg.replace(attention=attention, attention_block_sizes=ref.blocks,
                          remat=remat or ref.remat, scan_layers=True, seq_len=ref.seq,
                          loss_chunks=ref.loss_chunks)
    optimizer = optax.adamw(3e-4, mu_dtype=ref.mu_dtype) if ref.mu_dtype else None
    return wb.plan(cfg, mesh=wb.abstract_mesh(ref.hardware, fsdp=-1), rules="fsdp",
                   batch=ref.per_chip_batch * ref.chips, seq=ref.seq, name=ref.name,
                   progress=progress, **({"optimizer": optimizer} if optimizer else {}),
                   overlap=dict(compile_options("tpu", device=ref.hardware), **dict(ref.flags))
                   if overlap else False)


def mfu_both(p: wb.Plan) -> tuple[float, float]:
    """Predicted MFU in the causal-halved and the full-attention FLOP conventions."""
    pred = p.predicted
    full = gpt_flops(p.cfg, p.report.batch, p.report.seq, causal=False).total
    return pred.mfu, pred.mfu * full / p.model_flops


#: Per-token widths of the tensors a remat policy can offload (``RematPolicy.offloaded``).
def _offload_width(cfg: GPTConfig, name: str) -> int:
    nh, kh = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"decoder_layer_input": cfg.d_model, "query_proj": nh, "key_proj": kh,
            "value_proj": kh, "out_proj": cfg.d_model, "context": nh,
            "mlpwi_0": cfg.d_ff, "mlpwi_1": cfg.d_ff, "mlpwo": cfg.d_model}[name]


def host_bytes(ref: Reference, remat: Any) -> float:
    """Bytes per chip per step a host-offloading policy moves to host memory (and back
    again for the backward pass): its offloaded tensors, every layer, every token."""
    policy = resolve_remat(remat)
    width = sum(_offload_width(ref.cfg, n) for n in policy.offloaded)
    return ref.per_chip_batch * ref.seq * ref.cfg.n_layers * width \
        * np.dtype(ref.cfg.dtype).itemsize


def row(ref: Reference, p: wb.Plan, seconds: float) -> dict[str, Any]:
    pred = p.predicted
    halved, full = mfu_both(p)
    ours = halved if ref.mfu_causal_halved else full
    ideal_step = pred.breakdown["roofline_local"] + pred.breakdown["communication"]
    ideal = ours * pred.step_seconds / ideal_step
    conv = "causal-halved" if ref.mfu_causal_halved else "full attention"
    gib = p.memory["total"] / 2**30
    tok_chip = pred.tokens_per_s / ref.chips if pred.tokens_per_s else None
    published_step = ref.per_chip_batch * ref.seq / ref.tokens_per_chip
    n_async = sum(c.count for c in p.collectives if c.overlapped)
    n_all = sum(c.count for c in p.collectives)
    cycles, _ = p.report.compiler_cycles
    spec = wb.hardware.hardware_spec(p.mesh.device_kind)
    gap = ours - ref.mfu
    why = []
    if pred.breakdown["communication"] > 0.01 * pred.step_seconds:
        why.append(f"{pred.breakdown['communication']:.2f} s of collectives the compiled "
                   f"program runs synchronously ({n_async} of {n_all} async) count in full")
    b = pred.breakdown
    if resolve_remat(p.cfg.remat).offloads:
        hb = host_bytes(ref, p.cfg.remat)
        traffic = p.report.host_traffic
        why.append(f"host transfers {b['host_transfers']:.2f} s not hidden, of "
                   f"{b['host_link']:.2f} s on the host link: "
                   f"{b['host_bytes_to_host'] / 1e9:.1f} GB to host and "
                   f"{b['host_bytes_to_device'] / 1e9:.1f} GB back per chip per step, read "
                   f"from the HLO ({len(traffic.transfers)} async DMAs to/from S(5), "
                   f"{', '.join(sorted({t.op for t in traffic.transfers}))}; by formula "
                   f"{hb / 1e9:.1f} GB), at {spec.host_bandwidth / 1e9:.0f} GB/s each way "
                   f"({spec.source_of('host_bandwidth').split(':')[0]})")
    if p.kernel_flops:
        why.append("the splash kernel is timed at the efficiency the compiler's cycles give "
                   "the step's other FLOPs (the compiler does not model Pallas kernels)")
    notes = (f"{p.source}; {ref.per_chip_batch}x{ref.seq}/chip, {p.attention.split(':')[0]} "
             f"attention, remat {remat_label(p.cfg.remat)} (reference: {ref.reference_remat})"
             + (f", loss_chunks={p.cfg.loss_chunks}" if p.cfg.loss_chunks > 1 else "")
             + f"; memory {gib:.1f} of {p.memory['limit'] / 2**30:.1f} GiB/chip "
             f"({'fits' if p.fits else 'DOES NOT FIT'}); predicted {pred.step_seconds:.2f} "
             f"s/step (published {published_step:.2f}), {tok_chip:,.0f} tokens/s/chip "
             f"(published {ref.tokens_per_chip:,}); local work from the TPU compiler's "
             f"cycle estimates, {cycles:.3g} cycles at {spec.clock_hz / 1e9:.3g} GHz = "
             f"{cycles / spec.clock_hz:.2f} s, + splash kernel at the same efficiency "
             f"{pred.breakdown['local'] - cycles / spec.clock_hz:.2f} s (roofline "
             f"{pred.breakdown['roofline_local']:.2f} s: the ideal, MFU {ideal:.1%}); "
             f"collectives {pred.breakdown['communication']:.2f} s not hidden; host "
             f"transfers {b['host_transfers']:.2f} s not hidden; predicted/published "
             f"tokens/s {tok_chip / ref.tokens_per_chip:.2f}x; MFU "
             f"{halved:.1%} causal-halved / {full:.1%} full attention FLOPs"
             + (f" (against the bf16 peak; {pred.mfu_fp8 * full / halved:.1%} full "
                "attention against the fp8 peak)" if pred.mfu_fp8 is not None else "")
             + "; published "
             f"{ref.mfu:.1%} ({conv}); gap {gap * 100:+.1f} points: "
             + ("; ".join(why) or "none named")
             + f"; plan {seconds:.0f} s; {ref.source}")
    return {"name": f"reference: {ref.name} predicted MFU ({conv})", "value": round(ours * 100, 1),
            "unit": "%", "target": f"fits, tokens/s within 10% of published (MFU "
                                    f"{ref.mfu:.1%})",
            "ok": bool(p.fits) and tok_chip is not None
            and abs(tok_chip / ref.tokens_per_chip - 1) <= 0.10, "notes": notes}


def reference_row(ref: Reference, p: wb.Plan) -> dict[str, Any]:
    """One row of ``reference_rows.json``: the plan's predicted tokens/s per chip beside the
    published one, and their ratio (the measured / predicted step time)."""
    predicted = p.predicted.tokens_per_s / ref.chips
    return {"name": ref.name,
            "hardware": wb.hardware.hardware_spec(p.mesh.device_kind).name,
            "predicted_tokens_per_s_per_chip": round(predicted, 1),
            "published_tokens_per_s_per_chip": ref.tokens_per_chip,
            "ratio": round(predicted / ref.tokens_per_chip, 4), "source": ref.source,
            "measured": f"benchmarks/bench_reference.py, "
                        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}"}


def write_reference_rows(rows: list[dict[str, Any]]) -> None:
    """Replaces the rows of these references in ``workbench/perf/reference_rows.json``
    (the others are kept)."""
    from workbench.perf._band import REFERENCE_ROWS

    data = json.loads(REFERENCE_ROWS.read_text())
    names = {r["name"] for r in rows}
    data["rows"] = [r for r in data["rows"] if r["name"] not in names] + rows
    REFERENCE_ROWS.write_text(json.dumps(data, indent=1) + "\n")


def logits_gib(ref: Reference) -> float:
    """Per chip: the float32 logits of the per-chip tokens, for scale."""
    return ref.per_chip_batch * ref.seq * ref.cfg.vocab_size * 4 / 2**30


def _chosen() -> tuple[tuple[Reference, ...], list[dict[str, Any]]]:
    """The references to plan now (``WB_BENCH_REFERENCE``: names, comma-separated; default
    all) and the rows of the others already in results.json, kept (each is hours here)."""
    names = [n.strip() for n in os.environ.get("WB_BENCH_REFERENCE", "").split(",") if n.strip()]
    unknown = sorted(set(names) - {r.name for r in REFERENCES})
    if unknown:
        raise SystemExit(f"WB_BENCH_REFERENCE names {unknown}; known: "
                         f"{[r.name for r in REFERENCES]}")
    chosen = tuple(r for r in REFERENCES if not names or r.name in names)
    if not names:
        return chosen, []
    path = Path(__file__).resolve().parent / "results.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    others = [r.name for r in REFERENCES if r.name not in names]
    return chosen, [{k: v for k, v in r.items() if k != "module"} for r in rows
                    if r.get("module") == "bench_reference"
                    and any(_row_of(r["name"], o) for o in others)]


def _row_of(row_name: str, ref_name: str) -> bool:
    """Whether a results.json row is one of ``ref_name``'s (its MFU or its memory row; a
    name that extends another, "... tpu7x-128 fp8", is not the shorter one's)."""
    return row_name.startswith(f"reference: {ref_name} predicted MFU (") \
        or row_name == f"reference: {ref_name} memory/chip"


def run() -> list[dict[str, Any]]:
    chosen, rows = _chosen()
    stored = []
    for ref in chosen:
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
        if p.predicted.tokens_per_s:
            stored.append(reference_row(ref, p))
        rows.append({"name": f"reference: {ref.name} memory/chip", "value":
                     round(p.memory["total"] / 2**30, 2), "unit": "GiB",
                     "target": f"<= {p.memory['limit'] / 2**30:.1f} GiB (fits)",
                     "ok": bool(p.fits), "notes": (
                         f"{p.source}: {p.source_reason}; temp {p.memory['temp'] / 2**30:.1f}"
                         f" GiB; for scale: float32 logits of {ref.per_chip_batch}x{ref.seq} "
                         f"tokens x vocab {ref.cfg.vocab_size} are {logits_gib(ref):.1f} "
                         f"GiB/chip" + (f", held 1/{ref.loss_chunks} at a time "
                                        f"(loss_chunks={ref.loss_chunks})"
                                        if ref.loss_chunks > 1 else
                                        " (loss_chunks=1: held whole)"))})
    write_reference_rows(stored)
    return rows


if __name__ == "__main__":
    for r in run():
        print(r)
