"""One search's candidates planned and measured (``Search``): its fixed settings (model,
hardware, batch, the plan's and the search's options) and the two passes over the
candidates, by formula (``analytic_pass``: every candidate planned without compiling,
ranked by predicted step time) and compiled (``exact_pass``: the best few and those that
could still beat them, ``ranking.next_batch``, re-ranked by their compiled predictions);
when nothing fits, by how much and what would (``advice``). ``search.search`` builds one
and runs the passes.

Micro-batching is gradient accumulation, modelled from the plan of one micro-batch
(``Search.measure``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from workbench._sharding.layouts import format_bytes
from workbench.models import GPTConfig
from workbench.perf._refit import RESIDUAL_SD
from workbench.any_model._spec import ModelSpec
from workbench.planning._compile import one_tracer
from workbench.planning._options import PlanOptions
from workbench.planning._planner import plan as make_plan
from workbench.planning._handle import Plan
from workbench._search.ranking import (REJECTED, compilable, exact_ranks, next_batch, order,
                                       rank_key, rankable)
from workbench._search.result import SearchResult, SearchRow
from workbench._search.space import (
    Candidate, Hardware, SearchOptions, hardware as resolve_hardware, invalid, larger_presets,
    mesh_shape, skip)

__all__ = ["Search"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Search:
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
        rows = order(rows)
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
               "implausible": False, "refit_spread": None}
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
                      "no_overlap_seconds": pred.breakdown["no_overlap_step"] * microbatches,
                      "refit_spread": math.exp(RESIDUAL_SD) if "refit" in pred.breakdown
                      else None}

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
        for i, r in enumerate(sorted(filter(rankable, rows), key=rank_key), 1):
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

        Which ones (``next_batch``): in the formula's order until ``top_k`` of them fit
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
        queue = sorted((r for r in rows if compilable(r)), key=rank_key)
        tried: list[dict[str, Any]] = []
        turn, stopped = threading.Lock(), None
        with concurrent.futures.ThreadPoolExecutor(self.opts.workers) as pool:
            while True:
                batch, stopped = next_batch(queue, tried, top_k, self.opts.workers, every)
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
        exact_ranks(tried)
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
            r.update({k: v for k, v in m.items()
                      if k not in ("accumulator", "problem", "refit_spread")})
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
