"""``GPTConfig.dtype="auto"`` (issue 45, item 1): the presets compute in bfloat16 on GPU and
TPU and in float32 on CPU, resolved once for the platform the step runs or is planned for;
parameters and optimizer state stay float32; explicit dtypes are used as given; plans,
run.json and the Trainer's compile line say which dtype ran and why."""
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import workbench as wb
from workbench import _runs as runs
from workbench.models import GPT, GPTConfig
from workbench.models._config import AUTO_DTYPES, resolve_dtype
from workbench._hf_format.families import to_gpt_config
from workbench.perf import _analytic as analytic
from workbench.planning._report import PlanReport
from workbench._sharding.rules import Rules
from workbench.train._metrics import ProgressLine
from workbench.train._setup import RunConfigMismatch

AUTO_PRESETS = ("tiny", "small", "moe-tiny", "moe-small")
BF16_PRESETS = ("1b", "7b", "70b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b")


# -- resolution --------------------------------------------------------------------------------

@pytest.mark.parametrize("platform, want", [("cpu", "float32"), ("gpu", "bfloat16"),
                                            ("cuda", "bfloat16"), ("rocm", "bfloat16"),
                                            ("tpu", "bfloat16"), ("unknown", "float32")])
def test_auto_resolves_per_platform_and_says_why(platform, want):
    assert resolve_dtype("auto", platform) == (want, f"auto: {want} on {platform}")
    cfg = GPTConfig.preset("tiny")
    assert cfg.compute_dtype(platform) == want
    concrete = cfg.resolved(platform)
    assert concrete.dtype == want and concrete.param_dtype == "float32"
    assert concrete == cfg.replace(dtype=want)        # nothing else changes
    assert concrete.resolved("tpu") is concrete       # concrete stays as it is


def test_presets_default_to_auto_and_the_public_shapes_stay_bfloat16():
    assert GPTConfig.preset("tiny").to_dict()["dtype"] == "auto"
    for name in AUTO_PRESETS:
        cfg = GPTConfig.preset(name)
        assert (cfg.dtype, cfg.param_dtype) == ("auto", "float32"), name
    for name in BF16_PRESETS:
        assert GPTConfig.preset(name).dtype == "bfloat16", name
    fields = dict(vocab_size=8, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8,
                  d_ff=8, seq_len=8)
    assert GPTConfig(**fields).dtype == "auto"
    assert set(AUTO_DTYPES.values()) == {"bfloat16"} and "cpu" not in AUTO_DTYPES


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", jnp.bfloat16])
def test_explicit_dtypes_are_used_as_given_everywhere(dtype):
    cfg = GPTConfig.preset("tiny", dtype=dtype)
    name = np.dtype(dtype).name
    assert cfg.dtype == name
    for platform in ("cpu", "gpu", "tpu"):
        assert cfg.resolved(platform) is cfg and cfg.compute_dtype(platform) == name
        assert resolve_dtype(name, platform) == (name, f"{name} as configured")


def test_bad_dtypes_are_refused_naming_auto():
    with pytest.raises(TypeError, match=r"GPTConfig.dtype='automatic' is not a dtype; use "
                                        r"one of 'auto' or float32"):
        GPTConfig.preset("tiny", dtype="automatic")
    with pytest.raises(ValueError, match=r"GPTConfig.dtype='int8' is not a floating-point"):
        GPTConfig.preset("tiny", dtype="int8")
    with pytest.raises(TypeError, match=r"param_dtype='auto' is not a dtype.*'auto' is for "
                                        r"the compute dtype"):
        GPTConfig.preset("tiny", param_dtype="auto")


def test_hf_configs_keep_the_checkpoints_dtype():
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
          "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 64,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False}
    for dt in ("float32", "bfloat16"):
        cfg = to_gpt_config({**hf, "torch_dtype": dt})
        assert (cfg.dtype, cfg.param_dtype) == (dt, dt)
    assert to_gpt_config({**hf, "torch_dtype": "bfloat16"}, dtype="auto").dtype == "auto"


# -- models ------------------------------------------------------------------------------------

def test_a_gpt_built_here_resolves_for_this_backend_and_computes_as_before():
    """Outside a Trainer or a plan, ``GPT(cfg)`` resolves "auto" for JAX's default backend
    (CPU here: float32), and computes exactly what the explicit float32 model does."""
    auto = GPT(GPTConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
    f32 = GPT(GPTConfig.preset("tiny", n_layers=1, dtype="float32"), rngs=nnx.Rngs(0))
    want = jax.default_backend()
    assert auto.cfg.dtype == AUTO_DTYPES.get(want, "float32") == "float32"
    assert auto.cfg == f32.cfg and auto.blocks[0].attn.dtype == "float32"
    assert nnx.graphdef(auto) == nnx.graphdef(f32)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    a, b = auto(tokens), f32(tokens)
    assert a.dtype == jnp.float32 and np.array_equal(np.asarray(a), np.asarray(b))
    for layer in (wb.models.Attention, wb.models.MLP, wb.models.Block):
        built = layer(GPTConfig.preset("tiny"), key=jax.random.key(0))
        assert (built.attn if layer is wb.models.Block else built).dtype == "float32"


def test_a_gpt_for_tpu_computes_in_bfloat16_with_float32_weights():
    cfg = GPTConfig.preset("tiny", n_layers=1).resolved("tpu")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert {str(v.dtype) for v in jax.tree.leaves(params)} == {"float32"}
    hidden = model.hidden(jnp.zeros((1, 8), jnp.int32))
    assert hidden.dtype == jnp.bfloat16


# -- plans -------------------------------------------------------------------------------------

def _small_plan(dtype=None):
    cfg = GPTConfig.preset("small") if dtype is None else GPTConfig.preset("small", dtype=dtype)
    return wb.plan(cfg, mesh=wb.abstract_mesh("v5p-8", data=-1), rules="fsdp", batch=8,
                   seq=1024, compile=False, progress=False)


def test_an_abstract_tpu_plan_of_small_uses_bfloat16_activations():
    auto, bf16, f32 = _small_plan(), _small_plan("bfloat16"), _small_plan("float32")
    assert auto.dtype == "bfloat16: auto: bfloat16 on tpu"
    assert auto.cfg == GPTConfig.preset("small")      # the config as given: "auto"
    assert bf16.dtype == "bfloat16: bfloat16 as configured"
    assert f32.dtype == "float32: float32 as configured"
    # the analytic activations: those of the explicit bfloat16 plan, below float32's
    assert auto.report.memory_estimate == bf16.report.memory_estimate
    assert auto.report.memory_estimate["activations"] < f32.report.memory_estimate["activations"]
    info = wb.abstract_mesh("v5p-8", data=-1)
    rules = Rules.preset("fsdp", info)
    by = {d: analytic.temp_breakdown(GPTConfig.preset("small", dtype=d), 8, 1024, rules, info)
          for d in ("auto", "bfloat16", "float32")}
    assert by["auto"] == by["bfloat16"]
    # what the layers keep for the backward pass: 3/4 of float32's on TPU (whose compiler
    # already keeps some float32 matmul operands in bfloat16: analytic._bytes_per_element)
    assert by["auto"]["saved"] == 0.75 * by["float32"]["saved"]
    assert analytic.compute_dtype(GPTConfig.preset("small"), info).itemsize == 2
    assert analytic.compute_dtype(GPTConfig.preset("small"), wb.abstract_mesh(
        "8xH100", data=-1)).itemsize == 2
    # parameters and optimizer state stay float32 (master weights)
    for plan in (auto, bf16):
        dtypes = {k.split(".")[0]: set() for k in plan.layouts}
        for k, lay in plan.layouts.items():
            dtypes[k.split(".")[0]].add(lay.dtype.name)
        assert dtypes["params"] == {"float32"}
        assert dtypes["opt_state"] <= {"float32", "int32"} and "float32" in dtypes["opt_state"]
    assert auto.report.memory_estimate["params"] == f32.report.memory_estimate["params"]
    assert auto.report.memory_estimate["optimizer"] == f32.report.memory_estimate["optimizer"]


def test_the_plan_says_which_dtype_and_keeps_it_in_json():
    plan = _small_plan()
    assert "; dtype auto: bfloat16 on tpu; remat none" in str(plan)
    assert plan.report.to_dict()["dtype"] == "bfloat16: auto: bfloat16 on tpu"
    data = json.loads(json.dumps(plan.report.to_json()))
    back = PlanReport.from_json(data)
    assert back.dtype == plan.dtype and back.cfg == plan.cfg
    del data["dtype"]                    # a report written before the field existed
    assert PlanReport.from_json(data).dtype == ""
    gpu = wb.plan(GPTConfig.preset("tiny"), mesh=wb.abstract_mesh("8xH100", data=-1),
                  batch=8, seq=64, compile=False, progress=False)
    assert gpu.dtype == "bfloat16: auto: bfloat16 on gpu"
    assert "dtype auto: bfloat16 on gpu" in str(gpu)
    assert _small_plan("float32").summary().count("dtype float32 as configured") == 1


@pytest.mark.usefixtures("wb_cache")
def test_a_cpu_plan_of_tiny_compiles_the_float32_program():
    """On CPU "auto" is float32: the very program of ``dtype="float32"`` (same cache key,
    so the second plan is read back), with the same numbers."""
    mesh = wb.make_mesh(data=8)
    kw = dict(mesh=mesh, rules="fsdp", batch=8, seq=32, progress=False)
    auto = wb.plan(GPTConfig.preset("tiny", n_layers=1), **kw)
    f32 = wb.plan(GPTConfig.preset("tiny", n_layers=1, dtype="float32"), **kw)
    assert auto.dtype == "float32: auto: float32 on cpu"
    assert "dtype auto: float32 on cpu" in str(auto)
    assert auto.cfg.dtype == "auto" and auto.memory == f32.memory
    assert auto.report.memory_estimate == f32.report.memory_estimate
    assert auto.report.compiled_flops_per_device == f32.report.compiled_flops_per_device
    assert f32.report.compile_cached


# -- the Trainer -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.usefixtures("wb_cache")
def test_a_cpu_trainer_of_tiny_trains_in_float32_and_says_so(tmp_path):
    base = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh={"data": 8},
                          rules="fsdp", batch=8, seq=32, steps=2, checkpoint_every=2,
                          data="synthetic")
    tr = wb.Trainer(base, run_dir=tmp_path / "auto", progress=None)
    tr.run()
    assert tr.parts.dtype == "float32: auto: float32 on cpu"
    assert tr.parts.model_config.dtype == "float32"
    params = tr.state.params
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"float32"}
    meta = runs.read_run(tr.run_dir)
    assert meta["dtype"] == "float32: auto: float32 on cpu"
    assert meta["config"]["model_overrides"] == {"n_layers": 1}   # the config as given
    compile_event = next(e for e in runs.read_events(tr.run_dir) if e["event"] == "compile")
    assert compile_event["dtype"] == "float32: auto: float32 on cpu"
    explicit = wb.Trainer(base.replace(model_overrides={"n_layers": 1, "dtype": "float32"}),
                          run_dir=tmp_path / "f32", progress=None)
    explicit.run()
    assert [r["loss"] for r in tr.history] == [r["loss"] for r in explicit.history]
    assert explicit.parts.dtype == "float32: float32 as configured"
    # a run made when float32 was the default (its config says so) continues under "auto",
    # which computes the same float32 here; a dtype that computes otherwise is refused
    old_style = base.replace(model=GPTConfig.preset("tiny", n_layers=1, dtype="float32"),
                             model_overrides={})
    old = wb.Trainer(old_style, run_dir=tmp_path / "old", progress=None)
    old.run()
    before = (tmp_path / "old" / "run.json").read_bytes()
    with pytest.raises(RunConfigMismatch,
                       match=r"(?s)model.dtype: 'float32'.*'bfloat16'.*dtype 'auto' computes"):
        wb.Trainer(old_style.replace(model=old_style.model.replace(dtype="bfloat16")),
                   run_dir=tmp_path / "old", progress=None)
    assert (tmp_path / "old" / "run.json").read_bytes() == before    # refused: untouched
    resumed = wb.Trainer(old_style.replace(model=old_style.model.replace(dtype="auto")),
                         run_dir=tmp_path / "old", progress=None)
    assert resumed.step == 2
    resumed.run(steps=3)
    again = wb.Trainer(base, run_dir=tmp_path / "f32", progress=None)
    assert again.step == 2        # model_overrides' dtype "float32" -> the preset's "auto"
    straight = wb.Trainer(old_style, run_dir=tmp_path / "straight", progress=None)
    straight.run(steps=3)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]


def test_the_progress_line_names_the_dtype():
    out = io.StringIO()
    line = ProgressLine(10, stream=out)
    line.event("compile", seconds=1.5, attention="cudnn: auto: cuDNN flash attention on GPU",
               dtype="bfloat16: auto: bfloat16 on gpu")
    assert out.getvalue().strip() == ("compiled in 1.5 s; attention cudnn (auto: cuDNN flash "
                                      "attention on GPU); dtype auto: bfloat16 on gpu")
    out = io.StringIO()
    ProgressLine(10, stream=out).event("compile", seconds=1.0, dtype="bfloat16: bfloat16 as "
                                       "configured")
    assert out.getvalue().strip() == "compiled in 1.0 s; dtype bfloat16 as configured"
