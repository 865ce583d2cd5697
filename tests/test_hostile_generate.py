"""Hostile arguments to ``wb.generate`` (issue 44, item 6): each refused before anything
runs, with an error naming the argument, the value and the fix; the KV cache's bytes checked
against the device's memory up front (the reference: 2 x L x B x S x K x H x itemsize, by
hand); a warning past the positions the model was trained on; good arguments of other
numeric types give the same tokens as plain ints.
"""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import workbench as wb
from workbench import _generate as gen
from workbench import _generate_checks as generate_checks
from workbench.models._gpt import GPT

TINY = wb.models.GPTConfig.preset("tiny").replace(seq_len=16)
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def model():
    return GPT(TINY, rngs=nnx.Rngs(0))


class Chars:
    """A tokenizer of 128 ids, one per character."""

    def encode(self, text):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


V = TINY.vocab_size
BAD = [
    # (case, prompt, kwargs, exception, message)
    ("max-new-negative", PROMPT, dict(max_new_tokens=-1), ValueError,
     r"max_new_tokens=-1 is out of range; max_new_tokens must be an integer from 1"),
    ("max-new-zero", PROMPT, dict(max_new_tokens=0), ValueError, r"max_new_tokens=0 is out"),
    ("max-new-float", PROMPT, dict(max_new_tokens=1.5), TypeError,
     r"max_new_tokens=1.5 is a float.*pick max_new_tokens=1 or max_new_tokens=2"),
    ("max-new-string", PROMPT, dict(max_new_tokens="4"), TypeError,
     r"max_new_tokens='4' is a string.*write max_new_tokens=4"),
    ("max-new-bool", PROMPT, dict(max_new_tokens=True), TypeError,
     r"max_new_tokens=True is a bool"),
    ("max-new-huge", PROMPT, dict(max_new_tokens=10**9), ValueError,
     r"max_new_tokens=1000000000 needs a KV cache of 2 x 2 layers x batch 1 x 1000000003 "
     r"positions x 2 kv heads x head_dim 16 x 4 bytes: .* GiB on each device, but .* free; "
     r"at most max_new_tokens=\d+ fits"),
    ("max-new-past-int32", PROMPT, dict(max_new_tokens=2**31), ValueError,
     r"max_new_tokens=2147483648 is out of range.*from 1 to 2147483644"),
    ("temperature-nan", PROMPT, dict(temperature=float("nan")), ValueError,
     r"temperature=nan is not finite; temperature must be a finite number >= 0"),
    ("temperature-inf", PROMPT, dict(temperature=float("inf")), ValueError,
     r"temperature=inf is not finite"),
    ("temperature-negative", PROMPT, dict(temperature=-0.5), ValueError,
     r"temperature=-0.5 is out of range"),
    ("temperature-string", PROMPT, dict(temperature="0.8"), TypeError,
     r"temperature='0.8' is a string.*write temperature=0.8"),
    ("top-k-past-vocab", PROMPT, dict(temperature=1.0, top_k=V + 1), ValueError,
     rf"top_k={V + 1} is out of range; top_k must be an integer from 1 to {V}.*vocab_size={V}"),
    ("top-k-zero", PROMPT, dict(temperature=1.0, top_k=0), ValueError, r"top_k=0 is out of range"),
    ("top-k-float", PROMPT, dict(temperature=1.0, top_k=2.0), TypeError,
     r"top_k=2.0 is a float.*write top_k=2"),
    ("top-p-zero", PROMPT, dict(temperature=1.0, top_p=0), ValueError,
     r"top_p=0.0 is out of range; top_p is the probability mass kept, in \(0, 1\]"),
    ("top-p-past-one", PROMPT, dict(temperature=1.0, top_p=1.5), ValueError, r"top_p=1.5 is out"),
    ("top-p-nan", PROMPT, dict(temperature=1.0, top_p=float("nan")), ValueError,
     r"top_p=nan is not finite"),
    ("seed-string", PROMPT, dict(seed="1"), TypeError, r"seed='1' is a string.*write seed=1"),
    ("seed-huge", PROMPT, dict(seed=2**64), ValueError, r"seed=18446744073709551616 is out"),
    ("eos-past-vocab", PROMPT, dict(eos_id=V), ValueError,
     rf"eos_id={V} is out of range; eos_id must be an integer from 0 to {V - 1}"),
    ("eos-float", PROMPT, dict(eos_id=1.0), TypeError, r"eos_id=1.0 is a float"),
    ("cache-string", PROMPT, dict(cache="yes"), TypeError, r"cache='yes' must be True .* or False"),
    ("rules-int", PROMPT, dict(rules=5), TypeError, r"rules=5 must be a wb.Rules, a preset name"),
    ("stream-string", PROMPT, dict(stream="yes"), TypeError, r"stream= takes True or a callable"),
    ("prompt-empty-text", "", dict(tokenizer=Chars()), ValueError,
     r"prompt='' gives no tokens; a prompt needs at least one token"),
    ("prompt-empty-ids", [], {}, ValueError,
     r"prompt must be text, or token ids .* got shape \(1, 0\).*empty prompt"),
    ("prompt-ragged", [[1, 2], [3]], {}, ValueError, r"rows of prompt have different lengths"),
    ("prompt-floats", [1.0, 2.0], {}, ValueError, r"prompt must be text, or token ids.*float64"),
    ("prompt-none", None, {}, ValueError, r"give a prompt \(text or token ids\) or messages="),
    ("prompt-past-vocab", [1, V], {}, ValueError,
     rf"prompt token ids must be in \[0, {V}\).*got 1..{V}"),
    ("prompt-past-int32", [2**32 + 5], {}, ValueError,
     rf"prompt token ids must be in \[0, {V}\).*got 4294967301"),   # not wrapped to 5
    ("prompt-negative", [-1, 2], {}, ValueError, r"prompt token ids must be in \[0, 256\)"),
    ("text-without-tokenizer", "hi", {}, ValueError, r"a text prompt needs tokenizer="),
    ("tokenizer-without-decode", "hi", dict(tokenizer=type("E", (), {"encode": Chars.encode})()),
     ValueError, r"a text prompt needs tokenizer= \(an object with encode/decode"),
]


@pytest.mark.parametrize("case, prompt, kwargs, exc, message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_refused_naming_them(model, monkeypatch, case, prompt, kwargs, exc,
                                               message):
    ran = []
    monkeypatch.setattr(gen, "_run", lambda *a, **k: ran.append(a))   # nothing may run
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a refusal comes without a warning first
        with pytest.raises(exc, match=message) as err:
            wb.generate(model, prompt, **kwargs)
    assert not ran
    text = str(err.value)
    named = "prompt" if case.startswith("prompt") or not kwargs else list(kwargs)[-1]
    assert named in text or case.startswith(("text", "tokenizer")), text


def test_kv_cache_bytes_against_free_memory(model, monkeypatch):
    """The cache of batch B and S positions is 2 x L x B x S x K x H x itemsize bytes; with
    room for exactly 3 + 5 positions, 5 new tokens run and 6 are refused naming 5."""
    per_position = 2 * TINY.n_layers * 2 * TINY.n_kv_heads * TINY.head_dim * \
        jnp.dtype(TINY.resolved().dtype).itemsize   # batch 2
    monkeypatch.setattr(generate_checks, "free_bytes",
                        lambda d: (per_position * (3 + 5), "the test's"))
    prompt = np.array([PROMPT, PROMPT])
    assert wb.generate(model, prompt, max_new_tokens=5).shape == (2, 8)
    with pytest.raises(ValueError, match=rf"max_new_tokens=6 needs .* batch 2 x 9 positions.*: "
                                         rf"{per_position * 9 / 2**20:.3g} MiB on each device, "
                                         r"but the test's has .* free; at most "
                                         r"max_new_tokens=5 fits"):
        wb.generate(model, prompt, max_new_tokens=6)
    # without the cache: one layer's scores (B, N, S, S) in float32, every token
    monkeypatch.setattr(generate_checks, "free_bytes",
                        lambda d: (4 * 2 * TINY.n_heads * 8 * 8, "the test's"))
    assert wb.generate(model, prompt, max_new_tokens=5, cache=False).shape == (2, 8)
    with pytest.raises(ValueError, match=r"attention scores of batch 2 x 4 heads x 9\^2 .*"
                                         r"use cache=True"):
        wb.generate(model, prompt, max_new_tokens=6, cache=False)


def test_free_bytes_reads_the_host_for_cpu_devices():
    free, where = generate_checks.free_bytes(jax.devices("cpu")[0])
    assert 0 < free and where.startswith("this host")


WARN = [
    # (case, prompt length, max_new_tokens, warning or None)
    ("within", 13, 3, None),
    ("past-by-new-tokens", 13, 4, r"prompt \(13 tokens\) \+ max_new_tokens \(4\) = 17 positions "
     r"run past the 16 positions the model was trained on \(cfg.seq_len\).*max_new_tokens <= 3"),
    ("prompt-past", 17, 1, r"the prompt \(17 tokens\) is longer than the 16 positions.*"
     r"shorten the prompt"),
]


@pytest.mark.parametrize("case, t, new, warning", WARN, ids=[w[0] for w in WARN])
def test_a_warning_past_the_trained_length(model, case, t, new, warning):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = wb.generate(model, list(range(1, t + 1)), max_new_tokens=new)
    assert out.shape == (1, t + new)
    got = [str(w.message) for w in seen if "wb.generate" in str(w.message)]
    if warning is None:
        assert got == []
    else:
        assert len(got) == 1 and re.search(warning, got[0]), got
        assert seen[0].filename == __file__   # it points at the caller's line


def test_good_arguments_of_other_types_give_the_same_tokens(model):
    want = wb.generate(model, PROMPT, max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9,
                       seed=3)
    got = wb.generate(model, np.array(PROMPT, np.int64), max_new_tokens=np.int64(4),
                      temperature=np.float32(0.7), top_k=np.int32(5), top_p=0.9,
                      seed=np.uint8(3), cache=np.bool_(True))
    np.testing.assert_array_equal(got, want)
    # top_k = the whole vocabulary keeps every token: the same draws as no filter
    np.testing.assert_array_equal(
        wb.generate(model, PROMPT, max_new_tokens=4, temperature=1.0, top_k=V, seed=1),
        wb.generate(model, PROMPT, max_new_tokens=4, temperature=1.0, seed=1))
    assert wb.generate(model, "hi", tokenizer=Chars(), max_new_tokens=2)[:2] == "hi"


def test_sample_checks_its_filters():
    logits = jnp.zeros((1, 4))
    with pytest.raises(TypeError, match=r"sample: top_k=2.0 is a float"):
        gen.sample(logits, jax.random.key(0), temperature=1.0, top_k=2.0)
    with pytest.raises(ValueError, match=r"sample: top_k=5 is out of range.*from 1 to 4"):
        gen.sample(logits, jax.random.key(0), temperature=1.0, top_k=5)
    with pytest.raises(ValueError, match=r"sample: temperature=nan is not finite"):
        gen.sample(logits, jax.random.key(0), temperature=float("nan"))

