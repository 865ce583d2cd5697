"""A model folder's tokenizer settings as ``transformers`` reads them: the special tokens of
``special_tokens_map.json`` and ``tokenizer_config.json``, and the chat template
(``chat_template.jinja`` first)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The named special tokens a chat template sees (transformers' ``special_tokens_map``).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")


def _token_text(value: Any, file: Path, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, ``{"content": ...}``
    (an AddedToken) or null."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{file}: {key}={value!r} is not a token (a string or "
                         '{"content": "..."}); fix the file or copy the model\'s own')
    return value


def folder_config(folder: Path) -> tuple[dict[str, str], str | None, bool]:
    """``(special tokens, chat template)`` of a model folder, as transformers reads them:
    ``special_tokens_map.json`` (legacy), overridden by ``tokenizer_config.json``; the
    template from ``chat_template.jinja``, else ``tokenizer_config.json`` (a string, or a
    list of named templates: the ``"default"`` one); and whether a config was found (its
    missing tokens then mean none, not a guess by name)."""
    tokens: dict[str, str] = {}
    template = None
    found = False
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{file} is not readable JSON ({e}); fix it, delete it (the "
                             "special tokens are then found by name) or copy the model's "
                             "own") from None
        if not isinstance(data, dict):
            raise ValueError(f"{file} holds a {type(data).__name__}, not a JSON object; fix it "
                             "or copy the model's own")
        found = True
        for key in SPECIAL_TOKENS:
            if key in data:
                text = _token_text(data[key], file, key)
                if text is None:
                    tokens.pop(key, None)
                else:
                    tokens[key] = text
        if name == "tokenizer_config.json":
            template = _config_template(data.get("chat_template"), file)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            template = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{jinja} is not readable text ({e}); fix it or copy the "
                             "model's own") from None
    return tokens, template, found


def template_source(folder: Path) -> str:
    """Where :func:`folder_config` took the chat template from, for errors."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return f"the chat template {jinja}"
    return f"the chat template of {folder / 'tokenizer_config.json'} ('chat_template')"


def _config_template(value: Any, file: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{file} has chat templates {sorted(named)} but none named "
                         "'default'; name one 'default'")
    raise ValueError(f"{file}: chat_template is a {type(value).__name__}, not a template "
                     "(a string, or a list of {\"name\", \"template\"}); fix the file or copy "
                     "the model's own")
