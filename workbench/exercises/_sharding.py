"""Exercises on meshes and PartitionSpecs, checked with JAX's own shardings."""
from __future__ import annotations

import itertools
import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from workbench.exercises._core import (
    Exercise,
    Result,
    fmt_spec,
    parse_axes,
    parse_number,
    parse_ranges,
    parse_spec,
)
from workbench._sharding.layouts import normalize_spec
from workbench._sharding.mesh import make_mesh, mesh_info

__all__ = ["concrete_mesh", "device_block", "mesh_for_block", "replication", "spec_for_block",
           "vocab_padding"]


def concrete_mesh(**axes: int) -> Mesh:
    """A real mesh of ``prod(axes)`` devices: the default backend's, else simulated CPUs."""
    n = math.prod(axes.values())
    devs = jax.devices()
    if len(devs) < n:
        try:
            devs = jax.devices("cpu")
        except RuntimeError:
            devs = []
    if len(devs) < n:
        raise RuntimeError(
            f"this exercise compiles on a mesh of {n} devices but JAX has {len(jax.devices())}; "
            f"restart the kernel and run wb.simulate_devices({n}) before anything else")
    return make_mesh(axes, devices=devs[:n])


def _abstract(axes: dict[str, int]) -> AbstractMesh:
    return AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def _axes_of_size(m: int, sizes: dict[str, int]) -> list[str]:
    """Mesh axes, or tuples of them, whose sizes multiply to ``m``."""
    out = []
    for r in (1, 2):
        for combo in itertools.permutations(sizes, r):
            if math.prod(sizes[a] for a in combo) == m:
                out.append(repr(combo[0]) if r == 1 else repr(combo))
    return out[:4]


def _spec_errors(shape: tuple[int, ...], spec: PartitionSpec, axes: dict[str, int],
                 name: str) -> str | None:
    """JAX's and workbench's complaint about a spec, as the learner should read it."""
    try:
        normalize_spec(spec, len(shape), mesh_info(_abstract(axes)), name)
        NamedSharding(_abstract(axes), spec).shard_shape(shape)
    except ValueError as e:  # jax's IndivisibleError is a ValueError
        return str(e).split(" (full shape")[0]
    return None


def block_feedback(shape: tuple[int, ...], spec: PartitionSpec, axes: dict[str, int],
                   got: tuple[int, ...], want: tuple[int, ...]) -> list[str]:
    """One line per dim where the learner's block differs from the target block."""
    lines = []
    norm = normalize_spec(spec, len(shape), mesh_info(_abstract(axes)))
    for d, (n, g, w, used) in enumerate(zip(shape, got, want, norm)):
        if g == w:
            continue
        how = f"over {used[0]!r}" if len(used) == 1 else f"over {used}"
        yours = "you leave it whole" if not used else f"you split it {n // g} ways {how}"
        need = n // w
        fix = ("so leave it unsplit (None)" if need == 1 else
               f"so split it {need} ways: " + " or ".join(_axes_of_size(need, axes)))
        lines.append(f"dim {d} (size {n}): {yours}, giving {g} per device; the target is {w}, "
                     f"{fix}")
    return lines


def spec_for_block() -> Exercise:
    shape, axes, want = (64, 2048, 12288), {"data": 8, "model": 8}, (8, 2048, 1536)

    def judge(spec: PartitionSpec) -> Result:
        err = _spec_errors(shape, spec, axes, "x")
        if err:
            return Result(correct=False, explanation=err)
        got = tuple(NamedSharding(_abstract(axes), spec).shard_shape(shape))
        if got == want:
            swapped = " (P('model', None, 'data') gives the same block; by convention the " \
                      "batch dim goes on 'data')" if spec != PartitionSpec("data", None, "model") \
                      else ""
            return Result(correct=True, explanation=(
                f"JAX gives each of the 64 devices a {got} block: dim 0 is split 8 ways, dim 2 "
                f"is split 8 ways, dim 1 stays whole{swapped}."))
        lines = block_feedback(shape, spec, axes, got, want)
        return Result(correct=False, explanation=(
            f"{fmt_spec(spec)} gives each device a {got} block, not {want}:\n  "
            + "\n  ".join(lines)))

    return Exercise(
        name="spec_for_block", title="A PartitionSpec for a given block", notebook="02",
        prompt=("An activation x of shape (64, 2048, 12288) (batch, seq, hidden) lives on an "
                "8x8 mesh with axes data=8 and model=8.\nWrite the PartitionSpec that gives "
                "each device an (8, 2048, 1536) block.\n(A PartitionSpec has one entry per "
                "tensor dim: a mesh axis name, a tuple of names, or None.)"),
        placeholder="P('data', None, 'model')",
        hint="64 / 8 = 8 and 12288 / 8 = 1536: split dims 0 and 2, one 8-way axis each, and "
             "keep dim 1 whole with None.",
        solution="P('data', None, 'model')", parse=parse_spec, judge=judge)


def mesh_for_block() -> Exercise:
    shape, spec, want = (32, 4096), PartitionSpec("data", "model"), (8, 2048)

    def judge(sizes: dict[str, int]) -> Result:
        if set(sizes) != {"data", "model"}:
            return Result(correct=False, explanation=(
                f"the mesh needs exactly the axes 'data' and 'model' (the spec names them); "
                f"you gave {sorted(sizes)}"))
        n = math.prod(sizes.values())
        if n != 8:
            return Result(correct=False, explanation=(
                f"data={sizes['data']} x model={sizes['model']} = {n} devices, but there are 8:"
                " the product of the axis sizes must be the number of devices"))
        err = _spec_errors(shape, spec, sizes, "w")
        if err:
            return Result(correct=False, explanation=err)
        mesh = concrete_mesh(**sizes)
        got = tuple(NamedSharding(mesh, spec).shard_shape(shape))
        if got == want:
            return Result(correct=True, explanation=(
                f"on data={sizes['data']}, model={sizes['model']} JAX gives each device a "
                f"{got} block: 32/4 rows and 4096/2 columns."))
        return Result(correct=False, explanation=(
            f"with data={sizes['data']}, model={sizes['model']} each device gets a {got} block "
            f"(32/{sizes['data']} rows, 4096/{sizes['model']} columns), not {want}."))

    return Exercise(
        name="mesh_for_block", title="Choose the mesh shape", notebook="01",
        prompt=("With 8 devices, choose the sizes of the mesh axes 'data' and 'model' so "
                "that a (32, 4096) weight with PartitionSpec P('data', 'model') gives each "
                "device an (8, 2048) block."),
        placeholder="data=?, model=?",
        hint="rows: 32 / data = 8; columns: 4096 / model = 2048; and data x model = 8.",
        solution="data=4, model=2", parse=parse_axes, judge=judge)


def device_block() -> Exercise:
    shape, spec, axes = (16, 8), PartitionSpec("data", "model"), {"data": 4, "model": 2}
    coord = (2, 1)

    def judge(ranges: tuple[tuple[int, int], ...]) -> Result:
        mesh = concrete_mesh(**axes)
        dev = mesh.devices[coord]
        ref = NamedSharding(mesh, spec).devices_indices_map(shape)[dev]
        want = tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(ref, shape))
        text = "x[" + ", ".join(f"{a}:{b}" for a, b in want) + "]"
        if len(ranges) != len(shape):
            return Result(correct=False, explanation=(
                f"x has {len(shape)} dims, so give {len(shape)} ranges, like x[0:4, 0:4]"))
        if tuple(ranges) == want:
            return Result(correct=True, explanation=(
                f"JAX's devices_indices_map agrees: the device at data=2, model=1 (device id "
                f"{dev.id}) holds {text}: block 2 of 4 along rows, block 1 of 2 along "
                "columns."))
        lines = []
        for d, (g, w, ax) in enumerate(zip(ranges, want, ("data", "model"))):
            if g != w:
                k = axes[ax]
                lines.append(f"dim {d}: {g[0]}:{g[1]} is wrong; dim {d} is split {k} ways over "
                             f"{ax!r}, blocks of {shape[d] // k}, and this device is number "
                             f"{coord[d]} along {ax!r}")
        return Result(correct=False, explanation="\n".join(lines))

    return Exercise(
        name="device_block", title="Which block does a device hold?", notebook="02",
        prompt=("x has shape (16, 8) and PartitionSpec P('data', 'model') on the mesh "
                "data=4, model=2. Which slice of x does the device at mesh position "
                "data=2, model=1 hold? (Positions count from 0.)"),
        placeholder="x[a:b, c:d]",
        hint="rows are cut in 4 blocks of 4 (by 'data'), columns in 2 blocks of 4 (by "
             "'model'); take block 2 of the rows and block 1 of the columns.",
        solution="x[8:12, 4:8]", parse=parse_ranges, judge=judge)


def replication() -> Exercise:
    shape, spec, axes = (1024, 4096), PartitionSpec(None, "model"), {"data": 4, "model": 2}

    def judge(value: float) -> Result:
        mesh = concrete_mesh(**axes)
        index_map = NamedSharding(mesh, spec).devices_indices_map(shape)
        groups: dict[Any, list[int]] = {}
        for dev, idx in index_map.items():
            groups.setdefault(tuple((s.start, s.stop) for s in idx), []).append(dev.id)
        copies = len(next(iter(groups.values())))
        shown = "; ".join(f"{sorted(ids)}" for ids in groups.values())
        if value == copies:
            return Result(correct=True, explanation=(
                f"JAX places each of the {len(groups)} blocks on {copies} devices (device ids "
                f"{shown}): 'data' does not appear in the spec, so the tensor is replicated "
                f"along it."))
        why = ("that is the number of distinct blocks, not copies of each" if value == len(groups)
               else "that is every device" if value == 8 else "count again")
        return Result(correct=False, explanation=(
            f"{value:g}: {why}. JAX puts each block on {copies} devices (groups {shown})."))

    return Exercise(
        name="replication", title="How many copies?", notebook="02",
        prompt=("A weight w of shape (1024, 4096) has PartitionSpec P(None, 'model') on the "
                "mesh data=4, model=2. How many devices hold an identical copy of each block?"),
        placeholder="a number",
        hint="an axis missing from the spec means: replicated along that axis.",
        solution="4", parse=parse_number(None), judge=judge)


def vocab_padding() -> Exercise:
    vocab, d_model, axes = 50257, 768, {"model": 8}

    def judge(value: float) -> Result:
        if value != int(value) or value < vocab:
            return Result(correct=False, explanation=(
                f"{value:g}: the vocabulary can only grow (padding rows that no token uses), "
                f"so give an integer >= {vocab}"))
        v = int(value)
        mesh = _abstract(axes)
        try:
            rows = NamedSharding(mesh, PartitionSpec("model", None)).shard_shape((v, d_model))[0]
        except ValueError as e:
            return Result(correct=False, explanation=(
                "JAX refuses it: " + str(e).split(" (full shape")[0]))
        if rows % 8:
            return Result(correct=False, explanation=(
                f"JAX splits ({v}, {d_model}) into blocks of {rows} rows, and {rows} is not a "
                f"multiple of 8"))
        best = next(n for n in range(vocab, vocab + 64 * 8) if n % 64 == 0)
        if v != best:
            return Result(correct=False, explanation=(
                f"{v} works ({rows} rows per device, a multiple of 8) but it is not the "
                f"smallest: a smaller size also works"))
        return Result(correct=True, explanation=(
            f"JAX splits ({v}, {d_model}) into 8 blocks of {rows} rows ({rows} = 8 x "
            f"{rows // 8}); {v - vocab} padding rows are never used by a token. nanoGPT pads "
            "GPT-2's vocabulary to 50304 for the same reason."))

    return Exercise(
        name="vocab_padding", title="Pad the vocabulary", notebook="02",
        prompt=("GPT-2's vocabulary has 50257 tokens. JAX refuses to shard a (50257, 768) "
                "embedding over model=8, because 50257 is not divisible by 8. What is the "
                "smallest vocabulary size >= 50257 that splits evenly over model=8 and gives "
                "each device a multiple of 8 rows?"),
        placeholder="a vocabulary size",
        hint="8 devices x a multiple of 8 rows: the size must be a multiple of 64.",
        solution="50304", parse=parse_number(None), judge=judge)

