"""Exercises on pipeline parallelism, checked with the schedule's timeline and the model's
real shardings (``NamedSharding.shard_shape`` of the stacked blocks on a stage axis)."""
from __future__ import annotations

import re
from typing import Any

from workbench.exercises._core import AnswerError, Exercise, Result, close, parse_number

__all__ = ["pipeline_bubble", "stage_block_bytes"]

_KIB = 2**10


def _fraction(answer: Any) -> float:
    """``0.3``, ``30%`` or ``3/10``."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    text = str(answer).strip().replace(" ", "")
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if m and int(m.group(2)):
        return int(m.group(1)) / int(m.group(2))
    m = re.fullmatch(r"(\d+\.?\d*|\.\d+)%", text)
    if m:
        return float(m.group(1)) / 100
    m = re.fullmatch(r"\d+\.?\d*|\.\d+", text)
    if m:
        return float(text)
    raise AnswerError(f"could not read {text!r} as a fraction: write 0.25, 25% or 1/4")


def pipeline_bubble() -> Exercise:
    stages, micro = 4, 6

    def judge(frac: float) -> Result:
        from workbench.models._schedule import Pipeline, schedule_bubble, timeline

        events = timeline(Pipeline(microbatches=micro), stages)
        want = schedule_bubble(events, stages)
        span = max(e.end for e in events)
        if close(frac, want):
            return Result(correct=True, explanation=(
                f"Each stage works 6 forwards and 6 backwards (3 time units per micro-batch: "
                f"1 forward + 2 backward) out of a timeline of {span:g} units: idle "
                f"{span - 3 * micro:g} of {span:g} = {want:.4f}, the formula "
                f"(S-1)/(M+S-1) = 3/9. More micro-batches shrink it: 12 give 3/15."))
        mistakes = [
            ((stages - 1) / micro, "(S-1)/M is the bubble relative to the useful time, not "
                                   "the idle share of the whole timeline"),
            ((stages - 1) / stages, "that is the share of stages idle in the first step only"),
            (1 / stages, "1/S is each stage's share of the layers, not its idle time"),
            (1 - want, "that is the busy share; the question asks for the idle share"),
        ]
        for value, why in mistakes:
            if close(frac, value):
                return Result(correct=False, explanation=f"{frac:.4g}: {why}.")
        return Result(correct=False, explanation=(
            f"{frac:.4g} is not it. Draw it: stage s starts its first forward at time s and "
            f"the last stage must finish all forwards before the backwards run back."))

    return Exercise(
        name="pipeline_bubble", title="The bubble of a GPipe schedule", notebook="10",
        prompt=("A GPipe schedule on 4 stages with 6 micro-batches (a backward takes twice "
                "a forward). What fraction of each stage's time is idle (the bubble)?"),
        placeholder="e.g. 0.25, 25% or 1/4",
        hint="Count the time units of the whole timeline and the units each stage works.",
        solution="1/3", parse=_fraction, judge=judge)


def _stage_block_kib(n_layers: int, stages: int, data: int) -> tuple[float, float]:
    """(KiB of block parameters per device, KiB of all block parameters), from the
    stacked model's abstract state sharded by the fsdp preset on stage x data."""
    import jax
    from jax.sharding import NamedSharding

    from workbench._sharding.mesh import abstract_mesh
    from workbench.models import GPTConfig
    from workbench._sharding.pytrees import path_str
    from workbench._sharding.rules import Rules
    from workbench._train_state import abstract_model

    cfg = GPTConfig.preset("tiny", n_layers=n_layers, scan_layers=True)
    mesh = abstract_mesh(stage=stages, data=data)
    rules = Rules.preset("fsdp", mesh)
    _, params, logical = abstract_model(cfg)
    per_device = whole = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params["blocks"])[0]:
        name = "blocks." + path_str(path)
        spec = rules.spec(logical[name], tensor=name)
        block = NamedSharding(mesh.abstract, spec).shard_shape(leaf.shape)
        n = 1
        for s in block:
            n *= s
        per_device += n * leaf.dtype.itemsize
        whole += leaf.size * leaf.dtype.itemsize
    return per_device / _KIB, whole / _KIB


def stage_block_bytes() -> Exercise:
    n_layers, stages, data = 8, 4, 2

    def judge(kib: float) -> Result:
        want, whole = _stage_block_kib(n_layers, stages, data)
        if close(kib, want):
            return Result(correct=True, explanation=(
                f"The 8 stacked layers ({whole:,.0f} KiB of block weights in float32) are "
                f"split over stage=4 (2 layers per stage) and each weight's embed dim over "
                f"data=2 (fsdp): {whole:,.0f} / 8 = {want:,.1f} KiB per device."))
        mistakes = [
            (whole / stages, "that splits the layers over the stages but forgets fsdp's "
                             "split of embed over data=2"),
            (whole / data, "that shards embed over data but forgets that each stage holds "
                           "only its 2 of the 8 layers"),
            (whole, "that is every layer, whole: the stage axis and fsdp both split them"),
        ]
        for value, why in mistakes:
            if close(kib, value):
                return Result(correct=False, explanation=f"{kib:,.1f} KiB: {why}.")
        return Result(correct=False, explanation=(
            f"{kib:,.1f} KiB is not it; all block weights together are {whole:,.0f} KiB."))

    return Exercise(
        name="stage_block_bytes", title="Block weights per device with stages", notebook="10",
        prompt=("The tiny GPT with 8 stacked layers (scan_layers=True) on a mesh stage=4 x "
                "data=2 with the fsdp preset (layers over stage, embed over data). How many "
                "KiB of block parameters (float32, without the embedding and head) does each "
                "device hold?"),
        placeholder="e.g. 123 KiB",
        hint="Each tiny block has q, k, v, o, gate, up, down and two norms; count one block, "
             "then see which mesh axes split the stacked weights.",
        solution="240.5 KiB", parse=parse_number("KiB"), judge=judge)
