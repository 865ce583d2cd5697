"""Input data as Grain pipelines: your own text (tokenized, packed), a byte corpus, synthetic.

Example::

    import workbench as wb
    spec = wb.data.TextData()                 # the Python standard library's .py sources
    batches = wb.data.ShardedBatches(spec, seq=128, batch=8, seed=0,
                                     sharding=sharding, vocab_size=256)
    batch = next(batches)   # {"inputs": (8, 128), "targets": (8, 128)} int32, sharded

    tok = wb.data.Tokenizer("tokenizer.json")            # or a SentencePiece .model; None: bytes
    spec = wb.data.Dataset(files="docs/*.jsonl", field="text", tokenizer=tok,
                           eval_fraction=0.05)            # packed rows with segment ids
"""
from workbench.data._chat import chat_limits
from workbench.data._dataset import Dataset, prepare
from workbench.data._files import DataError
from workbench.data._packing import pack, row_batch
from workbench.data._tokenizer import Tokenizer, check_vocab
from workbench.data._tokens import build_token_cache
from workbench.data._corpus import TextData, build_text_corpus, cache_root, corpus_bytes
from workbench.data._pipeline import (
    DataSpec,
    ShardedBatches,
    SyntheticData,
    batch_keys,
    batch_shards,
    batched,
    as_spec,
    grain_dataset,
    source,
)

__all__ = ["DataError", "DataSpec", "Dataset", "ShardedBatches", "SyntheticData", "TextData",
           "Tokenizer", "batch_keys", "batch_shards", "batched", "build_text_corpus", "build_token_cache",
           "as_spec", "cache_root", "chat_limits", "check_vocab", "corpus_bytes", "grain_dataset", "pack",
           "prepare", "row_batch", "source"]

