"""``SearchResult`` of ``wb.search``: the rows, the best plan, the Pareto front and their text
form. No display imports here: a notebook draws it through
the display hook (``workbench._display``)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import jax

from workbench._display import Displayable, view
from workbench._sharding.layouts import format_bytes
from workbench.models import GPTConfig
from workbench.planning._background import Live
from workbench.planning._handle import Plan

__all__ = ["ROW_KEYS", "SearchResult", "SearchRow", "pareto_rows"]

#: The keys of every row of ``SearchResult.rows``.
ROW_KEYS = ("order", "rank", "id", "layout", "mesh", "rules", "remat", "microbatches",
            "memory_per_device", "limit", "fits", "over_by", "step_seconds", "mfu",
            "mfu_fp8", "tokens_per_s", "bound", "source", "analytic_rank", "exact_rank",
            "analytic_memory_per_device", "analytic_step_seconds", "no_overlap_seconds",
            "accumulator", "refit_spread", "implausible", "note")


@dataclasses.dataclass(kw_only=True, eq=False)
class SearchRow(MutableMapping):
    """One planned candidate of a ``wb.search``, ranked. Its fields read as a dict too
    (``row["step_seconds"]``, ``dict(row)``: the keys ``ROW_KEYS``), which is how tables,
    the widget and JSON take it; the search fills the ranks as it goes.

    Attributes:
        id: the candidate's number; layout: its label ("fsdp_tp data=16 model=8 remat=dots").
        mesh, rules, remat, microbatches: the candidate (rules: the preset's name).
        memory_per_device, limit, fits, over_by: bytes per device (plus the gradient
            accumulator of micro-batches), the device's memory, whether it fits, by how much
            it is over.
        step_seconds, mfu, tokens_per_s, bound, no_overlap_seconds: the prediction of one
            optimizer step (``Plan.predict``), and the step without overlap (ties).
        mfu_fp8: MFU against the chip's fp8 peak, for a model with fp8 matmuls
            (``Prediction.mfu_fp8``; ``mfu`` is against the bf16 peak); else None.
        source: where the numbers come from (the compiler, or "estimate").
        accumulator: bytes of the gradient accumulator (micro-batches > 1).
        analytic_memory_per_device, analytic_step_seconds: the formulas' numbers, kept
            when a compiled plan replaced them.
        refit_spread: where the formula's step is refitted to the TPU compiler's
            (``workbench.perf._refit``: GPT plans of scanned layers on a TPU slice), the
            refit's residual spread as a factor (exp(``RESIDUAL_SD``), 1.10); else None.
            The exact pass's stopping rule allows a compiled step that far below its
            formula step (``_search.ranking.next_batch``).
        analytic_rank, exact_rank, rank, order: ranks by formula, among the compiled, in
            the result; position in ``rows``.
        implausible: the prediction breaks a physical bound (``Prediction.implausible``,
            said in ``note``): never ranked.
        note: what was modelled or why the compiler rejected it.
    """

    id: int
    layout: str
    mesh: dict[str, int]
    rules: str
    remat: str | None
    microbatches: int
    memory_per_device: int
    limit: int | None
    accumulator: int
    fits: bool | None
    over_by: int | None
    step_seconds: float | None
    mfu: float | None
    mfu_fp8: float | None
    tokens_per_s: float | None
    bound: str | None
    no_overlap_seconds: float | None
    source: str
    analytic_memory_per_device: int
    analytic_step_seconds: float | None
    refit_spread: float | None = None
    analytic_rank: int | None = None
    exact_rank: int | None = None
    rank: int | None = None
    order: int | None = None
    implausible: bool = False
    note: str = ""

    def __getitem__(self, key: str) -> Any:
        if key not in _ROW_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in _ROW_FIELDS:
            raise KeyError(f"{key!r} is not a search row key; keys: {ROW_KEYS}")
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        raise TypeError("a search row's keys are fixed (ROW_KEYS)")

    def __iter__(self) -> Iterator[str]:
        return iter(_ROW_FIELDS)

    def __len__(self) -> int:
        return len(_ROW_FIELDS)

    def to_dict(self) -> dict[str, Any]:
        """The row as a plain dict (JSON-friendly)."""
        return dict(self)


_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(SearchRow))


def _fits(r: Mapping[str, Any]) -> bool:
    return r["fits"] is not False and r["step_seconds"] is not None \
        and not r.get("implausible")


def pareto_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The fitting rows no other fitting row beats in both memory per device and step time
    (at least as good in both, better in one); least memory first."""
    ok = [r for r in rows if _fits(r)]

    def beaten(r: Mapping[str, Any]) -> bool:
        m, t = r["memory_per_device"], r["step_seconds"]
        return any(s["memory_per_device"] <= m and s["step_seconds"] <= t
                   and (s["memory_per_device"] < m or s["step_seconds"] < t) for s in ok)

    return sorted((r for r in ok if not beaten(r)),
                  key=lambda r: (r["memory_per_device"], r["step_seconds"]))


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.4g} ms"


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False, eq=False)
class SearchResult(Live, Displayable):
    """Every candidate layout of a ``wb.search``, ranked (a notebook shows a sortable table
    and a chart of memory per device against predicted step time).

    Attributes:
        hardware: what was searched ("v5p-256", or the devices at hand).
        devices: number of devices.
        cfg: the model searched: a ``GPTConfig`` (remat as given; each row names its own)
            or a model factory's ``ModelSpec``.
        batch, seq: global batch (per optimizer step) and sequence length.
        rows: one ``SearchRow`` per planned candidate (keys ``ROW_KEYS``), in order: compiled and
            fitting (by ``exact_rank``), other fitting (by ``analytic_rank``), then those
            that do not fit (least memory first). ``memory_per_device``, ``fits``,
            ``step_seconds``... are the compiled plan's where ``source`` is a compiler,
            else analytic; ``analytic_*`` keep the analytic numbers; ``over_by`` is the
            bytes above ``limit``; ``note`` says what was modelled (micro-batching) or why
            the compiler rejected it.
        skipped: candidates not planned, each with its ``reason`` (a batch that does not
            divide over the data axes, heads that do not divide over the model axis...).
        plans: ``{row id: Plan}`` of the fitting rows (compiled where compiled; for
            micro-batched rows, the plan of one micro-batch).
        rank_changes: the compiled rows whose exact rank differs from their analytic rank
            (``id, layout, analytic_rank, exact_rank, analytic_step_seconds, step_seconds,
            why``); ``exact_rank`` None where the compiler says it does not fit.
        limit: device memory checked against (bytes; None if unknown).
        advice: when nothing fits: by how much the closest candidate is over and what,
            planned, would fit; else None.
        notes: what the search assumed or could not do, and why the exact pass stopped
            (the note starting "exact pass:": how many compiled, and that no candidate left
            could beat the best compiled step, or which the cap of ``2 top_k`` left out).
        analytic_seconds: time of the analytic pass; seconds: the whole search.
    """

    hardware: str
    devices: int
    cfg: GPTConfig | Any
    batch: int
    seq: int
    rows: list[SearchRow]
    skipped: list[dict[str, Any]]
    plans: dict[int, Plan]
    rank_changes: list[dict[str, Any]]
    limit: int | None
    advice: str | None
    notes: list[str]
    analytic_seconds: float
    seconds: float

    def wait(self, timeout: float | None = None) -> SearchResult:
        """Wait for the exact pass of ``wb.search(wait=False)``; returns this result, now
        what the blocking search returns. Ctrl-C (a kernel interrupt) cancels it.

        Args:
            timeout: seconds to wait at most (None: until the pass ends); past it a
                ``TimeoutError`` says so and the pass goes on.

        Raises:
            RuntimeError: the pass failed (a worker died) or was cancelled; the rows keep
                what was compiled, the rest the formula's numbers.
            TimeoutError: ``timeout`` passed first.
        """
        self._wait(timeout, "result.wait")
        return self

    def _update(self, **fields: Any) -> None:
        """Some fields replaced (a live search's rows re-ranked); its views redrawn."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        self._notify()

    def _land(self, other: SearchResult) -> None:
        """Every field of ``other`` (the exact pass's final result)."""
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, getattr(other, f.name))

    @property
    def fitting(self) -> list[SearchRow]:
        """The rows that fit (or whose fit is unknown) and have a prediction, best first."""
        return [r for r in self.rows if r["rank"] is not None]

    @property
    def best_row(self) -> SearchRow:
        """The row of the fastest layout that fits (raises like ``best``)."""
        if not self.fitting:
            raise ValueError(self.advice or "no candidate fits")
        return self.fitting[0]

    @property
    def best(self) -> Plan:
        """The Plan of the fastest layout that fits (compiled if the search compiled it).

        Raises:
            ValueError: nothing fits; the message says by how much and what would fit.
        """
        return self.plans[self.best_row["id"]]

    @property
    def pareto(self) -> list[dict[str, Any]]:
        """Fitting rows not dominated in (memory per device, step time); least memory first."""
        return [dict(r) for r in pareto_rows(self.rows)]

    def plan(self, row: Mapping[str, Any] | int) -> Plan:
        """The Plan of a fitting row (a row dict or its ``id``)."""
        rid = row["id"] if isinstance(row, Mapping) else int(row)
        if rid not in self.plans:
            raise KeyError(f"row id {rid} has no plan kept: only fitting rows keep theirs")
        return self.plans[rid]

    def summary(self) -> str:
        """Two lines: what was searched and what came out."""
        fit = self.fitting
        head = (f"wb.search on {self.hardware} ({self.devices} devices), batch {self.batch} x "
                f"seq {self.seq}, {self._model_text()}: "
                f"{len(self.rows)} planned, {len(self.skipped)} skipped, {len(fit)} fit in "
                f"{'-' if self.limit is None else format_bytes(self.limit)}/device "
                f"({self.seconds:.1f} s)")
        if not fit:
            return f"{head}\n  {self.advice}"
        b = fit[0]
        return (f"{head}\n  best: {b['layout']} — {_ms(b['step_seconds'])}/step, "
                f"{format_bytes(b['memory_per_device'])}/device ({b['source']})")

    def _model_text(self) -> str:
        """"GPT of 30.5M params" or "<factory name> of 1.2M params" (from a kept plan)."""
        if isinstance(self.cfg, GPTConfig):
            return f"GPT of {_count(self.cfg.n_params)} params"
        name = getattr(self.cfg, "name", "model")
        plan = next(iter(self.plans.values()), None)
        if plan is None:
            return f"model {name!r}"
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(plan.abstract_state.params))
        return f"{name} of {_count(n)} params"

    def table(self) -> str:
        """Every row as aligned text."""
        lines = [self.summary(), "",
                 f"{'#':>3} {'layout':<44}{'memory/dev':>11}{'fits':>6}{'step':>13}"
                 f"{'MFU':>7}{'bound':>15}  {'rank a/e':<9}source"]
        if any(r["mfu_fp8"] is not None for r in self.rows):
            lines.insert(2, "MFU: bf16 peak/fp8 peak (fp8 matmuls)")
        for r in self.rows:
            fits = {True: "yes", False: "NO", None: "?"}[r["fits"]]
            ranks = f"{r['analytic_rank'] or '-'}/{r['exact_rank'] or '-'}"
            mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}" + (
                "" if r["mfu_fp8"] is None else f"/{r['mfu_fp8']:.1%}")
            lines.append(f"{r['order']:>3} {r['layout']:<44}"
                         f"{format_bytes(r['memory_per_device']):>11}{fits:>6}"
                         f"{_ms(r['step_seconds']):>13}{mfu:>7}{r['bound'] or '-':>15}  "
                         f"{ranks:<9}{r['source']}")
        for c in self.rank_changes:
            lines.append(f"rank change: {c['layout']}: analytic {c['analytic_rank']} -> exact "
                         f"{c['exact_rank'] or 'does not fit'} ({_ms(c['analytic_step_seconds'])}"
                         f" -> {_ms(c['step_seconds'])})")
        lines += [f"note: {n}" for n in self.notes]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)}: " + "; ".join(
                f"{s['layout']}: {s['reason']}" for s in self.skipped[:4])
                + (" ..." if len(self.skipped) > 4 else ""))
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return f"<SearchResult {self.summary()}>"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the widget's rows)."""
        return {"hardware": self.hardware, "devices": self.devices, "batch": self.batch,
                "seq": self.seq, "limit": self.limit, "rows": [dict(r) for r in self.rows],
                "skipped": [dict(s) for s in self.skipped],
                "rank_changes": [dict(c) for c in self.rank_changes],
                "pareto": [r["id"] for r in self.pareto], "advice": self.advice,
                "notes": list(self.notes), "analytic_seconds": self.analytic_seconds,
                "seconds": self.seconds}

    def figure(self) -> Any:
        """A plotly figure: memory per device against predicted step time, the fitting
        region shaded, the Pareto front joined, hover naming the layout."""
        return view(self, "figure")(self)
