"""What ``wb.generate`` checks before it runs: the prompt's tokens, the chat it renders,
the sampling options, the stop ids, and the memory the cache needs."""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from workbench._sharding.rules import Rules
from workbench._validate import check_float, check_int


def prompt_tokens(prompt: Any, tokenizer: Any, vocab: int, chat: bool = False
                  ) -> tuple[np.ndarray, bool]:
    """``(tokens (B, T) int32, was_text)``; every id checked against the model's ``vocab``
    (``chat``: a rendered chat, whose special tokens the template wrote)."""
    if isinstance(prompt, str) and chat:
        arr = np.asarray([list(tokenizer.encode(prompt))])
        if arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError("wb.generate: the chat template rendered these messages as no "
                             "tokens; check the messages and the template")
    elif isinstance(prompt, str):
        arr = _text_ids(prompt, tokenizer)
    else:
        arr = _given_ids(prompt)
    if arr.max() >= vocab or arr.min() < 0:
        raise ValueError(f"wb.generate: prompt token ids must be in [0, {vocab}) (the model's "
                         f"vocab_size), got {arr.min()}..{arr.max()}: the tokenizer's "
                         "vocabulary does not match the model's")
    return arr.astype(np.int32), isinstance(prompt, str)


def _text_ids(prompt: str, tokenizer: Any) -> np.ndarray:
    """A text prompt encoded as ``transformers`` encodes it, ``(1, T)``."""
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
    return arr


def _given_ids(prompt: Any) -> np.ndarray:
    """Token ids ``(T,)`` or ``(B, T)`` as ``(B, T)``, or an error saying what they must be."""
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
    return arr


def check_sampling(temperature: Any, top_k: Any, top_p: Any, vocab: int,
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


def chat_text(messages: Any, tokenizer: Any, options: Mapping[str, Any] | None = None) -> str:
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


def eos_ids(eos_id: Any, model: Any, vocab: int) -> tuple[int, ...]:
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


def check_options(cfg: Any, tokenizer: Any, total: int, *, cache: Any, stream: Any,
                  rules: Any) -> None:
    """``cache``, ``stream`` and ``rules`` of a type ``wb.generate`` takes, a tokenizer no
    larger than the model's vocabulary, and ``total`` positions within its sliding window."""
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
    if cfg.sliding_window is not None and total > cfg.sliding_window:
        raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds the model's "
                         f"sliding_window={cfg.sliding_window}; generate fewer tokens")


def warn_past_trained(t: int, new: int, seq_len: int) -> None:
    head = (f"the prompt ({t} tokens) is longer than" if t > seq_len else
            f"prompt ({t} tokens) + max_new_tokens ({new}) = {t + new} positions run past")
    fix = ("shorten the prompt" if t >= seq_len else
           f"use max_new_tokens <= {seq_len - t} to stay within it")
    warnings.warn(f"wb.generate: {head} the {seq_len} positions the model was trained on "
                  "(cfg.seq_len); RoPE runs at any position, but the model has never seen "
                  f"these and its output usually degrades there; {fix}", stacklevel=3)


def free_bytes(device: Any) -> tuple[int, str]:
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


def check_memory(cfg: Any, b: int, t: int, new: int, cache: bool, mesh: Any,
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
    free, where = free_bytes(devices[0])
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
