"""Input data: an offline byte-level text corpus and synthetic tokens, as Grain pipelines.

Example::

    import workbench as wb
    spec = wb.data.TextData()                 # the Python standard library's .py sources
    batches = wb.data.ShardedBatches(spec, seq=128, batch=8, seed=0,
                                     sharding=sharding, vocab_size=256)
    batch = next(batches)   # {"inputs": (8, 128), "targets": (8, 128)} int32, sharded
"""
from workbench.data.corpus import TextData, build_text_corpus, cache_root, corpus_bytes
from workbench.data.pipeline import (
    DataSpec,
    ShardedBatches,
    SyntheticData,
    batch_shards,
    data_spec,
    dataset,
    source,
)

__all__ = ["DataSpec", "ShardedBatches", "SyntheticData", "TextData", "batch_shards",
           "build_text_corpus", "cache_root", "corpus_bytes", "data_spec", "dataset", "source"]
