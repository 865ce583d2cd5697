"""The workbench Trainer's step side by side with PyTorch, on the same GPU, windows interleaved.

Not a ``bench_*`` module: ``python -m benchmarks`` never runs it on CPU; it needs a GPU::

    python benchmarks/gpu_vs_torch.py                     # cases 1b and small
    python benchmarks/gpu_vs_torch.py --cases 1b --variant cudnn:attention=cudnn \\
        --out /tmp/out --profile
    python benchmarks/gpu_vs_torch.py --merge /tmp/out/rows.json   # into BENCHMARKS.md
    python benchmarks/gpu_vs_torch.py --smoke             # the same code on CPU (make test)

Each case trains one Llama-architecture model at the same tokens per step two ways, each
in its own process (so neither framework's allocator sees the other's buffers), driven by
this one with the timed windows interleaved (JAX, PyTorch, then PyTorch, JAX, ...; a
drifting clock or a warm-up falls on both sides):

- **workbench**: ``wb.Trainer(TrainConfig(model=<preset>, data="synthetic", ...))`` and
  the step it compiles (``Trainer.compiled_step``: its model config, optimizer, shardings,
  donation and compile options), run on a device-resident batch. ``--variant NAME:k=v,...``
  adds steps compiled the same way with GPTConfig fields changed (``attention=cudnn``,
  ``remat=minimal``, ``loss_chunks=4``) or XLA options (any key starting ``xla_``) on the
  same train state; ``trainer`` (the Trainer's own step, unchanged) is always measured.
- **pytorch**: ``transformers``' ``LlamaForCausalLM`` with the same shapes (SDPA attention:
  flash on Hopper), fp32 parameters under bf16 autocast, forward and loss under
  ``torch.compile``, gradient clipping and fused AdamW with the same hyperparameters and
  the same decay mask, as its users run it.

Both sides count FLOPs with ``workbench._flops.gpt_flops`` (causal attention halved, no
recompute) and divide by the device's peak bf16 FLOP/s from ``workbench.hardware``: MFU.
Rows (``--out DIR/rows.json``): ``"mfu, <case>, workbench <variant>"``, ``"mfu, <case>,
pytorch"`` (value: MFU as a fraction) and ``"vs pytorch, <case>, <variant>"`` (workbench
tokens/s over PyTorch's, window medians), with the device, the versions and the command.
``--profile`` also traces the fastest workbench variant of each case
(``workbench.perf._trace.read_trace``: time per category and the top ops) and PyTorch
(``torch.profiler``: top kernels), into ``DIR/profile-<case>.txt``.

``--predict`` adds, per case, the Trainer's profile against its plan (uncalibrated: the
catalogue, with its measured efficiencies where the GPU has them; then calibrated on the
first case) and, over two cases or more, the **held-out** rows: each case's step predicted
with the efficiencies (``workbench.perf._efficiency``: matmul fraction of peak by shape
class, fused-attention FLOP/s, HBM bytes/s) fitted on another case alone, target within
15%; each case's fitted record goes to ``DIR/efficiency-<case>.json``
(``workbench.hardware._efficiency.Efficiency.from_dict`` reads it: the catalogue's next
record). Memory (:func:`sizing`, from ``nvidia-smi`` or ``--gpu-memory``): the sides run
beside each other where both fit (an H200), else each alone with the other's temporaries
released, windows still interleaved (the 1b case on an H100 80 GB); the rows say which,
and which JAX ran against the range pyproject.toml declares (:func:`jax_range`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a file from a checkout that is not installed
    sys.path.insert(0, str(ROOT))
#: (preset, batch, seq): tokens per step batch x seq on one device
CASES: dict[str, tuple[str, int, int]] = {"1b": ("1b", 8, 2048), "small": ("small", 32, 1024)}
#: ``--smoke``: the same code path on CPU devices, checked by make test
SMOKE_CASE = ("tiny", 4, 64)
WARMUP, STEPS, WINDOWS = 3, 10, 5
#: seconds a child may take to import, build, compile and warm up (per variant on the
#: JAX side); past it the case is reported as failed
READY_TIMEOUT = 900
_DRIVER_SET_CPU = False
#: ``--smoke``'s second case: the held-out rows need a case to fit on and one to predict
SMOKE_CASES: dict[str, tuple[str, int, int]] = {"smoke": SMOKE_CASE, "smoke2": ("tiny", 2, 128)}
#: GPU bytes each side took in the stored H200 runs (benchmarks/gpu_runs, 2026-11-28): the
#: JAX side's compiled arguments + temporaries of the Trainer's step (1b: remat="minimal",
#: the preset's default, 14.8 + 21.4 GB; small: 1.5 + 16.6 GB), PyTorch's
#: ``torch.cuda.max_memory_allocated`` (46.0 and 16.2 GB)
NEEDS: dict[str, tuple[float, float]] = {"1b": (36.3e9, 46.0e9), "small": (18.1e9, 16.3e9),
                                         # stand-ins for the CPU smoke cases (they take a
                                         # few MB): --gpu-memory 4 makes them run alone
                                         "smoke": (0.5e9, 0.5e9), "smoke2": (0.5e9, 0.5e9)}
#: bytes each process holds besides its arrays (CUDA context, cuBLAS / cuDNN workspaces)
CONTEXT = 1.5e9
#: share of the GPU's memory the two sides may plan on (the rest: fragmentation)
USABLE = 0.95
#: bytes per parameter a side keeps between its windows: fp32 weights and AdamW's two
#: moments (PyTorch sets gradients to None; the JAX side's train state)
RESIDENT_PER_PARAM = 12


def log(*args: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)


def sizing(case: str, gpu_bytes: float | None, n_params: int) -> dict[str, Any]:
    """How the two sides share one GPU of ``gpu_bytes``: ``"beside"`` each other (the
    JAX side capped at what PyTorch leaves) when both fit (``NEEDS`` + ``CONTEXT`` each
    within ``USABLE``), else ``"alone"``: each side's window runs while the other holds
    only its weights and optimizer state (``RESIDENT_PER_PARAM`` x ``n_params``), the
    JAX side freeing its temporaries after every step (XLA's platform allocator) and
    PyTorch emptying its cache after every window; the windows stay interleaved.
    ``"too large"`` when even that does not fit. Returns ``mode``, ``env`` (the JAX
    side's variables), ``release`` (PyTorch empties its cache) and ``why`` (for the rows)."""
    if gpu_bytes is None:
        return {"mode": "beside", "env": {}, "release": False,
                "why": "sides beside each other (no GPU memory to share: CPU)"}
    jax_need, torch_need = NEEDS.get(case, (0.0, 0.0))
    usable, gb = USABLE * gpu_bytes, gpu_bytes / 1e9
    if jax_need + torch_need + 2 * CONTEXT <= usable:
        cap = (usable - torch_need - CONTEXT) / gpu_bytes
        return {"mode": "beside", "env": {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{cap:.2f}"},
                "release": False,
                "why": (f"sides beside each other: JAX {jax_need / 1e9:.1f} GB + PyTorch "
                        f"{torch_need / 1e9:.1f} GB of the GPU's {gb:.0f} GB (the JAX side "
                        f"capped at {cap:.2f} of it)")}
    resident = RESIDENT_PER_PARAM * n_params
    if max(jax_need, torch_need) + resident + 2 * CONTEXT > usable:
        return {"mode": "too large", "env": {}, "release": False,
                "why": (f"neither side fits beside the other's weights and AdamW state "
                        f"({resident / 1e9:.1f} GB) on the GPU's {gb:.0f} GB")}
    return {"mode": "alone", "env": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
            "release": True,
            "why": (f"each side alone, windows interleaved: JAX {jax_need / 1e9:.1f} GB + "
                    f"PyTorch {torch_need / 1e9:.1f} GB + 2 x {CONTEXT / 1e9:g} GB of context "
                    f"exceed {USABLE:.0%} of the GPU's {gb:.0f} GB; "
                    f"between its windows each side holds {resident / 1e9:.1f} GB (fp32 "
                    "weights, AdamW moments): JAX frees its temporaries after each step "
                    "(XLA_PYTHON_CLIENT_ALLOCATOR=platform), PyTorch empties its cache "
                    "after each window")}


def gpu_memory() -> float | None:
    """The first GPU's memory in bytes (``nvidia-smi``), or None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30)
        return float(out.stdout.split()[0]) * 2**20 if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def jax_range(version: str) -> str:
    """``"jax 0.11.2 (pyproject: jax>=0.11.2,<0.13: inside)"``: the JAX a run used
    against the range the project declares."""
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(Requirement(d) for d in deps if Requirement(d).name == "jax")
    inside = req.specifier.contains(version, prereleases=True)
    return (f"jax {version} (pyproject: jax{req.specifier}: "
            f"{'inside' if inside else 'OUTSIDE the declared range'})")


# ----------------------------------------------------------------------------- variants

def parse_variant(text: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``"name:attention=cudnn,loss_chunks=4,xla_gpu_enable_triton_gemm=false"`` ->
    ``(name, model overrides, XLA compile options)``."""
    name, _, body = text.partition(":")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise SystemExit(f"--variant {text!r}: start with a name of letters, digits, _ or -, "
                         "e.g. cudnn:attention=cudnn")
    model: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for item in filter(None, body.split(",")):
        key, eq, raw = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not key=value")
        value: Any = raw
        low = raw.lower()
        if low in ("true", "false"):
            value = low == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    pass
        (options if key.startswith("xla_") else model)[key] = value
    return name, model, options


def optax_lm_loss(model: Any, batch: Any) -> Any:
    """The next-token loss as optax computes it on float32 logits (``--variant
    name:loss=optax``): the reference that workbench.models._xent's loss replaced."""
    import jax.numpy as jnp
    import optax

    if "tokens" in batch:
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    else:
        inputs, targets = batch["inputs"], batch["targets"]
    logits = model(inputs).astype(jnp.float32)                           # (B, T, V)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


# ----------------------------------------------------------------------------- children

def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=float) + "\n")
    sys.stdout.flush()


def _commands() -> Any:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def jax_child(args: argparse.Namespace) -> None:
    """The workbench side: a Trainer, its compiled step and the variants' steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import workbench as wb
    from workbench._step import jit_train_step, make_train_step
    from workbench._train_state import abstract_state

    preset, batch, seq = _case(args)
    smoke = args.smoke
    devices = jax.devices()
    log(f"jax {jax.__version__} on {len(devices)} x {devices[0].device_kind}")
    overrides: dict[str, Any] = {"seq_len": seq, **parse_variant(f"o:{args.override or ''}")[1]}
    config = wb.TrainConfig(model=preset, model_overrides=overrides,
                            mesh={"data": 1}, rules="fsdp", batch=batch, seq=seq,
                            steps=1_000_000, checkpoint_every=1_000_000, keep=1,
                            data=wb.data.SyntheticData(size=4096))
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_vs_torch-")) / "run"
    trainer = wb.Trainer(config, run_dir, progress=None)
    p = trainer.parts
    cfg = p.model_config
    variants: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {}
    info: dict[str, Any] = {"device": devices[0].device_kind, "jax": jax.__version__,
                            "model_config": cfg.to_dict(), "variants": {}}
    import flax
    import optax
    info["versions"] = {"jax": jax.__version__, "flax": flax.__version__,
                        "optax": optax.__version__}
    def compile_trainer() -> None:
        t0 = time.perf_counter()
        variants["trainer"] = (trainer.compiled_step(), {}, {})
        info["variants"]["trainer"] = {
            "compile_s": time.perf_counter() - t0, "memory": trainer.memory_per_device,
            "model": dict(config.model_overrides),
            "options": dict(getattr(trainer, "compile_options", None) or {})}
        log(f"the Trainer's step: compiled in {info['variants']['trainer']['compile_s']:.1f} s")

    def compile_variant(text: str) -> None:
        name, model_changes, options = parse_variant(text)
        try:
            loss = model_changes.get("loss", "workbench")
            if loss not in ("workbench", "optax"):
                raise ValueError(f"loss={loss!r}: 'workbench' (the Trainer's) or 'optax'")
            vcfg = cfg.replace(**{k: v for k, v in model_changes.items() if k != "loss"})
            graphdef, _ = abstract_state(vcfg, p.tx, p.rules, p.mesh)
            fn = make_train_step(graphdef, p.tx, rules=p.rules, mesh=p.mesh,
                                 loss_fn=optax_lm_loss if loss == "optax" else None)
            opts = {**(getattr(trainer, "compile_options", None) or {}), **options}
            t0 = time.perf_counter()
            compiled = jit_train_step(fn, p.shardings, p.batch_shardings,
                                      compiler_options=opts or None
                                      ).lower(p.abstract_state, p.abstract_batch).compile()
            mem = compiled.memory_analysis()
            variants[name] = (compiled, model_changes, options)
            info["variants"][name] = {
                "compile_s": time.perf_counter() - t0, "model": model_changes,
                "options": opts,
                "memory": None if mem is None else {
                    k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
                    for k in ("argument", "output", "temp", "generated_code")}}
            log(f"variant {name}: compiled in {info['variants'][name]['compile_s']:.1f} s")
        except Exception as e:   # one variant's failure (OOM, bad option) is a row, not a crash
            info["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:600],
                                      "model": model_changes, "options": options}
            log(f"variant {name} failed: {e}")

    # XLA compiles release the GIL: the variants compile side by side (minutes on a GPU)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1 + len(args.variant or ())) as pool:
        futures = [pool.submit(compile_trainer)] + [pool.submit(compile_variant, v)
                                                    for v in args.variant or ()]
        for f in futures:
            f.result()
    variants = {n: variants[n] for n in ["trainer"] + [parse_variant(v)[0]
                                                       for v in args.variant or ()]
                if n in variants}
    state = trainer.state
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, size=(batch, seq + 1), dtype=np.int32)
    dev_batch = jax.device_put({"inputs": jnp.asarray(toks[:, :-1]),
                                "targets": jnp.asarray(toks[:, 1:])}, p.batch_shardings)
    if args.check_variants:   # each variant's first step from one state: the same numbers
        info["first_loss"] = {}
        for name, (step, _, _) in variants.items():
            copy = jax.tree.map(jnp.copy, state)
            _, metrics = step(copy, dev_batch)
            info["first_loss"][name] = float(metrics["loss"])
    limit = (devices[0].memory_stats() or {}).get("bytes_limit") if not smoke else None
    for name in list(variants):
        need = info["variants"][name].get("memory") or {}
        need_bytes = need.get("argument", 0) + need.get("temp", 0)
        if limit and need_bytes > limit:   # an OOM could take the whole side down
            info["variants"][name]["error"] = (
                f"needs {need_bytes / 2**30:.1f} GiB (arguments + temporaries), more than "
                f"the {limit / 2**30:.1f} GiB this side may use; not run")
            log(f"variant {name} skipped: {info['variants'][name]['error']}")
            del variants[name]
            continue
        try:
            step = variants[name][0]
            for _ in range(args.warmup):
                state, metrics = step(state, dev_batch)
            jax.block_until_ready((state, metrics))
            info["variants"][name]["warm_loss"] = float(metrics["loss"])
        except Exception as e:
            info["variants"][name]["error"] = f"{type(e).__name__}: {e}"[:600]
            log(f"variant {name} failed warming up: {e}")
            del variants[name]
            if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
                trainer._state = None   # the failed step consumed the donated state: init again
                state = trainer.state
    info["ready"] = list(variants)
    info["bytes_limit"] = limit
    _reply(info)
    for cmd in _commands():
        if cmd["cmd"] == "quit":
            break
        step = variants[cmd["variant"]][0] if "variant" in cmd else None
        if cmd["cmd"] == "window":
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            for _ in range(cmd["steps"]):
                state, metrics = step(state, dev_batch)
            jax.block_until_ready((state, metrics))
            _reply({"seconds": time.perf_counter() - t0, "loss": float(metrics["loss"])})
        elif cmd["cmd"] == "predict":
            # the Trainer's own profile against its plan: uncalibrated; with the
            # calibration stored by an earlier case (if any); and, when asked, calibrate
            # from this one (stored for the cases after it)
            from workbench.train._profile import trainer_plan

            trainer._state = state   # the live state (the variants' steps donated the first)
            plan = trainer_plan(trainer)
            before = plan.predict().step_seconds
            report = trainer.profile(steps=int(cmd.get("steps", 3)), warmup=2, plan=plan)
            state = trainer.state
            import dataclasses

            from workbench.hardware import effective_spec
            from workbench.perf._efficiency import measured_split
            from workbench.perf._predict_plan import step_numbers

            reply = {"measured": report.term("step").measured,
                     "uncalibrated": plan.predict(calibration=False).step_seconds,
                     "uncalibrated_origin": effective_spec(
                         plan.mesh, calibration=False).efficiency_origin,
                     "calibrated": before, "table": report.table(),
                     "numbers": dataclasses.asdict(step_numbers(plan.report)),
                     "split": measured_split(report.measured)}
            if cmd.get("calibrate"):
                wb.calibrate(report, save=True)
                reply["self_calibrated"] = plan.predict().step_seconds
            _reply(reply)
        elif cmd["cmd"] == "profile":
            from workbench.perf._trace import read_trace

            directory = Path(tempfile.mkdtemp(prefix="trace-"))
            with jax.profiler.trace(str(directory)):
                for _ in range(cmd["steps"]):
                    state, metrics = step(state, dev_batch)
                jax.block_until_ready((state, metrics))
            hlo = step.as_text()
            prof = read_trace(directory, hlo_text=hlo, axis_names=p.mesh.axis_names,
                              axis_sizes=tuple(p.mesh.shape.values()), steps=cmd["steps"])
            text = prof.table(int(cmd.get("top", 40)))
            if cmd.get("hlo"):
                import gzip
                Path(cmd["hlo"]).write_bytes(gzip.compress(hlo.encode()))
            if cmd.get("trace"):   # the XSpace itself, for reading again elsewhere
                import shutil
                from workbench.perf._trace import trace_files
                shutil.copy(trace_files(directory)[-1], cmd["trace"])
            _reply({"table": text, "categories": prof.categories,
                    "step_seconds": prof.step_seconds})


def _torch_model(preset: str, seq: int) -> tuple[Any, Any]:
    """``LlamaForCausalLM`` with the shapes of the workbench preset (no rope scaling, no
    biases, tied embeddings where the preset ties them)."""
    import transformers

    from workbench.models import GPTConfig

    g = GPTConfig.preset(preset, seq_len=seq)
    hf = transformers.LlamaConfig(
        vocab_size=g.vocab_size, hidden_size=g.d_model, intermediate_size=g.d_ff,
        num_hidden_layers=g.n_layers, num_attention_heads=g.n_heads,
        num_key_value_heads=g.n_kv_heads, head_dim=g.head_dim,
        max_position_embeddings=max(seq, g.seq_len), rms_norm_eps=g.norm_eps,
        rope_theta=g.rope_theta, tie_word_embeddings=g.tie_embeddings,
        attention_bias=False, mlp_bias=False, use_cache=False)
    hf._attn_implementation = "sdpa"
    return g, transformers.LlamaForCausalLM(hf)


def torch_child(args: argparse.Namespace) -> None:
    """The PyTorch side, as its users write it."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers

    preset, batch, seq = _case(args)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    with device:   # built where it trains (a 1B model's init on the host takes long)
        g, model = _torch_model(preset, seq)   # fp32 master weights; bf16 under autocast
    model.train()
    from workbench._optimizer import AdamW

    spec = AdamW()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(spec.b1, spec.b2), eps=spec.eps,
                            fused=cuda, foreach=None if cuda else True)
    vocab = g.vocab_size
    # the Trainer's warmup-cosine learning rate, step by step (TrainConfig steps=10**6)
    lrs = np.asarray(spec.schedule(1_000_000)(np.arange(10_000)), dtype=np.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: float(lrs[min(k, len(lrs) - 1)]) / spec.lr)

    def loss_fn(inputs: Any, targets: Any) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))

    compiled_loss = torch.compile(loss_fn, backend=args.torch_backend)

    def step(inputs: Any, targets: Any) -> Any:
        loss = compiled_loss(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip_norm or 1e9)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return loss.detach()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, vocab, (batch, seq + 1), generator=gen, dtype=torch.long)
    inputs, targets = toks[:, :-1].contiguous().to(device), toks[:, 1:].contiguous().to(device)
    log(f"torch {torch.__version__}, transformers {transformers.__version__} on {device}"
        + (f" ({torch.cuda.get_device_name()})" if cuda else ""))
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        loss = step(inputs, targets)
    sync()
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "compile_and_warmup_s": time.perf_counter() - t0, "warm_loss": float(loss),
            "params": sum(p.numel() for p in model.parameters()),
            "peak_memory": torch.cuda.max_memory_allocated() if cuda else None,
            "ready": ["pytorch"]}
    _reply(info)
    for cmd in _commands():
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "window":
            sync()
            t0 = time.perf_counter()
            for _ in range(cmd["steps"]):
                loss = step(inputs, targets)
            sync()
            seconds = time.perf_counter() - t0
            if args.release and cuda:   # measured alone: the JAX side's window needs it
                torch.cuda.empty_cache()
            _reply({"seconds": seconds, "loss": float(loss)})
        elif cmd["cmd"] == "profile":
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for _ in range(cmd["steps"]):
                    loss = step(inputs, targets)
                sync()
            key = "cuda_time_total" if cuda else "cpu_time_total"
            _reply({"table": prof.key_averages().table(sort_by=key,
                                                       row_limit=int(cmd.get("top", 40)))})


def _case(args: argparse.Namespace) -> tuple[str, int, int]:
    return SMOKE_CASES[args.case] if args.smoke else CASES[args.case]


# ----------------------------------------------------------------------------- driver

class Child:
    """One side's process, spoken to in JSON lines (its stderr goes to ours)."""

    def __init__(self, side: str, case: str, args: argparse.Namespace,
                 size: dict[str, Any]) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--case", case,
               "--warmup", str(args.warmup), "--torch-backend", args.torch_backend]
        if side == "torch" and size["release"]:
            cmd.append("--release")
        if args.smoke:
            cmd.append("--smoke")
        if args.check_variants or args.smoke:
            cmd.append("--check-variants")
        for v in (args.variant or ()) if side == "jax" else ():
            cmd += ["--variant", v]
        if args.override and side == "jax":
            cmd += ["--override", args.override]
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if side == "jax":
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            for key, value in size["env"].items():   # the user's own setting wins
                env.setdefault(key, value)
            if _DRIVER_SET_CPU:   # the driver's own setting, not the user's
                env.pop("JAX_PLATFORMS", None)
            if args.smoke:   # one CPU device, as one GPU (the suite's flags simulate 8)
                env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        else:
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            env["JAX_PLATFORMS"] = "cpu"   # the torch side imports workbench's config only
        self.side = side
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)

    def read(self, timeout: float) -> dict[str, Any]:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"{self.side} side gave no answer in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.side} side exited ({self.proc.wait()}) before answering")
        return json.loads(line)

    def ask(self, cmd: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def run_case(case: str, args: argparse.Namespace, out: Path | None) -> dict[str, Any]:
    """Both sides of one case: ready, interleaved windows, optional profiles."""
    global _DRIVER_SET_CPU
    if "JAX_PLATFORMS" not in os.environ:   # this driver computes FLOPs only
        os.environ["JAX_PLATFORMS"] = "cpu"
        _DRIVER_SET_CPU = True
    from workbench._flops import gpt_flops
    from workbench.hardware import cpu_spec, hardware_spec
    from workbench.models import GPTConfig

    preset, batch, seq = SMOKE_CASES[case] if args.smoke else CASES[case]
    result: dict[str, Any] = {"case": case, "preset": preset, "batch": batch, "seq": seq,
                              "tokens_per_step": batch * seq}
    gpu = args.gpu_memory * 1e9 if args.gpu_memory else (None if args.smoke else gpu_memory())
    size = sizing(case, gpu, GPTConfig.preset(preset, seq_len=seq).n_params)
    result["sizing"] = {k: size[k] for k in ("mode", "why")} | {"gpu_bytes": gpu}
    log(f"{case}: {size['why']}")
    sides: dict[str, Child] = {}
    try:
        if size["mode"] == "too large":
            raise MemoryError(size["why"])
        log(f"{case}: starting the workbench side")
        sides["jax"] = Child("jax", case, args, size)
        jinfo = sides["jax"].read(READY_TIMEOUT * (1 + len(args.variant or ())))
        result["workbench"] = jinfo
        log(f"{case}: workbench ready: {jinfo['ready']}; starting the PyTorch side")
        if not args.no_torch:
            sides["torch"] = Child("torch", case, args, size)
            result["pytorch"] = sides["torch"].read(READY_TIMEOUT)
            log(f"{case}: PyTorch ready ({result['pytorch']['compile_and_warmup_s']:.0f} s)")
        order = [("jax", v) for v in jinfo["ready"]] + (
            [("torch", "pytorch")] if "torch" in sides else [])
        times: dict[str, list[float]] = {name: [] for _, name in order}
        losses: dict[str, float] = {}
        for w in range(args.windows):
            seq_order = order if w % 2 == 0 else order[::-1]
            for side, name in seq_order:
                r = sides[side].ask({"cmd": "window", "variant": name, "steps": args.steps})
                times[name].append(r["seconds"] / args.steps)
                losses[name] = r["loss"]
            log(f"{case}: window {w + 1}/{args.windows}: " + ", ".join(
                f"{n} {t[-1] * 1e3:.1f} ms" for n, t in times.items()))
        result["step_seconds"] = times
        result["final_loss"] = losses
        # FLOPs: the model's (same formula both sides; the Trainer's config decides seq_len)
        gcfg = GPTConfig.preset(preset, seq_len=seq)
        flops = gpt_flops(gcfg, batch, seq)
        spec = hardware_spec(jinfo["device"]) if not args.smoke else cpu_spec(1)
        peak = spec.peak_flops if spec else None
        result.update(flops=flops.total, flops_formula=flops.formula, peak_flops=peak,
                      peak_source=spec.source if spec else None)
        med = {n: statistics.median(t) for n, t in times.items()}
        result["median_step_seconds"] = med
        result["tokens_per_s"] = {n: batch * seq / s for n, s in med.items()}
        result["mfu"] = {n: flops.total / s / peak for n, s in med.items()} if peak else {}
        if args.profile and out is not None:
            best = min((n for s, n in order if s == "jax"), key=lambda n: med[n])
            text = [f"# {case}: profiles ({args.profile_steps} steps each)", ""]
            r = sides["jax"].ask({"cmd": "profile", "variant": best,
                                  "steps": args.profile_steps, "top": 40,
                                  "hlo": str(out / f"hlo-{case}-{best}.txt.gz"),
                                  "trace": str(out / f"trace-{case}-{best}.xplane.pb")})
            text += [f"## workbench, variant {best}", "", r["table"], ""]
            if "torch" in sides:
                r = sides["torch"].ask({"cmd": "profile", "variant": "pytorch",
                                        "steps": args.profile_steps, "top": 40})
                text += ["## pytorch", "", r["table"], ""]
            (out / f"profile-{case}.txt").write_text("\n".join(text))
        if args.predict:
            r = sides["jax"].ask({"cmd": "predict", "steps": args.profile_steps,
                                  "calibrate": case == args.first_case})
            result["prediction"] = {k: r.get(k) for k in (
                "measured", "uncalibrated", "uncalibrated_origin", "calibrated",
                "self_calibrated", "numbers", "split")}
            result["prediction"]["calibrated_on"] = args.first_case
            log(f"{case}: predicted/measured uncalibrated "
                f"{r['uncalibrated'] / r['measured']:.2f}, with the stored calibration "
                f"{r['calibrated'] / r['measured']:.2f}")
            if out is not None:
                (out / f"profile-{case}-trainer.txt").write_text(r["table"])
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        log(f"{case}: failed: {traceback.format_exc()}")
    finally:
        for c in sides.values():
            c.close()
    return result


def effective(result: dict[str, Any], name: str) -> dict[str, Any]:
    """The GPTConfig fields that decide speed, and the XLA options, of one workbench side."""
    v = result["workbench"]["variants"].get(name, {})
    cfg = {**result["workbench"]["model_config"], **(v.get("model") or {})}
    out = {k: cfg[k] for k in ("attention", "remat", "loss_chunks", "dtype", "param_dtype")}
    out["options"] = dict(v.get("options") or {})
    out["other"] = {k: x for k, x in (v.get("model") or {}).items()
                    if k not in (*out, "seq_len")}     # scan_layers=False, loss=optax, ...
    return out


def label(result: dict[str, Any], name: str) -> str:
    """``"attention=cudnn remat=minimal loss_chunks=1 bfloat16"`` (+ XLA options)."""
    e = effective(result, name)
    text = (f"attention={e['attention']} remat={e['remat']} loss_chunks={e['loss_chunks']} "
            f"{e['dtype']}")
    return text + "".join(f" {k}={v}" for k, v in sorted({**e["other"], **e["options"]}
                                                          .items()))


def rows_of(result: dict[str, Any], command: str, steps: int) -> list[dict[str, Any]]:
    """BENCHMARKS.md rows of one case (``"accelerator"``: kept across CPU bench runs):
    each workbench side is named by its configuration (:func:`label`), PyTorch as such."""
    if not result.get("mfu"):
        return []
    w = result["workbench"]
    device = w["device"]
    versions = {**w.get("versions", {}), **result.get("pytorch", {}).get("versions", {})}
    vtext = ", ".join(jax_range(v) if k == "jax" else f"{k} {v}" for k, v in versions.items())
    if result.get("sizing"):
        vtext += "; " + result["sizing"]["why"]
    shape = f"{result['preset']} {result['batch']} x {result['seq']}"
    when = result.get("when") or time.strftime("%Y-%m-%d")
    base = {"module": "gpu_vs_torch", "accelerator": f"1 x {device}",
            "measured": {"machine": f"1 x {device}", "when": when}}
    mfu_target, ratio_target = {"1b": (0.50, 1.0), "small": (0.40, None)}.get(
        result["case"], (None, None))
    med = result["median_step_seconds"]
    windows = result["step_seconds"]
    how = (f"medians of {len(next(iter(windows.values())))} interleaved windows of {steps} "
           f"steps; {vtext}; `{command}`")
    rows = []
    for name, mfu in result["mfu"].items():
        torch_side = name == "pytorch"
        who = "pytorch (LlamaForCausalLM, SDPA, bf16 autocast, torch.compile, fused AdamW)" \
            if torch_side else f"workbench Trainer step, {label(result, name)}"
        lo, hi = min(windows[name]), max(windows[name])
        rows.append({**base, "name": f"mfu, {shape}, {who}", "value": mfu, "unit": "MFU",
                     "target": "" if torch_side or not mfu_target else f">= {mfu_target}",
                     "ok": None if torch_side or not mfu_target else mfu >= mfu_target,
                     "notes": (f"{med[name] * 1e3:.1f} ms/step (windows {lo * 1e3:.1f}-"
                               f"{hi * 1e3:.1f}), {result['tokens_per_s'][name]:,.0f} tokens/s; "
                               f"{result['flops'] / 1e12:.1f} TFLOP per step "
                               f"(workbench._flops.gpt_flops, both sides) over "
                               f"{result['peak_flops'] / 1e12:.0f} TFLOP/s peak; {how}")})
    pred = result.get("prediction")
    if pred and pred.get("measured"):
        m = pred["measured"]
        on = pred["calibrated_on"]
        own = on == result["case"]
        cal = pred.get("self_calibrated") if own else pred.get("calibrated")
        origin = pred.get("uncalibrated_origin") or "table"
        table = "hardware table" if origin.startswith("table") else \
            "catalogue: measured efficiencies"
        for what, value, target in (
                (f"uncalibrated ({table})", pred["uncalibrated"], ""),
                (f"calibrated on {'itself' if own else on}", cal,
                 "" if own else "0.85-1.15")):
            if value is None:
                continue
            ratio = value / m
            rows.append({**base, "name": f"predicted step, {shape}, Trainer default, {what}",
                         "value": ratio, "unit": "predicted/measured", "target": target,
                         "ok": (0.85 <= ratio <= 1.15) if target else None,
                         "notes": (f"predicted {value * 1e3:.1f} ms, measured {m * 1e3:.1f} "
                                   f"ms (trainer.profile, trace); {how}"
                                   + (f"; {origin}" if what.startswith("uncal") else ""))})
    for h in result.get("held_out", ()):
        ratio = h["predicted"] / h["measured"]
        t = h["terms"]
        rows.append({**base, "name": (f"predicted step, {shape}, Trainer default, held out: "
                                      f"measured efficiencies fitted on {h['fitted_on']}"),
                     "value": ratio, "unit": "predicted/measured", "target": "0.85-1.15",
                     "ok": 0.85 <= ratio <= 1.15,
                     "notes": (f"predicted {h['predicted'] * 1e3:.1f} ms = matmul "
                               f"{t['matmul'] * 1e3:.1f} + attention {t['attention'] * 1e3:.1f} "
                               f"+ memory {t['memory'] * 1e3:.1f} ms, measured "
                               f"{h['measured'] * 1e3:.1f} ms (trainer.profile, trace); "
                               f"{h['source']}; {how}")})
    if "pytorch" in med:
        for name in med:
            if name == "pytorch":
                continue
            ratio = med["pytorch"] / med[name]
            rows.append({**base, "name": f"vs pytorch, {shape}, {label(result, name)}",
                         "value": ratio, "unit": "x tokens/s",
                         "target": f">= {ratio_target}" if ratio_target else "",
                         "ok": ratio >= ratio_target if ratio_target else None,
                         "notes": (f"workbench {med[name] * 1e3:.1f} ms vs pytorch "
                                   f"{med['pytorch'] * 1e3:.1f} ms per step; {how}")})
    return rows


def held_out(results: list[dict[str, Any]], device_kind: str) -> None:
    """Each case's step predicted with the efficiencies fitted on each other case alone
    (``workbench.perf._efficiency``: the plan's numbers over the profile's split), into
    ``result["held_out"]``; and per case the record fitted on it (``result["efficiency"]``)."""
    from workbench.perf._efficiency import StepNumbers, efficient_local, fit_efficiency

    fits = {}
    for r in results:
        pred = r.get("prediction") or {}
        if pred.get("numbers") and pred.get("split"):
            numbers = StepNumbers(**pred["numbers"])
            fits[r["case"]] = (r, numbers, fit_efficiency(
                [(numbers, pred["split"])], device_kind=device_kind,
                peak_flops=r["peak_flops"], run=f"gpu_vs_torch {r['case']}",
                date=r.get("when") or time.strftime("%Y-%m-%d"),
                jax=r["workbench"].get("jax", "?")))
    for case, (r, numbers, own) in fits.items():
        r["efficiency"] = own.to_dict()
        r["held_out"] = []
        for other, (_, _, eff) in fits.items():
            if other == case:
                continue
            seconds, terms, source = efficient_local(numbers, eff, r["peak_flops"])
            r["held_out"].append({"fitted_on": other, "predicted": seconds, "terms": terms,
                                  "measured": r["prediction"]["measured"], "source": source})


def trace_split(run: Path, case: str, variant: str) -> dict[str, float]:
    """The measured split (``workbench.perf._efficiency.measured_split``) of a stored run's
    trace of one case's variant (``--profile``: ``profiles.tgz`` holds
    ``trace-<case>-<variant>.xplane.pb`` and its ``hlo-<case>-<variant>.txt.gz``), read on
    any machine with ``workbench.perf._trace.read_trace``."""
    import gzip
    import tarfile

    from workbench.perf._efficiency import measured_split
    from workbench.perf._trace import read_trace

    with tarfile.open(run / "profiles.tgz") as tar, tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "plugins" / "profile" / case
        where.mkdir(parents=True)
        trace = tar.extractfile(f"trace-{case}-{variant}.xplane.pb")
        hlo = tar.extractfile(f"hlo-{case}-{variant}.txt.gz")
        if trace is None or hlo is None:
            raise ValueError(f"{run}/profiles.tgz has no trace of {case} {variant}")
        (where / "step.xplane.pb").write_bytes(trace.read())
        profile = read_trace(tmp, hlo_text=gzip.decompress(hlo.read()).decode(),
                             axis_names=("data",), axis_sizes=(1,),
                             steps=json.loads((run / "host.json").read_text()).get(
                                 "profile_steps", 3))
    return measured_split(profile)


def merge(folders: list[Path]) -> None:
    """Put the rows of accelerator runs (their ``--out`` folders: results.json and
    host.json) into benchmarks/results.json and BENCHMARKS.md, replacing rows of the same
    name (a later folder's row wins)."""
    from benchmarks.__main__ import RESULTS, _write

    new: dict[str, dict[str, Any]] = {}
    for folder in folders:
        host = json.loads((folder / "host.json").read_text())
        for result in json.loads((folder / "results.json").read_text()):
            for row in rows_of(result, host["command"], host.get("steps", STEPS)):
                new[row["name"]] = row
    rows = [r for r in json.loads(RESULTS.read_text()) if r["name"] not in new]
    rows += list(new.values())
    RESULTS.write_text(json.dumps(rows, indent=1, default=float))
    _write(rows)
    print(f"merged {len(new)} rows into {RESULTS} and BENCHMARKS.md")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["1b", "small"])
    ap.add_argument("--variant", action="append",
                    help="NAME:key=value,...: also time the Trainer's step compiled with these "
                         "GPTConfig fields or xla_* options")
    ap.add_argument("--override", metavar="k=v,...",
                    help="GPTConfig fields the Trainer's own config changes "
                         "(TrainConfig.model_overrides), e.g. attention=cudnn,loss_chunks=4")
    ap.add_argument("--windows", type=int, default=WINDOWS)
    ap.add_argument("--steps", type=int, default=STEPS, help="steps per timed window")
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument("--out", type=Path, help="folder for rows.json, results.json, profiles")
    ap.add_argument("--profile", action="store_true", help="trace both sides after timing")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--predict", action="store_true",
                    help="after timing, trainer.profile() of each case against its plan: "
                         "predicted vs measured uncalibrated, and calibrated on the first "
                         "case (stored in the calibration directory for the later ones)")
    ap.add_argument("--no-torch", action="store_true", help="the workbench side alone")
    ap.add_argument("--torch-backend", default="inductor",
                    help="torch.compile backend (inductor; the smoke test uses aot_eager)")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny model on CPU, both sides: checks this script (make test)")
    ap.add_argument("--check-variants", action="store_true",
                    help="run each workbench variant's first step from one copied state and "
                         "record the losses (they must agree: the variants change speed, not "
                         "numbers); on by default with --smoke (needs a second state in memory)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                    help="add the rows of runs (their --out folders) to BENCHMARKS.md")
    ap.add_argument("--gpu-memory", type=float, metavar="GB",
                    help="the GPU's memory the sides share (default: nvidia-smi's): decides "
                         "whether they run beside each other or each alone (see sizing)")
    ap.add_argument("--child", choices=("jax", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--release", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", default="1b", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.merge:
        merge(args.merge)
        return 0
    if args.child == "jax":
        jax_child(args)
        return 0
    if args.child == "torch":
        torch_child(args)
        return 0
    for name, value in (("windows", args.windows), ("steps", args.steps),
                        ("warmup", args.warmup), ("profile-steps", args.profile_steps)):
        if value < 1:
            ap.error(f"--{name} must be at least 1, got {value}")
    for v in args.variant or ():
        parse_variant(v)
    command = "python benchmarks/gpu_vs_torch.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "host.json").write_text(json.dumps(
            {"python": platform.python_version(), "command": command, "steps": args.steps}))
    if args.gpu_memory is not None and not args.gpu_memory > 0:
        ap.error(f"--gpu-memory must be > 0 GB, got {args.gpu_memory}")
    cases = list(SMOKE_CASES) if args.smoke else args.cases
    args.first_case = cases[0]   # --predict calibrates on it, predicts the others
    results: list[dict[str, Any]] = []
    for case in cases:
        r = run_case(case, args, out)
        results.append(r)
        r["when"] = time.strftime("%Y-%m-%d")
        print(json.dumps({k: r.get(k) for k in ("case", "median_step_seconds", "tokens_per_s",
                                                 "mfu", "error")}, default=float), flush=True)
        _write(out, results, command, args.steps)   # a later case's crash keeps these
    if args.predict and len(results) > 1:
        held_out(results, _device_name(results, args.smoke))
        _write(out, results, command, args.steps)
    return 1 if any("error" in r for r in results) else 0


def _device_name(results: list[dict[str, Any]], smoke: bool) -> str:
    """The catalogue entry's name of the run's device ("H200"), or the measured CPU's."""
    from workbench.hardware import cpu_spec, hardware_spec

    kind = next((r["workbench"]["device"] for r in results if r.get("workbench")), "")
    spec = cpu_spec(1) if smoke else hardware_spec(kind)
    return spec.name if spec is not None else kind


def _write(out: Path | None, results: list[dict[str, Any]], command: str, steps: int) -> None:
    """results.json, rows.json and each case's efficiency record (efficiency-<case>.json,
    the form ``workbench.hardware._efficiency.Efficiency.from_dict`` reads) into ``out``."""
    if out is None:
        return
    rows = [row for r in results for row in rows_of(r, command, steps)]
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    (out / "rows.json").write_text(json.dumps(rows, indent=1, default=float))
    for r in results:
        if r.get("efficiency"):
            (out / f"efficiency-{r['case']}.json").write_text(json.dumps(r["efficiency"],
                                                                         indent=1))


if __name__ == "__main__":
    sys.exit(main())
