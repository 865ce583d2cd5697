"""Hostile chat templates and messages (workbench/data/_chat.py, _chat_bounds.py) and hostile
Hub caches and ids (workbench/hf/_hub.py): issue 56 items 2 and 7.

A template is untrusted code: each row runs with small bounds (0.5 s, 100,000 characters)
and must stop within a few multiples of them with a ChatTemplateError naming the template's
file. The Hub caches are built here (tests/_chat_models.hub_cache), offline.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

import workbench as wb
from tests._chat_models import hub_cache, write_tokenizer
from workbench.data import _chat
from workbench.data._chat import ChatTemplateError
from workbench._hub import HubError, resolve

SECONDS, CHARS = 0.5, 100_000
HI = [{"role": "user", "content": "hi"}]

# name, template, what the error says
TEMPLATES = [
    ("lipsum", "{{ lipsum(n=10**6) }}", "MAX_LIPSUM_WORDS"),
    ("nested-ranges", "{% for i in range(100000) %}{% for j in range(100000) %}"
                      "{% endfor %}{% endfor %}", "MAX_SECONDS"),
    ("loops-over-strings", "{% for a in 'x' * 10000 %}{% for b in 'x' * 10000 %}"
                           "{% endfor %}{% endfor %}", "MAX_SECONDS"),
    ("emits-100MB", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "MAX_CHARS"),
    ("literal-in-loops", "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx"
                         "{% endfor %}{% endfor %}", "MAX_CHARS"),
    ("macro-buffer", "{% macro big() %}{% for i in range(100000) %}{% for j in range(100000) %}"
                     "x{% endfor %}{% endfor %}{% endmacro %}{{ big() }}", "MAX_SECONDS"),
    ("str-times-n", "{{ 'x' * 10**9 }}", "MAX_CHARS"),
    ("huge-power", "{{ 10 ** (10 ** 9) }}", "MAX_INT_BITS"),
    ("namespace-doubling", "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                           "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "MAX_CHARS"),
    ("macro-doubling", "{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('x') }}", "MAX_CHARS"),
    ("center-width", "{{ 'x' | center(10**9) }}", "MAX_CHARS"),
    ("format-width", "{{ '{:>999999999}'.format('x') }}", "MAX_CHARS"),
    ("percent-width", "{{ '%999999999d' % 1 }}", "MAX_CHARS"),
    ("lone-surrogate-out", "{{ '\\ud800' }}", "lone surrogate"),
]


@pytest.fixture
def bounded(monkeypatch):
    monkeypatch.setattr(_chat, "MAX_SECONDS", SECONDS)
    monkeypatch.setattr(_chat, "MAX_CHARS", CHARS)


def tokenizer_with(folder: Path, template: str, *, jinja: bool) -> wb.data.Tokenizer:
    import json

    write_tokenizer(folder, "qwen3", template_file=jinja)
    if jinja:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                  "chat_template": template}))
    return wb.data.Tokenizer.from_hf(folder)


@pytest.mark.parametrize("jinja", [True, False], ids=["chat_template.jinja", "tokenizer_config"])
@pytest.mark.parametrize("case, template, says", TEMPLATES, ids=[t[0] for t in TEMPLATES])
def test_a_hostile_template_stops_at_a_bound_naming_its_file(bounded, tmp_path, case, template,
                                                             says, jinja):
    tok = tokenizer_with(tmp_path / "tok", template, jinja=jinja)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=says) as e:
        tok.apply_chat_template(HI)
    assert time.monotonic() - start < 4 * SECONDS + 1
    file = "chat_template.jinja" if jinja else "tokenizer_config.json"
    assert str(tmp_path / "tok" / file) in str(e.value)


def test_ordinary_templates_render_as_before_within_the_bounds(bounded, tmp_path):
    """Loops keep loop.length / loop.last / else; the budget applies per render."""
    t = ("{% for i in range(3) %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}"
         "{% endfor %}|{% for m in messages | reverse %}{{ m.role }}{% else %}none{% endfor %}"
         "|{{ 'ab' * 2 }}{{ '%3d' % 7 }}{{ lipsum(1, false, 5, 6) | length > 0 }}")
    tok = tokenizer_with(tmp_path / "tok", t, jinja=True)
    for _ in range(3):
        assert tok.apply_chat_template(HI) == "1/3,2/3,3/3|user|abab  7True"


def test_the_bounds_are_read_at_each_render_and_checked(monkeypatch, tmp_path):
    tok = tokenizer_with(tmp_path / "tok", "{{ 'x' * 200 }}", jinja=True)
    monkeypatch.setattr(_chat, "MAX_CHARS", 100)
    with pytest.raises(ChatTemplateError, match="MAX_CHARS"):
        tok.apply_chat_template(HI)
    monkeypatch.setattr(_chat, "MAX_CHARS", 1000)
    assert tok.apply_chat_template(HI) == "x" * 200
    monkeypatch.setattr(_chat, "MAX_SECONDS", "10")
    with pytest.raises(ValueError, match="MAX_SECONDS='10'"):
        tok.apply_chat_template(HI)


def _self_ref():
    m = {"role": "user", "content": "hi"}
    m["content"] = m
    return [m]


def _list_self_ref():
    parts = [{"type": "text", "text": "hi"}]
    parts.append(parts)
    return [{"role": "user", "content": parts}]


def _deep(n):
    x = "hi"
    for _ in range(n):
        x = [x]
    return [{"role": "user", "content": x}]


# name, messages, the message named, what is wrong
MESSAGES = [
    ("self-referencing-dict", _self_ref(), r"messages\[0\]\['content'\]", "contains itself"),
    ("self-referencing-list", _list_self_ref(), r"messages\[0\]\['content'\]\[1\]",
     "contains itself"),
    ("deeply-nested", _deep(5000), r"messages\[0\]\['content'\]\[0\]", "nested more than"),
    ("just-too-deep", _deep(_chat.MAX_DEPTH), r"messages\[0\]\['content'\]", "nested more than"),
    ("lone-surrogate", [{"role": "user", "content": "a\ud800b"}],
     r"messages\[0\]\['content'\]", "lone surrogate"),
    ("lone-surrogate-second", [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": [{"text": "\udfff"}]}],
     r"messages\[1\]\['content'\]\[0\]\['text'\]", "lone surrogate"),
    ("lone-surrogate-key", [{"role": "user", "content": {"\ud800": 1}}],
     r"messages\[0\]\['content'\] \(a key\)", "lone surrogate"),
]


@pytest.mark.parametrize("case, messages, names, says", MESSAGES, ids=[m[0] for m in MESSAGES])
def test_hostile_messages_are_refused_naming_the_message(tmp_path, case, messages, names, says):
    tok = tokenizer_with(tmp_path / "tok", "{{ messages | tojson }}", jinja=True)
    with pytest.raises(ValueError, match=f"apply_chat_template: {names}.*{says}"):
        tok.apply_chat_template(messages)


def test_a_chat_option_holding_itself_is_refused_naming_it(tmp_path):
    tok = tokenizer_with(tmp_path / "tok", "{{ x }}", jinja=True)
    loop = {}
    loop["a"] = loop
    with pytest.raises(ValueError, match="x=.*contains itself"):
        tok.apply_chat_template(HI, x=loop)
    assert tok.apply_chat_template(HI, x=[1, {"a": "b"}]) == "[1, {'a': 'b'}]"


# --- Hub refs and ids -------------------------------------------------------------------

REPO = "tiny-org/tiny"
A = "a" * 40


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE with REPO at A (main), offline; and a model folder outside the cache."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    outside = tmp_path / "outside_model"
    outside.mkdir()
    (outside / "config.json").write_text('{"model_type": "outside"}')
    root = tmp_path / "hub"
    hub_cache(root, REPO, {A: src}, {"main": A})
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return root / ("models--" + REPO.replace("/", "--"))


def _snapshot_named(repo: Path, name: str) -> None:
    """A snapshot folder under ``name`` (so that huggingface_hub would load it)."""
    folder = repo / "snapshots" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")


# name, refs/main content, snapshot folder made under that name, what the error says.
# Decided: only what huggingface_hub writes (40 lowercase hex digits, nothing after them) is
# a commit; its own reader does not strip, so whitespace is refused rather than guessed.
REFS = [
    ("a-path", "../../../outside_model", None, "not a commit hash"),
    ("a-path-inside-the-cache", "../../models--other--x", None, "not a commit hash"),
    ("short-hash", "abc1234", "abc1234", "not a commit hash"),
    ("uppercase-hex", "A" * 40, "A" * 40, "not a commit hash"),
    ("trailing-newline", A + "\n", A + "\n", "not a commit hash"),
    ("trailing-space", A + " ", A + " ", "not a commit hash"),
    ("empty", "", "", "not a commit hash"),
]


@pytest.mark.parametrize("case, ref, snapshot, says", REFS, ids=[r[0] for r in REFS])
def test_a_refs_file_must_hold_a_commit_hash(cache, case, ref, snapshot, says):
    (cache / "refs" / "main").write_text(ref)
    if snapshot:
        _snapshot_named(cache, snapshot)
    with pytest.raises(HubError, match=f"{REPO!r}.*refs.*main.*{says}"):
        wb.hf.hf_config(REPO)
    with pytest.raises(HubError, match=says):
        resolve(REPO, files=["config.json"])


def test_a_good_refs_file_resolves_to_its_snapshot(cache):
    got = resolve(REPO, files=["config.json"])
    assert got.path == cache / "snapshots" / A and got.revision == A


def test_a_revision_that_leaves_the_refs_folder_is_refused(cache):
    with pytest.raises(HubError, match="leaves the repo's refs folder"):
        resolve(REPO, revision="../../../outside_model/config.json", files=["config.json"])


def test_a_snapshot_file_linking_outside_the_cache_is_refused(cache, tmp_path):
    link = cache / "snapshots" / A / "config.json"
    link.unlink()
    os.symlink(tmp_path / "outside_model" / "config.json", link)
    with pytest.raises(HubError, match="links outside the Hugging Face cache"):
        resolve(REPO, files=["config.json"])


def test_a_snapshot_folder_linking_outside_the_cache_is_refused(cache, tmp_path):
    import shutil

    shutil.rmtree(cache / "snapshots" / A)
    os.symlink(tmp_path / "outside_model", cache / "snapshots" / A)
    with pytest.raises(HubError, match="links outside the Hugging Face cache"):
        resolve(REPO, files=["config.json"])


# name, id. Decided: an "org/name"-shaped string that is no existing path and that
# huggingface_hub would refuse is a HubError naming it (not a raw HFValidationError, not
# "no such folder"); "" stays the path check's ValueError.
IDS = [
    ("trailing-newline", "tiny-org/tiny\n"),
    ("non-ascii-letter", "tiny-org/tïny"),
    ("non-ascii-org", "örg/tiny"),
    ("a-space", "tiny-org/ti ny"),
    ("dot-dot", "tiny-org/.."),
    ("double-dash", "tiny--org/tiny"),
    ("leading-space", " tiny-org/tiny"),
]


@pytest.mark.parametrize("case, name", IDS, ids=[i[0] for i in IDS])
def test_a_bad_hub_id_is_a_hub_error_naming_it(cache, case, name):
    with pytest.raises(HubError, match=re.escape(f"path={name!r} is neither an existing "
                                                 "local path nor a valid Hub id")):
        wb.hf.hf_config(name)


def test_an_empty_id_is_the_path_check(cache):
    with pytest.raises(ValueError, match="path='' is empty"):
        wb.hf.hf_config("")


def test_chat_limits_sets_the_bounds_a_render_stops_at(monkeypatch, tmp_path):
    """The public setter: the next render stops at the bound it set, and says how to raise
    it; values that would stop every chat are refused, naming them."""
    monkeypatch.setattr(_chat, "MAX_SECONDS", _chat.MAX_SECONDS)   # restored after the test
    monkeypatch.setattr(_chat, "MAX_CHARS", _chat.MAX_CHARS)
    assert wb.data.chat_limits(seconds=0.5, chars=20_000) == {"seconds": 0.5, "chars": 20_000}
    tok = tokenizer_with(tmp_path / "tok", "{% for i in range(100000) %}{{ 'x' * 1000 }}"
                         "{% endfor %}", jinja=True)
    with pytest.raises(ChatTemplateError, match=r"wb\.data\.chat_limits\(chars=\.\.\.\)"):
        tok.apply_chat_template(HI)
    for bad in ({"seconds": 0.0}, {"seconds": float("nan")}, {"seconds": "10"},
                {"seconds": 0.01}, {"chars": 100}, {"chars": True}, {"chars": 2.5e7}):
        (name, value), = bad.items()
        with pytest.raises(ValueError, match=rf"chat_limits: {name}="):
            wb.data.chat_limits(**bad)
    assert wb.data.chat_limits() == {"seconds": 0.5, "chars": 20_000}
