"""benchmarks/gpu_vs_torch.py, the workbench Trainer's step beside PyTorch on one GPU: its
``--smoke`` mode runs the same code on CPU (both sides, windows interleaved), so the GPU
run is one prepared command; rows and the merge into BENCHMARKS.md."""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from workbench._flops import gpt_flops
from workbench.models import GPTConfig

ROOT = pathlib.Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_vs_torch.py"
sys.path.insert(0, str(ROOT))
from benchmarks import gpu_vs_torch as gvt  # noqa: E402


@pytest.mark.slow
@pytest.mark.multiprocess
def test_smoke_runs_both_sides_interleaved_on_the_same_model_and_tokens(tmp_path):
    """Both sides train the tiny model's shape (HF's LlamaForCausalLM has exactly the
    parameters GPTConfig counts), the same tokens per step, for the same windows; the
    workbench variant that only cuts the loss into chunks gives the Trainer's own loss
    on the same state (float32 reduction order apart); the same batch trained again lowers
    each side's loss; MFU is the FLOP formula over the median window and the peak. With
    ``--gpu-memory 4`` the sides do not fit beside each other (the smoke cases' stand-in
    needs) and each is measured alone, windows still interleaved, as the rows say; the
    second case is predicted with the efficiencies fitted on the first and the other way
    round (the held-out rows), and the run says which JAX it ran on against the range
    pyproject.toml declares."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               WORKBENCH_CALIBRATION=str(tmp_path / "calibration"))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--windows", "2", "--steps", "2",
         "--warmup", "2", "--torch-backend", "aot_eager", "--variant", "chunk:loss_chunks=2",
         "--variant", "optax:loss=optax", "--gpu-memory", "4",
         "--predict", "--out", str(tmp_path)], env=env, text=True, capture_output=True,
        timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r, r2 = json.loads((tmp_path / "results.json").read_text())
    _check_held_out(tmp_path, r, r2)
    assert "error" not in r
    tiny = GPTConfig.preset("tiny", seq_len=64)
    assert r["pytorch"]["params"] == tiny.n_params
    assert r["workbench"]["ready"] == ["trainer", "chunk", "optax"]
    assert {n: len(t) for n, t in r["step_seconds"].items()} == {
        "trainer": 2, "chunk": 2, "optax": 2, "pytorch": 2}
    first = r["workbench"]["first_loss"]
    # the same loss of the same logits; chunks only reorder the float32 mean over 256 tokens
    assert first["chunk"] == pytest.approx(first["trainer"], rel=1e-5)
    # optax's cross-entropy on float32 logits (the reference) gives the Trainer's loss
    assert first["optax"] == pytest.approx(first["trainer"], rel=1e-5)
    assert 0.5 * math.log(256) < first["trainer"] < 1.5 * math.log(256)
    flops = gpt_flops(tiny, 4, 64).total
    assert r["flops"] == flops
    for name, s in r["median_step_seconds"].items():
        assert r["tokens_per_s"][name] == pytest.approx(4 * 64 / s)
        assert r["mfu"][name] == pytest.approx(flops / s / r["peak_flops"])
    # warm-up and 4 timed steps on one batch: both sides learn it
    assert r["final_loss"]["trainer"] < first["trainer"]
    assert r["final_loss"]["pytorch"] < r["pytorch"]["warm_loss"] + 1e-3
    # --predict: the Trainer's own profile against its plan, then calibrated on itself
    # (stored where the later cases of a GPU run read it)
    pred = r["prediction"]
    assert pred["measured"] > 0 and pred["uncalibrated"] > 0 and pred["self_calibrated"] > 0
    assert list((tmp_path / "calibration").glob("*.json"))
    assert "step" in (tmp_path / "profile-smoke-trainer.txt").read_text()
    host = json.loads((tmp_path / "host.json").read_text())
    assert host["steps"] == 2 and "--smoke" in host["command"]


def _check_held_out(out: pathlib.Path, r: dict, r2: dict) -> None:
    """The smoke run's sizing and held-out rows, against the numbers it stored: each
    case's held-out prediction is its own plan's numbers at the other case's fitted
    efficiencies (workbench.perf._efficiency, re-done here from the stored record)."""
    from workbench.hardware._efficiency import Efficiency
    from workbench.perf._efficiency import StepNumbers, efficient_local

    assert r2["case"] == "smoke2" and "error" not in r2
    for a, b in ((r, r2), (r2, r)):
        assert a["sizing"]["mode"] == "alone" and a["sizing"]["gpu_bytes"] == 4e9
        (h,) = a["held_out"]
        assert h["fitted_on"] == b["case"]
        record = Efficiency.from_dict(json.loads((out / f"efficiency-{b['case']}.json")
                                                 .read_text()))
        seconds, _, _ = efficient_local(StepNumbers(**a["prediction"]["numbers"]), record,
                                        a["peak_flops"])
        assert h["predicted"] == pytest.approx(seconds)
        assert h["measured"] == a["prediction"]["measured"]
    rows = json.loads((out / "rows.json").read_text())
    held = [x for x in rows if "held out: measured efficiencies fitted on" in x["name"]]
    assert len(held) == 2 and all(x["target"] == "0.85-1.15" for x in held)
    assert all("each side alone, windows interleaved" in x["notes"] for x in rows)
    import jax
    assert all(f"jax {jax.__version__} (pyproject: jax" in x["notes"] for x in rows)


GIB_MIB = 2**20   # nvidia-smi reports MiB


@pytest.mark.parametrize("gpu_mib, case, mode", [
    (81559, "1b", "alone"),     # H100 80GB HBM3: 36.3 + 46.0 + 3 GB > 95% of 85.5 GB
    (81559, "small", "beside"),  # 18.1 + 16.3 + 3 GB
    (143771, "1b", "beside"),   # H200: 85.3 GB <= 95% of 150.8 GB
    (143771, "small", "beside"),
    (40960, "1b", "too large"),  # a 40 GB A100: 46.0 + 14.8 + 3 GB > 95% of 42.9 GB
])
def test_sizing_fits_both_sides_on_an_h100_and_an_h200(gpu_mib, case, mode):
    """Hand arithmetic over the stored needs (gvt.NEEDS: the H200 runs' compiled bytes
    and torch.cuda.max_memory_allocated) and 12 bytes per parameter kept between windows."""
    n = GPTConfig.preset(case).n_params
    got = gvt.sizing(case, gpu_mib * GIB_MIB, n)
    assert got["mode"] == mode
    gpu = gpu_mib * GIB_MIB
    jax_need, torch_need = gvt.NEEDS[case]
    if mode == "beside":   # the JAX side capped at what PyTorch and a context leave
        cap = float(got["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"])
        assert cap == pytest.approx((0.95 * gpu - torch_need - 1.5e9) / gpu, abs=0.005)
        assert cap * gpu >= jax_need and not got["release"]
    if mode == "alone":    # each window: its side's need + the other's resident state
        assert got["env"] == {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"} and got["release"]
        assert max(jax_need, torch_need) + 12 * n + 3e9 <= 0.95 * gpu
        assert "windows interleaved" in got["why"]


def test_the_jax_version_is_checked_against_the_declared_range():
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(Requirement(d) for d in deps if Requirement(d).name == "jax").specifier
    for version in ("0.10.2", "0.11.2", "0.12.0.1", "0.13.0"):
        text = gvt.jax_range(version)
        assert text.startswith(f"jax {version} (pyproject: jax{spec}: ")
        assert text.endswith("inside)") == spec.contains(version)


def test_a_gpu_memory_that_is_not_positive_is_refused(capsys):
    with pytest.raises(SystemExit):
        gvt.main(["--gpu-memory", "0"])
    assert "--gpu-memory must be > 0 GB" in capsys.readouterr().err


def test_held_out_predicts_each_case_with_the_others_fit():
    """Hand count: case B's matmul FLOPs at A's fraction of the peak, its attention FLOPs
    at A's rate, its bytes at A's bandwidth, added."""
    def case(name, d_model, flops, att, nbytes, split, measured):
        return {"case": name, "peak_flops": 1e15, "when": "2026-12-07",
                "workbench": {"jax": "0.11.2"},
                "prediction": {"measured": measured, "numbers": {
                    "matmul_flops": flops, "attention_flops": att, "hbm_bytes": nbytes,
                    "d_model": d_model, "name": name}, "split": split}}

    a = case("a", 2048, 6e14, 1e13, 3e11, {"matmul": 1.0, "attention": 0.1,
                                           "memory": 0.1, "rest": 0.0, "step": 1.2}, 1.2)
    b = case("b", 768, 3e14, 4e12, 2e11, {"matmul": 0.5, "attention": 0.05,
                                          "memory": 0.05, "rest": 0.0, "step": 0.6}, 0.6)
    gvt.held_out([a, b], "H200")
    (hb,) = b["held_out"]
    frac, rate, bw = 6e14 / 1.0 / 1e15, 1e13 / 0.1, 3e11 / 0.1
    assert hb["fitted_on"] == "a"
    assert hb["predicted"] == pytest.approx(3e14 / (1e15 * frac) + 4e12 / rate + 2e11 / bw)
    assert a["efficiency"]["matmul_fraction"] == {"medium": pytest.approx(frac)}
    rows = gvt.rows_of({**_result(), "held_out": b["held_out"]}, "cmd", 10)
    (row,) = [x for x in rows if "held out" in x["name"]]
    assert row["name"] == ("predicted step, 1b 8 x 2048, Trainer default, held out: measured "
                           "efficiencies fitted on a")
    assert row["value"] == pytest.approx(hb["predicted"] / 0.6)
    assert row["ok"] is (0.85 <= row["value"] <= 1.15)


def _result(mfu: float = 0.5) -> dict:
    cfg = GPTConfig.preset("1b").to_dict()
    return {"case": "1b", "preset": "1b", "batch": 8, "seq": 2048,
            "workbench": {"device": "NVIDIA H200", "model_config": cfg,
                          "versions": {"jax": "0.11.2"},
                          "variants": {"trainer": {"model": {"attention": "cudnn", "remat": "none"}},
                                       "lhs": {"model": {"remat": "minimal"}, "options": {
                                           "xla_gpu_enable_latency_hiding_scheduler": True}}}},
            "pytorch": {"versions": {"torch": "2.11"}},
            "step_seconds": {"trainer": [0.3, 0.31], "lhs": [0.2, 0.2],
                             "pytorch": [0.25, 0.26]},
            "median_step_seconds": {"trainer": 0.305, "lhs": 0.2, "pytorch": 0.255},
            "tokens_per_s": {"trainer": 1.0, "lhs": 1.0, "pytorch": 1.0},
            "mfu": {"trainer": mfu, "lhs": 0.6, "pytorch": 0.45},
            "flops": 1.28e14, "peak_flops": 989e12}


def test_rows_name_each_side_by_its_configuration_and_check_the_targets():
    rows = {r["name"]: r for r in gvt.rows_of(_result(0.45), "cmd", 10)}
    trainer = "mfu, 1b 8 x 2048, workbench Trainer step, attention=cudnn remat=none " \
              "loss_chunks=1 bfloat16"
    lhs = ("vs pytorch, 1b 8 x 2048, attention=auto remat=minimal loss_chunks=1 bfloat16 "
           "xla_gpu_enable_latency_hiding_scheduler=True")
    assert rows[trainer]["ok"] is False and rows[trainer]["target"] == ">= 0.5"
    assert rows[lhs]["value"] == pytest.approx(0.255 / 0.2) and rows[lhs]["ok"] is True
    torch_row = [r for n, r in rows.items() if n.startswith("mfu, 1b 8 x 2048, pytorch")]
    assert len(torch_row) == 1 and torch_row[0]["ok"] is None
    assert all(r["accelerator"] == "1 x NVIDIA H200" and r["module"] == "gpu_vs_torch"
               for r in rows.values())
    assert len(rows) == 5   # three MFU rows, two ratios


def test_merge_keeps_other_rows_and_replaces_rows_of_the_same_name(tmp_path, monkeypatch):
    import benchmarks.__main__ as bm

    results, md = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    old = [{"name": "other", "value": 1, "module": "bench_x"}]
    first = gvt.rows_of(_result(0.4), "cmd", 10)
    results.write_text(json.dumps(old + first))
    monkeypatch.setattr(bm, "RESULTS", results)
    monkeypatch.setattr(bm, "OUT", md)
    monkeypatch.setattr(bm, "_machine", lambda: "here")
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps([_result(0.55)]))
    (run / "host.json").write_text(json.dumps({"command": "cmd", "steps": 10}))
    gvt.merge([run])
    rows = json.loads(results.read_text())
    assert [r["name"] for r in rows].count("other") == 1
    assert len(rows) == 1 + len(first)
    trainer = [r for r in rows if "workbench Trainer step, attention=cudnn" in r["name"]]
    assert [r["value"] for r in trainer] == [0.55]
    assert "gpu_vs_torch" in md.read_text()


@pytest.mark.parametrize("text, expect", [
    ("a:attention=cudnn,loss_chunks=4", ("a", {"attention": "cudnn", "loss_chunks": 4}, {})),
    ("b:xla_gpu_enable_triton_gemm=false", ("b", {}, {"xla_gpu_enable_triton_gemm": False})),
    ("c:", ("c", {}, {})),
])
def test_variants_parse_model_fields_and_xla_options(text, expect):
    assert gvt.parse_variant(text) == expect


@pytest.mark.parametrize("text", ["", ":remat=full", "a b:remat=full", "a:remat"])
def test_malformed_variants_are_refused_with_the_form(text):
    with pytest.raises(SystemExit, match="--variant"):
        gvt.parse_variant(text)


@pytest.mark.parametrize("flag", ["--windows", "--steps", "--warmup"])
def test_counts_below_one_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        gvt.main([flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err
