"""One step resolver (``workbench.planning._step_inputs.resolve_step``) for ``wb.plan`` and
the Trainer: with defaults both compile the same program (optimised HLO compared op for op,
names and source locations stripped), a TrainConfig's optimizer passed to ``wb.plan`` too;
the plan's attention check sees the dtype; one batch check, one message."""
import re

import optax
import pytest

import workbench as wb
from workbench.planning._step_inputs import resolve_step

#: a one-layer tiny GPT: the smallest model with every part of the step (attention, MLP,
#: embedding, head, loss, AdamW with clipping and schedule)
CFG = wb.models.GPTConfig.preset("tiny").replace(n_layers=1)
OP = re.compile(r"^\s*(?:ROOT )?%\S+ = ", re.M)
#: what legitimately differs between two compiles of one program: the module's name, the
#: ops' metadata (op names of the Python frames, source files and lines) and the tables of
#: source files, functions and stack frames that metadata indexes
METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _program(hlo: str) -> str:
    """The optimised HLO text without its module name, metadata and source tables."""
    text = re.sub(r"^HloModule \S+", "HloModule m", METADATA.sub("", hlo), flags=re.M)
    out, table = [], False
    for line in text.splitlines():
        if line in TABLES:
            table = True
        elif not (table and (not line or re.match(r"\d+ ", line))):
            table = False
            out.append(line)
    return "\n".join(out)


def _trainer_hlo(tmp_path, config: wb.TrainConfig) -> str:
    trainer = wb.Trainer(config, run_dir=tmp_path / "run", progress=None,
                         compile_cache=False)
    return trainer.compiled_step().as_text()


def _plan_hlo(config: wb.TrainConfig, **options) -> str:
    plan = wb.plan(CFG, batch=config.batch, seq=config.seq, progress=False, **options)
    return plan.compiled.as_text()


def _assert_same_program(a: str, b: str) -> None:
    assert len(OP.findall(a)) == len(OP.findall(b)) > 100
    pa, pb = _program(a), _program(b)
    assert "metadata=" not in pa and "source_line" not in pa
    assert pa == pb


# data="synthetic" (int32 inputs/targets, as "text") spares reading the corpus; the program
# does not depend on where the tokens come from
def test_plan_and_trainer_compile_the_same_step_with_defaults(tmp_path):
    config = wb.TrainConfig(model=CFG, data="synthetic")
    trained, planned = _trainer_hlo(tmp_path, config), _plan_hlo(config)
    _assert_same_program(planned, trained)
    # the comparison tells programs apart: the optimizer the plan used to default to
    other = _plan_hlo(config, optimizer=optax.adamw(3e-4))
    assert len(OP.findall(other)) != len(OP.findall(trained))


def test_a_train_configs_optimizer_passed_to_plan_compiles_the_trainers_step(tmp_path):
    opt = wb.train.AdamW(lr=1e-3, warmup_steps=3, clip_norm=None, weight_decay=0.0,
                         decay_steps=50)
    config = wb.TrainConfig(model=CFG, data="synthetic", optimizer=opt)
    trained = _trainer_hlo(tmp_path, config)
    _assert_same_program(_plan_hlo(config, optimizer=config.optimizer), trained)
    # without clipping the step has fewer ops than the default one: the option arrived
    assert len(OP.findall(trained)) < len(OP.findall(_plan_hlo(config)))


def test_plan_and_trainer_resolve_the_same_step_inputs(tmp_path):
    config = wb.TrainConfig(model=CFG, mesh={"data": 4, "model": 2}, data="synthetic",
                            optimizer=wb.train.AdamW(accumulate=2), batch=16, seq=64)
    trainer = wb.Trainer(config, run_dir=tmp_path / "run", progress=None)
    plan = wb.plan(CFG, mesh={"data": 4, "model": 2}, batch=16, seq=64,
                   optimizer=config.optimizer, compile=False)
    p = trainer.parts
    assert (plan.report.rules, plan.report.attention, plan.report.dtype) == \
        (p.rules, p.attention, p.dtype)
    assert plan.report.placement == p.placement["why"]
    assert plan.report.compiler_options == p.compile_options
    # the compiled step takes a micro-batch: batch / accumulate, in both
    assert plan.abstract_batch["inputs"].shape == p.abstract_batch["inputs"].shape == (8, 64)
    assert p.schedule(0) == 0.0 and p.schedule(10) == pytest.approx(3e-3)


@pytest.mark.parametrize("attention", ["auto", "cudnn"])
def test_the_plans_attention_check_sees_the_dtype(attention):
    """cuDNN's flash attention takes bfloat16/float16 only (``attention.check``, the Trainer's
    check): a float32 plan on GPUs runs XLA attention ("auto") or is refused ("cudnn")."""
    cfg, mesh = CFG.replace(attention=attention), wb.abstract_mesh("8xH100", data=-1)

    def plan(dtype):
        return wb.plan(cfg, mesh=mesh, batch=8, dtype=dtype, progress=False)
    assert plan("bfloat16").report.attention.startswith("cudnn: ")
    if attention == "auto":
        got = plan("float32").report.attention
        assert got.startswith("xla: ") and "computes in float32" in got
    else:
        with pytest.raises(ValueError, match=r"attention='cudnn'.*computes in float32.*"
                                             r"dtype='auto' or 'bfloat16'"):
            plan("float32")


def test_one_batch_check_one_message(tmp_path):
    """The plan and the Trainer refuse a batch the data devices do not divide with the
    same message (the resolver's), only the caller named differently."""
    with pytest.raises(ValueError) as planned:
        wb.plan(CFG, mesh={"data": 8}, batch=12, compile=False)
    with pytest.raises(ValueError) as trained:
        wb.Trainer(wb.TrainConfig(model=CFG, mesh={"data": 8}, batch=12, data="synthetic"),
                   run_dir=tmp_path / "run", progress=None)
    a, b = str(planned.value), str(trained.value)
    assert a.startswith("wb.plan: batch=12 is not divisible by the 8 devices")
    assert a.removeprefix("wb.plan") == b.removeprefix("TrainConfig")
    assert "use batch=8 or batch=16 (a multiple of 8)" in a
    assert not (tmp_path / "run").exists()


def test_accumulation_is_part_of_the_batch_check():
    with pytest.raises(ValueError, match=r"micro-batch batch/accumulate=16/4=4 is not "
                                         r"divisible by the 8 devices.*batch=32 \(a multiple "
                                         r"of 32\)"):
        resolve_step(CFG, mesh={"data": 8}, rules=None, batch=16, seq=32,
                     optimizer=wb.train.AdamW(accumulate=4), where="wb.plan")
    with pytest.raises(ValueError, match=r"batch=10 is not divisible by "
                                         r"optimizer.accumulate=4"):
        resolve_step(CFG, mesh={"data": 8}, rules=None, batch=10, seq=32,
                     optimizer=wb.train.AdamW(accumulate=4), where="wb.plan")


@pytest.mark.parametrize("optimizer", ["adamw", 3e-4, {"lr": 1e-3}, optax.adamw])
def test_an_optimizer_of_the_wrong_kind_is_refused(optimizer):
    with pytest.raises(TypeError, match=r"wb.plan: optimizer=.* not an optax transformation "
                                        r"\(with init and update\) nor a wb.train.AdamW"):
        wb.plan(CFG, batch=8, optimizer=optimizer, compile=False)


@pytest.mark.parametrize("model", [None, "tiny", 3, {"n_layers": 1}])
def test_a_model_of_the_wrong_kind_is_refused(model):
    with pytest.raises(TypeError, match=r"TrainConfig: model=.* give a GPTConfig"):
        resolve_step(model, mesh={"data": 8}, rules=None, batch=8, seq=32,
                     where="TrainConfig")
    with pytest.raises(TypeError, match=r"wb.plan: cfg_or_factory=.* give a GPTConfig"):
        wb.plan(model, batch=8, compile=False)


def test_defaults_are_the_trainers():
    """No optimizer: the Trainer's default spec over its default steps (its schedule
    decays from the peak lr)."""
    inputs = resolve_step(CFG, mesh=None, rules=None, batch=8, seq=32, where="wb.plan")
    spec, config = wb.train.AdamW(), wb.TrainConfig()
    assert inputs.accumulate == spec.accumulate and inputs.micro_batch == 8
    for step in (0, 5, 10, 100, config.steps):
        assert inputs.schedule(step) == spec.schedule(config.steps)(step)
    assert inputs.dtype == "float32: auto: float32 on cpu"
