"""Layout search (``wb.search``): mesh splits x rules x remat x micro-batches of one model
on one slice, planned by formula, ranked by predicted step time, the best few compiled.

::

    res = wb.search(cfg, hardware="v5p-256", batch=256, seq=4096)
    res.best                  # the Plan of the fastest layout that fits
    res.rows, res.pareto      # every candidate; the memory / step-time front
    res.rank_changes          # where the compiled programs reordered the analytic top k

Each candidate is ``wb.plan(..., compile=False)``: memory, FLOPs and collectives by
formula, timed by the roofline of ``perf._predict``. Micro-batching is gradient
accumulation, modelled from the plan of one micro-batch (``passes.Search.measure``).

This module checks the arguments and runs the passes (``passes.Search``), at once or, with
``wait=False``, the exact pass in the background (``_live``); the rows' order and the exact
pass's stopping rule are ``ranking``'s.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

from workbench._display import status_line
from workbench._optimizer import AdamW
from workbench._validate import check_bool
from workbench.planning import _background as background
from workbench._notebook import in_notebook
from workbench.models import GPTConfig
from workbench.any_model._spec import ModelSpec, from_nnx
from workbench.planning._options import DEFAULT_REPLICATED_THRESHOLD, PlanOptions
from workbench.planning._handle import Plan
from workbench._search.passes import Search
from workbench._search.ranking import exact_ranks, order, rankable
from workbench._search.result import SearchResult, SearchRow
from workbench._search.space import (
    DEFAULT_REMAT, DEFAULT_STRATEGIES, EXPERT_STRATEGIES, Candidate, SearchOptions, candidates,
    check_seq, hardware as resolve_hardware, model_candidates)
from workbench._sharding.rules import Rules
from workbench._step import LossFn

__all__ = ["DEFAULT_REMAT", "DEFAULT_STRATEGIES", "SearchOptions", "SearchResult", "SearchRow",
           "search"]


def search(cfg: GPTConfig | Any, hardware: str | Any = None, *, batch: int,
           seq: int | None = None,
           strategies: Sequence[str | Rules] = DEFAULT_STRATEGIES,
           remat: Sequence[str] = DEFAULT_REMAT, microbatches: Sequence[int] = (1,),
           mesh_shapes: Sequence[Mapping[str, int] | tuple[int, int]] | None = None,
           max_model: int = 16, top_k: int = 3, exact: bool | str = True, workers: int = 2,
           overlap: float | None = None, stages: Sequence[int] = (1,),
           pipeline: Mapping[str, Any] | None = None, memory_limit: int | None = None,
           optimizer: optax.GradientTransformation | AdamW | None = None,
           dtype: str | None = None,
           replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD,
           loss_fn: LossFn | None = None, example_batch: Any = None, progress: bool = True,
           wait: bool = True) -> SearchResult:
    """Search layouts of ``cfg`` on ``hardware``: plan each by formula, keep what fits, rank
    by predicted step time, compile the best ``top_k`` and those that could still beat
    them, and re-rank them by their compiled predictions.

    Args:
        cfg: the model: a ``GPTConfig`` (remat is varied with ``cfg.replace(remat=...)``),
            or anything ``wb.plan`` takes (a ``wb.any_model.from_nnx`` / ``from_penzai`` spec,
            a factory ``rngs -> nnx.Module``): its remat is its own, and the candidates are
            the rules that fit its annotations (``search_space.model_candidates``: meshes
            with the mesh axes the annotations name, or the presets for logical and penzai
            axes), ranked the same way.
        hardware: a preset ("v5p-256", "v5e-16", "2x8xH100"), a mesh whose devices (or
            preset) to use, or None for the devices at hand (those of
            ``workbench._sharding.placement``'s default mesh, as ``wb.plan`` without a mesh).
        batch: global batch (sequences per optimizer step).
        seq: sequence length (default ``cfg.seq_len``).
        wait: True (the default, what scripts get): return when the exact pass is done.
            False: return the formula's ranking at once while the exact pass compiles in
            background worker processes (``wb.plan(wait=False)``, ``workers`` at once);
            the same result, and its table, re-rank as each compile lands, and the best
            row is the exact best once ``result.compile_state`` is "compiled".
            ``result.ready``, ``result.wait()`` (Ctrl-C there cancels),
            ``result.cancel()``.
        strategies: rules presets ("dp", "fsdp", "tp", "fsdp_tp"; "ep", "fsdp_ep", "ep_tp"
            for a mixture-of-experts config) or ``Rules`` naming the mesh axes ``data``
            and ``model``. A MoE config (``cfg.n_experts > 0``) searched with the default
            also gets the expert-parallel presets ep, fsdp_ep (on ``data x expert``
            meshes) and ep_tp (``data x expert x model``), the expert axis taking each
            size > 1 dividing both ``n_experts`` and the devices.
        remat: remat policies to try ("none", "dots", "full").
        microbatches: gradient-accumulation steps to try (each must divide ``batch``).
        mesh_shapes: meshes to try, ``{"data": 16, "model": 8}`` or ``(16, 8)``; default
            ``data x model`` with ``model`` a power of two up to ``max_model`` dividing the
            devices (dp and fsdp shard over every axis: they get ``model=1`` only).
        max_model: largest model axis of the default meshes.
        top_k: how many of the best analytic candidates to compile (0: none); beyond
            them, up to ``2 top_k`` compiles, those that could still beat the best compiled
            step: the best by formula of each strategy and remat policy not compiled yet,
            and any whose formula step x the smallest compiled/formula ratio seen is below
            the best (``ranking.next_batch``); up to ``2 top_k`` steps the compiler refuses as out
            of memory (an early verdict) do not count. ``notes`` says why it stopped, or
            which analytic ranks the cap left out. Abstract TPU presets compile with the TPU
            compiler, real meshes with XLA; other hardware (GPU presets) stays analytic,
            said in ``notes``.
            Candidates whose formula prediction is above the MFU ceiling (``perf.bounds``:
            a roofline at peak, as fsdp's often is) are compiled in their place in the
            formula's order: the compiled program decides whether they rank.
        exact: False skips compilation altogether; "all" compiles every candidate that fits
            by formula (the exhaustive reference the default's best is checked against,
            ``tests/test_search_exact.py``).
        workers: candidates compiled at once (threads: the compilers run in parallel while
            one thread at a time traces and lowers the next, so each program is the one a
            serial search lowers). Each compile holds its program's memory.
        overlap: fraction of communication hidden behind compute in the predictions
            (``Plan.predict``; default by platform: 1 on TPU/GPU, 0 on CPU). With full
            overlap compute-bound layouts tie; ties go to the least exposed communication
            (the step without overlap), then to the least memory.
        stages: pipeline stage counts to try besides none (1): each ``s > 1`` adds
            candidates with a ``stage`` axis of size ``s`` taken from ``data``, planned with
            ``scan_layers=True`` and ``pipeline``.
        pipeline: the pipelined candidates' ``{"microbatches", "schedule", "repeats"}``
            (default GPipe with ``2 x stages`` micro-batches).
        memory_limit: bytes per device to fit in (default: the device's memory).
        optimizer, dtype, replicated_threshold: as ``wb.plan``'s, for every candidate
            (each compiles with the platform's overlap flags, ``wb.plan``'s default).
        loss_fn: a factory's ``(model, batch) -> loss`` (as ``wb.plan``; a spec's own
            otherwise).
        example_batch: a factory's batch, ``(batch, seq) -> {name: ShapeDtypeStruct}`` or a
            fixed dict (as ``wb.any_model.from_nnx``; micro-batches need the callable).
        progress: one status line while it works, and the compiler's own while compiling.

    Returns:
        A ``SearchResult``: ``.rows``, ``.best`` (a Plan), ``.pareto``, ``.rank_changes``,
        ``.table()``, ``.figure()``; when nothing fits, ``.advice`` says by how much and
        what would, and ``.best`` raises it.

    Raises:
        ValueError: unknown hardware/strategy/remat, a micro-batch count that does not
            divide ``batch``, ``top_k < 0``, an empty option, or no candidate can be
            planned.
        TypeError: a flag that is not a bool, a ``loss_fn`` that is not callable (an
            unknown keyword: Python's own TypeError naming it).

    Example::

        res = wb.search(wb.models.GPTConfig.preset("7b"), "v5p-256", batch=256, seq=4096,
                        microbatches=(1, 2))
        res.best.summary()
    """
    t0 = time.perf_counter()
    wait = check_bool(wait, "wait", where="wb.search: ")
    opts = SearchOptions(strategies=strategies, remat=remat, microbatches=microbatches,
                         mesh_shapes=mesh_shapes, max_model=max_model, stages=stages,
                         pipeline=pipeline, top_k=top_k, exact=exact, workers=workers,
                         memory_limit=memory_limit, overlap=overlap, progress=progress)
    plan_opts = PlanOptions(optimizer=optimizer, dtype=dtype, memory_limit=memory_limit,
                            replicated_threshold=replicated_threshold, loss_fn=loss_fn,
                            example_batch=example_batch, progress=progress)
    gpt = isinstance(cfg, GPTConfig)
    if not gpt:
        cfg = _as_spec(cfg, plan_opts.loss_fn, plan_opts.example_batch, opts.remat,
                       opts.microbatches)
        plan_opts = plan_opts.replace(loss_fn=None, example_batch=None)   # the spec's now
    elif plan_opts.loss_fn is not None or plan_opts.example_batch is not None:
        raise ValueError("loss_fn= and example_batch= are for a model factory; a GPTConfig "
                         "trains on tokens with the next-token loss")
    opts.check(batch, gpt=gpt)
    check_seq(seq)
    s = Search(cfg=cfg, hw=resolve_hardware(hardware), batch=batch,
                seq=int(seq or (cfg.seq_len if gpt else 1)), plan_opts=plan_opts, opts=opts,
                say=_Status("wb.search", opts.progress))
    cands, skipped = candidates(cfg, s.hw, batch, opts) if gpt else \
        model_candidates(cfg, s.hw, batch, opts)
    rows, plans = s.analytic_pass(cands, skipped)
    analytic_seconds = time.perf_counter() - t0
    notes = _notes(opts.mesh_shapes, rows) + s.attention_notes()
    exact = opts.exact == "all" or (opts.exact and opts.top_k)
    if exact and not wait:
        return _live(s, rows, plans, cands, skipped, notes, analytic_seconds, t0)
    changes = s.exact_pass(rows, plans, cands, opts.top_k, notes) if exact else []
    return s.result(rows, plans, cands, skipped, changes, notes, analytic_seconds, t0)


def _live(s: Search, rows: list[SearchRow], plans: dict[int, Plan], cands: list[Candidate],
          skipped: list[dict[str, Any]], notes: list[str], analytic_seconds: float,
          t0: float) -> SearchResult:
    """The formula's ranking now; the exact pass in a background thread, each compile in a
    worker process (``wb.plan(wait=False)``), the result re-ranked as each lands and made
    equal to the blocking search's when the pass ends."""
    live = dataclasses.replace(s, say=_Status("wb.search", False), live=True,
                               opts=dataclasses.replace(s.opts, progress=False))
    result = s.result(rows, plans, cands, skipped, [], list(notes), analytic_seconds, t0)
    bg = background.Background(f"wb.search on {s.hw.name}")
    if s.opts.progress:   # one line, replaced when the exact pass ends
        s.say("the formula's ranking now; the exact pass compiles in background workers "
              "(result.wait() for the exact best)", final=True)
        said: list[str] = []

        def ended() -> None:
            if bg.done and not said:
                said.append(bg.state)
                s.say(f"exact pass {bg.state} in {time.perf_counter() - t0:.1f} s"
                      + (f": best {result.fitting[0]['layout']}" if result.fitting else ""),
                      final=True)
        result._watch(ended)

    def cancel() -> None:
        live.stop.set()
        for p in list(live.running):
            p.cancel()

    bg.on_cancel = cancel

    def landed(tried: list[dict[str, Any]]) -> None:
        exact_ranks(tried)
        result._update(rows=order(rows), plans={r["id"]: plans[r["id"]] for r in rows
                                                if r["id"] in plans and rankable(r)},
                       seconds=time.perf_counter() - t0)

    def run(b: background.Background) -> SearchResult:
        b.mark("compiling")
        changes = live.exact_pass(rows, plans, cands, s.opts.top_k, notes, landed=landed)
        return live.result(rows, plans, cands, skipped, changes, notes, analytic_seconds, t0)

    result._start(bg, run, result._land)
    return result


def _as_spec(model: Any, loss_fn: Any, example_batch: Any, remat: Sequence[str],
             microbatches: Sequence[int]) -> ModelSpec:
    """A factory (or spec) as the ``ModelSpec`` every candidate is planned with."""
    if not callable(model):
        raise TypeError(f"wb.search: cfg={model!r} is a {type(model).__name__}; cfg must be a "
                        "GPTConfig or a model factory (rngs -> nnx.Module, wb.any_model.from_nnx "
                        "/ from_penzai)")
    if tuple(remat) != DEFAULT_REMAT:
        raise ValueError(f"remat={tuple(remat)!r}: a model factory sets its own remat "
                         "(nnx.remat in the module); leave remat out")
    if isinstance(example_batch, Mapping) and tuple(microbatches) != (1,):
        raise ValueError(f"microbatches={tuple(microbatches)!r} need example_batch as a "
                         "callable (batch, seq) -> {name: ShapeDtypeStruct}: a fixed dict "
                         "has one batch size")
    if isinstance(model, ModelSpec):
        changes = {k: v for k, v in (("loss_fn", loss_fn), ("example_batch", example_batch))
                   if v is not None}
        if isinstance(changes.get("example_batch"), Mapping):
            fixed = dict(changes["example_batch"])
            changes["example_batch"] = lambda b, t: fixed
        return model.replace(**changes)
    return from_nnx(model, loss_fn=loss_fn, example_batch=example_batch)


def _notes(mesh_shapes: Any, rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    if mesh_shapes is None and any(r["rules"] in ("dp", "fsdp") for r in rows):
        notes.append("dp and fsdp shard over every mesh axis, so they are planned on "
                     "model=1 only; tp and fsdp_tp on model > 1")
    if mesh_shapes is None and any(r["rules"] in EXPERT_STRATEGIES for r in rows):
        notes.append("ep, fsdp_ep and ep_tp shard the experts over an 'expert' axis whose "
                     "size divides n_experts (each device holds whole experts)")
    if any(r["microbatches"] > 1 for r in rows):
        notes.append("mb = micro-batches: gradient accumulation, with the memory of one "
                     "micro-batch's step plus a gradient accumulator, and micro-batches x "
                     "its step time")
    return notes


class _Status:
    """One status line (``status_line``), updated every 5 s at most outside a notebook."""

    def __init__(self, prefix: str, enabled: bool) -> None:
        self.prefix, self.enabled = prefix, enabled
        self.update: Callable[[str], None] | None = None
        self.last = 0.0

    def __call__(self, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        now, line = time.perf_counter(), f"{self.prefix}: {text}"
        if self.update is None:
            self.update, self.last = status_line(line), now
        elif final or in_notebook() or now - self.last >= 5.0:
            self.update(line)
            self.last = now
