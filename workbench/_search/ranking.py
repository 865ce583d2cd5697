"""The order of a search's rows and the exact pass's stopping rule: plain functions of the
rows (``SearchRow`` dicts: the formula's and the compiler's step, fit, memory), so the rule
is checked on tables of measured steps without a compiler
(``tests/test_search_exact.py``).

``order`` puts the rows that fit and have a plausible prediction first (compiled ones by
their compiled rank, then by the formula's), the rest by memory; ``next_batch`` says which
candidates the exact pass compiles next, or why it stops.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["REJECTED", "compilable", "exact_ranks", "next_batch", "order", "rank_key",
           "rankable"]

#: a compiled row's ``source`` when the TPU compiler refused its step as out of memory
REJECTED = "tpu-compiler (rejected)"


def next_batch(queue: list[dict[str, Any]], tried: list[dict[str, Any]], top_k: int,
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
       Where the formula's step is refitted to the compiler's (``refit_spread``: GPT
       plans of scanned layers on a TPU slice, ``workbench.perf._refit``), the refit
       already models what the strategy and remat policy add (fitted on the 7B's 18
       compiled steps at 4096 tokens, within its interval on the 32k table and the
       reference rows it was not fitted on), so such a candidate is compiled only when its
       formula step x the smaller of ``r`` and 1 / ``refit_spread`` (a step one residual
       spread below its formula) is below ``best``: the 7B on v5p-128 takes 3 compiles
       (it took 7, 1 refused, before), the 7B at 32768 tokens 4 (1 refused; 9 before).
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
    done = _compiled_text(tried)
    if not left:
        return [], f"exact pass: {done}: every candidate that fits by formula"
    ranked = [t for t in tried if rankable(t)]
    if not ranked:
        return [], (f"exact pass: {done}, the cap (2 x top_k), and the compiler says none "
                    f"fits: {_names(left)} not compiled: raise top_k to compile them "
                    "(exact='all' compiles every candidate)")
    could, best, r = _could_win(left, ranked)
    at = f"{best * 1e3:.4g} ms"
    if not could:
        refitted = [row["refit_spread"] for row in left if row.get("refit_spread")]
        if not refitted:
            return [], (f"exact pass: {done}; stopped: no remaining candidate could beat "
                        f"{at} even at the most favourable compiled/formula ratio seen "
                        f"({r:.1f}x), and every strategy and remat policy left has a "
                        "compiled row")
        return [], (f"exact pass: {done}; stopped: no remaining candidate could beat {at} "
                    f"even at the most favourable compiled/formula ratio seen ({r:.2f}x) or "
                    f"{max(refitted):.2f}x below its refitted formula step (the refit's "
                    "residual spread, workbench.perf._refit)"
                    + ("" if len(refitted) == len(left) else
                       ", and every strategy and remat policy left without a refit has a "
                       "compiled row"))
    if room <= 0:
        return [], (f"exact pass: {done}, the cap (2 x top_k); {_names(could)} could still "
                    f"beat {at} (a strategy or remat policy not compiled yet, or below it at "
                    f"the most favourable compiled/formula ratio seen, {r:.1f}x): raise top_k "
                    "to compile them (exact='all' compiles every candidate)")
    return could[:min(room, workers)], None


def _could_win(left: list[dict[str, Any]], ranked: list[dict[str, Any]]
               ) -> tuple[list[dict[str, Any]], float, float]:
    """``(could, best, r)``: the rows of ``left`` that could still beat ``best``, the best
    compiled step of ``ranked``: the first of each strategy with no compiled row yet, and
    any whose formula step x ``r`` (the smallest compiled / formula ratio of ``ranked``;
    0 when there is none, and every row could) is below ``best``."""
    best = min(t["step_seconds"] for t in ranked)
    r = min((t["step_seconds"] / t["analytic_step_seconds"] for t in ranked
             if t["analytic_step_seconds"] > 0), default=0.0)
    seen = {_strategy(t) for t in ranked}
    could = []
    for row in left:
        spread = row.get("refit_spread")
        if spread:   # the refit models what the strategy and remat policy add
            if row["analytic_step_seconds"] * min(r, 1 / spread) < best:
                could.append(row)
        elif _strategy(row) not in seen or row["analytic_step_seconds"] * r < best:
            could.append(row)
            seen.add(_strategy(row))
    return could, best, r


def exact_ranks(tried: list[dict[str, Any]]) -> None:
    """Number the compiled rows that rank by their compiled predictions."""
    for i, r in enumerate(sorted(filter(rankable, tried), key=rank_key), 1):
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


def _compiled_text(tried: list[Mapping[str, Any]]) -> str:
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

def compilable(r: Mapping[str, Any]) -> bool:
    """Fits by formula (or its fit is unknown) and has a prediction, plausible or not."""
    return r["fits"] is not False and r["step_seconds"] is not None


def rankable(r: Mapping[str, Any]) -> bool:
    return r["fits"] is not False and r["step_seconds"] is not None \
        and not r.get("implausible")


def rank_key(r: Mapping[str, Any]) -> tuple:
    """Faster first; ties (compute-bound steps hide their communication) by the step
    without overlap, then by memory."""
    return (r["step_seconds"], r["no_overlap_seconds"], r["memory_per_device"], r["id"])


def order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compiled and fitting first (by exact rank), then the other fitting rows (by analytic
    rank), then the rest (least memory first); ``rank`` and ``order`` numbered."""
    ok = sorted(filter(rankable, rows),
                key=lambda r: (r["exact_rank"] is None, r["exact_rank"] or 0, r["analytic_rank"]))
    rest = sorted((r for r in rows if not rankable(r)),
                  key=lambda r: (r["memory_per_device"], r["id"]))
    for i, r in enumerate(ok, 1):
        r["rank"] = i
    for i, r in enumerate(ok + rest, 1):
        r["order"] = i
    return ok + rest
