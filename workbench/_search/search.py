"""Layout search (``wb.search``): mesh splits x rules x remat x micro-batches of one model
on one slice, planned by formula, ranked by predicted step time, the best few compiled.

::

    res = wb.search(cfg, hardware="v5p-256", batch=256, seq=4096)
    res.best                  # the Plan of the fastest layout that fits
    res.rows, res.pareto      # every candidate; the memory / step-time front
    res.rank_changes          # where the compiled programs reordered the analytic top k

Each candidate is ``wb.plan(..., compile=False)``: memory, FLOPs and collectives by
formula, timed by the roofline of ``predict.py``. Micro-batching is gradient
accumulation, modelled from the plan of one micro-batch (``_Search.measure``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optax

from workbench._display import status_line
from workbench._optimizer import AdamW
from workbench._validate import check_bool
from workbench.planning import _background as background
from workbench._notebook import in_notebook
from workbench._sharding.layouts import format_bytes
from workbench.models import GPTConfig
from workbench.any_model._spec import ModelSpec, from_nnx
from workbench.planning._compile import one_tracer
from workbench.planning._options import DEFAULT_REPLICATED_THRESHOLD, PlanOptions
from workbench.planning._planner import plan as make_plan
from workbench.planning._handle import Plan
from workbench._search.result import SearchResult, SearchRow
from workbench._search.space import (
    DEFAULT_REMAT, DEFAULT_STRATEGIES, EXPERT_STRATEGIES, Candidate, Hardware, SearchOptions,
    candidates, hardware as resolve_hardware, invalid, larger_presets, mesh_shape,
    check_seq, model_candidates, skip)
from workbench._sharding.rules import Rules
from workbench._step import LossFn

#: a compiled row's ``source`` when the TPU compiler refused its step as out of memory
REJECTED = "tpu-compiler (rejected)"

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
            the best (``_next_batch``); up to ``2 top_k`` steps the compiler refuses as out
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
    s = _Search(cfg=cfg, hw=resolve_hardware(hardware), batch=batch,
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


def _live(s: _Search, rows: list[SearchRow], plans: dict[int, Plan], cands: list[Candidate],
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
        _exact_ranks(tried)
        result._update(rows=_order(rows), plans={r["id"]: plans[r["id"]] for r in rows
                                                 if r["id"] in plans and _rankable(r)},
                       seconds=time.perf_counter() - t0)

    def run(b: background.Background) -> SearchResult:
        b.mark("compiling")
        changes = live.exact_pass(rows, plans, cands, s.opts.top_k, notes, landed=landed)
        return live.result(rows, plans, cands, skipped, changes, notes, analytic_seconds, t0)

    result._start(bg, run, result._land)
    return result


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Search:
    """One search's fixed settings: plans candidates and measures them."""

    cfg: GPTConfig | ModelSpec
    hw: Hardware
    batch: int
    seq: int
    plan_opts: PlanOptions
    opts: SearchOptions
    say: Callable[..., None]
    #: ``{candidate id: the attention its plan runs, and why}`` (``Plan.attention``)
    attention: dict[int, str] = dataclasses.field(default_factory=dict)
    #: compile in background worker processes (``wb.search(wait=False)``)
    live: bool = False
    #: the background plans being compiled (cancelled with the search)
    running: list[Plan] = dataclasses.field(default_factory=list)
    #: set when a live search is cancelled: no further candidate is planned
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def plan(self, c: Candidate, *, compile: bool | None, hw: Hardware | None = None,
             batch: int | None = None) -> Plan:
        """``wb.plan`` of one micro-batch of ``c`` (on ``hw``, of ``batch`` if given)."""
        hw, batch = hw or self.hw, batch or self.batch
        model = self.cfg if c.remat is None else self.cfg.replace(
            remat=c.remat, **({"scan_layers": True} if c.pipeline else {}))
        return make_plan(model, mesh=hw.mesh(c.mesh), rules=c.rules,
                         batch=batch // c.microbatches, seq=self.seq,
                         **self.plan_opts.replace(
                             name=c.label, compile=compile, pipeline=c.pipeline,
                             progress=self.opts.progress and compile is not False
                         ).as_keywords(),
                         wait=not (self.live and compile is not False))

    def result(self, rows: list[SearchRow], plans: dict[int, Plan], cands: list[Candidate],
               skipped: list[dict[str, Any]], changes: list[dict[str, Any]],
               notes: list[str], analytic_seconds: float, t0: float) -> SearchResult:
        """The ``SearchResult`` of the rows as they are ranked now."""
        rows = _order(rows)
        fitting = [r for r in rows if r["rank"] is not None]
        advice = None if fitting else self.advice(rows, cands, self.opts.remat)
        self.say(f"{len(rows)} candidates on {self.hw.name} in "
                 f"{time.perf_counter() - t0:.1f} s: {len(fitting)} fit"
                 + (f"; best {fitting[0]['layout']}" if fitting else ""), final=True)
        return SearchResult(
            hardware=self.hw.name, devices=self.hw.size, cfg=self.cfg, batch=self.batch,
            seq=self.seq, rows=rows, skipped=skipped,
            plans={r["id"]: plans[r["id"]] for r in fitting}, rank_changes=changes,
            limit=rows[0]["limit"], advice=advice, notes=notes,
            analytic_seconds=analytic_seconds, seconds=time.perf_counter() - t0)

    def measure(self, p: Plan, microbatches: int, batch: int | None = None) -> dict[str, Any]:
        """Memory, fit and predicted time of one optimizer step of ``batch`` run as
        ``microbatches`` accumulated steps of ``p`` (the plan of one micro-batch).

        Memory: the micro-batch step's, plus a gradient accumulator the size of the
        gradients when ``microbatches > 1``. Time: ``microbatches`` x the micro-batch step
        (the optimizer update and gradient reduction counted each time: an upper bound).
        """
        batch = batch or self.batch
        mem = p.memory
        acc = int(mem.get("gradients") or 0) if microbatches > 1 else 0
        total, limit = int(mem["total"]) + acc, mem.get("limit")
        out = {"memory_per_device": total, "limit": limit, "accumulator": acc,
               "fits": None if not limit else total <= limit,
               "over_by": None if not limit else max(0, total - limit),
               "step_seconds": None, "mfu": None, "mfu_fp8": None, "tokens_per_s": None,
               "bound": None, "no_overlap_seconds": None, "source": p.source, "problem": None,
               "implausible": False}
        try:
            pred = p.predict(overlap=self.opts.overlap)
        except (ValueError, OSError) as err:  # a hardware table without the numbers
            return out | {"problem": f"no prediction: {err}"}
        step = pred.step_seconds * microbatches
        if pred.implausible:   # never ranked: the prediction breaks a physical bound
            out["problem"] = "implausible prediction, not ranked: " + "; ".join(pred.implausible)
        return out | {"implausible": bool(pred.implausible),
                      "step_seconds": step, "mfu": pred.mfu, "mfu_fp8": pred.mfu_fp8,
                      "bound": pred.bound,
                      "tokens_per_s": batch * p.report.seq / step if step > 0 else None,
                      "no_overlap_seconds": pred.breakdown["no_overlap_step"] * microbatches}

    def row(self, c: Candidate, p: Plan) -> SearchRow:
        """The result row of candidate ``c`` planned as ``p``."""
        m = self.measure(p, c.microbatches)
        notes = [m.pop("problem")] if m["problem"] else []
        m.pop("problem", None)
        if c.microbatches > 1:
            notes.append(f"{c.microbatches} micro-batches of {self.batch // c.microbatches}: "
                         f"memory of one plus a {format_bytes(m['accumulator'])} gradient "
                         f"accumulator; time {c.microbatches} x its step (upper bound)")
        if m["fits"] is None:
            notes.append("device memory unknown: pass memory_limit= to check the fit")
        uneven = sum(len(w.paths) or 1 for w in p.warnings if w.kind == "uneven")
        if uneven:
            notes.append(f"{uneven} tensor(s) padded (a dim does not divide its mesh axes)")
        return SearchRow(id=c.id, layout=c.label, mesh=dict(c.mesh), rules=c.rules_name,
                         remat=c.remat, microbatches=c.microbatches, **m,
                         analytic_memory_per_device=m["memory_per_device"],
                         analytic_step_seconds=m["step_seconds"], note="; ".join(notes))

    # -- the passes -------------------------------------------------------------------------

    def analytic_pass(self, cands: list[Candidate], skipped: list[dict[str, Any]]
                      ) -> tuple[list[SearchRow], dict[int, Plan]]:
        """Plan every candidate by formula; rows ranked by ``analytic_rank``; the plans of
        those that fit. A candidate ``wb.plan`` refuses goes to ``skipped``."""
        self.say(f"planning {len(cands)} candidates on {self.hw.name}")
        rows, plans = [], {}
        for i, c in enumerate(cands, 1):
            self.say(f"candidate {i}/{len(cands)}: {c.label}")
            try:
                p = self.plan(c, compile=False)
            except (ValueError, TypeError, KeyError) as err:
                skipped.append(skip(c, f"wb.plan raised {type(err).__name__}: {err}"))
                continue
            rows.append(self.row(c, p))
            self.attention[c.id] = p.attention or ""
            if rows[-1]["fits"] is not False:
                plans[c.id] = p
        if not rows:
            reasons = sorted({s["reason"] for s in skipped}) or [self.no_candidates()]
            raise ValueError(f"wb.search: no candidate can be planned on {self.hw.name} "
                             f"(batch={self.batch}, seq={self.seq}): "
                             + "; ".join(reasons[:6]))
        for i, r in enumerate(sorted(filter(_rankable, rows), key=_key), 1):
            r["analytic_rank"] = i
        return rows, plans

    def attention_notes(self) -> list[str]:
        """Where candidates on an accelerator run XLA attention (the T x T scores held in
        memory, what keeps a 7B at 4k tokens off a v5p without a fused kernel): how many,
        and why."""
        xla = [a for a in self.attention.values()
               if a.startswith("xla:") and "on cpu" not in a]
        if not xla:
            return []
        return [f"{len(xla)} of {len(self.attention)} candidates hold the T x T attention "
                f"scores ({xla[0]}); attention='auto' runs the fused kernel (splash on TPU, "
                "cuDNN on GPU) wherever the layout allows it"]

    def no_candidates(self) -> str:
        """Why the search space was empty before anything was planned."""
        n_exp = getattr(self.cfg, "n_experts", 0)
        if n_exp:
            sizes = [d for d in range(2, self.hw.size + 1)
                     if self.hw.size % d == 0 and n_exp % d == 0]
            if not sizes:
                return (f"the expert-parallel strategies need an expert axis of size > 1 "
                        f"dividing both n_experts={n_exp} and the {self.hw.size} devices, "
                        "and none does: use n_experts with a common factor with the device "
                        "count (e.g. a power of two), or strategies without experts "
                        "('fsdp', 'tp')")
        return ("no layout was generated from these strategies and mesh shapes: widen "
                "strategies= or mesh_shapes=")

    def exact_pass(self, rows: list[dict[str, Any]], plans: dict[int, Plan],
                   cands: list[Candidate], top_k: int, notes: list[str], *,
                   landed: Callable[[list[dict[str, Any]]], None] | None = None
                   ) -> list[dict[str, Any]]:
        """Compile candidates, ``workers`` at once, and re-rank them by their compiled
        predictions; returns the rank changes, and says in ``notes`` why it stopped.

        Which ones (``_next_batch``): in the formula's order until ``top_k`` of them fit
        (going further down where the compiler says one does not fit), then those that
        could still beat the best compiled step, up to ``2 top_k`` compiles in all; or every
        candidate that fits by formula (``exact="all"``). The queue holds every candidate
        that fits by formula, also those whose formula prediction is above the MFU ceiling
        (not ranked by formula: a roofline at peak FLOP/s, which fsdp's compute-bound steps
        reach); their compiled prediction decides. ``landed(tried)`` is called after
        each batch is in (a live search re-ranks its table).
        """
        by_id = {c.id: c for c in cands}
        every = self.opts.exact == "all"
        queue = sorted((r for r in rows if _compilable(r)), key=_key)
        tried: list[dict[str, Any]] = []
        turn, stopped = threading.Lock(), None
        with concurrent.futures.ThreadPoolExecutor(self.opts.workers) as pool:
            while True:
                batch, stopped = _next_batch(queue, tried, top_k, self.opts.workers, every)
                if not batch:
                    break
                self.say(f"exact {len(tried) + 1}-{len(tried) + len(batch)} of at most "
                         f"{len(queue) if every else min(len(queue), 2 * top_k)}: compiling "
                         + ", ".join(r["layout"] for r in batch))
                compiled = list(pool.map(lambda r: self.compile(by_id[r["id"]], turn),
                                         batch))
                if not self._take(batch, compiled, tried, plans, notes):
                    stopped = None   # nothing compiles here: _take said so
                    break
                if landed is not None:
                    landed(tried)
        if stopped:
            notes.append(stopped)
        _exact_ranks(tried)
        return [{"id": r["id"], "layout": r["layout"], "analytic_rank": r["analytic_rank"],
                 "exact_rank": r["exact_rank"],
                 "analytic_step_seconds": r["analytic_step_seconds"],
                 "step_seconds": r["step_seconds"],
                 "why": "the compiler says it does not fit" if r["fits"] is False
                 else "its formula prediction was above the MFU ceiling (not ranked by "
                 "formula); compiled, it ranks" if r["analytic_rank"] is None
                 else "its compiled prediction moves it"}
                for r in tried if r["exact_rank"] != r["analytic_rank"]]

    def compile(self, c: Candidate, turn: threading.Lock) -> Plan:
        """``c`` planned with its compile, tracing and lowering in ``turn`` (one thread at a
        time, ``_compile.one_tracer``), the compiler beside the other workers'."""
        with one_tracer(turn):
            if self.stop.is_set():
                raise RuntimeError("wb.search: the exact pass was cancelled")
            p = self.plan(c, compile=None)
        if p.compile_state is None:
            return p
        self.running.append(p)   # in a worker process: cancelled with the search
        try:
            return p.wait()
        finally:
            self.running.remove(p)

    def _take(self, batch: list[dict[str, Any]], compiled: list[Plan],
              tried: list[dict[str, Any]], plans: dict[int, Plan], notes: list[str]) -> bool:
        """Update the rows of ``batch`` from their compiled plans (in queue order); False
        when nothing compiles here (the ranking stays analytic, said in ``notes``)."""
        for r, p in zip(batch, compiled):
            rejected = "compiler_required_temp" in p.memory  # the TPU compiler's OOM verdict
            if p.source == "estimate" and not rejected:
                why = p.source_reason.split(";")[0].removeprefix("analytic estimate: ")
                notes.append(f"exact pass: nothing compiled ({why}); the ranking is analytic")
                return False
            m = self.measure(p, r["microbatches"])
            r.update({k: v for k, v in m.items() if k not in ("accumulator", "problem")})
            if m["problem"]:
                r["note"] = "; ".join(filter(None, [r["note"], m["problem"]]))
            r["source"] = REJECTED if rejected else p.source
            tried.append(r)
            if rejected:
                r["note"] = "; ".join(filter(None, [r["note"], p.source_reason]))
                plans.pop(r["id"], None)
            else:
                plans[r["id"]] = p
        return True

    # -- when nothing fits --------------------------------------------------------------------

    def advice(self, rows: list[dict[str, Any]], cands: list[Candidate],
               remats: Sequence[str]) -> str:
        """By how much the closest candidate is over, and changes to it that were planned
        and fit: remat="full", more micro-batches, a larger slice, a smaller batch."""
        flagged = [r for r in rows if r.get("implausible") and r["fits"] is not False]
        if flagged:
            return (f"{len(flagged)} candidate(s) fit but none has a plausible prediction, "
                    f"so none is ranked: {flagged[0]['layout']}: {flagged[0]['note']}")
        sized = [r for r in rows if r["limit"]]
        if not sized:
            return "nothing could be predicted: " + (rows[0]["note"] or "no prediction")
        r = min(sized, key=lambda r: r["memory_per_device"])
        c = next(x for x in cands if x.id == r["id"])
        lim, need = r["limit"], r["memory_per_device"]
        head = (f"Nothing fits in {format_bytes(lim)} per device on {self.hw.name}: the "
                f"closest, {c.label}, needs {format_bytes(need)}, {format_bytes(need - lim)} "
                f"({need / lim - 1:.0%}) over.")
        fits = [f"{text}: {format_bytes(m['memory_per_device'])}"
                + (f", {m['step_seconds'] * 1e3:.4g} ms/step" if m["step_seconds"] else "")
                for text, m in self._alternatives(c, remats) if m["fits"]]
        if not fits:
            return head + (" None of remat='full', more micro-batches, a larger slice or a "
                           "smaller batch (each planned) fits either: shard the model further "
                           "or make it smaller.")
        return head + " What fits (each planned): " + "; ".join(fits) + "."

    def _alternatives(self, c: Candidate, remats: Sequence[str]
                      ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(what was changed, its measure) for each change to ``c`` that can be planned."""
        tries: list[tuple[str, Candidate, Hardware, int]] = []
        if c.remat not in ("full", None):
            tries.append(("remat='full'" + ("" if "full" in remats else " (not searched)"),
                          dataclasses.replace(c, remat="full"), self.hw, self.batch))
        for k in (2, 4, 8, 16, 32):
            cm = dataclasses.replace(c, microbatches=c.microbatches * k)
            if self.batch % cm.microbatches == 0 and invalid(self.cfg, cm, self.batch) is None:
                tries.append((f"microbatches={cm.microbatches} (same global batch)", cm,
                              self.hw, self.batch))
        for name in larger_presets(self.hw):
            big = resolve_hardware(name)
            shape = mesh_shape({**c.mesh, "data": -1} if "data" in c.mesh else
                               {"data": -1, "model": c.mesh.get("model", 1)}, big.size, name)
            tries.append((f"more devices: hardware={name!r} ({big.size} devices)",
                          dataclasses.replace(c, mesh=shape), big, self.batch))
        for b in (self.batch // 2, self.batch // 4, self.batch // 8):
            if b >= c.microbatches and invalid(self.cfg, c, b) is None:
                tries.append((f"a smaller batch: batch={b}", c, self.hw, b))
        for text, cand, hw, batch in tries:
            try:
                p = self.plan(cand, compile=False, hw=hw, batch=batch)
            except (ValueError, TypeError, KeyError):
                continue
            yield text, self.measure(p, cand.microbatches, batch)


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


# -- the exact pass's stopping rule ------------------------------------------------------------

def _next_batch(queue: list[dict[str, Any]], tried: list[dict[str, Any]], top_k: int,
                workers: int, every: bool) -> tuple[list[dict[str, Any]], str | None]:
    """The exact pass's next candidates to compile (at most ``workers``), or none and the
    note saying why it stops.

    ``queue``: the candidates that fit by formula, in the formula's order; ``tried``: those
    compiled so far (their rows updated: ``step_seconds`` compiled, ``analytic_step_seconds``
    the formula's). ``exact="all"`` (``every``) compiles the whole queue. Otherwise:

    1. the formula's first ``top_k`` that the compiler says fit (one it rejects as out of
       memory is replaced by the next), as before;
    2. then every candidate that could still beat the best compiled step ``best``: one
       whose formula step x ``r`` is below ``best``, ``r`` being the smallest compiled /
       formula ratio among the compiled rows that fit (the most favourable correction the
       compiler has shown), or one of a strategy (rules preset, pipelined or not) with
       no compiled row yet, remat policy included (``_strategy``): the compiler has shown
       no correction for it, and corrections differ by strategy (measured on tiny v5e-8
       programs: 7.8-8.9x for dp and tp against 11.4-13.2x for fsdp; moe-tiny's fsdp 14.0x
       against ep's 15.4-15.9x, which made it the best at analytic rank 4) and by remat
       policy (the 7B's fsdp_tp data=32 model=2 on v5p-128: 1.30x with remat=none, 1.16x
       with remat=dots, which made it the best at analytic rank 5). The ratio test alone
       would never go further: ``r`` comes from a compiled row at least as fast by formula
       as any candidate left, so ``formula x r`` is at least that row's compiled step. It
       bites when a strategy compiled later shows a smaller ratio; candidates are
       rechecked after every batch.
    3. at most ``2 top_k`` compiles in all, not counting the first ``2 top_k`` the
       compiler refuses as out of memory (its verdict comes early: under 10 s each for the
       7B on v5p-128, against 60-1,263 s for a step that fits; bounded all the same, for a
       model the formula places far below its compiled memory): where the cap stops it
       while candidates could still win, the note names them and says to raise top_k.
    """
    left = [r for r in queue if all(r is not t for t in tried)]
    if every:
        return left[:workers], None if left else (
            f"exact pass: {len(tried)} compiled (exact='all': every candidate that fits by "
            "formula)")
    refused = sum(map(_rejected, tried))
    room = 2 * top_k - (len(tried) - refused) - max(0, refused - 2 * top_k)
    fit = sum(t["fits"] is not False for t in tried)
    if left and room > 0 and fit < top_k:
        return left[:min(room, top_k - fit, workers)], None
    done = _compiled(tried)
    if not left:
        return [], f"exact pass: {done}: every candidate that fits by formula"
    ranked = [t for t in tried if _rankable(t)]
    if not ranked:
        return [], (f"exact pass: {done}, the cap (2 x top_k), and the compiler says none "
                    f"fits: {_names(left)} not compiled: raise top_k to compile them "
                    "(exact='all' compiles every candidate)")
    best = min(t["step_seconds"] for t in ranked)
    r = min((t["step_seconds"] / t["analytic_step_seconds"] for t in ranked
             if t["analytic_step_seconds"] > 0), default=0.0)   # 0: no ratio, all could
    seen = {_strategy(t) for t in ranked}
    could = []
    for row in left:
        if _strategy(row) not in seen or row["analytic_step_seconds"] * r < best:
            could.append(row)
            seen.add(_strategy(row))
    at = f"{best * 1e3:.4g} ms"
    if not could:
        return [], (f"exact pass: {done}; stopped: no remaining candidate could beat {at} "
                    f"even at the most favourable compiled/formula ratio seen ({r:.1f}x), and "
                    "every strategy and remat policy left has a compiled row")
    if room <= 0:
        return [], (f"exact pass: {done}, the cap (2 x top_k); {_names(could)} could still "
                    f"beat {at} (a strategy or remat policy not compiled yet, or below it at "
                    f"the most favourable compiled/formula ratio seen, {r:.1f}x): raise top_k "
                    "to compile them (exact='all' compiles every candidate)")
    return could[:min(room, workers)], None


def _exact_ranks(tried: list[dict[str, Any]]) -> None:
    """Number the compiled rows that rank by their compiled predictions."""
    for i, r in enumerate(sorted(filter(_rankable, tried), key=_key), 1):
        r["exact_rank"] = i


def _strategy(r: Mapping[str, Any]) -> str:
    """A row's rules preset, its pipeline stages when pipelined, and its remat policy: what
    the compiler's correction to the formula is taken to depend on (measured: the 7B's
    fsdp_tp data=32 model=2 on v5p-128 compiles at 1.30x its formula step with remat=none,
    1.16x with remat=dots)."""
    stages = r["mesh"].get("stage", 1)
    return (r["rules"] + (f" stage={stages}" if stages > 1 else "")
            + f" remat={r['remat']}")


def _rejected(r: Mapping[str, Any]) -> bool:
    """The compiler refused the step as out of memory: its verdict comes early (the 7B on
    v5p-128: under 10 s, against 60-1,263 s for a step that fits), so the cap counts only
    the refusals beyond ``2 top_k``."""
    return r["source"] == REJECTED


def _compiled(tried: list[Mapping[str, Any]]) -> str:
    """``7 compiled (1 refused as out of memory)``."""
    refused = sum(map(_rejected, tried))
    return f"{len(tried)} compiled" + (f" ({refused} refused as out of memory)" if refused else "")


def _names(rows: list[Mapping[str, Any]]) -> str:
    """``analytic rank(s) 5, 7`` and the layouts of rows the formula does not rank."""
    ranks = [str(r["analytic_rank"]) for r in rows if r["analytic_rank"] is not None]
    other = [f"{r['layout']} (not ranked by formula)" for r in rows
             if r["analytic_rank"] is None]
    return " and ".join(filter(None, [
        f"analytic rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks[:6])}" if ranks
        else "", ", ".join(other[:3])]))


# -- ordering ------------------------------------------------------------------------------

def _compilable(r: Mapping[str, Any]) -> bool:
    """Fits by formula (or its fit is unknown) and has a prediction, plausible or not."""
    return r["fits"] is not False and r["step_seconds"] is not None


def _rankable(r: Mapping[str, Any]) -> bool:
    return r["fits"] is not False and r["step_seconds"] is not None \
        and not r.get("implausible")


def _key(r: Mapping[str, Any]) -> tuple:
    """Faster first; ties (compute-bound steps hide their communication) by the step
    without overlap, then by memory."""
    return (r["step_seconds"], r["no_overlap_seconds"], r["memory_per_device"], r["id"])


def _order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compiled and fitting first (by exact rank), then the other fitting rows (by analytic
    rank), then the rest (least memory first); ``rank`` and ``order`` numbered."""
    ok = sorted(filter(_rankable, rows),
                key=lambda r: (r["exact_rank"] is None, r["exact_rank"] or 0, r["analytic_rank"]))
    rest = sorted((r for r in rows if not _rankable(r)),
                  key=lambda r: (r["memory_per_device"], r["id"]))
    for i, r in enumerate(ok, 1):
        r["rank"] = i
    for i, r in enumerate(ok + rest, 1):
        r["order"] = i
    return ok + rest


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
