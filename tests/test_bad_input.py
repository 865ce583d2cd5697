"""Every bad input of issue 12 gets a clear error (the value, the constraint, the fix) before
anything touches disk: one table, each row named after the issue's wording."""
from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

import workbench as wb
from workbench.__main__ import main
from workbench.models import GPTConfig
from workbench.train import TrainConfig, Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = GPTConfig.preset("tiny")
MOE = GPTConfig.preset("moe-tiny")
GOOD = {"model": "tiny", "mesh": {"data": 8}, "batch": 8, "seq": 32, "steps": 2,
        "data": "synthetic"}


class CliError(Exception):
    """The CLI exited non-zero; the message is its exit status and stderr."""


def cli(*argv: object) -> None:
    """``python -m workbench ARGV`` in this process; raises CliError on a non-zero exit."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    if code:
        raise CliError(f"exit {code}: {err.getvalue()}")


def cli_process(*argv: object) -> None:
    """``python -m workbench ARGV`` in a fresh process (for errors found after JAX starts)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")  # 8 devices: conftest
    out = subprocess.run([sys.executable, "-m", "workbench", *map(str, argv)],
                         capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        raise CliError(f"exit {out.returncode}: {out.stderr[-3000:]}")


def config_file(tmp: pathlib.Path, text: str, name: str = "cfg.json") -> pathlib.Path:
    """An input file under ``tmp/in`` (the one folder a case may find afterwards)."""
    path = tmp / "in" / name
    path.write_text(text)
    return path


def mesh8() -> jax.sharding.Mesh:
    return wb.make_mesh(data=8)


def plan(**kw: object) -> object:
    return wb.plan(TINY, mesh=mesh8(), compile=False, progress=False, **kw)


def trainer(tmp: pathlib.Path, **fields: object) -> Trainer:
    return Trainer(TrainConfig(**{**GOOD, **fields}), run_dir=tmp / "runs" / "bad",
                   progress=None, compile_cache=False)


# (name after the wording, call(tmp), expected exception or warning, message regex).
# A call may write its inputs under tmp/in; nothing else may appear under tmp.
CASES = [
    ("wb.plan(batch=12) on data=8 (raw IndivisibleError)",
     lambda tmp: plan(batch=12), ValueError,
     r"wb.plan: batch=12 is not divisible by the 8 devices that split the batch dim .* "
     r"mesh axes "
     r"\('data',\) .*use batch=8 or batch=16 \(a multiple of 8\)"),
    ("wb.plan(batch=8.0) (raw jit error)",
     lambda tmp: plan(batch=8.0), TypeError,
     r"wb.plan: batch=8.0 is a float; batch must be a positive integer: write batch=8"),
    ("wb.plan(batch=0)",
     lambda tmp: plan(batch=0), ValueError,
     r"wb.plan: batch=0 is out of range; batch must be a positive integer: .*e.g. batch=8"),
    ("wb.plan(seq=0) (silently becomes 128)",
     lambda tmp: plan(batch=8, seq=0), ValueError,
     r"wb.plan: seq=0 is out of range; seq must be a positive integer: .*leave it out for "
     r"the model's seq_len"),
    ("wb.plan seq longer than the model's seq_len (no word)",
     lambda tmp: plan(batch=8, seq=256), UserWarning,
     r"wb.plan: seq=256 is longer than the model's seq_len=128.*cfg.replace\(seq_len=256\)"),
    ("TrainConfig(seed=-1) (raw Grain error)",
     lambda tmp: TrainConfig(seed=-1), ValueError,
     r"TrainConfig.seed=-1 is out of range; TrainConfig.seed must be an integer from 0 to "
     r"4294967295: .*seed % 2\*\*32"),
    ("TrainConfig(seed='abc') (raw Grain error)",
     lambda tmp: TrainConfig(seed="abc"), TypeError,
     r"TrainConfig.seed='abc' is a string; TrainConfig.seed must be an integer from 0"),
    ("TrainConfig(seed=2**70) (raw Grain error)",
     lambda tmp: TrainConfig(seed=2 ** 70), ValueError,
     r"TrainConfig.seed=1180591620717411303424 is out of range; .*from 0 to 4294967295"),
    ("model_overrides={'dtype': 'int8'} (raw JAX error, leaves checkpoints/ behind)",
     lambda tmp: trainer(tmp, model_overrides={"dtype": "int8"}), ValueError,
     r"GPTConfig.dtype='int8' is not a floating-point dtype: .*\(float32, bfloat16, "
     r"float16, float64\); for half the memory use 'bfloat16'"),
    ("TrainConfig(steps=True) (runs one step)",
     lambda tmp: trainer(tmp, steps=True), TypeError,
     r"TrainConfig.steps=True is a bool; TrainConfig.steps must be a positive integer"),
    ("TrainConfig(steps=0) (leaves an empty run directory)",
     lambda tmp: trainer(tmp, steps=0), ValueError,
     r"TrainConfig.steps=0 is out of range; .*positive integer: .*e.g. steps=200"),
    ("CLI config errors: steps=0 in CONFIG.json (leaves checkpoints/)",
     lambda tmp: cli("train", config_file(tmp, json.dumps({**GOOD, "steps": 0})),
                     "--run-dir", tmp / "runs" / "cli"), CliError,
     r"exit 2: workbench train: error: config .*cfg.json: TrainConfig.steps=0 is out of range"),
    ("CLI config errors: --steps 0",
     lambda tmp: cli("train", config_file(tmp, json.dumps(GOOD)), "--run-dir",
                     tmp / "runs" / "cli", "--steps", "0"), CliError,
     r"(?s)exit 2: .*workbench train: error: argument --steps: 0 must be a positive integer"),
    ("CLI config errors: unreadable CONFIG.json",
     lambda tmp: cli("train", config_file(tmp, "{bad"), "--run-dir", tmp / "runs" / "cli"),
     CliError, r"exit 2: workbench train: error: config .*cfg.json: Expecting property name"),
    ("CLI config errors: an unknown field",
     lambda tmp: cli("train", config_file(tmp, json.dumps({**GOOD, "stepz": 3})),
                     "--run-dir", tmp / "runs" / "cli"), CliError,
     r"exit 2: .*config .*cfg.json: unknown TrainConfig fields \['stepz'\]"),
    ("CLI config errors: a bad CONFIG.py for launch",
     lambda tmp: cli("launch", config_file(tmp, "config = {'seed': -1}\n", "cfg.py"),
                     "--run-dir", tmp / "runs" / "cli"), CliError,
     r"exit 2: workbench launch: error: config .*cfg.py: TrainConfig.seed=-1 is out of range"),
    ("CLI config errors: a batch the mesh cannot split (found when the Trainer starts)",
     lambda tmp: cli_process("train", config_file(tmp, json.dumps({**GOOD, "batch": 12})),
                             "--run-dir", tmp / "runs" / "cli"), CliError,
     r"TrainConfig: batch=12 is not divisible by the 8 devices that split the batch dim .*"
     r"use batch=8 or batch=16 \(a multiple of 8\)"),
    ("wb.launch with a bad config (starts workers that fail)",
     lambda tmp: wb.launch({"seed": -1}, run_dir=tmp / "runs" / "job"), ValueError,
     r"TrainConfig.seed=-1 is out of range"),
    ("wb.launch(steps=0)",
     lambda tmp: wb.launch(TrainConfig(**GOOD), run_dir=tmp / "runs" / "job", steps=0),
     ValueError, r"wb.launch: steps=0 is out of range; steps must be a positive integer"),
    ("wb.launch with an unreadable CONFIG.json",
     lambda tmp: wb.launch(config_file(tmp, "{bad"), run_dir=tmp / "runs" / "job"),
     ValueError, r"wb.launch: the config .*cfg.json' is not valid JSON: Expecting property"),
    ("GPTConfig(d_model='64') (accepted, then a raw shape error)",
     lambda tmp: TINY.replace(d_model="64"), TypeError,
     r"GPTConfig.d_model='64' is a string; GPTConfig.d_model must be a positive integer: "
     r"write GPTConfig.d_model=64"),
    ("GPTConfig(d_model=64.5) (accepted, then a raw shape error)",
     lambda tmp: TINY.replace(d_model=64.5), TypeError,
     r"GPTConfig.d_model=64.5 is a float; .*pick GPTConfig.d_model=64 or GPTConfig.d_model=65"),
    ("wb.layout with a dim of 64.7 (silently 64)",
     lambda tmp: wb.layout((64.7, 8), ("data", None), mesh8()), TypeError,
     r"wb.layout of 'tensor': shape\[0\]=64.7 is a float; .*pick shape\[0\]=64 or "
     r"shape\[0\]=65"),
    ("wb.layout spec given as the string 'data' (read as P('d','a','t','a'))",
     lambda tmp: wb.layout((64, 8), "data", mesh8()), TypeError,
     r"spec='data' for 'tensor' is a bare string, .*\(P\('d', 'a', 't', 'a'\)\); .*write "
     r"P\('data'\) or \('data',\)"),
    ("make_mesh(data=True, ...) accepted",
     lambda tmp: wb.make_mesh(data=True, devices=jax.devices()[:1]), TypeError,
     r"mesh axis data=True is a bool; data must be a positive integer or -1"),
    ("make_mesh with duplicate devices accepted",
     lambda tmp: wb.make_mesh(data=2, devices=[jax.devices()[0]] * 2), ValueError,
     r"devices lists the same device more than once: .*\(x2\); .*pass distinct devices"),
    ("make_mesh(data=-1, devices=[]) (raw IndexError)",
     lambda tmp: wb.make_mesh(data=-1, devices=[]), ValueError,
     r"devices=\[\] is empty; a mesh needs at least one device"),
    # issue 29: accepted, then failing deep inside (or silently changed)
    ("capacity_factor=inf (raw OverflowError in moe.py)",
     lambda tmp: MOE.replace(capacity_factor=float("inf")), ValueError,
     r"GPTConfig.capacity_factor=inf is not finite; .*finite number > 0 \(e.g. 1.25"),
    ("capacity_factor='1.25' (raw TypeError)",
     lambda tmp: MOE.replace(capacity_factor="1.25"), TypeError,
     r"GPTConfig.capacity_factor='1.25' is a string; .*write GPTConfig.capacity_factor=1.25"),
    ("router_aux_loss='0.01' (raw TypeError)",
     lambda tmp: MOE.replace(router_aux_loss="0.01"), TypeError,
     r"GPTConfig.router_aux_loss='0.01' is a string; .*write GPTConfig.router_aux_loss=0.01"),
    ("router_aux_loss=nan (NaN loss at step 1)",
     lambda tmp: trainer(tmp, model="moe-tiny", model_overrides={"router_aux_loss":
                                                                  float("nan")}),
     ValueError, r"GPTConfig.router_aux_loss=nan is not finite; .*>= 0.0 \(e.g. 0.01\)"),
    ("attention_block_sizes=(True, True)",
     lambda tmp: TINY.replace(attention_block_sizes=(True, True)), ValueError,
     r"attention_block_sizes=\(True, True\) must be two positive ints .*e.g. \(128, 128\)"),
    ("wb.abstract_mesh('0xH100') (0 devices, then ZeroDivisionError)",
     lambda tmp: wb.abstract_mesh("0xH100"), ValueError,
     r"hardware preset '0xH100' has no devices \(1 host\(s\) x 0 GPU\(s\)\); use e.g. "
     r"'8xH100'"),
    ("dcn={'data': 1.5} (silently 1)",
     lambda tmp: wb.abstract_mesh("v5p-32", data=-1, dcn={"data": 1.5}), TypeError,
     r"abstract_mesh: dcn\['data'\]=1.5 is a float; .*pick dcn\['data'\]=1 or "
     r"dcn\['data'\]=2"),
    ("dcn=True (silently coerced)",
     lambda tmp: wb.abstract_mesh("v5p-32", data=-1, dcn=True), TypeError,
     r"abstract_mesh: dcn=True must be a dict of mesh axis -> number of slices"),
    ("dcn={'data': '2'} (silently coerced)",
     lambda tmp: wb.abstract_mesh("v5p-32", data=-1, dcn={"data": "2"}), TypeError,
     r"dcn\['data'\]='2' is a string; .*write dcn\['data'\]=2"),
    ("dcn=[2] (raw TypeError)",
     lambda tmp: wb.abstract_mesh("v5p-32", data=-1, dcn=[2]), TypeError,
     r"abstract_mesh: dcn=\[2\] must be a dict"),
    ("dcn ignored without a hardware preset",
     lambda tmp: wb.abstract_mesh(data=4, dcn={"data": 2}), ValueError,
     r"abstract_mesh\(dcn=\{'data': 2\}\) needs a hardware preset"),
    ("make_mesh(data=-1, dcn={'data': 0}) (ZeroDivisionError)",
     lambda tmp: wb.make_mesh(data=-1, dcn={"data": 0}), ValueError,
     r"make_mesh: dcn\['data'\]=0 is out of range; .*positive integer"),
    ("wb.plan(rules=42) (raw AttributeError)",
     lambda tmp: plan(batch=8, rules=42), TypeError,
     r"wb.plan: rules=42 \(int\) must be a preset name \(dp, fsdp.*e.g. rules='fsdp'"),
    ("wb.search(seq=0) (planned at 128)",
     lambda tmp: wb.search(TINY, batch=8, seq=0, exact=False, progress=False), ValueError,
     r"wb.search: seq=0 is out of range; .*leave it out for the model's seq_len"),
    ("wb.search(seq=32.5) (planned at 32)",
     lambda tmp: wb.search(TINY, batch=8, seq=32.5, exact=False, progress=False), TypeError,
     r"wb.search: seq=32.5 is a float; .*pick seq=32 or seq=33"),
    ("wb.search(stages=[0]) (ignored)",
     lambda tmp: wb.search(TINY, batch=8, stages=[0], exact=False, progress=False),
     ValueError, r"wb.search: stages\[0\]=0 is out of range; .*1 for no pipeline"),
    ("wb.search(stages=[2.5]) (ignored)",
     lambda tmp: wb.search(TINY, batch=8, stages=[2.5], exact=False, progress=False),
     TypeError, r"wb.search: stages\[0\]=2.5 is a float; .*pick stages\[0\]=2 or"),
    ("wb.search(stages='2') (raw TypeError)",
     lambda tmp: wb.search(TINY, batch=8, stages="2", exact=False, progress=False),
     TypeError, r"wb.search: stages='2' must be a non-empty list of stage counts"),
    ("wb.search MoE with experts dividing no expert axis (empty reason, blames the batch)",
     lambda tmp: wb.search(MOE.replace(n_experts=7), batch=16, strategies=("ep", "fsdp_ep"),
                           exact=False, progress=False), ValueError,
     r"no candidate can be planned on .* \(batch=16, seq=128\): the expert-parallel "
     r"strategies need an expert axis of size > 1 dividing both n_experts=7 and the 8 "
     r"devices"),
    ("Trainer: pipeline micro-batch smaller than the data axis (refused after checkpoints/)",
     lambda tmp: trainer(tmp, mesh={"stage": 2, "data": 4}, pipeline={"microbatches": 4},
                         model_overrides={"scan_layers": True}), ValueError,
     r"a micro-batch of batch/microbatches = 8/4 = 2 sequences does not split over the 4 "
     r"devices"),
    ("Trainer: loss_chunks=3 with seq=32 (refused after checkpoints/)",
     lambda tmp: trainer(tmp, model_overrides={"loss_chunks": 3}), ValueError,
     r"GPTConfig.loss_chunks=3 does not divide the sequence length 32"),
    ("Trainer: attention='splash' with seq=32 (refused after checkpoints/)",
     lambda tmp: trainer(tmp, model_overrides={"attention": "splash"}), ValueError,
     r"splash block_kv=32: the kernel tiles keys by multiples of 128"),
    ("Trainer: mesh={'stage': -1, 'data': 2} with 2 layers (raw IndivisibleError)",
     lambda tmp: trainer(tmp, mesh={"stage": -1, "data": 2}, pipeline={"microbatches": 2},
                         model_overrides={"scan_layers": True}), ValueError,
     r"n_layers=2 is not divisible by stages x repeats = 4 x 1 = 4"),
    # issue 29, a second hostile round
    ("wb.plan(rules='') (silently fsdp)",
     lambda tmp: plan(batch=8, rules=""), ValueError, r"unknown rules preset ''; choose one of"),
    ("wb.plan(memory_limit=-1) (accepted: everything 'over')",
     lambda tmp: plan(batch=8, memory_limit=-1), ValueError,
     r"wb.plan: memory_limit=-1 is out of range; .*bytes per device"),
    ("wb.search(memory_limit='1GB') (every candidate 'skipped')",
     lambda tmp: wb.search(TINY, batch=8, memory_limit="1GB", exact=False, progress=False),
     TypeError, r"wb.search: memory_limit='1GB' is a string"),
    ("wb.search(top_k=True) (compiled one)",
     lambda tmp: wb.search(TINY, batch=8, top_k=True, progress=False), ValueError,
     r"top_k must be an int >= 0 .*got True"),
    ("TrainConfig(model_overrides={'capacity_factor': '1.25'})",
     lambda tmp: TrainConfig(model="moe-tiny", model_overrides={"capacity_factor": "1.25"}),
     TypeError, r"GPTConfig.capacity_factor='1.25' is a string"),
    ("wb.abstract_mesh('00x8xH100') (0 devices)",
     lambda tmp: wb.abstract_mesh("00x8xH100"), ValueError,
     r"hardware preset '00x8xH100' has no devices \(0 host\(s\) x 8 GPU\(s\)\)"),
    ("TrainConfig seq longer than the model's seq_len trains with no word",
     lambda tmp: TrainConfig(seq=256), UserWarning,
     r"TrainConfig.seq=256 is longer than the model's seq_len=128\. .*"
     r"model_overrides=\{'seq_len': 256\}"),
]


@pytest.mark.parametrize("name, call, error, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error_and_leaves_nothing_behind(name, call, error, match,
                                                                tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path anyone writes would land here too
    (tmp_path / "in").mkdir()
    if issubclass(error, Warning):
        with pytest.warns(error, match=match):
            call(tmp_path)
    else:
        with pytest.raises(error, match=match):
            call(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"], name


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("started") / "run"
    return Trainer(TrainConfig(**GOOD), run_dir=run_dir, progress=None, compile_cache=False)


@pytest.mark.parametrize("steps, error, match", [
    (True, TypeError, r"Trainer.run: steps=True is a bool; steps must be a positive integer"),
    (0, ValueError, r"Trainer.run: steps=0 is out of range; .*e.g. steps=200"),
    (2.0, TypeError, r"Trainer.run: steps=2.0 is a float; .*write steps=2"),
])
def test_trainer_run_steps_true_or_zero_is_refused_before_it_writes(started, steps, error,
                                                                    match):
    before = sorted(p.relative_to(started.run_dir) for p in started.run_dir.rglob("*"))
    with pytest.raises(error, match=match):
        started.run(steps=steps)
    assert sorted(p.relative_to(started.run_dir) for p in started.run_dir.rglob("*")) == before
    assert started.step == 0 and not (started.run_dir / "metrics.jsonl").exists()


def test_a_trainer_that_fails_after_making_checkpoints_removes_only_what_it_made(tmp_path):
    """A failure after ``checkpoints/`` exists (a model of another shape) removes the empty
    directories it made, and keeps a parent that was there before."""
    from flax import nnx

    from workbench.models import GPT

    other = GPT(TINY.replace(n_layers=1), rngs=nnx.Rngs(0))
    (tmp_path / "runs").mkdir()
    with pytest.raises(ValueError, match="the model's parameters do not match"):
        Trainer(TrainConfig(**GOOD), run_dir=tmp_path / "runs" / "a" / "b", progress=None,
                compile_cache=False, initial_model=other)
    assert [p.name for p in tmp_path.rglob("*")] == ["runs"]
