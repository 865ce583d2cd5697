"""A tokenizer's token ids against a model's vocabulary: a ``tokenizer.json`` or
SentencePiece ``.model`` with more ids than the embedding table has rows belongs to another
model. Checked when a folder is read (``load_params``) and before one is written (``to_hf``)."""
from __future__ import annotations

from pathlib import Path

#: JSON files of a model folder that are not tokenizers (their ids are not counted).
NOT_TOKENIZERS = ("tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                  "generation_config.json", "config.json")


def tokenizer_vocab(file: Path) -> int | None:
    """How many token ids a ``tokenizer.json`` / SentencePiece ``.model`` file has (None
    for other files)."""
    try:
        if file.suffix == ".json" and file.name not in NOT_TOKENIZERS:
            from tokenizers import Tokenizer

            return int(Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True))
        if file.suffix == ".model":
            import sentencepiece as spm

            return int(spm.SentencePieceProcessor(model_file=str(file)).GetPieceSize())
    except Exception as e:   # the Rust / C++ sides raise plain exceptions
        raise ValueError(f"{file} is not a readable tokenizer ({e}); give the model's own "
                         "tokenizer.json (or its folder)") from None
    return None


def check_tokenizer(files: list[Path], vocab_size: int, *, where: str,
                    fix: str = "use the tokenizer the model was trained with",
                    unreadable_ok: bool = False) -> None:
    """Raises if a tokenizer among ``files`` has more token ids than the model's vocab
    (ids past the embedding table; a tokenizer of another model), or cannot be read
    (unless ``unreadable_ok``)."""
    for f in files:
        try:
            n = tokenizer_vocab(f)
        except ValueError:
            if unreadable_ok:
                continue
            raise
        if n is not None and n > vocab_size:
            raise ValueError(
                f"{where}: the tokenizer {f} has {n} token ids but the model's vocab_size is "
                f"{vocab_size}; ids from {vocab_size} up would index past the embedding "
                f"table: {fix}")
