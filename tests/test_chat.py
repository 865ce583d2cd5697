"""Chat templates (workbench/data/chat.py) and the model's own tokenizer in generation,
checked against transformers: its ``apply_chat_template`` rendering and tokens, its
tokenizer's special tokens and ``tokenizer(text)``, its greedy ``generate`` stopping at EOS.

The tokenizers are local (tests/_chat_models.py): Llama-3- and Qwen3-style templates, in
``tokenizer_config.json`` and in ``chat_template.jinja``.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import workbench as wb
from tests._chat_models import write_tokenizer
from tests._hf_models import make_model, save

transformers = pytest.importorskip(
    "transformers", reason="the test extra installs transformers (the reference rendering)")

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "  2+2?  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!",
                                         "reasoning_content": "greet back"},
     {"role": "user", "content": "Name a prime"}],
    [{"role": "user", "content": "quote \" and <tags> & {{ braces }}", "tool_calls": None}],
]


@pytest.fixture(scope="module", params=[("llama3", False), ("llama3", True),
                                        ("qwen3", False), ("qwen3", True)],
                ids=["llama3", "llama3-jinja", "qwen3", "qwen3-jinja"])
def tokenizers(request, tmp_path_factory):
    style, jinja = request.param
    folder = write_tokenizer(tmp_path_factory.mktemp(style), style, template_file=jinja)
    if jinja:
        assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    return (style, transformers.AutoTokenizer.from_pretrained(str(folder)),
            wb.data.Tokenizer.from_hf(folder))


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["", "no-thinking"])
def test_rendering_equals_transformers(tokenizers, chat, kwargs):
    _, ref, ours = tokenizers
    want = ref.apply_chat_template(CHATS[chat], add_generation_prompt=True, tokenize=False,
                                   **kwargs)
    got = ours.apply_chat_template(CHATS[chat], **kwargs)
    assert got == want
    ids = ref.apply_chat_template(CHATS[chat], add_generation_prompt=True, **kwargs)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ours.encode(got) == list(ids)          # the special tokens become their ids
    assert ours.apply_chat_template(CHATS[chat], add_generation_prompt=False, **kwargs) == \
        ref.apply_chat_template(CHATS[chat], add_generation_prompt=False, tokenize=False,
                                **kwargs)


def test_special_tokens_and_prompts_equal_transformers(tokenizers):
    _, ref, ours = tokenizers
    assert ours.special_tokens == ref.special_tokens_map
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (ref.bos_token_id, ref.eos_token_id,
                                                       ref.pad_token_id)
    for text in ("Hi", "Once upon a time\nthere"):
        assert ours.encode_prompt(text) == ref(text)["input_ids"]    # Llama 3: BOS first


def test_template_helpers_behave_as_in_transformers(tmp_path):
    """raise_exception, strftime_now, tojson without HTML escaping, loop controls, the
    sandbox's namespace: each in a template of its own, against transformers."""
    folder = write_tokenizer(tmp_path / "t", "qwen3")
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = wb.data.Tokenizer(folder)
    msgs = [{"role": "user", "content": "<a & b>"}, {"role": "assistant", "content": "x"}]
    for template in [
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
        "{{ strftime_now('%Y-%m') }} {{ eos_token }} {{ bos_token is defined }}",
        "{% for m in messages %}{% if loop.last %}{% break %}{% endif %}{{ m.role }}\n"
        "{% endfor %}   \n  {% if add_generation_prompt %}GEN{% endif %}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}{{ dict(a=1) }}{{ tools }}{{ documents }}",
        "{% generation %}kept{% endgeneration %}",
    ]:
        ref.chat_template = ours.chat_template = template
        assert ours.apply_chat_template(msgs) == ref.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=False)
    ours.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ValueError, match="refused these messages: only user turns"):
        ours.apply_chat_template(msgs)
    ours.chat_template = "{% set ns = namespace(_x=1) %}"
    with pytest.raises(ValueError, match="underscore"):
        ours.apply_chat_template(msgs)
    ours.chat_template = "{{ messages.__class__.__mro__ }}"   # the sandbox holds
    with pytest.raises(ValueError, match="refused these messages"):
        ours.apply_chat_template(msgs)


# -- generation with the model's own tokenizer ------------------------------------------------

@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A random Qwen3-shaped model (vocab 128) with a Qwen3-style tokenizer (101 ids)."""
    torch_model = make_model("qwen3")
    folder = save(torch_model, tmp_path_factory.mktemp("chat") / "m")
    write_tokenizer(folder, "qwen3")
    return folder, torch_model


def test_generate_text_and_messages_with_the_models_tokenizer(chat_model):
    folder, _ = chat_model
    model = wb.hf.from_hf(folder, mesh=wb.make_mesh(data=8))
    tok = model.tokenizer
    assert isinstance(tok, wb.data.Tokenizer) and tok.chat_template is not None
    want = wb.generate(model, "Hi", tokenizer=tok, max_new_tokens=4, eos_id=())
    assert wb.generate(model, "Hi", max_new_tokens=4, eos_id=()) == want
    msgs = [{"role": "user", "content": "Hi"}]
    ids = tok.encode(tok.apply_chat_template(msgs))
    out = wb.generate(model, ids, max_new_tokens=4, eos_id=())[0, len(ids):].tolist()
    assert wb.generate(model, messages=msgs, max_new_tokens=4, eos_id=()) == tok.decode(out)
    with pytest.raises(ValueError, match="give prompt= or messages=, not both"):
        wb.generate(model, "Hi", messages=msgs)
    with pytest.raises(ValueError, match="give a prompt"):
        wb.generate(model)
    with pytest.raises(TypeError, match="messages='Hi' is a str"):
        wb.generate(model, messages="Hi")
    with pytest.raises(ValueError, match=r"messages\[0\] has no string 'role'"):
        wb.generate(model, messages=[{"content": "Hi"}])
    with pytest.raises(ValueError, match=r"\(byte-level\) has no chat template.*a text "
                       "prompt instead of messages"):
        wb.generate(model, messages=msgs, tokenizer=wb.data.Tokenizer())
    with pytest.raises(ValueError, match="messages= need the model's tokenizer"):
        wb.generate(model, messages=msgs, tokenizer=object())
    # template variables reach the template as transformers' keyword arguments do
    quiet = tok.encode(tok.apply_chat_template(msgs, enable_thinking=False))
    assert quiet != ids     # the Qwen3-style template renders an empty <think> block
    out = wb.generate(model, quiet, max_new_tokens=4, eos_id=())[0, len(quiet):].tolist()
    assert wb.generate(model, messages=msgs, chat_options={"enable_thinking": False},
                       max_new_tokens=4, eos_id=()) == tok.decode(out)
    with pytest.raises(TypeError, match="chat_options=.* must map template variable names"):
        wb.generate(model, messages=msgs, chat_options=["enable_thinking"])
    with pytest.raises(ValueError, match=r"may not set \['add_generation_prompt'\]"):
        wb.generate(model, messages=msgs, chat_options={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="chat_options= are for the chat template"):
        wb.generate(model, "Hi", chat_options={"enable_thinking": False})


def test_generation_stops_at_the_models_eos_as_transformers_does(chat_model, tmp_path):
    """generation_config.json's eos_token_id (a list) stops wb.generate where it stops
    transformers' greedy generate."""
    import torch

    folder, torch_model = chat_model
    prompt = np.array([[5, 9, 3, 17]])
    free = wb.generate(wb.hf.from_hf(folder, mesh=wb.make_mesh(data=8)), prompt,
                       max_new_tokens=6, eos_id=())
    stop = int(free[0, 4 + 2])                       # the third new token
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [127, stop]}))
    model = wb.hf.from_hf(d, mesh=wb.make_mesh(data=8))
    assert model.hf_source.eos_ids == (127, stop)
    eos = [model.tokenizer.eos_id, 127, stop]    # the tokenizer's EOS, then the config's
    got = wb.generate(model, prompt, max_new_tokens=6)
    with torch.no_grad():
        ref = torch_model.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False,
                                   eos_token_id=eos, pad_token_id=eos[0]).numpy()
    first = next(i for i in range(4, 10) if free[0, i] in eos)   # where it must stop
    assert first <= 6 and ref.shape[1] == first + 1
    np.testing.assert_array_equal(got[:, :first + 1], ref)       # the same tokens, to EOS
    np.testing.assert_array_equal(got[:, :first + 1], free[:, :first + 1])
    assert (got[0, first + 1:] == eos[0]).all()   # after EOS: the first of the EOS ids
    np.testing.assert_array_equal(wb.generate(model, prompt, max_new_tokens=6, eos_id=()),
                                  free)   # eos_id=(): never stops early


def test_eos_id_values(chat_model):
    folder, _ = chat_model
    model = wb.hf.from_hf(folder, mesh=wb.make_mesh(data=8))
    out = wb.generate(model, [1, 2], max_new_tokens=3, eos_id=[5, 6])
    assert out.shape == (1, 5)
    with pytest.raises(ValueError, match=r"eos_id\[1\]=999 is out of range"):
        wb.generate(model, [1, 2], eos_id=[5, 999])
    with pytest.raises(TypeError, match=r"eos_id\[0\]='a'"):
        wb.generate(model, [1, 2], eos_id=["a"])


def test_export_writes_the_tokenizer_files_back(chat_model, tmp_path):
    folder, _ = chat_model
    d = tmp_path / "src"
    shutil.copytree(folder, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.jinja").write_text(cfg.pop("chat_template"))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    model = wb.hf.from_hf(d, mesh=wb.make_mesh(data=8))
    out = wb.hf.to_hf(model, tmp_path / "out")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (d / name).read_bytes()
    back = wb.hf.from_hf(out, mesh=wb.make_mesh(data=8))
    assert back.tokenizer.fingerprint == model.tokenizer.fingerprint
    assert back.tokenizer.chat_template == model.tokenizer.chat_template
    ref = transformers.AutoTokenizer.from_pretrained(str(out))
    msgs = [{"role": "user", "content": "Hi"}]
    assert back.tokenizer.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False)
    assert wb.hf.to_hf(model, out, overwrite=True) == out     # a folder to_hf wrote
