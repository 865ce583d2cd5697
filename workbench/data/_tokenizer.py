"""Tokenizers: byte-level (the default), a Hugging Face ``tokenizer.json``, a SentencePiece model.

``Tokenizer()`` is byte-level: token ``i`` is byte ``i`` (vocabulary 256, no special
tokens). ``Tokenizer("tokenizer.json")`` loads a local Hugging Face fast tokenizer with
the ``tokenizers`` package; ``Tokenizer("spm.model")`` a SentencePiece model with the
``sentencepiece`` package. Nothing is downloaded. Special tokens: SentencePiece models
carry their own BOS/EOS/PAD ids; for a ``tokenizer.json`` they are looked up by the usual
names (``<s>``, ``</s>``, ``<|endoftext|>``, ``<pad>``, ...) or given by name
(``Tokenizer(path, eos="<|im_end|>")``). A model folder's ``tokenizer_config.json`` (and a
legacy ``special_tokens_map.json``) beside the ``tokenizer.json`` names them instead, as
``transformers`` reads them, and carries the chat template (``chat_template.jinja``
first): :meth:`Tokenizer.apply_chat_template`. :meth:`Tokenizer.from_hf` also takes a
Hub id.

A document becomes ``[bos] + encode(text) + [eos]`` (each where the tokenizer has one):
:meth:`Tokenizer.document`. The object pickles by path (Grain worker processes reload
it) and is named in caches by :attr:`Tokenizer.fingerprint` (the file's SHA-256 and the
special tokens).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from workbench._validate import check_bool, check_int, check_path, check_str
from workbench.data._files import DataFileNotFound
from workbench.data._tokenizer_folder import folder_config, template_source

__all__ = ["Tokenizer", "check_vocab"]

_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]", "<|startoftext|>")
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]", "<|im_end|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


class Tokenizer:
    """Text <-> token ids, by one of three kinds ("bytes", "hf", "sentencepiece").

    Args:
      path: None (byte-level), a Hugging Face ``tokenizer.json`` (or the folder holding
        one), or a SentencePiece ``.model`` file.
      bos, eos, pad: special tokens by name (``tokenizer.json`` only), overriding the ones
        found by their usual names; ``""`` means none.

    Attributes:
      kind: "bytes", "hf" or "sentencepiece".
      vocab_size: ids are below this (the model's ``vocab_size`` must be at least this).
      bos_id, eos_id, pad_id: special token ids, or None.
      special_tokens: ``{"bos_token": "<s>", ...}``: the named special tokens of the
        folder's ``tokenizer_config.json`` (empty without one).
      chat_template: the folder's Jinja chat template (``chat_template.jinja``, else
        ``tokenizer_config.json``'s ``chat_template``), or None.

    Example::

        tok = wb.data.Tokenizer("my_tokenizer/tokenizer.json")
        tok.encode("Once upon a time")      # [1435, 2402, 257, 640]
        tok.decode(tok.encode("hi")) == "hi"
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, bos: str | None = None,
                 eos: str | None = None, pad: str | None = None) -> None:
        self.path = None if path is None else str(check_path(path, "path", where="Tokenizer: "))
        self._names = {"bos": bos, "eos": eos, "pad": pad}
        for role, given in self._names.items():
            if given is not None:
                _check_token_name(given, role)
        self._impl: Any = None
        if self.path is None:
            if any(v is not None for v in self._names.values()):
                raise ValueError("the byte-level tokenizer has no special tokens; bos/eos/pad "
                                 "need a tokenizer.json")
            self.kind, self.vocab_size = "bytes", 256
            self.bos_id = self.eos_id = self.pad_id = None
            self.special_tokens, self.chat_template, self._configured = {}, None, False
            self._sha = "bytes"
            return
        file = Path(self.path).expanduser().absolute()   # a job may start elsewhere
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise DataFileNotFound(
                f"tokenizer file {str(file)!r} (path={path!r}) does not exist; pass a Hugging "
                "Face tokenizer.json (or its folder) or a SentencePiece .model file, or "
                "Tokenizer() for byte-level tokens")
        self.path = str(file)
        self._sha = hashlib.sha256(file.read_bytes()).hexdigest()
        self.kind = "sentencepiece" if file.suffix == ".model" else "hf"
        if self.kind == "sentencepiece" and any(v is not None for v in self._names.values()):
            raise ValueError(f"{file} is a SentencePiece model: its special tokens are part "
                             "of the model (trained with bos_id/eos_id/pad_id); drop bos/eos/pad")
        self.special_tokens, self.chat_template, self._configured = ({}, None, False) \
            if self.kind != "hf" else folder_config(file.parent)
        self._load()

    @classmethod
    def from_hf(cls, name: str | os.PathLike[str], *, revision: str | None = None,
                progress: bool = True) -> Tokenizer:
        """A model's own tokenizer: a local model folder or a Hub id.

        Reads ``tokenizer.json`` with ``tokenizer_config.json``'s special tokens and chat
        template. A Hub id (``"org/name"``) downloads only the tokenizer files into the
        Hugging Face cache (or reads them from it: ``HF_HUB_OFFLINE=1``); an existing local
        path wins over an id.

        Args:
          name: the folder (or its ``tokenizer.json``), or a Hub id.
          revision: the Hub repo's branch, tag or commit (default "main"); ids only.
          progress: a progress bar while downloading.

        Example::

            tok = wb.data.Tokenizer.from_hf("Qwen/Qwen3-0.6B")
            tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
        """
        from workbench._hub import TOKENIZER_PATTERNS, resolve

        check_path(name, "name", where="Tokenizer.from_hf: ")
        where = resolve(name, revision=revision, progress=progress, files=TOKENIZER_PATTERNS,
                        where="Tokenizer.from_hf", arg="name")
        if where.repo_id is not None and not (where.path / "tokenizer.json").is_file():
            raise DataFileNotFound(
                f"Tokenizer.from_hf: the Hub repo {where.repo_id!r} (commit {where.revision}) "
                "has no tokenizer.json (only fast tokenizers are read); use a repo that has "
                "one, or save one with transformers' AutoTokenizer(...).save_pretrained(folder)")
        return cls(where.path)

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The text of ``messages`` in the model's chat template, as transformers'
        ``apply_chat_template(messages, add_generation_prompt=..., tokenize=False)``
        renders it (its special tokens included: encode it with :meth:`encode`).

        Args:
          messages: ``[{"role": "user", "content": "Hi!"}, ...]``.
          add_generation_prompt: end with the header of the assistant's turn.
          **kwargs: template variables (``enable_thinking=False`` for Qwen3).

        Raises:
          ValueError: this tokenizer has no chat template, or the template refused.
        """
        from workbench.data._chat import render

        check_bool(add_generation_prompt, "add_generation_prompt",
                   where="apply_chat_template: ")
        if self.chat_template is None:
            raise ValueError(
                f"the tokenizer {self.path or '(byte-level)'} has no chat template (no "
                "chat_template.jinja and none in tokenizer_config.json: a base model, not an "
                "instruct one); pass a text prompt instead of messages, or use the instruct "
                "model's tokenizer")
        return render(self.chat_template, messages, self.special_tokens,
                      add_generation_prompt=add_generation_prompt, where="apply_chat_template",
                      source=template_source(Path(str(self.path)).parent), **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt as ``transformers``' ``tokenizer(text)`` gives them: the
        ``tokenizer.json``'s own post-processor adds the special tokens the model expects
        (Llama 3's BOS; none for Qwen). Byte-level and SentencePiece: :meth:`encode`."""
        if self.kind == "hf":
            return list(self._impl.encode(text, add_special_tokens=True).ids)
        return self.encode(text)

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        if self.kind == "sentencepiece":
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor()
            try:
                sp.Load(self.path)
            except (OSError, RuntimeError) as err:
                raise ValueError(f"{self.path} is not a SentencePiece model ({err}); "
                                 "train one with sentencepiece or pass a tokenizer.json") from err
            self._impl = sp
            self.vocab_size = int(sp.GetPieceSize())
            self.bos_id, self.eos_id, self.pad_id = (
                i if i >= 0 else None for i in (sp.bos_id(), sp.eos_id(), sp.pad_id()))
            return
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(self.path)
        except Exception as err:   # the Rust side raises plain Exception
            raise ValueError(f"{self.path} is not a Hugging Face tokenizer.json ({err}); "
                             "save one with tokenizer.save(path) or pass a .model file") from err
        self._impl = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        ids = {}
        for role, names in (("bos", _BOS_NAMES), ("eos", _EOS_NAMES), ("pad", _PAD_NAMES)):
            given = self._names[role]
            if given is None and self._configured:
                # the folder's tokenizer_config.json names it (or, by leaving it out, none)
                given = self.special_tokens.get(f"{role}_token", "")
                if given and tok.token_to_id(given) is None:
                    raise ValueError(
                        f"{Path(self.path).parent / 'tokenizer_config.json'} names {role}_token"
                        f"={given!r}, which is not a token of {self.path}; the files belong to "
                        "different tokenizers: copy the model's own tokenizer files")
            if given == "":
                ids[role] = None
            elif given is not None:
                found = tok.token_to_id(given)
                if found is None:
                    raise ValueError(f"{role}={given!r} is not a token of {self.path}; give "
                                     f"one of its special tokens, or {role}='' for none")
                ids[role] = int(found)
            else:
                ids[role] = next((int(i) for n in names
                                  if (i := tok.token_to_id(n)) is not None), None)
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_impl"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._impl = None
        if self.kind != "bytes":
            self._load()

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        if self.kind == "sentencepiece":
            return list(self._impl.EncodeAsIds(text))
        return list(self._impl.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of several texts (the Rust tokenizer runs them in parallel)."""
        if self.kind == "hf":
            return [list(e.ids) for e in
                    self._impl.encode_batch(list(texts), add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Any) -> str:
        """Text of token ids (special tokens dropped; invalid UTF-8 bytes replaced)."""
        ids = [int(i) for i in ids]
        if self.kind == "bytes":
            return bytes(ids).decode("utf-8", errors="replace")
        if self.kind == "sentencepiece":
            return str(self._impl.DecodeIds(ids))
        return str(self._impl.decode(ids, skip_special_tokens=True))

    def document(self, text: str) -> list[int]:
        """``[bos] + encode(text) + [eos]``, each special token where the tokenizer has one."""
        return self._wrap(self.encode(text))

    def documents(self, texts: list[str]) -> list[list[int]]:
        """:meth:`document` of several texts."""
        return [self._wrap(ids) for ids in self.encode_batch(texts)]

    def _wrap(self, ids: list[int]) -> list[int]:
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else []
        return head + ids + tail

    # ------------------------------------------------------------------ identity
    @property
    def sha256(self) -> str:
        """The SHA-256 of the tokenizer file when it was loaded ("bytes": byte-level)."""
        return self._sha

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming this tokenizer in caches (file hash and special tokens)."""
        key = json.dumps([self.kind, self._sha, self.bos_id, self.eos_id, self.pad_id])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``Tokenizer.from_dict`` inverts it)."""
        return {"path": self.path, **{k: v for k, v in self._names.items() if v is not None}}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Tokenizer:
        """Inverse of :meth:`to_dict` (None: byte-level)."""
        d = dict(d or {})
        return cls(d.pop("path", None), **d)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and other.fingerprint == self.fingerprint \
            and other.path == self.path

    def __hash__(self) -> int:
        return hash((self.fingerprint, self.path))

    def __repr__(self) -> str:
        where = "" if self.path is None else f"{self.path!r}, "
        return (f"Tokenizer({where}kind={self.kind!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})")


def _check_token_name(value: Any, role: str) -> None:
    """A special token's name: a string (``""``: none) that a tokenizer can look up."""
    check_str(value, role, where="Tokenizer: ", empty=True, example=f"{role}='</s>'")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"Tokenizer: {role}={value!r} holds a lone surrogate, which no token "
                         f"can; give the token's text, or {role}='' for none") from None


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Raises unless every id of ``tokenizer`` is below the model's ``vocab_size``.

    Raises:
      TypeError: ``tokenizer`` is not a ``Tokenizer``, or ``vocab_size`` not an integer.
      ValueError: naming both sizes and the fix.
    """
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer={tokenizer!r} is a {type(tokenizer).__name__}; give a "
                        "wb.data.Tokenizer (wb.data.Tokenizer() for byte-level tokens)")
    check_int(vocab_size, "vocab_size", fix="give the model's vocabulary size")
    if tokenizer.vocab_size > vocab_size:
        where = tokenizer.path or "byte-level"
        raise ValueError(
            f"the tokenizer ({where}) has vocab_size={tokenizer.vocab_size}, larger than the "
            f"model's vocab_size={vocab_size}: token ids up to {tokenizer.vocab_size - 1} "
            f"would index past the embedding table. Use model_overrides={{'vocab_size': "
            f"{tokenizer.vocab_size}}} (or a multiple of 128 above it, e.g. "
            f"{-(-tokenizer.vocab_size // 128) * 128}), or a tokenizer with at most "
            f"{vocab_size} tokens")
