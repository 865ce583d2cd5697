"""Trust nothing read from disk: hostile Hugging Face folders and exports, one row each.

Reference: a tiny workbench GPT written by ``wb.hf.to_hf`` (one file, and sharded with
an index) loads back with every parameter equal. Each row damages one thing: a
``config.json`` field of the wrong type or range (``"hidden_size": 64.9`` must not become
64), a binary / list-shaped / truncated JSON file, an index whose shards point outside the
folder, a weight that is NaN or inf; or asks an export for a family that cannot hold the
model, or an integer dtype. Each must raise an error naming the file and the field (or
the tensor), and an export that is refused writes nothing.
"""
import json
import re
import shutil

import numpy as np
import pytest
from flax import nnx

import workbench as wb
from workbench.hf import CheckpointError, HFConfigError

CFG = wb.models.GPTConfig.preset("tiny").replace(n_layers=1, vocab_size=128)


@pytest.fixture(scope="module")
def model():
    from workbench.models._gpt import GPT

    return GPT(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def folders(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-hf")
    single = wb.hf.to_hf(model, root / "single")
    sharded = wb.hf.to_hf(model, root / "sharded", max_shard_bytes=40_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    return {"single": single, "sharded": sharded}


def _params(m):
    return nnx.to_pure_dict(nnx.state(m, nnx.Param))


def _assert_same_params(a, b):
    import jax

    for x, y in zip(jax.tree.leaves(_params(a)), jax.tree.leaves(_params(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _copy(folders, which, tmp_path):
    return shutil.copytree(folders[which], tmp_path / which)


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_the_clean_folders_load_every_parameter(model, folders, which):
    _assert_same_params(wb.hf.from_hf(folders[which]), model)


# -- config.json ------------------------------------------------------------------------

def _edit(**changes):
    def apply(cfg):
        for k, v in changes.items():
            if v is ...:
                cfg.pop(k)
            else:
                cfg[k] = v
        return cfg
    return apply


CONFIG_ROWS = {   # case -> (change to the parsed config.json, the error after "<file>: ")
    "hidden_size 64.9": (_edit(hidden_size=64.9),
                         "field 'hidden_size' is 64.9 (float), not a whole number; fix "
                         "config.json"),
    "hidden_size '64'": (_edit(hidden_size="64"),
                         "field 'hidden_size' is '64' (str), not a whole number"),
    "hidden_size true": (_edit(hidden_size=True),
                         "field 'hidden_size' is True (bool), not a whole number"),
    "hidden_size missing": (_edit(hidden_size=...),
                            "field 'hidden_size' is missing; a int is needed"),
    "num_hidden_layers 0": (_edit(num_hidden_layers=0),
                            "field 'num_hidden_layers' is 0, below 1; fix config.json"),
    "vocab_size -5": (_edit(vocab_size=-5), "field 'vocab_size' is -5, below 1"),
    "rms_norm_eps NaN": (_edit(rms_norm_eps=float("nan")),
                         "field 'rms_norm_eps' is nan (float), not a finite number"),
    "rope_theta a list": (_edit(rope_theta=[1e4]),
                          "field 'rope_theta' is [10000.0] (list), not a finite number"),
    "rope_scaling a list": (_edit(rope_scaling=["linear"]),
                            "field 'rope_scaling' is ['linear'] (list), not an object"),
    "tie_word_embeddings 'yes'": (_edit(tie_word_embeddings="yes"),
                                  "field 'tie_word_embeddings' is 'yes' (str), not true or "
                                  "false"),
    "architectures a string": (_edit(architectures="LlamaForCausalLM"),
                               "field 'architectures' is 'LlamaForCausalLM' (str), not a "
                               "list"),
    "architectures [5]": (_edit(architectures=[5]),
                          "field 'architectures' is [5], not a list of class names"),
    "dtype int8": (_edit(dtype="int8"),
                   "field 'dtype' is 'int8'; the parameters must be one of float32, "
                   "bfloat16, float16, float64"),
    "hidden_act a number": (_edit(hidden_act=3),
                            "field 'hidden_act' is 3 (int), not a string"),
    "heads GPTConfig refuses": (_edit(num_attention_heads=3),
                                "n_heads=3 is not a multiple of n_kv_heads=2"),
}


@pytest.mark.parametrize("case", list(CONFIG_ROWS))
def test_a_bad_config_field_is_named_with_its_file(folders, tmp_path, case):
    change, says = CONFIG_ROWS[case]
    folder = _copy(folders, "single", tmp_path)
    file = folder / "config.json"
    file.write_text(json.dumps(change(json.loads(file.read_text()))))
    for load in (wb.hf.hf_config, wb.hf.from_hf):
        with pytest.raises(HFConfigError) as err:
            load(folder)
        assert str(err.value).startswith(f"{file}: {says}"), str(err.value)


def test_a_whole_float_is_a_whole_number(model, folders, tmp_path):
    folder = _copy(folders, "single", tmp_path)
    file = folder / "config.json"
    file.write_text(json.dumps(_edit(hidden_size=64.0)(json.loads(file.read_text()))))
    assert wb.hf.hf_config(folder) == wb.hf.hf_config(folders["single"])
    _assert_same_params(wb.hf.from_hf(folder), model)


FILE_ROWS = {   # what config.json is -> the error after "<file> "
    "binary": (b"\x80\x81PK\x00\x01", "is not UTF-8 text (byte 0; binary?)"),
    "a list": (b'[{"hidden_size": 64}]', "holds a JSON list, not an object of config fields"),
    "truncated": (b'{"architectures": ["Llama', "is not valid JSON"),
    "empty": (b"", "is not valid JSON"),
}


@pytest.mark.parametrize("case", list(FILE_ROWS))
def test_a_config_json_that_is_no_object_is_named(folders, tmp_path, case):
    raw, says = FILE_ROWS[case]
    folder = _copy(folders, "single", tmp_path)
    (folder / "config.json").write_bytes(raw)
    with pytest.raises(HFConfigError) as err:
        wb.hf.from_hf(folder)
    assert str(err.value).startswith(f"{folder / 'config.json'} {says}")


# -- model.safetensors.index.json -------------------------------------------------------

def _index_rows(folder, outside):
    first = "model-00001-of-00002.safetensors"
    return {   # case -> (new index text, the error after "<index>")
        "binary": (b"\xff\x00\x81", " is not UTF-8 text"),
        "a list": (b"[]", " holds a JSON list; a safetensors index needs a 'weight_map'"),
        "weight_map a list": (json.dumps({"weight_map": [first]}).encode(),
                              " holds 'weight_map' = ['model-00001-of-00002.safetensors']"),
        "a shard ../x": ("../" + outside.name, ": weight_map['model.embed_tokens.weight'] is "
                         f"'../{outside.name}', outside the model folder"),
        "an absolute shard": (str(outside), ": weight_map['model.embed_tokens.weight'] is "
                              f"{str(outside)!r}, outside the model folder"),
        "a shard 5": (5, ": weight_map['model.embed_tokens.weight'] is 5, not a shard file"),
    }


@pytest.mark.parametrize("case", ["binary", "a list", "weight_map a list", "a shard ../x",
                                  "an absolute shard", "a shard 5"])
def test_a_bad_index_is_refused_and_shards_stay_inside_the_folder(folders, tmp_path, case):
    folder = _copy(folders, "sharded", tmp_path)
    index = folder / "model.safetensors.index.json"
    clean = json.loads(index.read_text())
    shard = clean["weight_map"]["model.embed_tokens.weight"]
    outside = shutil.copy(folder / shard, tmp_path / "elsewhere.safetensors")   # loadable
    new, says = _index_rows(folder, tmp_path / "elsewhere.safetensors")[case]
    if not isinstance(new, bytes):   # the embedding's shard moved to ``new``
        new = json.dumps({**clean, "weight_map": {**clean["weight_map"],
                                                  "model.embed_tokens.weight": new}}).encode()
    index.write_bytes(new)
    with pytest.raises(CheckpointError) as err:
        wb.hf.from_hf(folder)
    assert str(err.value).startswith(f"{index}{says}"), str(err.value)
    assert outside


# -- weights ----------------------------------------------------------------------------

@pytest.mark.parametrize("value, kinds", [(np.nan, "NaN"), (np.inf, "inf"),
                                          (-np.inf, "inf")])
def test_non_finite_weights_are_refused_as_they_stream(folders, tmp_path, value, kinds):
    from safetensors.numpy import load_file, save_file

    folder = _copy(folders, "single", tmp_path)
    file = folder / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name][3, 5] = value
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        wb.hf.from_hf(folder)
    assert str(err.value).startswith(
        f"tensor {name!r} in {file} (parameter blocks.0.mlp.down) holds 1 non-finite "
        f"value(s) ({kinds}) in the block read")


# -- export -----------------------------------------------------------------------------

EXPORT_ROWS = {   # to_hf arguments -> (error class, the message's start)
    "family qwen3 (q/k norms)": (dict(family="qwen3"), HFConfigError,
                                 "family='qwen3' cannot hold this model: read back as qwen3, "
                                 "it would have qk_norm: False -> True (transformers would "
                                 "initialise the missing tensors at random); use "
                                 "family='llama'"),
    "family qwen2 (q/k/v biases)": (dict(family="qwen2"), HFConfigError,
                                    "family='qwen2' cannot hold this model: read back as "
                                    "qwen2, it would have qkv_bias: False -> True"),
    "family mixtral (experts)": (dict(family="mixtral"), HFConfigError,
                                 "family='mixtral' cannot hold this model: it is a "
                                 "mixture-of-experts family and the model is dense; use "
                                 "family='llama'"),
    "family gpt2": (dict(family="gpt2"), HFConfigError, "family='gpt2'; choose one of"),
    "family 3": (dict(family=3), HFConfigError, "family=3; choose one of"),
    "dtype int8": (dict(dtype="int8"), ValueError,
                   "to_hf dtype='int8' cannot hold the weights; use one of float32, "
                   "bfloat16, float16, float64 (integer dtypes would truncate them"),
    "dtype int32": (dict(dtype="int32"), ValueError, "to_hf dtype='int32' cannot hold"),
    "dtype bool": (dict(dtype="bool"), ValueError, "to_hf dtype='bool' cannot hold"),
    "dtype 'fast'": (dict(dtype="fast"), ValueError, "to_hf dtype='fast' cannot hold"),
    "dtype np.uint8": (dict(dtype=np.uint8), ValueError, "to_hf dtype=<class"),
}


@pytest.mark.parametrize("case", list(EXPORT_ROWS))
def test_an_export_that_cannot_hold_the_model_is_refused_before_any_file(model, tmp_path,
                                                                         case):
    kwargs, cls, says = EXPORT_ROWS[case]
    with pytest.raises(cls, match="^" + re.escape(says)):
        wb.hf.to_hf(model, tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_family_that_holds_the_model_exports_it(model, tmp_path):
    out = wb.hf.to_hf(model, tmp_path / "out", family="mistral", dtype="float32")
    assert json.loads((out / "config.json").read_text())["model_type"] == "mistral"
    _assert_same_params(wb.hf.from_hf(out), model)
