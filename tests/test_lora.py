"""LoRA (``TrainConfig(lora=...)``, ``workbench.models._lora``) against its references.

- an unadapted GPT of the same seed: at init (B = 0) its logits, bit for bit;
- the merged model ``W + alpha/r * A @ B`` (``merge_params``) after training: the adapted
  model's logits to float32 rounding (``_tolerance``: the two compute the same sums in
  another order, ``x @ W + s * (x @ A) @ B`` vs ``x @ (W + s * A @ B)``);
- the base weights at step 0: bit for bit after training (only adapters change);
- an uninterrupted run: an interrupted and resumed LoRA run, bit for bit;
- the optimizer state: leaves mirror adapter parameters only.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import workbench as wb
import workbench._step  # noqa: F401 - wb._step below
from workbench.models import GPT, GPTConfig
from workbench.models._lora import LoRA, merge_params, split_params
from workbench._train_state import opt_state_params
from workbench._sharding.pytrees import path_str
from workbench.train._setup import RunConfigMismatch
from tests._tolerance import assert_close_at_scale

ALL = ("q", "k", "v", "o", "gate", "up", "down")
LORA = {"rank": 4, "alpha": 8, "targets": ALL}
CFG = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 2, "dtype": "float32"},
                     mesh={"data": 4, "model": 2}, rules="fsdp_tp", batch=8, seq=32, steps=6,
                     checkpoint_every=2, data=wb.data.TextData(max_bytes=50_000),
                     optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=1), lora=LORA)
TOKENS = (np.arange(2 * 32).reshape(2, 32) * 7 % 256).astype(np.int32)


def _leaves(tree):
    return {path_str(p): np.asarray(x) for p, x in
            jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An uninterrupted LoRA run of 6 steps, and its step-0 parameters."""
    tr = wb.Trainer(CFG, run_dir=tmp_path_factory.mktemp("lora") / "run", progress=None)
    start = _leaves(tr.state.params)
    tr.run()
    return tr, start


@pytest.mark.parametrize("scan", [False, True])
def test_at_init_the_logits_are_the_unadapted_models_bit_for_bit(scan):
    base = GPTConfig.preset("tiny", dtype="float32", scan_layers=scan)
    plain = GPT(base, rngs=nnx.Rngs(3))
    adapted = GPT(base.replace(lora=LORA), rngs=nnx.Rngs(3))
    assert np.array_equal(np.asarray(plain(TOKENS)), np.asarray(adapted(TOKENS)))
    # the base weights are drawn exactly as without adapters
    b, a = split_params(nnx.to_pure_dict(nnx.state(adapted, nnx.Param)))
    assert jax.tree.all(jax.tree.map(np.array_equal, b,
                                     nnx.to_pure_dict(nnx.state(plain, nnx.Param))))
    assert a and all(not np.any(np.asarray(x)) for p, x in _leaves(a).items()
                     if p.endswith("lora_b"))


def test_only_the_adapters_change_and_the_base_stays_bit_for_bit(trained):
    tr, start = trained
    now = _leaves(tr.state.params)
    assert now.keys() == start.keys()
    changed = {k for k in now if not np.array_equal(now[k], start[k])}
    adapters = {k for k in now if ".lora." in k}
    assert changed == adapters   # every adapter moved (B from 0, A through B's gradient)
    # the base is the unadapted model of the seed (the reference: no LoRA at all)
    plain = wb.TrainConfig.from_dict({k: v for k, v in CFG.to_dict().items() if k != "lora"})
    _, st = wb._step.init_state(plain.model_config(), optax.sgd(0.1),
                               wb.Rules.preset("fsdp_tp", tr.mesh), tr.mesh, seed=CFG.seed)
    base = _leaves(st.params)
    assert all(np.array_equal(now[k], v) for k, v in base.items())
    assert tr.losses[-1] < tr.losses[0]


def test_the_optimizer_state_holds_adapter_leaves_only(trained):
    tr, _ = trained
    state = tr.state
    mirrors = opt_state_params(state.opt_state, state.params)
    leaves = jax.tree.leaves(state.opt_state)
    big = [m for m, x in zip(mirrors, leaves, strict=True) if np.ndim(x) > 0]
    assert big and all(m is not None and ".lora." in m for m in big)
    n_adapter = sum(x.size for k, x in _leaves(state.params).items() if ".lora." in k)
    assert sum(x.size for x in leaves) <= 2 * n_adapter + 16   # Adam's mu, nu + counts


def test_merged_weights_give_the_adapted_models_logits(trained):
    tr, _ = trained
    params = jax.device_get(tr.state.params)
    lora = tr.parts.model_config.lora
    assert any(np.any(x) for k, x in _leaves(params).items() if k.endswith("lora_b"))
    base_cfg = tr.parts.model_config.replace(lora=None)
    merged = nnx.merge(nnx.split(nnx.eval_shape(lambda: GPT(base_cfg, rngs=nnx.Rngs(0))))[0],
                       merge_params(params, lora))
    got = np.asarray(merged(TOKENS))
    want = np.asarray(tr.model(TOKENS))
    # the same sums in another order (x@W + s*(x@A)@B vs x@(W + s*A@B)), over a few
    # hundred terms per projection, through 2 blocks: float32 reordering, _tolerance's 1e-5
    assert_close_at_scale(got, want, rtol=1e-5)
    assert not np.array_equal(got, np.asarray(GPT(base_cfg, rngs=nnx.Rngs(0))(TOKENS)))


def test_an_interrupted_and_resumed_run_is_bitwise_the_uninterrupted_one(trained, tmp_path):
    ref, _ = trained
    run_dir = tmp_path / "run"
    first = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    first.run(steps=3)   # stops at 3 (saved: a checkpoint past every=2)
    first.close()
    again = wb.Trainer(CFG, run_dir=run_dir, progress=None)
    assert again.restored_from == 3
    again.run()
    assert again.losses == ref.losses
    a, b = _leaves(again.state), _leaves(ref.state)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_checkpoints_hold_the_adapters_not_the_base(trained):
    tr, _ = trained
    _check_adapter_checkpoint(tr)
    run = json.loads((tr.run_dir / "run.json").read_text())
    assert run["config"]["lora"]["rank"] == 4


def test_a_model_config_with_adapters_trains_as_lora_too(tmp_path):
    """A plan's model (a GPTConfig with ``lora``) given as TrainConfig.model: the same."""
    cfg = CFG.replace(model=CFG.model_config(), model_overrides={}, lora=None, steps=2)
    tr = wb.Trainer(cfg, run_dir=tmp_path / "run", progress=None)
    tr.run()
    _check_adapter_checkpoint(tr)


def _check_adapter_checkpoint(tr):
    step = max(int(p.name) for p in (tr.run_dir / "checkpoints").iterdir() if p.name.isdigit())
    stored = {}   # Orbax's tree metadata: every saved leaf (the base's slots are empty)
    for f in (tr.run_dir / "checkpoints" / str(step)).rglob("_METADATA"):
        tree = json.loads(f.read_text()).get("tree_metadata") or {}
        stored.update({k: v["value_metadata"]["value_type"] for k, v in tree.items()})
    arrays = [k for k, t in stored.items() if t != "None" and "'train'" in k
              and ("'params'" in k or "'mu'" in k or "'nu'" in k)]
    assert arrays and all("'lora'" in k for k in arrays), arrays
    assert not any("'lora'" not in k for k in stored if "'params'" in k)


def test_a_bfloat16_base_trains_float32_adapters(tmp_path):
    cfg = CFG.replace(lora={**LORA, "base_dtype": "bfloat16"}, steps=2)
    tr = wb.Trainer(cfg, run_dir=tmp_path / "run", progress=None)
    start = _leaves(tr.state.params)
    tr.run()
    now = _leaves(tr.state.params)
    assert {x.dtype for k, x in now.items() if ".lora." not in k} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for k, x in now.items() if ".lora." in k} == {np.dtype(np.float32)}
    assert all(np.array_equal(now[k], start[k]) for k in now if ".lora." not in k)


# ------------------------------------------------------------------ hostile input
@pytest.mark.parametrize("value, error, words", [
    ({"rank": 0, "alpha": 8}, ValueError, "rank=0"),
    ({"rank": 4.0, "alpha": 8}, TypeError, "rank=4.0"),
    ({"rank": True, "alpha": 8}, TypeError, "bool"),
    ({"rank": "4", "alpha": 8}, TypeError, "string"),
    ({"rank": 4, "alpha": 0}, ValueError, "alpha=0"),
    ({"rank": 4, "alpha": float("nan")}, ValueError, "alpha=nan"),
    ({"rank": 4, "alpha": "8"}, TypeError, "alpha='8'"),
    ({"rank": 4, "alpha": 8, "targets": ()}, ValueError, "empty"),
    ({"rank": 4, "alpha": 8, "targets": ("q", "wq")}, ValueError, "'gate'"),
    ({"rank": 4, "alpha": 8, "targets": ("q", "q")}, ValueError, "twice"),
    ({"rank": 4, "alpha": 8, "targets": [1]}, TypeError, "projection names"),
    ({"rank": 4, "alpha": 8, "dropout": 0.1}, ValueError, "dropout=0.0"),
    ({"rank": 4, "alpha": 8, "base_dtype": "int8"}, ValueError, "base_dtype"),
    ({"rank": 4, "alpha": 8, "ranks": 4}, ValueError, "unknown field"),
    ({"alpha": 8}, ValueError, "rank"),
    ([4, 8], TypeError, "wb.train.LoRA"),
    ("rank=4", TypeError, "wb.train.LoRA"),
])
def test_bad_lora_values_are_refused_by_name(value, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        wb.TrainConfig(model="tiny", lora=value)


def test_targets_name_the_valid_choices():
    with pytest.raises(ValueError) as e:
        LoRA(rank=2, alpha=4, targets=("wq",))
    for name in ALL:
        assert repr(name) in str(e.value)


def test_a_rank_past_the_projections_dims_is_refused():
    with pytest.raises(ValueError, match=r"rank=65 .*'q' \(64 -> 64"):
        wb.TrainConfig(model="tiny", lora={"rank": 65, "alpha": 1})
    with pytest.raises(ValueError, match="rank <= 32"):   # k: 64 -> 2 kv heads x 16
        wb.TrainConfig(model="tiny", lora={"rank": 33, "alpha": 1, "targets": ("k",)})


def test_mlp_targets_on_a_mixture_of_experts_are_refused():
    with pytest.raises(ValueError, match="experts"):
        wb.TrainConfig(model="moe-tiny", lora={"rank": 2, "alpha": 4, "targets": ("up",)})
    wb.TrainConfig(model="moe-tiny", lora={"rank": 2, "alpha": 4})   # attention: fine


def test_the_config_round_trips_through_json():
    cfg = wb.TrainConfig(model="tiny", lora=LoRA(rank=2, alpha=4, targets=("v", "q")))
    again = wb.TrainConfig.from_json(cfg.to_json())
    assert again == cfg and again.lora.targets == ("q", "v")
    assert "lora" not in wb.TrainConfig(model="tiny").to_dict()   # old hashes kept


def _tree_state(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*"))


@pytest.mark.parametrize("change", [{"lora": None}, {"lora": {**LORA, "rank": 2}},
                                    {"lora": {**LORA, "targets": ("q",)}}])
def test_resuming_with_other_adapters_is_refused_and_nothing_changes(trained, change):
    tr, _ = trained
    before = _tree_state(tr.run_dir)
    with pytest.raises(RunConfigMismatch) as e:
        wb.Trainer(CFG.replace(**change), run_dir=tr.run_dir, progress=None)
    assert "lora." in str(e.value) and "Nothing was changed" in str(e.value)
    assert _tree_state(tr.run_dir) == before


# ------------------------------------------------------------------ PEFT / transformers
@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A LoRA run on a Qwen3-shaped HF folder made by transformers (random weights)."""
    pytest.importorskip("transformers", reason="the test extra installs transformers + torch")
    from tests._hf_models import make_model, save

    root = tmp_path_factory.mktemp("lora-hf")
    folder = save(make_model("qwen3"), root / "base")
    model = wb.hf.hf_config(folder, dtype="float32")
    cfg = CFG.replace(model=model, model_overrides={}, init=str(folder), steps=3, data="synthetic",
                      lora={**LORA, "alpha": 16})
    tr = wb.Trainer(cfg, run_dir=root / "run", progress=None)
    tr.run()
    return tr, folder, root


# peft 0.21 asks transformers 5 for a deprecated attribute while it wraps the model
PEFT_NOISE = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _torch_logits(model):
    import torch

    with torch.no_grad():
        return model(torch.tensor(TOKENS % 128, dtype=torch.long)).logits.float().numpy()


@PEFT_NOISE
def test_the_peft_export_loads_in_peft_with_the_same_logits(hf_run):
    peft = pytest.importorskip("peft", reason="the test extra installs peft")
    import transformers

    tr, folder, root = hf_run
    out = wb.hf.to_peft(tr.model, root / "adapter", base_model=str(folder))
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 16 and conf["peft_type"] == "LORA"
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    model = peft.PeftModel.from_pretrained(base, out).eval()
    want = np.asarray(tr.model(jnp.asarray(TOKENS % 128)))
    # torch's kernels vs XLA's: each sums in its own order (test_hf's RTOL, 80 eps)
    assert_close_at_scale(_torch_logits(model), want, rtol=1e-5)
    # and the adapters matter: the base alone is far off
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    assert not np.allclose(_torch_logits(plain), want, rtol=1e-3, atol=1e-3)
    # PEFT's own merge gives the same model
    assert_close_at_scale(_torch_logits(model.merge_and_unload()), want, rtol=1e-5)


@PEFT_NOISE
def test_export_run_writes_merged_weights_or_peft_adapters(hf_run):
    peft = pytest.importorskip("peft", reason="the test extra installs peft")
    import transformers

    tr, folder, root = hf_run
    tr.checkpoints.wait()
    want = np.asarray(tr.model(jnp.asarray(TOKENS % 128)))
    merged = wb.hf.export_run(tr.run_dir, root / "merged")
    got = _torch_logits(transformers.AutoModelForCausalLM.from_pretrained(merged,
                                                                          dtype="float32"))
    assert_close_at_scale(got, want, rtol=1e-5)
    adapter = wb.hf.export_run(tr.run_dir, root / "peft", lora="peft")
    assert json.loads((adapter / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(folder)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    got = _torch_logits(peft.PeftModel.from_pretrained(base, adapter).eval())
    assert_close_at_scale(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match="'merged' or 'peft'"):
        wb.hf.export_run(tr.run_dir, root / "x", lora="adapters")


def test_to_peft_refuses_a_model_without_adapters_and_an_existing_folder(hf_run, tmp_path):
    tr, folder, root = hf_run
    with pytest.raises(ValueError, match="no LoRA adapters"):
        wb.hf.to_peft(GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0)), tmp_path / "a")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        wb.hf.to_peft(tr.model, tmp_path / "taken", overwrite=True)
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    with pytest.raises(TypeError, match="base_model"):
        wb.hf.to_peft(tr.model, tmp_path / "b", base_model=3)


# ------------------------------------------------------------------ the plan, TPU compiler
def _tpu_compiler():
    from workbench._sharding.topology import tpu_compiler_available

    return tpu_compiler_available()


@pytest.mark.skipif(not _tpu_compiler(), reason="the TPU compiler (libtpu) is not installed")
@pytest.mark.tpu
@pytest.mark.slow   # two compiles of a 16-layer 1B model for a v5e slice (minutes of CPU)
def test_plan_full_fine_tuning_of_1b_does_not_fit_a_v5e_chip_and_lora_does():
    """Reference: the TPU compiler's memory_analysis of the two steps (Llama-3.2-1B-shaped,
    every weight on each chip, 1 x 1024 tokens per chip; benchmarks/bench_lora_plans)."""
    from benchmarks.bench_lora_plans import lora_plans

    plans = lora_plans(("1b",))
    full, lora = plans["1b full"], plans["1b lora"]
    # LoRA compiles; full fine-tuning is refused by the compiler (out of memory: the plan
    # keeps the formula's numbers with the compiler's temp from its message) and does not fit
    assert lora["source"] == "tpu-compiler"
    assert full["fits"] is False and lora["fits"] is True
    fm, lm = full["memory"], lora["memory"]
    # the optimizer state (argument shards: exact) is the adapters' only: < 1% of full's
    assert lm["optimizer"] < fm["optimizer"] / 100
    assert lm["params"] >= fm["params"]   # the base, plus the adapters
    # the formula says the same: full does not fit, LoRA does
    assert full["estimate"]["total"] > full["memory"]["limit"] > lora["estimate"]["total"]


def test_export_run_refuses_lora_for_a_run_without_adapters(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"config": wb.TrainConfig(model="tiny").to_dict()}))
    with pytest.raises(ValueError, match="lora='peft'.*no LoRA"):
        wb.hf.export_run(run, tmp_path / "out", lora="peft")
    assert not (tmp_path / "out").exists()


def test_to_peft_of_stacked_blocks_equals_the_unrolled_models(tmp_path):
    """Reference: the unrolled model of the same seed (block i drawn from the same key)."""
    from safetensors.numpy import load_file

    cfg = GPTConfig.preset("tiny", dtype="float32").replace(lora=LORA)
    out = {}
    for scan in (False, True):
        model = GPT(cfg.replace(scan_layers=scan), rngs=nnx.Rngs(5))
        folder = wb.hf.to_peft(model, tmp_path / f"scan-{scan}")
        out[scan] = load_file(folder / "adapter_model.safetensors")
    assert out[False].keys() == out[True].keys() and len(out[True]) == 2 * 2 * len(ALL)
    assert all(np.array_equal(out[False][k], out[True][k]) for k in out[True])
    assert out[True]["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == \
        (4, 256)   # (rank, d_ff)


def test_stacked_blocks_train_their_adapters_only(tmp_path):
    cfg = CFG.replace(model_overrides={**CFG.model_overrides, "scan_layers": True}, steps=2)
    tr = wb.Trainer(cfg, run_dir=tmp_path / "run", progress=None)
    start = _leaves(tr.state.params)
    tr.run()
    now = _leaves(tr.state.params)
    changed = {k for k in now if not np.array_equal(now[k], start[k])}
    assert changed == {k for k in now if ".lora." in k}
    assert now["blocks.attn.lora.q.lora_a"].shape == (2, 64, 4)   # (layers, in, rank)
