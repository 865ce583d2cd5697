"""Text generation with a sharded KV cache: greedy, temperature, top-k and top-p sampling.

The prompt runs once through the model filling a per-layer key/value cache ``(B, S, K, H)``
(batch over the rules' ``batch`` axes, kv heads over ``kv_heads``); each new token then
runs one position through every block against that cache. ``cache=False`` recomputes the
whole sequence for every token instead (a fixed-length buffer, one compile): the same
tokens, for checking the cache.

Shape letters: B batch, T prompt length, S prompt + new tokens, D d_model, N query heads,
K kv heads, H head_dim, V vocab.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench.models.gpt import GPT, rope
from workbench.rules import Rules

__all__ = ["Stream", "generate", "sample"]

#: What ``generate(..., stream=)`` takes: a callable given the tokens so far ``(B, T + i)``
#: after each new token (its ``finish()``, if it has one, is called at the end), or True.
Stream = Callable[[np.ndarray], Any] | bool | None


def _tokens(prompt: Any, tokenizer: Any) -> tuple[np.ndarray, bool]:
    """``(tokens (B, T) int32, was_text)``."""
    if isinstance(prompt, str):
        if tokenizer is None or not hasattr(tokenizer, "encode"):
            raise ValueError("a text prompt needs tokenizer= (an object with encode/decode, "
                             "e.g. wb.data.Tokenizer); or pass token ids")
        ids = tokenizer.encode(prompt)
        ids = getattr(ids, "ids", ids)   # a tokenizers.Encoding
        return np.asarray([list(ids)], np.int32), True
    arr = np.asarray(prompt)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"prompt must be text, or token ids (T,) / (B, T) with T >= 1, got "
                         f"shape {arr.shape} dtype {arr.dtype} (rows of a batch must have "
                         "the same length)")
    return arr.astype(np.int32), False


def sample(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """Next tokens ``(B,)`` from the last position's logits ``(B, V)``.

    ``temperature == 0`` is greedy (argmax). Otherwise ``logits / temperature`` keeping the
    ``top_k`` largest and the smallest set whose probability reaches ``top_p`` (nucleus
    sampling, Holtzman et al. 2020), then a categorical draw.
    """
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


def _attend_cached(attn: Any, x: jax.Array, ck: jax.Array, cv: jax.Array, pos: jax.Array,
                   kv_sharding: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One attention layer on ``x`` (B, t, D) at positions ``pos..pos+t``, writing its keys
    and values into the cache ``ck, cv`` (B, S, K, H) and attending to the cache."""
    dt = attn.dtype
    q = jnp.einsum("btd,dnh->btnh", x, attn.q[...].astype(dt))              # (B, t, N, H)
    k = jnp.einsum("btd,dkh->btkh", x, attn.k[...].astype(dt))              # (B, t, K, H)
    v = jnp.einsum("btd,dkh->btkh", x, attn.v[...].astype(dt))              # (B, t, K, H)
    if attn.bias is not None:
        q, k, v = (y + attn.bias[n][...].astype(dt) for y, n in ((q, "q"), (k, "k"), (v, "v")))
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    t, s = x.shape[1], ck.shape[1]
    positions = pos + jnp.arange(t)
    q, k = rope(q, attn.theta, positions), rope(k, attn.theta, positions)
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, pos, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, pos, 0, 0))
    ck = jax.lax.with_sharding_constraint(ck, kv_sharding)
    cv = jax.lax.with_sharding_constraint(cv, kv_sharding)
    mask = jnp.arange(s)[None, :] <= positions[:, None]                      # (t, S)
    y = jax.nn.dot_product_attention(q, ck.astype(dt), cv.astype(dt),
                                     mask=mask[None, None], implementation="xla")
    out = jnp.einsum("btnh,nhd->btd", y, attn.o[...].astype(dt))             # (B, t, D)
    return out, ck, cv


def _block_step(block: Any, x: jax.Array, ck: jax.Array, cv: jax.Array, pos: jax.Array,
                kv_sharding: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    a, ck, cv = _attend_cached(block.attn, block.attn_norm(x), ck, cv, pos, kv_sharding)
    x = x + a
    return x + block.mlp(block.mlp_norm(x)), ck, cv


def _forward_cached(model: GPT, tokens: jax.Array, cache: tuple[jax.Array, jax.Array],
                    pos: jax.Array, kv_sharding: Any
                    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Logits of the last position ``(B, V)`` and the updated cache ``(L, B, S, K, H)``
    twice, for ``tokens`` (B, t) at positions ``pos..pos+t``."""
    cfg = model.cfg
    x = jnp.take(model.embed[...], tokens, axis=0).astype(cfg.dtype)        # (B, t, D)
    ks, vs = cache
    if cfg.scan_layers:
        graphdef, state = nnx.split(model.blocks)

        def body(h: jax.Array, layer: Any) -> tuple[jax.Array, Any]:
            params, ck, cv = layer
            h, ck, cv = _block_step(nnx.merge(graphdef, params), h, ck, cv, pos, kv_sharding)
            return h, (ck, cv)

        x, (ks, vs) = jax.lax.scan(body, x, (state, ks, vs))
    else:
        new_k, new_v = [], []
        for i, block in enumerate(model.blocks):
            x, ck, cv = _block_step(block, x, ks[i], vs[i], pos, kv_sharding)
            new_k.append(ck)
            new_v.append(cv)
        ks, vs = jnp.stack(new_k), jnp.stack(new_v)
    logits = model.head(model.final_norm(x[:, -1:]))                         # (B, 1, V)
    return logits[:, 0].astype(jnp.float32), (ks, vs)


def _layout(model: GPT, rules: Rules | str | None, batch: int) -> tuple[Any, Rules]:
    """The mesh the parameters live on and the rules to run with (batch replicated when
    the data axes do not divide it)."""
    leaf = model.embed[...]
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(mesh, "devices"):
        from workbench.mesh import make_mesh

        mesh = make_mesh(data=1, devices=[next(iter(leaf.devices()))])
    if rules is None or isinstance(rules, str):
        name = rules or ("fsdp_tp" if "model" in mesh.axis_names else "fsdp")
        rules = Rules.preset(name, mesh)
    axes = rules.mesh_axes("batch") if "batch" in rules else ()
    if batch % int(np.prod([mesh.shape[a] for a in axes])):
        rules = rules.replace(batch=None)
    return mesh, rules


def generate(model: Any, prompt: Any, *, tokenizer: Any = None, max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, eos_id: int | None = None, cache: bool = True,
             rules: Rules | str | None = None, stream: Stream = None) -> Any:
    """Continue a prompt with a GPT (imported, trained or planned).

    Args:
        model: a ``GPT`` (``wb.models.from_hf``, ``plan.materialize``) or anything with a
            ``.model`` (a ``wb.Trainer``).
        prompt: text (with ``tokenizer``), or token ids ``(T,)`` / ``(B, T)``.
        tokenizer: any object with ``encode(text) -> ids`` and ``decode(ids) -> text``
            (``wb.data.Tokenizer``, a ``tokenizers.Tokenizer``).
        max_new_tokens: tokens to add.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k, top_p: sampling filters (see :func:`sample`).
        seed: the sampling key.
        eos_id: stop when every sequence has produced it (later tokens are ``eos_id``).
        cache: use the KV cache (False recomputes the sequence for every token).
        rules: how activations and the cache are sharded on the parameters' mesh (default
            "fsdp_tp" if the mesh has a ``model`` axis, else "fsdp"); a batch that the
            data axes do not divide is replicated over them.
        stream: show tokens as they are produced. A callable is called after each new
            token with the int32 tokens so far ``(B, T + i)`` (prompt included; the last
            column is the new token) and, if it has a ``finish()`` method, that is called
            once at the end. ``True``: in a notebook a live text view
            (``wb.widgets.GenerationView``) in the cell, elsewhere the text on stdout.
            The tokens are the same as without streaming.

    Returns:
        For a text prompt, the decoded text (prompt + continuation); for token ids, an
        int32 array ``(B, T + max_new_tokens)``.

    Example::

        wb.generate(model, [1, 2, 3], max_new_tokens=8)           # greedy
        wb.generate(trainer, "Once upon", tokenizer=tok, temperature=0.8, top_p=0.9)
        wb.generate(trainer, "Once upon", tokenizer=tok, stream=True)   # live in the cell
    """
    if not isinstance(model, GPT) and isinstance(getattr(model, "model", None), GPT):
        model = model.model
    if not isinstance(model, GPT):
        raise TypeError(f"generate needs a workbench GPT (or a Trainer); got "
                        f"{type(model).__name__}")
    if temperature < 0 or (top_k is not None and top_k < 1) or \
            (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"temperature={temperature} must be >= 0, top_k={top_k} >= 1, "
                         f"top_p={top_p} in (0, 1]")
    tokens, was_text = _tokens(prompt, tokenizer)
    cfg = model.cfg
    n_vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(n_vocab, int) and n_vocab > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {n_vocab} token ids but the model's vocab_size is "
                         f"{cfg.vocab_size}; use the tokenizer the model was trained with")
    if tokens.max() >= cfg.vocab_size or tokens.min() < 0:
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}) (the model's "
                         f"vocab_size), got {tokens.min()}..{tokens.max()}: the tokenizer's "
                         "vocabulary does not match the model's")
    b, t = tokens.shape
    total = t + max_new_tokens
    if cfg.sliding_window is not None and total > cfg.sliding_window:
        raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds the model's "
                         f"sliding_window={cfg.sliding_window}; generate fewer tokens")
    mesh, rules = _layout(model, rules, b)
    sink = _sink(stream, tokenizer if was_text else None)
    with rules.activate(mesh):   # (also inside the compiled steps: a cache hit skips tracing)
        out = _run(model, tokens, max_new_tokens, cache, mesh, rules, eos_id,
                   dict(temperature=temperature, top_k=top_k, top_p=top_p), seed, sink)
    if sink is not None and callable(getattr(sink, "finish", None)):
        sink.finish()
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
def _cached(graphdef: Any, rules: Rules, kv: Any, state: Any, toks: jax.Array, kvcache: Any,
            pos: jax.Array) -> Any:
    """Logits of the last position and the updated cache (compiled once per model, rules
    and shapes: the prompt, then one token at a time)."""
    with rules.activate(kv.mesh):
        return _forward_cached(nnx.merge(graphdef, state), toks, kvcache, pos, kv)


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
         eos_id: int | None, how: dict[str, Any], seed: int,
         sink: Callable[[np.ndarray], Any] | None = None) -> np.ndarray:
    from jax.sharding import NamedSharding

    cfg = model.cfg
    b, t = tokens.shape
    total = t + new
    graphdef, state = nnx.split(model)
    batch_sh = NamedSharding(mesh, rules.spec(("batch", None)))
    key = jax.random.key(seed)
    buf = jax.device_put(np.pad(tokens, ((0, 0), (0, new))), batch_sh)      # (B, S)
    if cache:
        kv = NamedSharding(mesh, rules.spec(("batch", None, "kv_heads", "head_dim")))
        stacked = NamedSharding(mesh, rules.spec((None, "batch", None, "kv_heads",
                                                  "head_dim")))
        shape = (cfg.n_layers, b, total, cfg.n_kv_heads, cfg.head_dim)
        kvcache = (jnp.zeros(shape, cfg.dtype, device=stacked),
                   jnp.zeros(shape, cfg.dtype, device=stacked))
        logits, kvcache = _cached(graphdef, rules, kv, state, buf[:, :t], kvcache,
                                  jnp.int32(0))
    else:
        logits = _full(graphdef, rules, mesh, state, buf, jnp.int32(t - 1))
    out = np.asarray(tokens)
    done = np.zeros(b, bool)
    for i in range(new):
        nxt = np.asarray(_pick(logits, jax.random.fold_in(key, i), **how))
        if eos_id is not None:
            nxt = np.where(done, eos_id, nxt)
            done |= nxt == eos_id
        out = np.concatenate([out, nxt[:, None]], axis=1)
        if sink is not None:
            sink(out.copy())
        if i == new - 1 or (eos_id is not None and done.all()):
            break
        step_tokens = jax.device_put(nxt[:, None], batch_sh)
        if cache:
            logits, kvcache = _cached(graphdef, rules, kv, state, step_tokens, kvcache,
                                      jnp.int32(t + i))
        else:
            buf = buf.at[:, t + i].set(step_tokens[:, 0])
            logits = _full(graphdef, rules, mesh, state, buf, jnp.int32(t + i))
    if out.shape[1] < total:   # stopped at eos
        out = np.pad(out, ((0, 0), (0, total - out.shape[1])), constant_values=eos_id)
    return out.astype(np.int32)
