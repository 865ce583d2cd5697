"""The process tests/test_api_fuzz.py calls the public API in: one call per request, each
with valid base arguments and one argument replaced by a hostile value.

Run as ``python -c "import _api_fuzz_worker as w; w.main()"`` with ``tests/`` on the path,
in a sandbox (the parent sets cwd, HOME, TMPDIR and the caches). Requests and answers are
pickled, length-prefixed, on stdin and on the original stdout (fd 1 then points at stderr,
so whatever a call prints cannot corrupt the answers).

Heavy imports (JAX, Workbench) happen in ``main``: the test module imports this file for
RECIPES' names and SIGNATURES only.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import pickle
import shutil
import struct
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable


class Opaque:
    """A value of a type no argument accepts (neither a number, a string nor a container)."""

    def __repr__(self) -> str:
        return "<Opaque>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)

    def __hash__(self) -> int:
        return 0


# --- messages ---------------------------------------------------------------------------------

def send(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream: Any) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


# --- fixtures: the valid objects the base arguments are made of, built once when first used ---

class Fixtures:
    """Valid objects for base arguments, each built on first use, under ``fixtures/``."""

    def __init__(self, sandbox: Path) -> None:
        self.sandbox, self.dir = sandbox, sandbox / "fixtures"
        self.dir.mkdir(exist_ok=True)
        self._made: dict[str, Any] = {}
        self._counter = itertools.count()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._made:
            self._made[name] = getattr(self, f"_make_{name}")()
        return self._made[name]

    def fresh(self, stem: str) -> str:
        """A path in the run folder (cwd) no call has used."""
        return f"{stem}-{next(self._counter)}"

    def _make_cfg(self) -> Any:
        import workbench as wb
        return wb.models.GPTConfig.preset("tiny").replace(
            vocab_size=384, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8,
            d_ff=32, seq_len=16)

    def _make_mesh(self) -> Any:
        import workbench as wb
        return wb.make_mesh(data=8)

    def _make_model(self) -> Any:
        from flax import nnx

        from workbench.models import GPT
        return GPT(self.cfg, rngs=nnx.Rngs(0))

    def _make_lora_model(self) -> Any:
        from flax import nnx

        from workbench.models import GPT
        return GPT(self.cfg.replace(lora={"rank": 2, "alpha": 4.0}), rngs=nnx.Rngs(0))

    def _make_plan(self) -> Any:
        import workbench as wb
        return wb.plan(self.cfg, mesh=self.mesh, batch=8, seq=16, compile=False, progress=False)

    def _make_compiled_plan(self) -> Any:
        import workbench as wb
        return wb.plan(self.cfg, mesh=self.mesh, batch=8, seq=16, progress=False)

    def _make_spec(self) -> Any:
        from workbench.hardware import effective_spec
        return effective_spec(self.plan.report.mesh, calibration=False)

    def _make_step_cost(self) -> Any:
        from workbench.perf import StepCost
        return StepCost(flops=1e9, bytes_accessed=1e8, mesh=self.mesh,
                        collectives=list(self.plan.collectives), tokens_per_step=128)

    def _make_report(self) -> Any:
        import workbench as wb
        return wb.profile_step(self.compiled_plan, steps=1, warmup=0,
                               directory=str(self.dir / "profile"))

    def _make_docs(self) -> list[str]:
        return [f"document {i}: " + " ".join(f"word{j}" for j in range(i, i + 40))
                for i in range(40)]

    def _make_tok_file(self) -> str:
        from tokenizers import Tokenizer as HF
        from tokenizers import decoders, models, pre_tokenizers, trainers

        hf = HF(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        hf.train_from_iterator(self.docs, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        path = self.dir / "tokenizer.json"
        hf.save(str(path))
        return str(path)

    def _make_tokenizer(self) -> Any:
        import workbench as wb
        return wb.data.Tokenizer(self.tok_file)

    def _make_jsonl(self) -> str:
        import json
        path = self.dir / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in self.docs))
        return str(path)

    def _make_dataset(self) -> Any:
        import workbench as wb
        return wb.data.Dataset(files=self.jsonl, tokenizer=self.tok_file)

    def _make_src(self) -> str:
        src = self.dir / "src"
        src.mkdir()
        for i in range(4):
            (src / f"m{i}.py").write_text("\n".join(f"x{j} = {j} * {i}" for j in range(200)))
        return str(src)

    def _make_text(self) -> Any:
        import workbench as wb
        return wb.data.TextData(root=self.src, max_bytes=20000)

    def _make_synthetic(self) -> Any:
        import workbench as wb
        return wb.data.SyntheticData(vocab_size=384, size=4096, seed=0)

    def _make_sharding(self) -> Any:
        import jax
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("data"))

    def _make_records(self) -> Any:
        import grain
        return grain.MapDataset.range(32)

    def _make_hf_dir(self) -> str:
        import workbench as wb
        return str(wb.hf.to_hf(self.model, self.dir / "hf", config=self.cfg))

    def _make_train_config(self) -> Any:
        import workbench as wb
        return wb.TrainConfig(model="tiny", model_overrides={
            "vocab_size": 384, "d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2,
            "head_dim": 8, "d_ff": 32, "seq_len": 16}, mesh={"data": 8}, batch=8, seq=16,
            steps=1, checkpoint_every=1, data="synthetic")

    def _make_trained_run(self) -> str:
        import workbench as wb
        run = self.dir / "trained"
        trainer = wb.Trainer(self.train_config, run, progress=None)
        trainer.run()
        trainer.close()
        return str(run)

    def _make_written_run(self) -> str:
        import workbench as wb
        run = self.dir / "written"
        writer = wb.runs.RunWriter(run, config={"model": "tiny"}, name="written")
        writer.log({"step": 1, "loss": 2.0})
        writer.close()
        return str(run)

    def _make_run_meta(self) -> dict[str, Any]:
        import workbench as wb
        return wb.runs.read_run(self.written_run)

    def _make_nnx_factory(self) -> Callable[..., Any]:
        from workbench.any_model import MLPClassifier
        return lambda rngs: MLPClassifier(8, (16,), 4, rngs=rngs)

    def _make_classifier(self) -> Any:
        from flax import nnx
        return self.nnx_factory(nnx.Rngs(0))

    def _make_penzai_builder(self) -> Callable[..., Any]:
        from penzai import pz
        return lambda key: pz.nn.Linear.from_config(
            name="dense", init_base_rng=key, input_axes={"embedding": 8},
            output_axes={"neurons": 8})


def _np(x: Any, dtype: str = "int32") -> Any:
    import numpy as np
    return np.asarray(x, dtype=dtype)


def _rules_preset(name: str, mesh: Any) -> Any:
    from workbench import Rules

    return Rules.preset(name, mesh)


def _jnp_ones(shape: tuple[int, ...]) -> Any:
    import jax.numpy as jnp
    return jnp.ones(shape)


def _key() -> Any:
    import jax
    return jax.random.key(0)


def _rngs() -> Any:
    from flax import nnx
    return nnx.Rngs(0)


# --- recipes: valid base arguments of each public callable ------------------------------------
#: public name -> fixtures -> {parameter: value}. Parameters left out take their defaults;
#: a var-keyword parameter's value is a dict (its keys are what the fuzzer varies).
Recipe = Callable[[Fixtures], dict[str, Any]]
RECIPES: dict[str, Recipe] = {
    # wb.*
    "wb.simulate_devices": lambda f: {"n": 8},
    "wb.devices": lambda f: {},
    "wb.peak_flops": lambda f: {"device": None},
    "wb.make_mesh": lambda f: {"named": {"data": 4, "model": 2}},
    "wb.abstract_mesh": lambda f: {"hardware": "v5p-8", "axes": {"data": 4}},
    "wb.layout": lambda f: {"x": (64, 32), "spec": ("data", None), "mesh": f.mesh},
    "wb.Rules": lambda f: {"logical_to_mesh": {"batch": "data", "embed": None}},
    "wb.plan": lambda f: {"cfg_or_factory": f.cfg, "mesh": f.mesh, "batch": 8, "seq": 16,
                          "compile": False, "progress": False},
    "wb.compare": lambda f: {"plans": [f.plan, f.plan]},
    "wb.search": lambda f: {"cfg": f.cfg, "hardware": "v5p-8", "batch": 8, "seq": 16,
                            "strategies": ("dp",), "remat": ("none",), "exact": False,
                            "progress": False},
    "wb.calibrate": lambda f: {"reports": f.report, "save": False},
    "wb.perf.fit_collectives": lambda f: {"reports": f.report},
    "wb.perf.predict": lambda f: {"cost": f.step_cost, "spec": f.spec},
    "wb.perf.predict_plan": lambda f: {"report": f.plan.report, "spec": f.spec},
    "wb.perf.StepCost": lambda f: {"flops": 1e9, "bytes_accessed": 1e8, "mesh": f.mesh,
                                   "collectives": list(f.plan.collectives),
                                   "tokens_per_step": 128, "model_flops": 8e9,
                                   "exposed_axes": ("data",)},
    "wb.remove_calibration": lambda f: {"device_kind": "cpu"},
    "wb.profile_step": lambda f: {"plan": f.compiled_plan, "steps": 1, "warmup": 0,
                                  "directory": f.fresh("profile")},
    # init and a Dataset: the files TrainConfig.check reads (THEN) are real ones
    "wb.TrainConfig": lambda f: {"model": f.cfg, "init": f.hf_dir, "mesh": {"data": 8},
                                 "batch": 8, "seq": 16, "steps": 1, "data": f.dataset,
                                 "lora": {"rank": 2, "alpha": 4.0},
                                 "trackers": ["tensorboard", "mlflow"]},
    "wb.Trainer": lambda f: {"config": f.train_config, "run_dir": f.fresh("run"),
                             "progress": None},
    "wb.launch": lambda f: {"config": f.train_config, "processes": 1,
                            "run_dir": f.fresh("job")},
    "wb.attach": lambda f: {"run_dir": "no-job-here"},
    "wb.Local": lambda f: {"processes": 2, "devices_per_process": 4},
    "wb.Slurm": lambda f: {"nodes": 2, "gpus_per_node": 8, "partition": "a100",
                           "time": "1:00:00", "job_name": "fuzz"},
    "wb.Hosts": lambda f: {"hosts": ["10.0.0.1", "10.0.0.2"], "port": 22},
    "wb.TPUSlice": lambda f: {"name": "my-slice", "zone": "us-central2-b", "project": "p"},
    "wb.show": lambda f: {"obj": f.mesh, "options": {}},
    "wb.exercise": lambda f: {"name": "mesh_for_block"},
    "wb.generate": lambda f: {"model": f.model, "prompt": [1, 2, 3], "max_new_tokens": 2},
    # wb.data
    "wb.data.Dataset": lambda f: {"files": f.jsonl, "tokenizer": f.tok_file},
    "wb.data.chat_limits": lambda f: {},
    "wb.data.ShardedBatches": lambda f: {"spec": "synthetic", "seq": 16, "batch": 8, "seed": 0,
                                         "sharding": f.sharding, "vocab_size": 384},
    "wb.data.SyntheticData": lambda f: {"vocab_size": 384, "size": 4096, "seed": 0},
    "wb.data.TextData": lambda f: {"root": f.src, "max_bytes": 20000},
    "wb.data.Tokenizer": lambda f: {"path": f.tok_file},
    "wb.data.batch_keys": lambda f: {"spec": "synthetic"},
    "wb.data.batch_shards": lambda f: {"sharding": f.sharding},
    "wb.data.batched": lambda f: {"records": f.records, "batch": 4, "seed": 0},
    "wb.data.build_text_corpus": lambda f: {"spec": f.text, "seq": 16},
    "wb.data.build_token_cache": lambda f: {"patterns": [f.jsonl], "tokenizer": f.tokenizer},
    "wb.data.cache_root": lambda f: {},
    "wb.data.check_vocab": lambda f: {"tokenizer": f.tokenizer, "vocab_size": 384},
    "wb.data.corpus_bytes": lambda f: {"spec": f.text},
    "wb.data.as_spec": lambda f: {"value": "synthetic"},
    "wb.data.grain_dataset": lambda f: {"spec": f.synthetic, "seq": 16, "batch": 8, "seed": 0,
                                  "vocab_size": 384},
    "wb.data.pack": lambda f: {"lengths": _np([5, 7, 3]), "docs": _np([0, 1, 2]), "seq": 8,
                               "seed": 0},
    "wb.data.prepare": lambda f: {"spec": f.dataset, "seq": 16, "vocab_size": 384},
    "wb.data.row_batch": lambda f: {"rows": {"tokens": _np([[1, 2, 3, 4]]),
                                             "segments": _np([[1, 1, 1, 1]]),
                                             "positions": _np([[0, 1, 2, 3]])}},
    "wb.data.source": lambda f: {"spec": f.synthetic, "seq": 16, "vocab_size": 384},
    # wb.models
    "wb.models.GPT": lambda f: {"cfg": f.cfg, "rngs": _rngs()},
    "wb.models.MLP": lambda f: {"cfg": f.cfg, "key": _key()},
    "wb.models.Attention": lambda f: {"cfg": f.cfg, "key": _key()},
    "wb.models.Block": lambda f: {"cfg": f.cfg, "key": _key()},
    "wb.models.RMSNorm": lambda f: {"dim": 16, "eps": 1e-5, "dtype": "float32",
                                    "param_dtype": "float32"},
    "wb.any_model.MLPClassifier": lambda f: {"in_features": 8, "hidden": (16,), "n_classes": 4,
                                          "rngs": _rngs()},
    # an fp8 config (issue 58): every field fuzzed with quantization on, and it hostile too
    "wb.models.GPTConfig": lambda f: {k: getattr(f.cfg, k) for k in (
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
        "seq_len")} | {"quantization": "fp8"},
    "wb.any_model.ModelSpec": lambda f: {"factory": f.nnx_factory},
    "wb.any_model.classifier_loss": lambda f: {"model": f.classifier,
                                            "batch": {"x": _jnp_ones((2, 8)),
                                                      "y": _np([0, 1])}},
    "wb.any_model.from_nnx": lambda f: {"factory": f.nnx_factory},
    "wb.any_model.from_penzai": lambda f: {"model_or_builder": f.penzai_builder, "vocab_size": 8},
    "wb.models.rope": lambda f: {"x": _jnp_ones((1, 4, 2, 8)), "theta": 10000.0},
    "wb.models.Pipeline": lambda f: {"microbatches": 2, "schedule": "gpipe", "repeats": 1},
    "wb.models.blocks_per_device": lambda f: {"size": 4, "zigzag": True},
    "wb.models.constrain": lambda f: {"x": _jnp_ones((2, 8)), "logical_axes": ("batch", None),
                                      "name": "x"},
    "wb.models.penzai_rules": lambda f: {"rules": _rules_preset("fsdp", f.mesh)},
    "wb.models.zigzag_order": lambda f: {"seq": 64, "size": 4},
    # wb.hf
    "wb.hf.export_run": lambda f: {"run_dir": f.trained_run, "path": f.fresh("export")},
    "wb.hf.from_hf": lambda f: {"path": f.hf_dir},
    # workbench._sharding.placement (a documented module; test_api_fuzz.EXTRA_MODULES)
    "wb._sharding.placement.resolve_placement": lambda f: {"mesh": {"data": 4, "model": 2},
                                                 "rules": None, "where": "placement"},
    "wb._sharding.placement.default_preset": lambda f: {"mesh": f.mesh},
    "wb.hf.hf_config": lambda f: {"path": f.hf_dir},
    "wb.hf.to_hf": lambda f: {"obj": f.model, "path": f.fresh("hf"), "config": f.cfg},
    "wb.hf.to_peft": lambda f: {"obj": f.lora_model, "path": f.fresh("peft"),
                                "base_model": "org/name", "revision": None},
    # wb.train
    "wb.train.AdamW": lambda f: {"lr": 1e-3},
    "wb.train.LoRA": lambda f: {"rank": 2, "alpha": 4.0, "targets": ("q", "v"),
                                "dropout": 0.0, "base_dtype": None},
    # wb.runs
    "wb.runs.MetricsTail": lambda f: {"run_dir": f.written_run},
    "wb.runs.RunWriter": lambda f: {"run_dir": f.fresh("writer"), "config": {"a": 1}},
    "wb.runs.check_run": lambda f: {"meta": f.run_meta},
    "wb.runs.clean_prediction": lambda f: {"value": None},
    "wb.runs.columns": lambda f: {"records": [{"step": 1, "loss": 2.0}]},
    "wb.runs.config_hash": lambda f: {"config": {"a": 1}},
    "wb.runs.effective_status": lambda f: {"run": f.run_meta},
    "wb.runs.find_run_dirs": lambda f: {"root": str(f.dir)},
    "wb.runs.is_hidden": lambda f: {"rel": "a/b"},
    "wb.runs.json_safe": lambda f: {"value": {"a": 1}},
    "wb.runs.list_runs": lambda f: {"roots": [str(f.dir)]},
    "wb.runs.pid_alive": lambda f: {"pid": os.getpid()},
    "wb.runs.pid_start_time": lambda f: {"pid": os.getpid()},
    "wb.runs.read_events": lambda f: {"run_dir": f.written_run},
    "wb.runs.read_attempts": lambda f: {"run_dir": f.written_run},
    "wb.runs.read_metrics": lambda f: {"run_dir": f.written_run},
    "wb.runs.read_run": lambda f: {"run_dir": f.written_run},
    "wb.runs.resolve_run": lambda f: {"roots": [str(f.dir)], "rid": "written"},
    "wb.runs.run_id": lambda f: {"root": str(f.dir), "run_dir": f.written_run},
}

#: Public classes whose instances have an entry point of their own, called on every instance
#: a fuzzed call made, so that hostile values that construct reach it too: ``TrainConfig``
#: checks values when it is made, and the files it names in ``check()``.
THEN: dict[str, str] = {"wb.TrainConfig": "check"}

#: Signatures inspect cannot read (Flax NNX modules show ``(*args, **kwargs)``): the
#: parameters of their ``__init__``, as (name, kind) in order.
SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    name: (("cfg", "positional"), ("key", "keyword"))
    for name in ("wb.models.MLP", "wb.models.Attention", "wb.models.Block")
}
SIGNATURES["wb.models.GPT"] = (("cfg", "positional"), ("rngs", "keyword"))
SIGNATURES["wb.models.RMSNorm"] = (("dim", "positional"), ("eps", "keyword"),
                                   ("dtype", "keyword"), ("param_dtype", "keyword"))
SIGNATURES["wb.any_model.MLPClassifier"] = (
    ("in_features", "positional"), ("hidden", "positional"), ("n_classes", "positional"),
    ("rngs", "keyword"), ("dtype", "keyword"))


# --- the call ---------------------------------------------------------------------------------

def resolve(name: str) -> Any:
    import workbench as wb
    import workbench._sharding.placement  # noqa: F401 - wb._sharding.placement.*
    import workbench.perf  # noqa: F401 - wb.perf.fit_collectives (test_api_fuzz.EXTRA_MODULES)
    # (test_api_fuzz.EXTRA_MODULES)
    obj: Any = wb
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def parameters(name: str, obj: Any) -> list[tuple[str, str]]:
    """(name, kind) of each parameter a caller passes: 'positional' (positional only),
    'keyword' (by name) or 'var_keyword' (``**kwargs``); ``*args`` is left out."""
    if name in SIGNATURES:
        return list(SIGNATURES[name])
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional",
             inspect.Parameter.VAR_KEYWORD: "var_keyword"}
    return [(p.name, kinds.get(p.kind, "keyword"))
            for p in inspect.signature(obj).parameters.values()
            if p.kind is not inspect.Parameter.VAR_POSITIONAL]


def fuzz_key(base: dict[str, Any], param: str) -> str:
    """The key a hostile value goes under for a ``**kwargs`` parameter: the base's first key
    (e.g. ``data`` for ``make_mesh(**named)``), else ``bogus``."""
    return next(iter(base.get(param) or {}), "bogus")


def call(fx: Fixtures, name: str, hostile: dict[str, Any]) -> Any:
    """``name`` called with its recipe's arguments, those named in ``hostile`` (one or
    several at once) replaced by its values."""
    obj = resolve(name)
    base = RECIPES[name](fx)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = True   # until a positional parameter takes its default
    for pname, kind in parameters(name, obj):
        if kind == "var_keyword":
            extra = dict(base.get(pname) or {})
            if pname in hostile:
                extra[fuzz_key(base, pname)] = hostile[pname]
            kwargs.update(extra)
            continue
        if pname in hostile:
            v = hostile[pname]
        elif pname in base:
            v = base[pname]
        else:
            positional = positional and kind != "positional"
            continue
        if kind == "positional" and positional:
            args.append(v)
        elif kind != "positional":
            kwargs[pname] = v
    result = obj(*args, **kwargs)
    if name in THEN:
        getattr(result, THEN[name])()
    return result


def close(result: Any) -> None:
    """Stops what a call that worked started: a launched job, a trainer's checkpointer, a
    prefetching data iterator."""
    for attr in ("stop", "close"):
        method = getattr(result, attr, None)
        if callable(method) and type(result).__module__.startswith("workbench"):
            with contextlib.suppress(Exception):
                method()
            return


def listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")} if folder.is_dir() else set()


def answer(fx: Fixtures, request: tuple[Any, ...]) -> dict[str, Any]:
    """One call: ``("call", name, {parameter: hostile value, ...})``."""
    _, name, hostile = request
    try:
        base_ready = RECIPES[name](fx)   # fixtures built outside the measured call
        del base_ready
    except Exception:
        return {"ok": False, "setup": traceback.format_exc()}
    return attempt(fx, lambda: call(fx, name, hostile))


def attempt(fx: Fixtures, run: Callable[[], Any],
            inspect_result: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """What ``run()`` did: returned (``inspect_result`` adds what it says of the result) or
    raised (where, what), and what it wrote outside the run folder and the caches."""
    sandbox, pkg = fx.sandbox, str(Path(__import__("workbench").__file__).parent)
    top, home = set(os.listdir(sandbox)), listing(sandbox / "home")
    out: dict[str, Any] = {"ok": True}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run()
            if inspect_result is not None:
                out.update(inspect_result(result))
        close(result)
        del result
    except BaseException as e:  # noqa: BLE001 - judged by the parent (SystemExit too)
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        frame = tb.tb_frame.f_code.co_filename if tb is not None else ""
        cls = type(e)
        out = {"ok": False, "type": f"{cls.__module__}.{cls.__qualname__}",
               "workbench_class": cls.__module__.startswith("workbench"),
               "value_or_type_error": isinstance(e, (ValueError, TypeError)),
               "message": str(e)[:4000], "frame": f"{frame}:{tb.tb_lineno if tb else 0}",
               "in_workbench": frame.startswith(pkg + os.sep),
               "traceback": "".join(traceback.format_exception(e))[-6000:]}
    if os.getcwd() != str(sandbox / "run"):
        out["changed_cwd"] = os.getcwd()
        os.chdir(sandbox / "run")
    out["new_top"] = sorted(set(os.listdir(sandbox)) - top)
    out["new_home"] = sorted(listing(sandbox / "home") - home)[:20]
    left = sorted(listing(sandbox / "tmp"))
    out["tmp_left"] = left[:20]
    for entry in (sandbox / "tmp").iterdir():   # one call's leftovers are reported once
        (shutil.rmtree if entry.is_dir() and not entry.is_symlink() else os.remove)(entry)
    return out


# --- files between calls: what a call wrote, edited by a hostile hand, read by the next -------

def _rewrite_json(path: Path, change: Callable[[Any], Any]) -> None:
    """``path``'s JSON (gzip-compressed for ``.gz``, a value a line for ``.jsonl``) with
    ``change`` applied to it."""
    import gzip
    import json

    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode()
    if path.suffix == ".jsonl":
        out = "".join(json.dumps(change(json.loads(line))) + "\n"
                      for line in text.splitlines() if line.strip())
    else:
        out = json.dumps(change(json.loads(text)))
    path.write_bytes(gzip.compress(out.encode()) if path.suffix == ".gz" else out.encode())


def _numbers(to: Callable[[float], Any]) -> Callable[[Any], Any]:
    """Every number of a JSON value (bools aside) replaced by ``to(number)``; a record's
    ``key`` and ``checksum`` dropped (as a plan record written before they were kept), so
    that its type and range checks are what must catch it."""
    def change(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: change(x) for k, x in v.items() if k not in ("key", "checksum")}
        if isinstance(v, list):
            return [change(x) for x in v]
        return to(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return change


def _edit_numbers(to: Callable[[Any], Any]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        if path.suffix == ".npy":
            import numpy as np
            np.save(path, to(np.load(path)))
        else:
            _rewrite_json(path, _numbers(to))
    return edit


def _edit_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "keep.txt").write_text("not Workbench's")


def _edit_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


#: Hostile edits of a file, by name: each a function of its path.
EDITS: dict[str, Callable[[Path], None]] = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "garbage": lambda p: p.write_bytes(b"\x00\xff{garbage\n" * 3),
    "empty": lambda p: p.write_bytes(b""),
    "a directory": _edit_directory,
    "a FIFO": _edit_fifo,
    "negative numbers": _edit_numbers(lambda n: -abs(n) - 1),
    "numbers as strings": _edit_numbers(lambda n: n.astype("float64") + 0.5
                                        if hasattr(n, "astype") else str(n)),
}
_BYTES = ("truncated", "garbage", "empty", "a directory", "a FIFO")
ALL_EDITS = tuple(EDITS)


class Target:
    """Files a call writes (``write``) under ``where`` (``run``: the user's folder, where
    nothing saved may be lost; ``cache``), the names of those edited (``files``: basename
    pattern -> edits), the calls that read them next (``readers``: public name ->
    function of the fixtures and the edited file's path), and which readers must answer
    as the writer did (``same``: their names and a summary of the result, compared)."""

    def __init__(self, write: Callable[[Fixtures], Any], files: dict[str, tuple[str, ...]],
                 readers: dict[str, Callable[[Fixtures, Path], Any]], *, where: str,
                 same: tuple[tuple[str, ...], Callable[[Any], Any]] | None = None) -> None:
        self.write, self.files, self.readers = write, files, readers
        self.where, self.same = where, same


def _write_run(fx: Fixtures) -> Any:
    import workbench as wb
    with wb.runs.RunWriter("files/run/r", config={"a": 1}, name="r") as w:
        w.event("compile", seconds=1.0)
        for step in (1, 2, 3):
            w.log({"step": step, "loss": 3.0 - step / 2})


def _write_trained(fx: Fixtures) -> Any:
    shutil.copytree(fx.trained_run, "files/trained/t")


def _plan_cfg(fx: Fixtures) -> Any:
    return fx.cfg.replace(d_ff=48)   # a step no other call compiles: its record is new


def _plan(fx: Fixtures) -> Any:
    """A plan compiled for an abstract TPU slice: its record is kept on disk (``plans/``),
    and read back by the next process (this one, its in-memory executables forgotten)."""
    import workbench as wb
    from workbench.planning import _compile

    _compile.clear_cache()
    return wb.plan(_plan_cfg(fx), mesh=wb.abstract_mesh("v5p-8", data=4), batch=8, seq=16,
                   progress=False)


def _docs2(fx: Fixtures) -> str:
    """A corpus only these cases tokenize (its token cache is theirs alone)."""
    import json
    path = fx.dir / "docs2.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"text": d[::-1]}) + "\n" for d in fx.docs))
    return str(path)


def _token_cache(fx: Fixtures) -> Any:
    import workbench as wb
    return wb.data.build_token_cache([_docs2(fx)], tokenizer=fx.tokenizer)


def _prepare(fx: Fixtures) -> Any:
    import workbench as wb
    return wb.data.prepare(wb.data.Dataset(files=_docs2(fx), tokenizer=fx.tok_file), seq=16,
                           vocab_size=384)


#: A Hub dataset in the sandbox's Hugging Face cache (``HF_HOME/hub``), and its commit.
HUB_DATASET, HUB_COMMIT = "fuzz-org/fuzz-text", "f" * 40


def _hub_dataset(fx: Fixtures) -> Any:
    """Files ``huggingface_hub`` would have downloaded (refs, snapshot, blobs), prepared."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from _chat_models import hub_cache
    src = fx.dir / "hub-src"
    if not src.exists():
        (src / "data").mkdir(parents=True)
        pq.write_table(pa.table({"text": fx.docs}), src / "data/train-00000-of-00001.parquet")
    hub_cache(Path(os.environ["HF_HOME"]) / "hub", HUB_DATASET, {HUB_COMMIT: src},
              {"main": HUB_COMMIT}, repo_type="dataset")
    return _hub_prepare(fx)


def _hub_prepare(fx: Fixtures) -> Any:
    import workbench as wb
    return wb.data.prepare(wb.data.Dataset(hf=HUB_DATASET, tokenizer=fx.tok_file), seq=16,
                           vocab_size=384)


def _tail(d: Path) -> Any:
    import workbench as wb
    tail = wb.runs.MetricsTail(d)
    tail.poll()
    return tail.read()


def _resume_writer(d: Path) -> Any:
    import workbench as wb
    with wb.runs.RunWriter(d, config={"a": 1}) as w:
        w.log({"step": 4, "loss": 1.0})


def _resume_trainer(fx: Fixtures, d: Path) -> Any:
    import workbench as wb
    trainer = wb.Trainer(fx.train_config, d, progress=None)
    try:
        trainer.run()
    finally:
        trainer.close()


def _runs() -> Any:
    import workbench as wb
    return wb.runs


TARGETS: dict[str, Target] = {
    "run directory": Target(
        _write_run, {"run.json": ALL_EDITS, "metrics.jsonl": ALL_EDITS}, where="run",
        readers={
            "wb.runs.read_run": lambda fx, p: _runs().read_run(p.parent),
            "wb.runs.read_metrics": lambda fx, p: _runs().read_metrics(p.parent),
            "wb.runs.read_events": lambda fx, p: _runs().read_events(p.parent),
            "wb.runs.read_attempts": lambda fx, p: _runs().read_attempts(p.parent),
            "wb.runs.MetricsTail": lambda fx, p: _tail(p.parent),
            "wb.runs.list_runs": lambda fx, p: _runs().list_runs([p.parent.parent]),
            "wb.runs.resolve_run": lambda fx, p: _runs().resolve_run([p.parent.parent], "r"),
            "wb.runs.RunWriter": lambda fx, p: _resume_writer(p.parent)}),
    # a trained run (its checkpoint kept): resumed by a Trainer, exported
    "trained run": Target(
        _write_trained, {"run.json": ("garbage", "a directory", "numbers as strings"),
                         "metrics.jsonl": ("truncated", "a FIFO")}, where="run",
        readers={"wb.Trainer": lambda fx, p: _resume_trainer(fx, p.parent),
                 "wb.hf.export_run": lambda fx, p: __import__("workbench").hf.export_run(
                     p.parent, fx.fresh("files-export"))}),
    "plan cache": Target(
        _plan, {"*.json.gz": ALL_EDITS}, where="cache",
        readers={"wb.plan": lambda fx, p: _plan(fx)},
        same=(("wb.plan",), lambda plan: plan.memory)),
    "token cache": Target(
        _token_cache, {"info.json": ALL_EDITS, "lengths.npy": ALL_EDITS,
                       "tokens.array_record": _BYTES}, where="cache",
        readers={"wb.data.build_token_cache": lambda fx, p: _token_cache(fx),
                 "wb.data.prepare": lambda fx, p: _prepare(fx)},
        same=(("wb.data.build_token_cache",),
              lambda c: (c.lengths.tolist(), __import__("hashlib").sha256(
                  c.path.read_bytes()).hexdigest()))),
    # a Hub dataset's cache edited by hand: its ref, its snapshot's data file
    "hub dataset": Target(
        _hub_dataset, {"main": _BYTES, "train-00000-of-00001.parquet": _BYTES}, where="hf",
        readers={"wb.data.prepare": lambda fx, p: _hub_prepare(fx)},
        same=(("wb.data.prepare",), lambda p: p.info["sha256"])),
}


def file_cases() -> list[tuple[str, str, str, str]]:
    """Every (target, file pattern, edit, reader), in a fixed order."""
    return [(t, pattern, edit, reader) for t, target in TARGETS.items()
            for pattern, edits in target.files.items() for edit in edits
            for reader in target.readers]




def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _written(fx: Fixtures, name: str) -> tuple[dict[Path, bytes], Any]:
    """What ``name``'s writer wrote (once in the sandbox: kept under ``fixtures/`` for the
    worker started after a hang), as bytes to put back, and the summary of its answer."""
    kept = fx.dir / f"written-{name.replace(' ', '-')}.pickle"
    if not kept.exists():
        target = TARGETS[name]
        root = fx.sandbox / target.where
        before = set(root.rglob("*"))
        result = target.write(fx)
        summary = target.same[1](result) if target.same else None
        new = {p: b for p, b in _files(root).items() if p not in before}
        kept.write_bytes(pickle.dumps((new, summary)))
    return pickle.loads(kept.read_bytes())


def _put_back(files: dict[Path, bytes]) -> None:
    for path, data in files.items():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _lost(kept: dict[Path, bytes]) -> list[str]:
    """The saved files a call removed or cut (``run.json`` is rewritten whole; any other
    file may only grow)."""
    out = []
    for path, data in kept.items():
        if not path.is_file():
            out.append(f"{path.name} is gone")
        elif path.name != "run.json" and not path.read_bytes().startswith(data):
            out.append(f"{path.name} lost bytes ({len(data)} before, "
                       f"{path.stat().st_size} after)")
    return out


def answer_files(fx: Fixtures, request: tuple[Any, ...]) -> dict[str, Any]:
    """``("files", target, pattern, edit, reader)``: the target's files as its writer left
    them, the file matching ``pattern`` edited, then the reader called."""
    import fnmatch

    _, name, pattern, edit, reader = request
    target = TARGETS[name]
    try:
        files, summary = _written(fx, name)
        _put_back(files)
        (path,) = [p for p in files if fnmatch.fnmatch(p.name, pattern)]
        EDITS[edit](path)
        kept = {p: b for p, b in files.items() if p != path} if target.where == "run" else {}
    except Exception:
        return {"ok": False, "setup": traceback.format_exc()}

    def same(result: Any) -> dict[str, Any]:
        if target.same is None or reader not in target.same[0]:
            return {}
        got = target.same[1](result)
        return {} if got == summary else {"differs": f"{got!r:.300} != {summary!r:.300}"}

    out = attempt(fx, lambda: target.readers[reader](fx, path), same)
    out.update(lost=_lost(kept), file=path.name, folder=str(path.parent))
    return out


def main() -> None:
    proto = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sandbox = Path(os.environ["WORKBENCH_FUZZ_SANDBOX"])
    import jax  # noqa: F401 - before the first request, so its start is not a call's time

    import workbench  # noqa: F401
    fx = Fixtures(sandbox)
    stdin = sys.stdin.buffer
    send(proto, {"ready": True})
    while True:
        try:
            request = receive(stdin)
        except EOFError:
            return
        send(proto, (answer_files if request[0] == "files" else answer)(fx, request))
