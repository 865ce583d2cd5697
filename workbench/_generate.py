"""Text generation with a sharded KV cache: greedy, temperature, top-k and top-p sampling.

This module owns only the prompt, the sampling and the stopping loop; the tokens run
through the model's own forward in decode mode (:meth:`GPT.decode_hidden
<workbench.models._gpt.GPT.decode_hidden>`). The prompt runs once, filling a per-layer
key/value cache ``(B, S, K, H)`` (batch over the rules' ``batch`` axes, kv heads over
``kv_heads``); each new token then runs one position through every block against that
cache. ``cache=False`` recomputes the whole sequence for every token instead (the training
forward on a fixed-length buffer, one compile): the same tokens, for checking the cache.

Shape letters: B batch, T prompt length, S prompt + new tokens, D d_model, N query heads,
K kv heads, H head_dim, V vocab.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench._generate_checks import (
    chat_text,
    check_memory,
    check_options,
    check_sampling,
    eos_ids,
    prompt_tokens,
    warn_past_trained,
)
from workbench._sharding.rules import Rules
from workbench._validate import check_int
from workbench.models._gpt import GPT, KVCache

__all__ = ["Stream", "generate", "sample"]

#: What ``generate(..., stream=)`` takes: a callable given the tokens so far ``(B, T + i)``
#: after each new token (its ``finish()``, if it has one, is called at the end), or True.
Stream = Callable[[np.ndarray], Any] | bool | None


def sample(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """Next tokens ``(B,)`` from the last position's logits ``(B, V)``.

    ``temperature == 0`` is greedy (argmax). Otherwise ``logits / temperature`` keeping the
    ``top_k`` largest and the smallest set whose probability reaches ``top_p`` (nucleus
    sampling, Holtzman et al. 2020), then a categorical draw.
    """
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p, logits.shape[-1],
                                                where="sample: ")
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]                       # (B, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)                                # (B, V)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs          # mass of the better tokens
        drop_sorted = before >= top_p                         # the first token always kept
        drop = jnp.zeros_like(drop_sorted).at[
            jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _gpt_of(model: Any) -> GPT:
    """The GPT to run: ``model`` itself, or a Trainer's ``.model``."""
    if not isinstance(model, GPT) and isinstance(getattr(model, "model", None), GPT):
        model = model.model
    if not isinstance(model, GPT):
        raise TypeError(f"generate: model={model!r} is a {type(model).__name__}; give a workbench "
                        "GPT (wb.hf.from_hf(...), plan.materialize()) or a Trainer")
    return model


def _prompt_text(prompt: Any, messages: Any, chat_options: Mapping[str, Any] | None,
                 tokenizer: Any) -> Any:
    """The prompt to encode: ``prompt``, or ``messages`` rendered by the chat template."""
    if messages is not None:
        if prompt is not None:
            raise ValueError("wb.generate: give prompt= or messages=, not both")
        return chat_text(messages, tokenizer, chat_options)
    if chat_options is not None:
        raise ValueError("wb.generate: chat_options= are for the chat template of messages=; "
                         "a text prompt is not rendered by it")
    if prompt is None:
        raise ValueError("wb.generate: give a prompt (text or token ids) or messages=[{'role': "
                         "'user', 'content': ...}]")
    return prompt


def _layout(model: GPT, rules: Rules | str | None, batch: int) -> tuple[Any, Rules]:
    """The mesh the parameters live on and the rules to run with (batch replicated when
    the data axes do not divide it)."""
    from workbench._sharding.placement import resolve_placement  # the one default of rules

    leaf = model.embed[...]
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(mesh, "devices"):   # unsharded: its one device
        mesh, rules = resolve_placement(None, rules, devices=[next(iter(leaf.devices()))],
                                        where="wb.generate")
    else:
        mesh, rules = resolve_placement(mesh, rules, where="wb.generate")
    axes = rules.mesh_axes("batch") if "batch" in rules else ()
    if batch % int(np.prod([mesh.shape[a] for a in axes])):
        rules = rules.replace(batch=None)
    return mesh, rules


def generate(model: Any, prompt: Any = None, *, messages: Any = None,
             chat_options: Mapping[str, Any] | None = None, tokenizer: Any = None,
             max_new_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0,
             eos_id: int | Sequence[int] | None = None, cache: bool = True,
             rules: Rules | str | None = None, stream: Stream = None) -> Any:
    """Continue a prompt, or answer a chat, with a GPT (imported, trained or planned).

    Args:
        model: a ``GPT`` (``wb.hf.from_hf``, ``plan.materialize``) or anything with a
            ``.model`` (a ``wb.Trainer``).
        prompt: text, or token ids ``(T,)`` / ``(B, T)``. Text is encoded as
            ``transformers``' ``tokenizer(text)`` encodes it (a ``wb.data.Tokenizer``'s
            ``encode_prompt``: Llama 3's BOS first, none for Qwen).
        messages: instead of ``prompt``, a chat: ``[{"role": "user", "content": "Hi!"},
            ...]``, rendered by the tokenizer's chat template as ``transformers``'
            ``apply_chat_template(messages, add_generation_prompt=True)`` renders it.
        chat_options: more variables for the chat template, as ``apply_chat_template``'s
            keyword arguments (``{"enable_thinking": False}``: Qwen3 answers without a
            ``<think>`` block).
        tokenizer: any object with ``encode(text) -> ids`` and ``decode(ids) -> text``
            (``wb.data.Tokenizer``, a ``tokenizers.Tokenizer``); ``messages`` need a
            ``wb.data.Tokenizer`` with a chat template. Default: the model's own
            (``model.tokenizer``, attached by ``wb.hf.from_hf``).
        max_new_tokens: tokens to add.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k, top_p: sampling filters (see :func:`sample`).
        seed: the sampling key.
        eos_id: stop when every sequence has produced one of these ids (later tokens are
            the first of them). Default None: the model's own end-of-sequence ids (its
            tokenizer's EOS and ``generation_config.json``'s ``eos_token_id``, for a
            ``wb.hf.from_hf`` model), else never; ``()`` never stops early.
        cache: use the KV cache (False recomputes the sequence for every token).
        rules: how activations and the cache are sharded on the parameters' mesh (default
            ``workbench._sharding.placement``'s, as the model was loaded: "fsdp_tp" if the mesh has
            one model axis larger than 1, else "fsdp"); a batch that the
            data axes do not divide is replicated over them.
        stream: show tokens as they are produced. A callable is called after each new
            token with the int32 tokens so far ``(B, T + i)`` (prompt included; the last
            column is the new token) and, if it has a ``finish()`` method, that is called
            once at the end. ``True``: in a notebook a live text view
            (``wb.widgets.GenerationView``) in the cell, elsewhere the text on stdout.
            The tokens are the same as without streaming.

    Returns:
        For a text prompt, the decoded text (prompt + continuation); for ``messages``, the
        reply alone (special tokens dropped); for token ids, an int32 array
        ``(B, T + max_new_tokens)``.

    Example::

        model = wb.hf.from_hf("Qwen/Qwen3-0.6B")
        wb.generate(model, messages=[{"role": "user", "content": "Hi!"}])
        wb.generate(model, "The capital of France is", max_new_tokens=8)
        wb.generate(model, [1, 2, 3], max_new_tokens=8)           # greedy
        wb.generate(trainer, "Once upon", tokenizer=tok, temperature=0.8, top_p=0.9)
        wb.generate(trainer, "Once upon", tokenizer=tok, stream=True)   # live in the cell
    """
    model = _gpt_of(model)
    cfg = model.cfg
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    prompt = _prompt_text(prompt, messages, chat_options, tokenizer)
    tokens, was_text = prompt_tokens(prompt, tokenizer, cfg.vocab_size, chat=messages is not None)
    b, t = tokens.shape
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1,
                               maximum=np.iinfo(np.int32).max - t, where="wb.generate: ",
                               fix="the number of tokens to add, e.g. 32")
    how = check_sampling(temperature, top_k, top_p, cfg.vocab_size)
    seed = check_int(seed, "seed", minimum=-2**63, maximum=2**63 - 1, where="wb.generate: ")
    eos = eos_ids(eos_id, model, cfg.vocab_size)
    check_options(cfg, tokenizer, t + max_new_tokens, cache=cache, stream=stream, rules=rules)
    mesh, rules = _layout(model, rules, b)
    check_memory(cfg, b, t, max_new_tokens, cache, mesh, rules)
    if t + max_new_tokens > cfg.seq_len:
        warn_past_trained(t, max_new_tokens, cfg.seq_len)
    sink = _sink(stream, tokenizer if was_text else None)
    with rules.activate(mesh):   # (also inside the compiled steps: a cache hit skips tracing)
        out = _run(model, tokens, max_new_tokens, cache, mesh, rules, eos,
                   dict(zip(("temperature", "top_k", "top_p"), how)), seed, sink)
    if sink is not None and callable(getattr(sink, "finish", None)):
        sink.finish()
    if messages is not None:
        new = out[0, t:].tolist()
        stop = next((i for i, x in enumerate(new) if x in eos), len(new))
        return tokenizer.decode(new[:stop])
    if was_text:
        return tokenizer.decode(out[0].tolist())
    return out


def _sink(stream: Stream, tokenizer: Any) -> Callable[[np.ndarray], Any] | None:
    """The callable that receives the tokens so far (``stream=True``: a live view)."""
    if stream is None or stream is False:
        return None
    if stream is True:
        from workbench._display import text_stream

        return text_stream(tokenizer)
    if not callable(stream):
        raise TypeError(f"stream= takes True or a callable of the tokens so far (B, T + i); "
                        f"got {type(stream).__name__}")
    return stream


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def _pick(logits: jax.Array, key: jax.Array, *, temperature: float, top_k: int | None,
          top_p: float | None) -> jax.Array:
    return sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _cached(graphdef: Any, rules: Rules, mesh: Any, state: Any, toks: jax.Array,
            kvcache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits ``(B, V)`` of the last of ``toks`` (B, t) and the updated cache: the model's
    own forward in decode mode (compiled once per model, rules and shapes: the prompt,
    then one token at a time)."""
    with rules.activate(mesh):
        model = nnx.merge(graphdef, state)
        h, kvcache = model.decode_hidden(toks, kvcache)                   # (B, t, D)
        logits = model.head(h[:, -1:])                                    # (B, 1, V)
    return logits[:, 0].astype(jnp.float32), kvcache


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _full(graphdef: Any, rules: Rules, mesh: Any, state: Any, buf: jax.Array,
          last: jax.Array) -> jax.Array:
    """Logits ``(B, V)`` at position ``last`` of the whole buffer ``(B, S)`` (no cache)."""
    with rules.activate(mesh):
        model = nnx.merge(graphdef, state)
        h = model.hidden(buf)                                             # (B, S, D)
        h = jax.lax.dynamic_slice_in_dim(h, last, 1, axis=1)              # (B, 1, D)
        logits = model.head(h)                                            # (B, 1, V)
    return logits[:, 0].astype(jnp.float32)


def _run(model: GPT, tokens: np.ndarray, new: int, cache: bool, mesh: Any, rules: Rules,
         eos: tuple[int, ...], how: dict[str, Any], seed: int,
         sink: Callable[[np.ndarray], Any] | None = None) -> np.ndarray:
    from jax.sharding import NamedSharding

    b, t = tokens.shape
    total = t + new
    graphdef, state = nnx.split(model)
    batch_sh = NamedSharding(mesh, rules.spec(("batch", None)))
    key = jax.random.key(seed)
    buf = jax.device_put(np.pad(tokens, ((0, 0), (0, new))), batch_sh)      # (B, S)
    if cache:
        stacked = NamedSharding(mesh, rules.spec((None, "batch", None, "kv_heads",
                                                  "head_dim")))
        kvcache = model.init_cache(b, total, sharding=stacked)   # (L, B, S, K, H) twice
        logits, kvcache = _cached(graphdef, rules, mesh, state, buf[:, :t], kvcache)
    else:
        logits = _full(graphdef, rules, mesh, state, buf, jnp.int32(t - 1))
    out = np.asarray(tokens)
    done = np.zeros(b, bool)
    for i in range(new):
        nxt = np.asarray(_pick(logits, jax.random.fold_in(key, i), **how))
        if eos:
            nxt = np.where(done, eos[0], nxt)
            done |= np.isin(nxt, eos)
        out = np.concatenate([out, nxt[:, None]], axis=1)
        if sink is not None:
            sink(out.copy())
        if i == new - 1 or (eos and done.all()):
            break
        step_tokens = jax.device_put(nxt[:, None], batch_sh)
        if cache:
            logits, kvcache = _cached(graphdef, rules, mesh, state, step_tokens, kvcache)
        else:
            buf = buf.at[:, t + i].set(step_tokens[:, 0])
            logits = _full(graphdef, rules, mesh, state, buf, jnp.int32(t + i))
    if out.shape[1] < total:   # stopped at eos
        out = np.pad(out, ((0, 0), (0, total - out.shape[1])), constant_values=eos[0])
    return out.astype(np.int32)
