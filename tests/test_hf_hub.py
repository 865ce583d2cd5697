"""Hub ids (workbench/hf/hub.py): ``from_hf``, ``hf_config``, ``Tokenizer.from_hf`` and
``TrainConfig(init=...)`` read a Hugging Face cache laid out as ``huggingface_hub`` writes
it (blobs, snapshot symlinks, refs), with ``HF_HUB_OFFLINE=1``: nothing is downloaded.

The reference is the snapshot folder loaded directly by path. The Hub's own refusals
(gated, not found, no such revision) cannot happen offline: those go through a stand-in
for ``snapshot_download`` that raises huggingface_hub's own exception classes.
"""
from __future__ import annotations

import json
import os
import shutil

import httpx2
import numpy as np
import pytest
from flax import nnx
from huggingface_hub import errors

import workbench as wb
from tests._chat_models import hub_cache, write_tokenizer
from tests._hf_models import PROMPT, make_model, save
from tests._tolerance import assert_close_at_scale
from workbench._hub import HubError

pytest.importorskip("transformers", reason="the test extra installs transformers + torch (CPU)")

REPO = "tiny-org/tiny-llama"
A, B = "a" * 40, "b" * 40      # two commits: main, and the tag v2 (other weights)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-src")
    out = {}
    for commit, seed in ((A, 0), (B, 1)):
        d = save(make_model("llama", seed=seed), root / commit)
        write_tokenizer(d, "llama3")
        out[commit] = d
    return out


@pytest.fixture
def cache(folders, tmp_path, monkeypatch):
    """HF_HUB_CACHE with REPO at A (main) and B (v2), offline."""
    root = tmp_path / "hf-cache"
    hub_cache(root, REPO, folders, {"main": A, "v2": B})
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return root


def snapshot(cache, commit):
    return cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / commit


def params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def same(a, b):
    for x, y in zip(jax_leaves(a), jax_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_the_cache_layout_is_huggingface_hubs(cache):
    """The fixture is what huggingface_hub itself reads: its cache scan sees both revisions."""
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache)
    (repo,) = info.repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {A, B}
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {A: {"main"}, B: {"v2"}}
    assert os.path.islink(snapshot(cache, A) / "model.safetensors")


def test_from_hf_id_equals_the_snapshot_folder(cache):
    mesh = wb.make_mesh(data=8)
    by_id = wb.hf.from_hf(REPO, mesh=mesh, progress=False)
    by_path = wb.hf.from_hf(snapshot(cache, A), mesh=mesh)
    same(params(by_id), params(by_path))
    src = by_id.hf_source
    assert (src.repo_id, src.revision, src.path) == (REPO, A, str(snapshot(cache, A)))
    assert by_path.hf_source.repo_id is None and by_path.hf_source.revision is None
    assert src.to_dict()["repo_id"] == REPO and src.to_dict()["revision"] == A
    assert by_id.tokenizer == by_path.tokenizer and by_id.tokenizer.chat_template
    assert wb.hf.hf_config(REPO) == wb.hf.hf_config(snapshot(cache, A))


def test_a_revision_picks_its_snapshot(cache):
    mesh = wb.make_mesh(data=8)
    main = params(wb.hf.from_hf(REPO, mesh=mesh))
    want = params(wb.hf.from_hf(snapshot(cache, B), mesh=mesh))
    for rev in (B, "v2"):
        m = wb.hf.from_hf(REPO, revision=rev, mesh=mesh)
        assert m.hf_source.revision == B
        same(params(m), want)
    assert not np.array_equal(np.asarray(main["embed"]), np.asarray(want["embed"]))
    with pytest.raises(HubError, match=r"path='tiny-org/tiny-llama' \(revision 'v3'\) is not "
                       r"in the Hugging Face cache .*HF_HUB_OFFLINE=1"):
        wb.hf.from_hf(REPO, revision="v3")


def test_tokenizer_from_hf_id_equals_the_folder(cache):
    by_id = wb.data.Tokenizer.from_hf(REPO)
    by_path = wb.data.Tokenizer.from_hf(snapshot(cache, A))
    assert by_id == by_path == wb.data.Tokenizer(snapshot(cache, A))
    assert by_id.chat_template == by_path.chat_template is not None
    assert by_id.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    msgs = [{"role": "user", "content": "Hi"}]
    assert by_id.apply_chat_template(msgs) == by_path.apply_chat_template(msgs)
    assert wb.data.Tokenizer.from_hf(REPO, revision="v2").path.startswith(
        str(snapshot(cache, B)))


def test_a_local_folder_wins_over_an_id(cache, folders, tmp_path):
    local = tmp_path / REPO                     # ./tiny-org/tiny-llama, the other weights
    shutil.copytree(folders[B], local)
    model = wb.hf.from_hf(REPO, mesh=wb.make_mesh(data=8))
    assert model.hf_source.repo_id is None and model.hf_source.path == str(local)
    with pytest.raises(ValueError, match="revision='v2' is for Hub ids; path=.* is a local"):
        wb.hf.from_hf(REPO, revision="v2")


def test_offline_and_not_cached(cache):
    with pytest.raises(HubError, match=r"from_hf: path='tiny-org/absent' \(revision 'main'\) "
                       r"is not in the Hugging Face cache .*hf download tiny-org/absent"):
        wb.hf.from_hf("tiny-org/absent")
    with pytest.raises(HubError, match=r"Tokenizer.from_hf: name='tiny-org/absent'"):
        wb.data.Tokenizer.from_hf("tiny-org/absent")
    with pytest.raises(HubError, match=r"hf_config: path='tiny-org/absent'"):
        wb.hf.hf_config("tiny-org/absent")
    with pytest.raises(HubError, match=r"TrainConfig: init='tiny-org/absent'"):
        wb.TrainConfig(init="tiny-org/absent").check()


def test_a_repo_without_safetensors(cache, folders, tmp_path):
    bins = tmp_path / "bin-only"
    bins.mkdir()
    shutil.copy(folders[A] / "config.json", bins)
    (bins / "pytorch_model.bin").write_bytes(b"\0" * 16)
    hub_cache(cache, "tiny-org/bin-only", {A: bins}, {"main": A})
    from workbench._hf_format.tensors import CheckpointError
    with pytest.raises(CheckpointError, match=r"path='tiny-org/bin-only' \(commit a+\) has no "
                       r"safetensors weights.*safe_serialization=True"):
        wb.hf.from_hf("tiny-org/bin-only")
    conf = tmp_path / "config-only"      # hf_config ran, the weights never came
    conf.mkdir()
    shutil.copy(folders[A] / "config.json", conf)
    hub_cache(cache, "tiny-org/config-only", {A: conf}, {"main": A})
    assert wb.hf.hf_config("tiny-org/config-only").n_layers > 0
    with pytest.raises(HubError, match="without its weights.*HF_HUB_OFFLINE=1"):
        wb.hf.from_hf("tiny-org/config-only")


def _response(status):
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api"))


@pytest.mark.parametrize("exc, match", [
    (errors.GatedRepoError("403 gated", response=_response(403)),
     r"path='tiny-org/gated' is a gated model: .*hf auth login.*HF_TOKEN"),
    (errors.RepositoryNotFoundError("404", response=_response(404)),
     r"path='tiny-org/gated' is neither a local folder nor a model on the Hugging Face Hub"),
    (errors.RevisionNotFoundError("404 rev", response=_response(404)),
     r"path='tiny-org/gated' has no revision 'main'"),
])
def test_the_hubs_refusals_name_the_id_and_the_fix(cache, monkeypatch, exc, match):
    """Online refusals (no offline way to have them): huggingface_hub's own classes."""
    import huggingface_hub

    seen = {}

    def refuse(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(HubError, match=match):
        wb.hf.from_hf("tiny-org/gated")
    assert seen["local_files_only"] is False and seen["cache_dir"] == cache
    assert "model.safetensors" in seen["allow_patterns"]
    assert not any(p.endswith(".bin") or p == "*" for p in seen["allow_patterns"])


def test_progress_bar_is_shown_or_quiet(cache, monkeypatch, capsys):
    """The bar class handed to snapshot_download: tqdm.auto (a widget in notebooks, where
    huggingface_hub's TTY-only bar stays hidden), or one that draws nothing."""
    import huggingface_hub
    from tqdm.auto import tqdm

    real = huggingface_hub.snapshot_download
    bars = []

    def download(repo_id, **kwargs):
        bar = kwargs["tqdm_class"](total=3, desc="Fetching 3 files")
        bar.update(3)
        bar.close()
        bars.append(kwargs["tqdm_class"])
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    wb.hf.hf_config(REPO, progress=False)
    assert "Fetching" not in capsys.readouterr().err
    wb.hf.hf_config(REPO)
    assert "Fetching 3 files" in capsys.readouterr().err
    assert bars[1] is tqdm and issubclass(bars[0], tqdm)


def test_train_config_init_id_records_the_commit(cache, tmp_path):
    cfg = wb.hf.hf_config(REPO)
    tc = wb.TrainConfig(model=cfg, init=REPO, init_revision="v2", mesh={"data": 8}, batch=8,
                        seq=16, steps=1, checkpoint_every=1, data="synthetic")
    assert tc.init == REPO and tc.check() is tc
    assert wb.TrainConfig.from_dict(tc.to_dict()) == tc
    assert wb.TrainConfig(model=cfg, init=REPO).to_dict().get("init_revision") is None
    trainer = wb.Trainer(tc, tmp_path / "run", progress=None)
    want = wb.hf.from_hf(REPO, revision="v2", mesh=wb.make_mesh(data=8))
    same(trainer.state.params, params(want))          # the run starts at v2's weights
    trainer.run()
    trainer.close()
    rec = json.loads((tmp_path / "run" / "run.json").read_text())["init"]
    assert rec == {"format": "huggingface", "path": str(snapshot(cache, B)),
                   "repo_id": REPO, "revision": B}
    out = wb.hf.export_run(tmp_path / "run", tmp_path / "exported")   # the id's tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (snapshot(cache, B) / name).read_bytes()
    assert wb.data.Tokenizer.from_hf(out).chat_template == want.tokenizer.chat_template
    # v2 moves on: the run keeps the commit it started from
    (cache / ("models--" + REPO.replace("/", "--")) / "refs" / "v2").write_text(A)
    again = wb.Trainer(tc, tmp_path / "run", progress=None)
    assert again._init_hub(["config.json"]).revision == B
    assert again._init_record()["revision"] == B
    again.close()


def test_train_config_init_values(cache):
    with pytest.raises(TypeError, match="init_revision=5 must be a branch"):
        wb.TrainConfig(init=REPO, init_revision=5)
    with pytest.raises(ValueError, match="init_revision='v2' picks a revision of a Hub id; "
                       "init=None"):
        wb.TrainConfig(init_revision="v2")
    with pytest.raises(ValueError, match="is a local path"):
        wb.TrainConfig(init=str(snapshot(cache, A)), init_revision="v2")
    with pytest.raises(ValueError, match="different architecture"):
        wb.TrainConfig(model="tiny", init=REPO).check()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_lora_run_from_an_id_exports_merged_and_peft(cache, tmp_path):
    """A LoRA run whose base is a Hub id (TrainConfig(init=REPO)) exports as merged weights
    and as PEFT adapters naming the id and its commit. Reference: transformers loads the
    merged folder, and peft applies the adapters to the snapshot the id names, each with
    the trained model's logits; exporting again over
    the earlier folders (overwrite=True) replaces them."""
    peft = pytest.importorskip("peft", reason="the test extra installs peft")
    import torch
    import transformers

    lora = {"rank": 4, "alpha": 16, "targets": ("q", "k", "v", "o", "gate", "up", "down")}
    tc = wb.TrainConfig(model=wb.hf.hf_config(REPO), init=REPO, lora=lora, mesh={"data": 8},
                        batch=8, seq=16, steps=3, checkpoint_every=3, data="synthetic",
                        optimizer=wb.train.AdamW(lr=1e-2, warmup_steps=1))
    trainer = wb.Trainer(tc, tmp_path / "run", progress=None)
    trainer.run()
    want = np.asarray(trainer.model(PROMPT))
    trainer.close()

    def logits(model):
        with torch.no_grad():
            return model(torch.tensor(PROMPT, dtype=torch.long)).logits.float().numpy()

    for again in (False, True):   # the second time over the first's folders
        merged = wb.hf.export_run(tmp_path / "run", tmp_path / "merged", overwrite=again)
        adapter = wb.hf.export_run(tmp_path / "run", tmp_path / "adapter", lora="peft",
                                   overwrite=again)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (merged / name).read_bytes() == (snapshot(cache, A) / name).read_bytes()
        got = logits(transformers.AutoModelForCausalLM.from_pretrained(merged,
                                                                       dtype=torch.float32))
        assert_close_at_scale(got, want, rtol=1e-5)
        conf = json.loads((adapter / "adapter_config.json").read_text())
        assert (conf["base_model_name_or_path"], conf["revision"]) == (REPO, A)
        base = transformers.AutoModelForCausalLM.from_pretrained(   # what REPO names at A
            snapshot(cache, A), dtype=torch.float32)
        got = logits(peft.PeftModel.from_pretrained(base, adapter).eval())
        assert_close_at_scale(got, want, rtol=1e-5)
    plain = transformers.AutoModelForCausalLM.from_pretrained(snapshot(cache, A),
                                                              dtype=torch.float32)
    assert not np.allclose(logits(plain), want, rtol=1e-3, atol=1e-3)   # the adapters matter


# -- hostile caches -------------------------------------------------------------------------

def _replace_blob(cache, commit, name, text):
    link = snapshot(cache, commit) / name
    link.unlink()
    link.write_text(text)


def test_malformed_files_in_a_snapshot(cache):
    from workbench._hf_format.families import HFConfigError

    _replace_blob(cache, A, "tokenizer_config.json", "{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not readable JSON"):
        wb.data.Tokenizer.from_hf(REPO)
    with pytest.warns(UserWarning, match="tokenizer was not attached.*not readable JSON"):
        model = wb.hf.from_hf(REPO, mesh=wb.make_mesh(data=8))
    assert model.tokenizer is None
    with pytest.raises(ValueError, match="a text prompt needs tokenizer="):
        wb.generate(model, "Hi", max_new_tokens=1)
    _replace_blob(cache, A, "tokenizer_config.json", json.dumps(
        {"eos_token": "<|nope|>", "chat_template": "{{ x"}))
    with pytest.raises(ValueError, match=r"names eos_token='<\|nope\|>', which is not a token"):
        wb.data.Tokenizer.from_hf(REPO)
    _replace_blob(cache, A, "tokenizer_config.json", json.dumps({"chat_template": 7}))
    with pytest.raises(ValueError, match="chat_template is a int, not a template"):
        wb.data.Tokenizer.from_hf(REPO)
    _replace_blob(cache, A, "tokenizer_config.json", json.dumps({"chat_template": "{{ x"}))
    tok = wb.data.Tokenizer.from_hf(REPO)
    with pytest.raises(ValueError, match="is not a valid Jinja template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    _replace_blob(cache, A, "config.json", "[1, 2]")
    with pytest.raises(HFConfigError, match="config.json"):
        wb.hf.from_hf(REPO)


def test_a_dangling_snapshot_symlink(cache):
    target = (snapshot(cache, A) / "model.safetensors").resolve()
    target.unlink()                       # the blob is gone, the link stays
    with pytest.raises(HubError, match=r"cache is damaged: \['model.safetensors'\].*"
                       r"--force-download"):
        wb.hf.from_hf(REPO)


@pytest.mark.parametrize("value, error", [
    (5, TypeError), (b"tiny-org/x", TypeError), ("", ValueError), ("a\0b", ValueError)])
def test_hostile_names(cache, value, error):
    for call in (wb.hf.from_hf, wb.hf.hf_config, wb.data.Tokenizer.from_hf):
        with pytest.raises(error):
            call(value)


@pytest.mark.parametrize("kwargs, match", [
    ({"revision": 3}, "revision=3 must be a branch"),
    ({"revision": ""}, "revision='' must be a branch"),
    ({"progress": "yes"}, "progress='yes' must be True"),
])
def test_hostile_revision_and_progress(cache, kwargs, match):
    for call in (wb.hf.from_hf, wb.hf.hf_config, wb.data.Tokenizer.from_hf):
        with pytest.raises(TypeError, match=match):
            call(REPO, **kwargs)
