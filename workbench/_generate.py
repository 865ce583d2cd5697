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
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench._validate import check_float, check_int
from workbench.models._gpt import GPT, KVCache
from workbench._sharding.rules import Rules

__all__ = ["Stream", "generate", "sample"]

#: What ``generate(..., stream=)`` takes: a callable given the tokens so far ``(B, T + i)``
#: after each new token (its ``finish()``, if it has one, is called at the end), or True.
Stream = Callable[[np.ndarray], Any] | bool | None


def _tokens(prompt: Any, tokenizer: Any, vocab: int, chat: bool = False
            ) -> tuple[np.ndarray, bool]:
    """``(tokens (B, T) int32, was_text)``; every id checked against the model's ``vocab``
    (``chat``: a rendered chat, whose special tokens the template wrote)."""
    if isinstance(prompt, str) and chat:
        arr = np.asarray([list(tokenizer.encode(prompt))])
        if arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError("wb.generate: the chat template rendered these messages as no "
                             "tokens; check the messages and the template")
        was_text = True
    elif isinstance(prompt, str):
        if tokenizer is None or not callable(getattr(tokenizer, "encode", None)) \
                or not callable(getattr(tokenizer, "decode", None)):
            raise ValueError("a text prompt needs tokenizer= (an object with encode/decode, "
                             "e.g. wb.data.Tokenizer) or the model's own (wb.hf.from_hf "
                             "attaches its folder's tokenizer.json as model.tokenizer); or "
                             "pass token ids")
        encode = getattr(tokenizer, "encode_prompt", None)   # wb.data.Tokenizer: as transformers
        ids = encode(prompt) if callable(encode) else tokenizer.encode(prompt)
        ids = getattr(ids, "ids", ids)   # a tokenizers.Encoding
        arr = np.asarray([list(ids)])
        if arr.size == 0:
            raise ValueError(f"wb.generate: prompt={prompt!r} gives no tokens; a prompt needs "
                             "at least one token (a word, or the tokenizer's BOS id as token "
                             "ids)")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"wb.generate: tokenizer.encode({prompt[:40]!r}) returned "
                            f"{arr.dtype} values, not token ids; pass a tokenizer whose encode "
                            "gives integer ids")
        was_text = True
    else:
        try:
            arr = np.asarray(prompt)
        except ValueError:
            raise ValueError("wb.generate: the rows of prompt have different lengths; give "
                             "token ids (T,) or (B, T) with rows of one length (pad them, or "
                             "generate for each prompt on its own)") from None
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or arr.shape[1] == 0 or not np.issubdtype(arr.dtype, np.integer):
            shape = getattr(arr, "shape", None)
            raise ValueError(f"wb.generate: prompt must be text, or token ids (T,) / (B, T) "
                             f"with T >= 1, got shape {shape} dtype {arr.dtype} (rows of a "
                             "batch must have the same length; an empty prompt has no token "
                             "to continue)")
        was_text = False
    if arr.max() >= vocab or arr.min() < 0:
        raise ValueError(f"wb.generate: prompt token ids must be in [0, {vocab}) (the model's "
                         f"vocab_size), got {arr.min()}..{arr.max()}: the tokenizer's "
                         "vocabulary does not match the model's")
    return arr.astype(np.int32), was_text


def _check_sampling(temperature: Any, top_k: Any, top_p: Any, vocab: int,
                    where: str = "wb.generate: ") -> tuple[float, int | None, float | None]:
    """The sampling arguments as Python numbers, or an error naming the argument."""
    temperature = check_float(temperature, "temperature", minimum=0.0, where=where,
                              example="0 for greedy, 0.8 to sample")
    if top_k is not None:
        top_k = check_int(top_k, "top_k", minimum=1, maximum=vocab, where=where,
                          fix=f"keep between 1 and the model's vocab_size={vocab} tokens, or "
                              "top_k=None to keep all")
    if top_p is not None:
        top_p = check_float(top_p, "top_p", where=where, example="0.9")
        if not 0 < top_p <= 1:
            raise ValueError(f"{where}top_p={top_p!r} is out of range; top_p is the "
                             "probability mass kept, in (0, 1] (e.g. 0.9), or None to keep all")
    return temperature, top_k, top_p


def sample(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """Next tokens ``(B,)`` from the last position's logits ``(B, V)``.

    ``temperature == 0`` is greedy (argmax). Otherwise ``logits / temperature`` keeping the
    ``top_k`` largest and the smallest set whose probability reaches ``top_p`` (nucleus
    sampling, Holtzman et al. 2020), then a categorical draw.
    """
    temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p, logits.shape[-1],
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


def _layout(model: GPT, rules: Rules | str | None, batch: int) -> tuple[Any, Rules]:
    """The mesh the parameters live on and the rules to run with (batch replicated when
    the data axes do not divide it)."""
    from workbench._sharding.placement import resolve_placement   # the one default of rules

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
    if not isinstance(model, GPT) and isinstance(getattr(model, "model", None), GPT):
        model = model.model
    if not isinstance(model, GPT):
        raise TypeError(f"generate: model={model!r} is a {type(model).__name__}; give a workbench "
                        "GPT (wb.hf.from_hf(...), plan.materialize()) or a Trainer")
    cfg = model.cfg
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    if messages is not None:
        if prompt is not None:
            raise ValueError("wb.generate: give prompt= or messages=, not both")
        prompt = _chat_text(messages, tokenizer, chat_options)
    elif chat_options is not None:
        raise ValueError("wb.generate: chat_options= are for the chat template of messages=; "
                         "a text prompt is not rendered by it")
    elif prompt is None:
        raise ValueError("wb.generate: give a prompt (text or token ids) or messages=[{'role': "
                         "'user', 'content': ...}]")
    tokens, was_text = _tokens(prompt, tokenizer, cfg.vocab_size, chat=messages is not None)
    b, t = tokens.shape
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1,
                               maximum=np.iinfo(np.int32).max - t, where="wb.generate: ",
                               fix="the number of tokens to add, e.g. 32")
    how = _check_sampling(temperature, top_k, top_p, cfg.vocab_size)
    seed = check_int(seed, "seed", minimum=-2**63, maximum=2**63 - 1, where="wb.generate: ")
    eos = _eos_ids(eos_id, model, cfg.vocab_size)
    if not isinstance(cache, (bool, np.bool_)):
        raise TypeError(f"wb.generate: cache={cache!r} must be True (the KV cache) or False "
                        "(recompute the sequence for every token)")
    if not (stream is None or isinstance(stream, bool) or callable(stream)):
        raise TypeError(f"stream= takes True or a callable of the tokens so far (B, T + i); "
                        f"got {type(stream).__name__}")
    if rules is not None and not isinstance(rules, (str, Rules)):
        raise TypeError(f"wb.generate: rules={rules!r} must be a wb.Rules, a preset name "
                        "('fsdp', 'fsdp_tp', ...) or None")
    n_vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(n_vocab, int) and n_vocab > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {n_vocab} token ids but the model's vocab_size is "
                         f"{cfg.vocab_size}; use the tokenizer the model was trained with")
    total = t + max_new_tokens
    if cfg.sliding_window is not None and total > cfg.sliding_window:
        raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds the model's "
                         f"sliding_window={cfg.sliding_window}; generate fewer tokens")
    mesh, rules = _layout(model, rules, b)
    _check_memory(cfg, b, t, max_new_tokens, cache, mesh, rules)
    if total > cfg.seq_len:
        _warn_past_trained(t, max_new_tokens, cfg.seq_len)
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


def _chat_text(messages: Any, tokenizer: Any, options: Mapping[str, Any] | None = None) -> str:
    """The chat rendered by the tokenizer's template (its special tokens as text), with the
    template variables ``options``."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) and k.isidentifier()
                                                    for k in options):
        raise TypeError(f"wb.generate: chat_options={options!r:.80} must map template variable "
                        "names to values, e.g. {'enable_thinking': False}")
    reserved = {"messages", "add_generation_prompt", "tools", "documents"} & set(options)
    if reserved:
        raise ValueError(f"wb.generate: chat_options may not set {sorted(reserved)}: "
                         "wb.generate sets them itself")
    apply = getattr(tokenizer, "apply_chat_template", None)
    if tokenizer is None or not callable(apply) or not hasattr(tokenizer, "chat_template"):
        raise ValueError(
            "wb.generate: messages= need the model's tokenizer and its chat template: load "
            "the model with wb.hf.from_hf (a folder or Hub id with tokenizer.json and "
            "tokenizer_config.json), or pass tokenizer=wb.data.Tokenizer.from_hf(...)")
    text = apply(messages, add_generation_prompt=True, **options)
    if not isinstance(text, str):
        raise TypeError(f"wb.generate: tokenizer.apply_chat_template returned a "
                        f"{type(text).__name__}, not text; pass a wb.data.Tokenizer")
    return text


def _eos_ids(eos_id: Any, model: Any, vocab: int) -> tuple[int, ...]:
    """The ids generation stops at: ``eos_id`` (one or several), or the model's own."""
    fix = "a token id of the model's vocabulary, a list of them, () for none, or None"
    if eos_id is None:
        tok = getattr(model, "tokenizer", None)
        source = getattr(model, "hf_source", None)
        ids = [getattr(tok, "eos_id", None), *getattr(source, "eos_ids", ())]
        return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and 0 <= i < vocab))
    if isinstance(eos_id, (str, bytes)) or not isinstance(eos_id, (Sequence, np.ndarray)):
        eos_id = [check_int(eos_id, "eos_id", minimum=0, maximum=vocab - 1,
                            where="wb.generate: ", fix=fix)]
    return tuple(dict.fromkeys(check_int(i, f"eos_id[{n}]", minimum=0, maximum=vocab - 1,
                                         where="wb.generate: ", fix=fix)
                               for n, i in enumerate(list(eos_id))))


def _warn_past_trained(t: int, new: int, seq_len: int) -> None:
    head = (f"the prompt ({t} tokens) is longer than" if t > seq_len else
            f"prompt ({t} tokens) + max_new_tokens ({new}) = {t + new} positions run past")
    fix = ("shorten the prompt" if t >= seq_len else
           f"use max_new_tokens <= {seq_len - t} to stay within it")
    warnings.warn(f"wb.generate: {head} the {seq_len} positions the model was trained on "
                  "(cfg.seq_len); RoPE runs at any position, but the model has never seen "
                  f"these and its output usually degrades there; {fix}", stacklevel=3)


def _free_bytes(device: Any) -> tuple[int, str]:
    """Bytes free for new arrays on ``device``, and where they are.

    An accelerator reports its own (``memory_stats``: limit - in use). CPU devices share
    the host's memory: ``MemAvailable`` from /proc/meminfo (else the physical memory).
    """
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, f"{device.platform.upper()} device {device.id}"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this host (MemAvailable)"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host"


def _gb(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def _check_memory(cfg: Any, b: int, t: int, new: int, cache: bool, mesh: Any,
                  rules: Rules) -> None:
    """Refuses a generation whose cache (or, without one, attention scores) cannot fit.

    With the cache: keys and values ``2 x (L, B, S, K, H)`` in ``cfg.dtype``, sharded as
    ``_run`` shards them (per device: the shard's shape). Without: one layer's attention
    scores ``(B, N, S, S)`` in float32 for every new token. CPU devices share the host's
    memory, so there the bytes of every device of the mesh count against it.
    """
    from jax.sharding import NamedSharding

    total = t + new
    if cache:
        shape = (cfg.n_layers, b, total, cfg.n_kv_heads, cfg.head_dim)
        with rules.activate(mesh):
            spec = rules.spec((None, "batch", None, "kv_heads", "head_dim"))
        shard = NamedSharding(mesh, spec).shard_shape(shape)
        need = 2 * math.prod(shard) * jnp.dtype(cfg.dtype).itemsize
        what = (f"a KV cache of 2 x {cfg.n_layers} layers x batch {b} x {total} positions x "
                f"{cfg.n_kv_heads} kv heads x head_dim {cfg.head_dim} x "
                f"{jnp.dtype(cfg.dtype).itemsize} bytes")
        per_position = need / total
    else:
        need = 4 * b * cfg.n_heads * total * total
        what = (f"attention scores of batch {b} x {cfg.n_heads} heads x {total}^2 positions x "
                "4 bytes (cache=False recomputes the whole sequence)")
        per_position = None
    devices = list(mesh.devices.flat)
    free, where = _free_bytes(devices[0])
    n = len(devices) if devices[0].platform == "cpu" else 1   # CPU devices share the host
    if need * n <= free:
        return
    if per_position is not None:
        fit = int(free // (per_position * n)) - t
        hint = (f"at most max_new_tokens={fit} fits with this prompt and batch" if fit >= 1
                else "the prompt alone does not fit")
    else:
        hint = "use cache=True (its memory grows with the length, not its square)"
    amount = f"{_gb(need)} on each device" + (
        f" x {n} devices sharing this host's memory = {_gb(need * n)}" if n > 1 else "")
    raise ValueError(f"wb.generate: max_new_tokens={new} needs {what}: {amount}, but {where} "
                     f"has {_gb(free)} free; {hint}. Lower max_new_tokens or the batch, or "
                     "shard the cache over more devices (a mesh axis for batch or kv_heads)")


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
