"""What ``wb.search`` enumerates: the hardware, its mesh splits, the candidates (rules x
remat x micro-batches) and why a candidate cannot be planned as asked.

One file on purpose: the search space is one thing (the hardware, the options that bound it,
the candidates and why one is skipped), and its parts share the candidate record and the
options' checks."""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import nnx

from workbench.hardware import generation
from workbench._validate import check_float, check_int
from workbench._sharding.mesh import abstract_mesh, make_mesh, mesh_info
from workbench.models import GPTConfig
from workbench.models._remat import REMAT_POLICIES
from workbench.perf._analytic import axes_size
from workbench._sharding.rules import Rules

__all__ = ["DEFAULT_REMAT", "DEFAULT_STRATEGIES", "EXPERT_STRATEGIES", "Candidate",
           "Hardware", "SearchOptions", "candidates", "expert_sizes", "hardware", "invalid",
           "larger_presets", "mesh_shape", "model_candidates", "skip"]

DEFAULT_STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")
#: Expert-parallel presets, searched besides the dense ones for a mixture-of-experts config.
EXPERT_STRATEGIES = ("ep", "fsdp_ep", "ep_tp")
DEFAULT_REMAT = ("none", "dots", "full")
PRESETS = ("dp", "fsdp", "tp", "fsdp_tp", "cp", "fsdp_cp",   # cp: mesh_shapes with a context axis
           *EXPERT_STRATEGIES)
# cfg dimensions a tensor-parallel split must divide exactly (attention reshapes them)
_EXACT = {"heads": "n_heads", "kv_heads": "n_kv_heads", "mlp": "d_ff"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout: mesh shape, rules, remat policy and micro-batches per optimizer step."""

    id: int
    mesh: dict[str, int]
    rules: str | Rules
    rules_name: str
    remat: str | None
    microbatches: int
    pipeline: Mapping[str, Any] | None = None

    @property
    def label(self) -> str:
        """``"fsdp_tp data=16 model=8 remat=dots mb=2"`` (mb: micro-batches, when > 1;
        ``pp=gpipe/8``: a pipeline over the ``stage`` axis, its schedule and micro-batches;
        no remat for a model factory, which sets its own)."""
        shape = " ".join(f"{a}={s}" for a, s in self.mesh.items())
        mb = f" mb={self.microbatches}" if self.microbatches > 1 else ""
        remat = "" if self.remat is None else f" remat={self.remat}"
        pp = "" if self.pipeline is None else \
            f" pp={self.pipeline['schedule']}/{self.pipeline['microbatches']}" + (
                f"x{self.pipeline['repeats']}" if self.pipeline.get("repeats", 1) > 1 else "")
        return f"{self.rules_name} {shape}{remat}{mb}{pp}"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the search lays out over: a preset (abstract meshes) or the devices at hand."""

    name: str
    size: int
    mesh: Callable[[dict[str, int]], Any]
    preset: str | None


def hardware(spec: Any) -> Hardware:
    """A preset name, a mesh (its devices, or its preset when abstract), or None (the
    devices of ``workbench._sharding.placement``'s default mesh: ``jax.devices()``)."""
    if isinstance(spec, str):
        try:
            size = abstract_mesh(spec).size
        except ValueError as err:
            raise ValueError(f"wb.search(hardware={spec!r}): {err}") from None
        return Hardware(spec, size, lambda s: abstract_mesh(spec, **s), spec)
    if spec is None:   # the devices of workbench._sharding.placement's default mesh
        from workbench._sharding.placement import resolve_placement

        devices = list(resolve_placement(where="wb.search").mesh.devices.flat)
    else:
        try:
            info = mesh_info(spec)
        except TypeError as err:
            raise TypeError(f"wb.search(hardware={spec!r:.80}): {err}; give a preset such as "
                            "'v5p-256' or '8xH100', a mesh, or None for the devices at hand"
                            ) from None
        if info.jax_mesh is None:
            if info.hardware is None:
                raise ValueError("wb.search needs a hardware preset or real devices; this "
                                 "abstract mesh has neither: use hardware='v5p-256' or similar")
            return hardware(info.hardware)
        devices = list(info.jax_mesh.devices.flat)
    name = f"{len(devices)} x {devices[0].device_kind} at hand"
    return Hardware(name, len(devices), lambda s: make_mesh(s, devices=devices), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What ``wb.search`` varies and how far it goes (its keyword arguments, documented
    there): the layouts (``strategies``, ``remat``, ``microbatches``, ``mesh_shapes``,
    ``max_model``, ``stages``, ``pipeline``), the exact pass (``top_k``, ``exact``,
    ``workers``), the fit and the prediction (``memory_limit``, ``overlap``) and
    ``progress``."""

    strategies: Sequence[str | Rules] = DEFAULT_STRATEGIES
    remat: Sequence[str] = DEFAULT_REMAT
    microbatches: Sequence[int] = (1,)
    mesh_shapes: Sequence[Mapping[str, int] | tuple[int, int]] | None = None
    max_model: int = 16
    stages: Sequence[int] = (1,)
    pipeline: Mapping[str, Any] | None = None
    top_k: int = 3
    exact: bool | str = True
    workers: int = 2
    memory_limit: int | None = None
    overlap: float | None = None
    progress: bool = True

    def check(self, batch: int, *, gpt: bool) -> None:
        """Raise ``ValueError`` naming the bad option and what to give instead (remat is
        checked for a GPTConfig only: a model factory sets its own)."""
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        self._check_layouts(batch, gpt=gpt)
        self._check_pass()
        check_stages(self.stages)
        self._check_mesh_shapes()

    def _check_layouts(self, batch: int, *, gpt: bool) -> None:
        """``strategies``, ``remat`` (a GPTConfig's) and ``microbatches``: non-empty lists
        of presets or Rules, named policies, and counts that divide ``batch``."""
        examples = {"strategies": DEFAULT_STRATEGIES, "remat": DEFAULT_REMAT,
                    "microbatches": (1, 2)}
        remat = self.remat if gpt else DEFAULT_REMAT
        for name, value in (("strategies", self.strategies), ("remat", remat),
                            ("microbatches", self.microbatches)):
            if isinstance(value, (str, Rules)) or not isinstance(value, (list, tuple)) \
                    or not len(value):
                raise ValueError(f"{name}={value!r}: give a non-empty list, e.g. "
                                 f"{name}={examples[name]!r}")
        for s in self.strategies:
            if not isinstance(s, Rules) and s not in PRESETS:
                raise ValueError(f"unknown strategy {s!r}; use rules presets {PRESETS} or "
                                 "wb.Rules objects")
        for r in remat:
            if not isinstance(r, str):
                raise TypeError(f"remat holds {r!r:.80}: wb.search compares named policies "
                                f"({sorted(REMAT_POLICIES)}); plan a custom policy with "
                                "wb.plan(cfg.replace(remat={'save': [...], 'offload': [...]}))")
            if r not in REMAT_POLICIES:
                raise ValueError(f"unknown remat policy {r!r}; choose from "
                                 f"{sorted(REMAT_POLICIES)}")
        for m in self.microbatches:
            if not isinstance(m, int) or m < 1 or batch % m:
                ok = [d for d in range(1, batch + 1) if batch % d == 0][:12]
                raise ValueError(f"batch {batch} is not divisible by microbatches={m!r}; use "
                                 f"micro-batch counts that divide the batch: {ok}")

    def _check_pass(self) -> None:
        """The exact pass and the fit: ``memory_limit``, ``top_k``, ``exact``, ``workers``,
        ``max_model`` and ``overlap``."""
        if self.memory_limit is not None:
            check_int(self.memory_limit, "memory_limit", where="wb.search: ",
                      fix="bytes per device, e.g. memory_limit=16 * 2**30")
        top_k = self.top_k
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (how many candidates to compile), "
                             f"got {top_k!r}; top_k=0 or exact=False compiles none")
        if self.exact not in (True, False, "all"):
            raise ValueError(f"exact={self.exact!r}: give True (compile the analytic best "
                             "top_k), False (compile none) or 'all' (compile every candidate "
                             "that fits by formula: the exhaustive reference)")
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) \
                or self.workers < 1:
            raise ValueError(f"workers must be a positive int (compiles at once), got "
                             f"{self.workers!r}")
        if not isinstance(self.max_model, int) or isinstance(self.max_model, bool) \
                or self.max_model < 1:
            raise ValueError(f"max_model must be a positive int, got {self.max_model!r}")
        if self.overlap is not None and not 0.0 <= check_float(
                self.overlap, "overlap", where="wb.search: ",
                example="overlap=0.5 (the fraction of communication hidden)") <= 1.0:
            raise ValueError(f"overlap must be in [0, 1] or None, got {self.overlap!r}")

    def _check_mesh_shapes(self) -> None:
        """None, or a non-empty list of ``{"data": d, "model": m}`` / ``(d, m)`` shapes."""
        shapes = self.mesh_shapes
        if shapes is None:
            return
        if isinstance(shapes, (str, Mapping)) or not isinstance(shapes, (list, tuple)) \
                or not shapes:
            raise TypeError(f"mesh_shapes={shapes!r:.80}: give a non-empty list of mesh "
                            "shapes, e.g. mesh_shapes=[{'data': 16, 'model': 8}, (32, 4)], or "
                            "None for every split")
        for shape in shapes:
            sizes = list(shape.values()) if isinstance(shape, Mapping) else shape
            if isinstance(shape, str) or not isinstance(sizes, (list, tuple)) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in sizes):
                raise TypeError(f"mesh_shapes holds {shape!r:.80}: each shape is a dict of "
                                "axis sizes or a (data, model) pair of ints, e.g. "
                                "{'data': 16, 'model': 8} or (16, 8)")


def check_seq(seq: Any) -> None:
    """Raise naming ``seq`` unless it is a positive int or None (the model's seq_len)."""
    if seq is not None:
        check_int(seq, "seq", where="wb.search: ",
                  fix="seq is tokens per sequence; leave it out for the model's seq_len")


def check_stages(stages: Any) -> None:
    """Raise naming ``stages`` unless it is a non-empty list of positive ints."""
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise TypeError(f"wb.search: stages={stages!r} must be a non-empty list of stage "
                        "counts, e.g. stages=(1, 2, 4) (1: no pipeline)")
    for i, st in enumerate(stages):
        check_int(st, f"stages[{i}]", where="wb.search: ",
                  fix="a stage count: 1 for no pipeline, s > 1 for s pipeline stages")


def _default_combos(named: Sequence[tuple[Any, str]], hw: Hardware, max_model: int,
                    experts: int) -> list[tuple[dict[str, int], Any, str]]:
    """(mesh, rules, name) of the default meshes (see :func:`candidates`): ``data x model``
    for the dense strategies, ``data x expert`` (ep, fsdp_ep) and ``data x expert x
    model`` (ep_tp) for the expert-parallel ones."""
    models = [m for m in (2 ** k for k in range(16)) if m <= max_model and hw.size % m == 0]
    dense = [(s, n) for s, n in named if not (isinstance(s, str) and s in EXPERT_STRATEGIES)]
    combos = [({"data": hw.size // m, "model": m}, s, n) for m in models for s, n in dense
              if not isinstance(s, str) or (m == 1) == (s in ("dp", "fsdp"))]
    for e in expert_sizes(experts, hw.size):
        for s, n in named:
            if s in ("ep", "fsdp_ep"):
                combos.append(({"data": hw.size // e, "expert": e}, s, n))
            elif s == "ep_tp":
                combos += [({"data": hw.size // (e * m), "expert": e, "model": m}, s, n)
                           for m in models if m > 1 and hw.size % (e * m) == 0]
    return combos


def candidates(cfg: GPTConfig, hw: Hardware, batch: int, opts: SearchOptions
               ) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """Every combination to plan, and those skipped before planning (with the reason).

    Default meshes are ``data x model`` with ``model`` a power of two up to ``max_model``
    dividing the devices; dp and fsdp shard over every axis, so the split changes nothing
    for them: they get ``model=1`` only, and tp and fsdp_tp ``model > 1`` only. A
    mixture-of-experts config (``cfg.n_experts > 0``) searched with the default
    strategies also gets the expert-parallel presets (``EXPERT_STRATEGIES``), which are
    planned on ``data x expert`` meshes (ep, fsdp_ep) and ``data x expert x model``
    meshes (ep_tp), the expert axis taking each size > 1 that divides both
    ``n_experts`` and the devices (:func:`expert_sizes`). Each stage count ``s > 1`` in
    ``opts.stages`` adds pipelined candidates: a ``stage`` axis of size ``s`` taken from
    ``data`` (``pipeline`` gives the schedule; default GPipe with ``2 s``
    micro-batches).

    Raises:
        ValueError: expert-parallel strategies for a config without experts.
    """
    strategies, remats, microbatches = opts.strategies, opts.remat, opts.microbatches
    mesh_shapes, max_model, stages, pipeline = (opts.mesh_shapes, opts.max_model,
                                                opts.stages, opts.pipeline)
    experts = getattr(cfg, "n_experts", 0) if isinstance(cfg, GPTConfig) else 0
    asked = [s for s in strategies if isinstance(s, str) and s in EXPERT_STRATEGIES]
    if asked and not experts:
        raise ValueError(f"strategies {tuple(asked)!r} shard the experts of a "
                         "mixture-of-experts model, but this model has none (n_experts=0); "
                         "search a MoE config (e.g. GPTConfig.preset('moe-tiny')) or leave "
                         "them out")
    if experts and tuple(strategies) == DEFAULT_STRATEGIES:
        strategies = (*strategies, *EXPERT_STRATEGIES)
    named = [(s, s if isinstance(s, str) else f"rules#{i}") for i, s in enumerate(strategies, 1)]
    if mesh_shapes is None:
        combos = _default_combos(named, hw, max_model, experts)
    else:
        combos = [(mesh_shape(s, hw.size, hw.name), st, n) for s in mesh_shapes
                  for st, n in named]
    combos = [(*c, None, None) for c in combos] + piped_combos(combos, stages, pipeline)
    return _expand(cfg, combos, remats, microbatches, batch)


def _expand(cfg: GPTConfig, combos: Sequence[tuple[Any, ...]], remats: Sequence[Any],
            microbatches: Sequence[int], batch: int
            ) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """Each (mesh, rules, name, pipeline, why undivided) combination x remat x
    micro-batches as a numbered candidate: kept, or skipped with the reason."""
    cands, skipped, i = [], [], 0
    for shape, rules, name, pp, undivided in combos:
        for r in remats:
            for m in microbatches:
                c = Candidate(id=i, mesh=shape, rules=rules, rules_name=name, remat=r,
                              microbatches=m, pipeline=pp)
                i += 1
                why = undivided or invalid(cfg, c, batch)
                if why:
                    skipped.append(skip(c, why))
                else:
                    cands.append(c)
    return cands, skipped


def piped_combos(combos: list[tuple[dict[str, int], Any, str]], stages: Sequence[int],
                 pipeline: Mapping[str, Any] | None) -> list[tuple[Any, ...]]:
    """``(mesh, rules, name, pipeline, reason)`` per stage count ``s > 1`` and mesh: a
    ``stage`` axis of size ``s`` taken from ``data``; a mesh whose data axis ``s`` does not
    divide is kept with the reason (a skipped row), and a count no mesh takes is refused."""
    out = []
    for k, st in enumerate(stages):
        if st <= 1:
            continue
        datas = sorted({shape.get("data", 1) for shape, _, _ in combos})
        if combos and all(d % st for d in datas):
            fits = [d for d in range(2, max(datas) + 1) if any(x % d == 0 for x in datas)]
            raise ValueError(
                f"wb.search: stages[{k}]={st}: no candidate mesh's data axis (sizes "
                f"{datas}) divides into {st} pipeline stages, so no pipelined candidate "
                f"exists; use stage counts that divide it ({fits or 'none'}), or 1 for none")
        pp = {"schedule": "gpipe", "repeats": 1, "microbatches": 2 * st, **(pipeline or {})}
        for shape, rules, name in combos:
            data = shape.get("data", 1)
            if data % st == 0:
                out.append(({"stage": st, **shape, "data": data // st}, rules, name, pp, None))
            else:
                out.append(({"stage": st, **shape}, rules, name, pp,
                            f"stages={st} does not divide the data axis of mesh {shape} "
                            f"({data} devices): no stage axis can be taken from it"))
    return out


def expert_sizes(n_experts: int, devices: int) -> list[int]:
    """The expert-axis sizes the search tries: each ``e > 1`` dividing both ``n_experts``
    (every device holds whole experts) and ``devices`` (none for a dense model)."""
    return [e for e in range(2, min(n_experts, devices) + 1)
            if n_experts % e == 0 and devices % e == 0]


def _annotation_meshes(direct: Sequence[str], hw: Hardware,
                       mesh_shapes: Sequence[Any] | None, max_model: int
                       ) -> list[dict[str, int]]:
    """The meshes a model annotated with mesh axes ``direct`` is tried on: ``mesh_shapes``
    if given, else ``data`` x each named axis at powers of two whose product is at most
    ``max_model`` and divides the hardware."""
    if mesh_shapes is not None:
        return [mesh_shape(s, hw.size, hw.name) for s in mesh_shapes]
    axes = [a for a in direct if a != "data"]
    sizes = [m for m in (2 ** k for k in range(16)) if m <= max_model]
    meshes = []
    for combo in itertools.product(sizes, repeat=len(axes)):
        n = math.prod(combo)
        if n <= max_model and hw.size % n == 0:
            meshes.append({"data": hw.size // n, **dict(zip(axes, combo))})
    return meshes


def model_candidates(model: Any, hw: Hardware, batch: int, opts: SearchOptions
                     ) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """The candidates of a model factory (``wb.any_model.from_nnx`` / ``from_penzai`` spec):
    rules that fit the names its parameters are annotated with.

    - Annotations that name mesh axes (the Flax guide's ``(None, "model")``), and no
      Workbench logical axes: the candidates are meshes with those axes (``data`` x each
      named axis, powers of two up to ``max_model``), planned with the rules ``wb.plan``
      resolves for them (``rules_name`` "annotations"), unless ``strategies`` are given
      other than the default.
    - Otherwise (Workbench's logical axes, penzai's named axes through ``penzai_rules``,
      or no annotations): the ``strategies`` on ``data x model`` meshes, as for a GPTConfig.

    Remat is the model's own (``Candidate.remat`` None); a plan the model's shapes refuse
    is skipped by the search with ``wb.plan``'s message.
    """
    from workbench.any_model._spec import annotation_names, resolve_rules
    from workbench._sharding.rules import LOGICAL_AXES
    from workbench._train_state import abstract_param_state, logical_axes

    strategies, microbatches = opts.strategies, opts.microbatches
    mesh_shapes, max_model = opts.mesh_shapes, opts.max_model
    state = abstract_param_state(model)[1]
    logical = logical_axes(state)
    shapes = {".".join(map(str, path)): tuple(v.shape) for path, v in nnx.to_flat_state(state)}
    names = annotation_names(logical)
    direct = [a for a in names if a not in LOGICAL_AXES]
    by_mesh = (direct and getattr(model, "rules_for", None) is None
               and not any(a in LOGICAL_AXES for a in names)
               and tuple(strategies) == DEFAULT_STRATEGIES)
    if not by_mesh:
        cands, skipped = candidates(model, hw, batch, dataclasses.replace(
            opts, remat=(None,), stages=(1,), pipeline=None))
        kept = []
        for c in cands:
            why = _indivisible(model, logical, shapes, c)
            (skipped.append(skip(c, why)) if why else kept.append(c))
        return kept, skipped
    cands, skipped, i = [], [], 0
    for shape in _annotation_meshes(direct, hw, mesh_shapes, max_model):
        try:
            rules = resolve_rules(logical, None, mesh_info(abstract_mesh(**shape)))
        except ValueError as err:
            skipped.append(skip(Candidate(id=i, mesh=shape, rules="annotations",
                                          rules_name="annotations", remat=None,
                                          microbatches=1), str(err)))
            i += 1
            continue
        for m in microbatches:
            c = Candidate(id=i, mesh=shape, rules=rules, rules_name="annotations", remat=None,
                          microbatches=m)
            i += 1
            why = invalid(model, c, batch) or _indivisible(model, logical, shapes, c)
            (skipped.append(skip(c, why)) if why else cands.append(c))
    return cands, skipped


def _indivisible(model: Any, logical: Mapping[str, Sequence[str | None]],
                 shapes: Mapping[str, tuple[int, ...]], c: Candidate) -> str | None:
    """The first parameter dim of a model factory that its mesh axes under ``c`` do not
    divide (JAX cannot lay it out: the compiled step would refuse it), or None."""
    from workbench.any_model._spec import resolve_rules

    info = mesh_info(abstract_mesh(**c.mesh))
    try:
        rules = resolve_rules(logical, c.rules, info, spec=model if hasattr(
            model, "rules_for") else None)
    except ValueError as err:
        return str(err)
    for path, axes in logical.items():
        shape = shapes.get(path, ())
        for dim, name in zip(shape, axes):
            n = axes_size(info, [a for a in rules.axes(name) if a in info.shape]) \
                if name is not None else 1
            if dim % n:
                return (f"parameter {path} dim {name!r} of size {dim} does not divide over "
                        f"its {n} shards")
    return None


def mesh_shape(s: Mapping[str, int] | Sequence[int], size: int, where: str) -> dict[str, int]:
    """``{"data": 16, "model": 8}`` or ``(16, 8)`` (one size may be -1) covering ``size``."""
    shape = dict(s) if isinstance(s, Mapping) else dict(zip(("data", "model"), s))
    if isinstance(s, Mapping) or len(s) == 2:
        known = math.prod(v for v in shape.values() if v != -1)
        if list(shape.values()).count(-1) == 1 and known and size % known == 0:
            shape = {a: size // known if v == -1 else v for a, v in shape.items()}
        if all(isinstance(v, int) and v > 0 for v in shape.values()) \
                and math.prod(shape.values()) == size:
            return {a: int(v) for a, v in shape.items()}
    raise ValueError(f"mesh shape {s!r} does not cover the {size} devices of {where}; "
                     f"give {{'data': d, 'model': m}} or (d, m) with d x m = {size}")


def invalid(cfg: GPTConfig, c: Candidate, batch: int) -> str | None:
    """Why a candidate cannot be planned as asked (the batch per micro-batch does not
    divide over the devices that split it; heads or the MLP do not divide over the model
    axis; the experts do not divide over the expert axes, ``_moe_choice.check_layout``), or
    None."""
    info = mesh_info(abstract_mesh(**c.mesh))
    try:
        rules = Rules.preset(c.rules, info) if isinstance(c.rules, str) else c.rules
        rules.check_mesh(info)
    except ValueError as err:
        return str(err)
    per_step, shards = batch // c.microbatches, axes_size(info, rules.axes("batch"))
    if per_step % shards:
        what = f"batch {batch} / {c.microbatches} micro-batches" if c.microbatches > 1 \
            else f"batch {batch}"
        axes = " x ".join(f"{a}={info.shape[a]}" for a in rules.axes("batch"))
        return (f"{what} = {per_step} sequences per step do not divide over the {shards} "
                f"devices that split the batch ({axes})")
    for logical, field in _EXACT.items() if isinstance(cfg, GPTConfig) else ():
        n, size = axes_size(info, rules.axes(logical)), getattr(cfg, field)
        if size % n:
            return f"cfg.{field}={size} does not divide over {logical} shards of size {n}"
    if isinstance(cfg, GPTConfig) and cfg.n_experts:
        from workbench.models._moe_choice import check_layout

        try:
            check_layout(cfg, rules, info)
        except ValueError as err:
            return str(err)
    if c.pipeline is not None:
        from workbench.models._pipeline import Pipeline, check_pipeline, check_rules, stages_of

        try:
            pipe = Pipeline.of(c.pipeline)
            check_rules(pipe, rules, info)
            check_pipeline(pipe, n_layers=cfg.n_layers, stages=stages_of(info),
                           batch=per_step, batch_shards=shards, train=False)
        except ValueError as err:
            return str(err)
    return None


def skip(c: Candidate, reason: str) -> dict[str, Any]:
    """The record of a candidate that was not planned."""
    return {"id": c.id, "layout": c.label, "mesh": dict(c.mesh), "rules": c.rules_name,
            "remat": c.remat, "microbatches": c.microbatches, "pipeline": c.pipeline,
            "reason": reason}


def larger_presets(hw: Hardware, n: int = 2) -> list[str]:
    """The next ``n`` larger presets of the same chip ("v5p-256" -> v5p-512, v5p-1024;
    "8xH100" -> 2x8xH100, 4x8xH100)."""
    gen = generation(hw.preset) if hw.preset is not None else None
    if gen is None:
        return []
    sizes = sorted((abstract_mesh(p).size, p) for p in gen.presets)
    return [p for s, p in sizes if s > hw.size][:n]
