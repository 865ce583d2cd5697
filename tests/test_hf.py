"""Hugging Face checkpoints in and out, checked against transformers' own implementation.

Models come from transformers itself (random weights from small configs, saved with
``save_pretrained``); the reference is their float32 CPU logits and greedy ``generate``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import workbench as wb
from tests._hf_models import FAMILIES, PROMPT, make_model, reference, save
from tests._tolerance import assert_close_at_scale
from workbench._hf_format.families import HFConfigError
from workbench._hf_format.tensors import CheckpointError

pytest.importorskip("transformers", reason="the test extra installs transformers + torch (CPU)")

# float32 logits of two implementations (torch's kernels vs XLA's sum each matmul and norm
# in their own order, a few layers deep): 80 eps at the logits' scale (seen: 6 eps), within
# the bound of 1e-4
RTOL = 1e-5
NEW = 6


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Per family: (folder, transformers logits, transformers greedy tokens). Mixtral and
    Qwen3 are saved sharded (index + several files), Qwen2 in bfloat16."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for fam in FAMILIES:
        model = make_model(fam)
        shard = "40KB" if fam in ("mixtral", "qwen3") else None
        folder = save(model, root / fam, shard=shard)
        logits, greedy = reference(model, new=NEW)
        out[fam] = (folder, logits, greedy)
    return out


def _mesh(**axes):
    return wb.make_mesh(**axes)


@jax.jit
def _logits_jit(graphdef, state, tokens):
    from flax import nnx
    return nnx.merge(graphdef, state)(tokens)


def logits(model, tokens=PROMPT):
    """The model's logits of ``tokens``, compiled once (eager dispatch is slow here)."""
    from flax import nnx
    graphdef, state = nnx.split(model)
    return np.asarray(_logits_jit(graphdef, state, jnp.asarray(tokens)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_logits_and_greedy_tokens_equal_transformers(hf, family):
    folder, want, greedy = hf[family]
    model = wb.hf.from_hf(folder, mesh=_mesh(data=4, model=2), rules="fsdp_tp")
    got = logits(model)
    assert_close_at_scale(got, want, rtol=RTOL)
    np.testing.assert_array_equal(wb.generate(model, PROMPT, max_new_tokens=NEW), greedy)


@pytest.mark.parametrize("family,axes,rules", [
    ("qwen3_moe", {"expert": 4, "data": 2}, "ep"),
    ("qwen2_moe", {"data": 8}, "fsdp"),
    ("llama", {"data": 4, "model": 2}, "tp"),
])
@pytest.mark.slow
def test_scanned_layers_and_other_layouts_equal_transformers(hf, family, axes, rules):
    folder, want, greedy = hf[family]
    model = wb.hf.from_hf(folder, mesh=_mesh(**axes), rules=rules, scan_layers=True)
    assert_close_at_scale(logits(model), want, rtol=RTOL)
    np.testing.assert_array_equal(wb.generate(model, PROMPT, max_new_tokens=NEW), greedy)


def test_each_device_reads_only_its_block(hf, monkeypatch):
    """Every parameter is read once in total (its devices' distinct blocks), never whole
    per device, and each device holds exactly its slice of the HF tensor."""
    from workbench._hf_format import tensors as hf_tensors

    folder, _, _ = hf["llama"]
    read: dict[str, int] = {}
    orig = hf_tensors.Folder.read

    def counting(self, name, index):
        block = orig(self, name, index)
        read[name] = read.get(name, 0) + block.size
        return block
    monkeypatch.setattr(hf_tensors.Folder, "read", counting)
    mesh = _mesh(data=4, model=2)
    model = wb.hf.from_hf(folder, mesh=mesh, rules="fsdp_tp")
    from safetensors.numpy import load_file
    whole = load_file(str(folder / "model.safetensors"))
    for name, arr in whole.items():
        assert read[name] == arr.size, name   # each distinct block read once
    q = model.blocks[0].attn.q[...]            # (D, N, H) from q_proj (N*H, D)
    assert q.sharding.spec == jax.sharding.PartitionSpec("data", "model", None)
    ref = whole["model.layers.0.self_attn.q_proj.weight"].reshape(4, 16, 64).transpose(2, 0, 1)
    for shard in q.addressable_shards:
        assert shard.data.shape == (16, 2, 16)
        np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])


def test_bf16_and_f16_checkpoints_load_exactly(tmp_path):
    model = make_model("qwen2")
    _, greedy = None, None
    for dt in ("bfloat16", "float16"):
        folder = save(model, tmp_path / dt, dtype=dt)
        m16 = wb.hf.from_hf(folder, mesh=_mesh(data=8))
        assert m16.cfg.param_dtype == dt
        m32 = wb.hf.from_hf(folder, mesh=_mesh(data=8), param_dtype="float32",
                                dtype="float32")
        import torch
        import transformers
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        want, _ = reference(ref, new=1)
        assert_close_at_scale(logits(m32), want, rtol=RTOL)
        np.testing.assert_array_equal(np.asarray(m32.embed[...]),
                                      np.asarray(m16.embed[...]).astype(np.float32))


#: Llama 3's RoPE scaling (Llama 3.1 / 3.2: factor 32 over 8192 positions), here over 32
#: positions so that a head of 16 has frequencies in all three bands (kept, blended,
#: stretched).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def test_llama3_rope_scaling_equals_transformers(tmp_path):
    """Reference: transformers' Llama with the same rope_scaling (its
    _compute_llama3_parameters), on import and on the exported folder read back."""
    import torch
    import transformers

    ref = make_model("llama", rope_scaling=dict(LLAMA3_ROPE))
    want, _ = reference(ref, new=1)
    plain, _ = reference(make_model("llama"), new=1)
    assert not np.allclose(plain, want, rtol=1e-3, atol=1e-3)   # the scaling matters here
    model = wb.hf.from_hf(save(ref, tmp_path / "in"), mesh=_mesh(data=8))
    assert model.cfg.rope_scaling == (8.0, 1.0, 4.0, 32)
    assert_close_at_scale(logits(model), want, rtol=RTOL)
    out = wb.hf.to_hf(model, tmp_path / "out")
    assert wb.hf.hf_config(out) == wb.hf.hf_config(tmp_path / "in")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert_close_at_scale(reference(back, new=1)[0], want, rtol=RTOL)
    cfg = model.cfg
    assert wb.models.GPTConfig(**{**cfg.to_dict(), "rope_scaling": [8, 1, 4, 32]}) == cfg
    assert "rope_scaling" not in cfg.replace(rope_scaling=None).to_dict()   # old hashes kept
    for bad, error in ((8.0, TypeError), ((8.0, 1.0, 4.0), TypeError),
                       ((0.0, 1.0, 4.0, 32), ValueError), ((8.0, 1.0, 4.0, 0), ValueError)):
        with pytest.raises(error, match="rope_scaling"):
            cfg.replace(rope_scaling=bad)


@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe", "mixtral"])
def test_export_round_trip_is_bitwise_and_transformers_reads_it(hf, family, tmp_path):
    import torch
    import transformers
    from safetensors.numpy import load_file

    folder, want, _ = hf[family]
    mesh = _mesh(data=4, model=2)
    model = wb.hf.from_hf(folder, mesh=mesh, rules="fsdp_tp",
                              scan_layers=family == "mixtral")
    out = wb.hf.to_hf(model, tmp_path / "out", max_shard_bytes=30_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
    # the source folder's other files come along (generation_config.json here)
    assert (out / "generation_config.json").read_bytes() == \
        (folder / "generation_config.json").read_bytes()
    tok = _tokenizer_json(tmp_path / "tokenizer.json", 100)
    with_tok = wb.hf.to_hf(model, tmp_path / "with_tok", tokenizer=tok)
    assert (with_tok / "tokenizer.json").read_text() == tok.read_text()
    bad = tmp_path / "broken" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="broken/tokenizer.json is not a readable tokenizer"):
        wb.hf.to_hf(model, tmp_path / "with_bad", tokenizer=bad.parent)
    assert not (tmp_path / "with_bad").exists()

    def tensors(d):
        t = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            t.update(load_file(str(f)))
        return t
    a, b = tensors(folder), tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got, _ = reference(ref, new=1)
    assert_close_at_scale(got, want, rtol=RTOL)
    again = wb.hf.from_hf(out, mesh=mesh, rules="fsdp_tp", scan_layers=family == "mixtral")
    np.testing.assert_array_equal(logits(again),
                                  logits(model))


def test_generation_with_and_without_cache_agree_when_sampling(hf):
    folder, _, _ = hf["qwen3"]
    model = wb.hf.from_hf(folder, mesh=_mesh(data=4, model=2), rules="fsdp_tp")
    kw = dict(max_new_tokens=NEW, temperature=0.9, top_k=40, top_p=0.9, seed=3)
    a = wb.generate(model, PROMPT, **kw)
    b = wb.generate(model, PROMPT, cache=False, **kw)
    np.testing.assert_array_equal(a, b)
    c = wb.generate(model, PROMPT, **{**kw, "seed": 4})
    assert not np.array_equal(a, c)   # the seed matters
    one = wb.generate(model, PROMPT[:1], max_new_tokens=3)   # batch 1 on data=4: replicated
    assert one.shape == (1, PROMPT.shape[1] + 3)


def test_sampling_filters():
    from workbench._generate import sample

    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 400)
    draw = jax.jit(jax.vmap(lambda k, top_k, top_p: sample(logits, k, temperature=1.0,
                                                            top_k=top_k, top_p=top_p)[0],
                            in_axes=(0, None, None)), static_argnums=(1, 2))
    assert set(np.asarray(draw(keys, 2, None)).tolist()) == {0, 1}
    # 0.5 < 0.75 needs the second token; 0.5 + 0.3 >= 0.75 stops there
    assert set(np.asarray(draw(keys, None, 0.75)).tolist()) == {0, 1}
    assert set(np.asarray(draw(keys, None, None)).tolist()) == {0, 1, 2, 3}
    assert int(sample(logits, keys[0])[0]) == 0


def test_text_prompt_with_any_tokenizer(hf):
    folder, _, _ = hf["llama"]
    model = wb.hf.from_hf(folder, mesh=_mesh(data=8))
    text = wb.generate(model, "hi", tokenizer=Chars(), max_new_tokens=3)
    ids = wb.generate(model, [ord("h"), ord("i")], max_new_tokens=3)
    assert text == Chars().decode(ids[0].tolist())


class Chars:
    """A tokenizer of 128 ids: one character each (any object with encode/decode)."""

    def encode(self, text):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_streamed_tokens_are_the_greedy_tokens(hf, capsys, monkeypatch):
    from workbench import _display
    from workbench.widgets._generation_view import GenerationView

    folder, _, greedy = hf["llama"]
    model = wb.hf.from_hf(folder, mesh=_mesh(data=8))
    seen = []
    out = wb.generate(model, PROMPT, max_new_tokens=NEW, stream=seen.append)
    np.testing.assert_array_equal(out, greedy)             # transformers' greedy tokens
    assert [s.shape for s in seen] == [(2, PROMPT.shape[1] + i) for i in range(1, NEW + 1)]
    for s in seen:                                          # each call: a prefix of the answer
        np.testing.assert_array_equal(s, greedy[:, :s.shape[1]])
    # the widget: after streaming it holds the whole text, the same as the return value
    view = GenerationView(Chars(), rate=1e-6)               # (sends only at finish)
    text = wb.generate(model, "hi", tokenizer=Chars(), max_new_tokens=NEW, stream=view)
    assert text == Chars().decode(wb.generate(model, [104, 105], max_new_tokens=NEW)[0].tolist())
    assert view.texts == [text] and view.prompts == ["hi"]
    assert view.tokens == NEW and view.state == "done"
    # stream=True: the text on stdout outside a notebook, a GenerationView in one
    capsys.readouterr()
    assert wb.generate(model, "hi", tokenizer=Chars(), max_new_tokens=NEW, stream=True) == text
    assert capsys.readouterr().out == text + "\n"
    monkeypatch.setattr(_display, "in_notebook", lambda: True)
    shown = []
    monkeypatch.setattr("IPython.display.display", shown.append)
    wb.generate(model, "hi", tokenizer=Chars(), max_new_tokens=NEW, stream=True)
    assert isinstance(shown[0], GenerationView) and shown[0].texts == [text]
    with pytest.raises(TypeError, match="stream= takes True or a callable"):
        wb.generate(model, PROMPT, max_new_tokens=1, stream="yes")


@pytest.mark.slow
def test_plan_and_trainer_start_from_hf_and_export_the_run(hf, tmp_path):
    import torch
    import transformers

    folder, want, _ = hf["qwen3"]
    cfg = wb.hf.hf_config(folder)
    mesh = _mesh(data=8)
    plan = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=8, seq=16)
    assert plan.memory["total"] > 0
    model = wb.hf.from_hf(folder, plan=plan)
    assert_close_at_scale(logits(model), want, rtol=RTOL)
    tc = wb.TrainConfig(model=cfg, init=str(folder), mesh={"data": 8}, batch=8, seq=16,
                        steps=2, checkpoint_every=2, data="synthetic")
    trainer = wb.Trainer(tc, tmp_path / "run", progress=None)
    start = logits(trainer.model)
    assert_close_at_scale(start, want, rtol=RTOL)     # the run starts at the HF weights
    trainer.run()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["init"] == str(folder)
    assert run["init"] == {"format": "huggingface", "path": str(Path(folder).resolve())}
    trained = logits(trainer.model)
    assert not np.allclose(trained, start)
    trainer.close()
    out = wb.hf.export_run(tmp_path / "run", tmp_path / "exported")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got, _ = reference(ref, new=1)
    assert_close_at_scale(got, trained, rtol=RTOL)
    assert json.loads((out / "config.json").read_text())["architectures"] == \
        ["Qwen3ForCausalLM"]


def test_init_must_match_the_model_config(hf):
    folder, _, _ = hf["llama"]
    with pytest.raises(ValueError, match="different architecture.*n_layers"):
        wb.TrainConfig(model=wb.hf.hf_config(folder, n_layers=3), init=str(folder)).check()


# -- bad input ----------------------------------------------------------------------------

def _copy(hf, family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(hf[family][0], dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_layout_that_does_not_divide_a_tensor(hf):
    folder, _, _ = hf["llama"]   # 2 kv heads
    with pytest.raises(ValueError, match=r"dim 1 of 'blocks.0.attn.k' \(size 2\).*'model' "
                       r"\(size 4\)"):
        wb.hf.from_hf(folder, mesh=_mesh(data=2, model=4), rules="fsdp_tp")


def test_missing_config_and_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        wb.hf.from_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        wb.hf.from_hf(tmp_path / "nope")


def test_unknown_architecture_and_fields(hf, tmp_path):
    d = _copy(hf, "llama", tmp_path)
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(HFConfigError, match="'GPT2LMHeadModel' is not supported"):
        wb.hf.from_hf(d)
    _edit_config(d, architectures=["LlamaForCausalLM"], fancy_gate=True)
    with pytest.raises(HFConfigError, match=r"\['fancy_gate'\].*ignore_fields"):
        wb.hf.from_hf(d)
    _edit_config(d, fancy_gate=None, rope_parameters={"rope_type": "yarn", "rope_theta": 5e5})
    with pytest.raises(HFConfigError, match="rope_type='yarn' .*not implemented"):
        wb.hf.from_hf(d, ignore_fields=["fancy_gate"])
    _edit_config(d, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    with pytest.raises(HFConfigError, match=r"rope_type 'llama3' without \['low_freq_factor', "
                       r"'high_freq_factor', 'original_max_position_embeddings'\]"):
        wb.hf.from_hf(d, ignore_fields=["fancy_gate"])
    _edit_config(d, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                     "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                     "original_max_position_embeddings": 32})
    with pytest.raises(HFConfigError, match="high_freq_factor=1.0 must be larger"):
        wb.hf.from_hf(d, ignore_fields=["fancy_gate"])


def test_missing_and_truncated_shards(hf, tmp_path):
    d = _copy(hf, "mixtral", tmp_path)      # sharded: index + files
    shards = sorted(d.glob("model-*.safetensors"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shards[1].name}.*truncated"):
        wb.hf.from_hf(d)
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"shard {shards[1].name}.*missing"):
        wb.hf.from_hf(d)
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="need their index file"):
        wb.hf.from_hf(d)


def test_shape_vocab_and_dtype_disagreeing_with_config(hf, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(hf, "llama", tmp_path)
    _edit_config(d, vocab_size=200)
    with pytest.raises(CheckpointError, match="embed_tokens.weight.*vocabulary size"):
        wb.hf.from_hf(d)
    _edit_config(d, vocab_size=128, intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight.*shape \[96, 64\].*implies \[64, 64\]"):
        wb.hf.from_hf(d)
    _edit_config(d, intermediate_size=96)
    t = load_file(str(d / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int8)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight.*is I8.*dequantise"):
        wb.hf.from_hf(d)


def test_prompt_outside_vocab_is_refused(hf):
    folder, _, _ = hf["llama"]
    model = wb.hf.from_hf(folder, mesh=_mesh(data=8))
    with pytest.raises(ValueError, match=r"\[0, 128\).*tokenizer's vocabulary"):
        wb.generate(model, [5, 300])
    with pytest.raises(ValueError, match="needs tokenizer="):
        wb.generate(model, "text")
    with pytest.raises(ValueError, match="tokenizer has 256 token ids.*vocab_size is 128"):
        wb.generate(model, "text", tokenizer=wb.data.Tokenizer())


def test_failed_export_leaves_nothing_and_existing_folder_is_kept(hf, tmp_path, monkeypatch):
    import safetensors.numpy

    folder, _, _ = hf["llama"]
    model = wb.hf.from_hf(folder, mesh=_mesh(data=8))
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="keep.txt"):   # not to_hf's: never replaced
        wb.hf.to_hf(model, existing, overwrite=True)
    assert (existing / "keep.txt").read_text() == "x"
    (existing / "keep.txt").unlink()
    wb.hf.to_hf(model, existing, overwrite=True, max_shard_bytes=30_000)   # to_hf's own
    old = {p.name: p.read_bytes() for p in existing.iterdir()}
    with pytest.raises(FileExistsError, match="overwrite=True"):
        wb.hf.to_hf(model, existing)
    calls = []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(tensors, filename, metadata=metadata)
    real = safetensors.numpy.save_file
    monkeypatch.setattr(safetensors.numpy, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        wb.hf.to_hf(model, existing, overwrite=True, max_shard_bytes=30_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]   # no partial folder
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == old


def _tokenizer_json(path, n):
    """A word-level tokenizer.json with ``n`` token ids."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0")).save(str(path))
    return path


def test_tokenizer_larger_than_the_vocab_is_refused_on_import_and_export(hf, tmp_path):
    d = _copy(hf, "llama", tmp_path)                     # vocab_size 128
    _tokenizer_json(d / "tokenizer.json", 200)
    with pytest.raises(CheckpointError, match=r"tokenizer .*tokenizer.json has 200 token ids "
                       r"but the model's vocab_size is 128.*own tokenizer files"):
        wb.hf.from_hf(d)
    model = wb.hf.from_hf(hf["llama"][0], mesh=_mesh(data=8))
    big = _tokenizer_json(tmp_path / "big.json", 200)
    with pytest.raises(ValueError, match=r"exporting to .*out: the tokenizer .*big.json has "
                       r"200 token ids.*vocab_size is 128"):
        wb.hf.to_hf(model, tmp_path / "out", tokenizer=big)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    fits = _tokenizer_json(tmp_path / "tokenizer.json", 100)   # fewer ids than rows: fine
    out = wb.hf.to_hf(model, tmp_path / "out", tokenizer=fits)
    assert (out / "tokenizer.json").read_bytes() == fits.read_bytes()
    assert wb.hf.from_hf(out, mesh=_mesh(data=8)).cfg.vocab_size == 128


def test_a_crash_mid_export_leaves_no_folder_that_looks_complete(hf, tmp_path, monkeypatch):
    """A process killed while writing cannot clean up (simulated: no rmtree): what is left
    is a hidden ``.<name>.partial-*`` folder without config.json, which from_hf refuses."""
    import safetensors.numpy

    from workbench.hf import _save as hf_save

    model = wb.hf.from_hf(hf["llama"][0], mesh=_mesh(data=8))
    real, calls = safetensors.numpy.save_file, []

    def dies(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise KeyboardInterrupt   # BaseException: the cleanup runs for it too
        return real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(safetensors.numpy, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        wb.hf.to_hf(model, tmp_path / "out", max_shard_bytes=30_000)
    assert list(tmp_path.iterdir()) == []
    calls.clear()
    monkeypatch.setattr(hf_save.shutil, "rmtree", lambda *a, **k: None)   # a SIGKILL
    with pytest.raises(KeyboardInterrupt):
        wb.hf.to_hf(model, tmp_path / "out", max_shard_bytes=30_000)
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".out.partial-") and not (tmp_path / "out").exists()
    assert [p.name for p in left.iterdir()] == ["model-00001-of-00012.safetensors"]   # 1 of 12
    assert not (left / "config.json").exists()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        wb.hf.from_hf(left)
