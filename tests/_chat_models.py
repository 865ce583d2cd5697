"""Small local tokenizers in the Llama-3 and Qwen styles (tokenizer.json, tokenizer_config.json
with special tokens and a chat template), and a Hugging Face cache laid out as
``huggingface_hub`` writes it (``models--org--name/blobs``, ``snapshots/<commit>``, ``refs``).

Nothing here touches the network: the tokenizers are built with ``tokenizers``, the cache
by hand.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

#: Llama 3.2's template (its shape: date header, system turn, bos_token, trim, strftime_now).
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- if strftime_now is defined %}\n"
    "        {%- set date_string = strftime_now(\"%d %b %Y\") %}\n"
    "    {%- else %}\n"
    "        {%- set date_string = \"26 Jul 2024\" %}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role not in ['user', 'assistant'] %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported!') }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")

#: Qwen3's template shape: a namespace walked backwards, loop controls, reasoning
#: content, enable_thinking, and blocks without "-" (trim_blocks / lstrip_blocks matter).
QWEN3 = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == 'user' %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "        {%- break %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}\n"
    "    {% if message.role == 'assistant' %}\n"
    "        {%- set reasoning = message.reasoning_content if message.reasoning_content "
    "is string else '' %}\n"
    "        {%- if loop.index0 > ns.last_query_index and reasoning %}\n"
    "            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + "
    "'\\n</think>\\n\\n' + message.content.lstrip('\\n') + '<|im_end|>\\n' }}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {% else %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' "
    "+ '\\n' }}\n"
    "    {% endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n")

STYLES = {
    "llama3": {"special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                           "<|end_header_id|>", "<|eot_id|>"],
               "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               "template": LLAMA3, "bos": "<|begin_of_text|>"},
    "qwen3": {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              "config": {"bos_token": None, "eos_token": "<|im_end|>",
                         "pad_token": "<|endoftext|>"},
              "template": QWEN3, "bos": None},
}


def write_tokenizer(folder: str | Path, style: str, *, template_file: bool = False) -> Path:
    """A character-level ``tokenizer.json`` (printable ASCII and newline: ids below 128)
    with the style's special tokens, and its ``tokenizer_config.json`` (special tokens and
    chat template; ``template_file``: the template in ``chat_template.jinja`` instead)."""
    from tokenizers import Tokenizer, decoders, models, processors

    spec = STYLES[style]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {c: i for i, c in enumerate(chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(spec["special"])
    if spec["bos"]:   # Llama 3: tokenizer(text) starts with BOS (the post-processor)
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **spec["config"],
              "model_max_length": 4096}
    if template_file:
        (folder / "chat_template.jinja").write_text(spec["template"])
    else:
        config["chat_template"] = spec["template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def hub_cache(cache: str | Path, repo_id: str, snapshots: dict[str, str | Path],
              refs: dict[str, str], repo_type: str = "model") -> Path:
    """A Hugging Face cache holding ``repo_id``, as ``huggingface_hub`` writes it.

    Args:
        cache: the cache folder (``HF_HUB_CACHE``).
        snapshots: commit hash (40 hex digits) -> a folder whose files it holds.
        refs: branch or tag -> commit hash (``refs/main``...).
        repo_type: "model" (``models--org--name``) or "dataset" (``datasets--org--name``).

    Every file becomes ``blobs/<sha256>`` (its content address), and
    ``snapshots/<commit>/<name>`` a relative symlink to it; ``refs/<name>`` holds the commit.
    """
    repo = Path(cache) / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, src in snapshots.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        for f in sorted(Path(src).rglob("*")):
            if not f.is_file():
                continue
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            if not blob.exists():
                blob.write_bytes(data)
            link = snap / f.relative_to(src)
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(blob, link.parent), link)
    for ref, commit in refs.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)   # no newline, as huggingface_hub writes
    return repo


def copy_model(src: str | Path, dst: str | Path, style: str | None = None) -> Path:
    """A copy of a model folder, with a tokenizer of ``style`` written into it."""
    shutil.copytree(src, dst)
    if style is not None:
        write_tokenizer(dst, style)
    return Path(dst)
