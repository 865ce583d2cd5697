"""Input pipeline throughput (tokenize, pack, batch) against what the Trainer consumes.

- Corpus: the standard library's ``.py`` files as JSONL documents (one per file, the
  first ``CORPUS_BYTES``), a byte-level BPE of ``VOCAB`` tokens trained on them locally.
- Tokenize: building the token cache (``workbench.data._tokens``: read, tokenize, write the
  ArrayRecord) in this process and in ``WORKERS`` Grain worker processes; tokens/s.
- Pipeline: global batches of packed rows as the Trainer reads them (``ShardedBatches``:
  shuffled rows, segment ids, positions, mask, ``make_array_from_process_local_data``),
  inline and with Grain's read-ahead threads; tokens/s over ``BATCHES`` batches after one.
- Trainer: the ``small`` preset (124M, its 50304 vocabulary holds the BPE) on the same
  Dataset, ``batch x seq`` tokens per step: tokens/s from the measured step times
  (``metrics.jsonl``, warm-up steps dropped) and the data wait's share of the step
  (``data_time / step_time``). Targets: the pipeline >= 3x the Trainer; data wait < 2%.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

CORPUS_BYTES = 8 << 20
VOCAB = 8192
WORKERS = 2
SEQ, BATCH = 1024, 16
BATCHES = 40
TRAIN_SEQ, TRAIN_BATCH, TRAIN_STEPS, WARMUP = 256, 8, 6, 2


def corpus(root: Path, max_bytes: int = CORPUS_BYTES) -> tuple[Path, Path]:
    """Writes ``docs.jsonl`` and a trained ``tokenizer.json`` under ``root``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    return jsonl, root / "tokenizer.json"


def tokenize_rate(jsonl: Path, tokenizer: Path, workers: int, cache: Path) -> float:
    """Tokens/s of building the token cache from scratch."""
    from workbench.data import Tokenizer, build_token_cache

    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    built = build_token_cache([str(jsonl)], tokenizer=Tokenizer(tokenizer), workers=workers,
                              cache_dir=cache)
    return built.info["tokens"] / (time.perf_counter() - t0)


def pipeline_rate(spec: Any, prefetch: int, cache: Path, batches: int = BATCHES) -> float:
    """Tokens/s of global batches of packed rows, as the Trainer reads them."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from workbench.data import ShardedBatches
    from workbench._sharding.mesh import make_mesh

    mesh = make_mesh({"data": 8})
    sh = NamedSharding(mesh, PartitionSpec("data"))
    it = ShardedBatches(spec, seq=SEQ, batch=BATCH, seed=0, sharding=sh, vocab_size=VOCAB,
                        prefetch=prefetch, cache_dir=cache)
    jax.block_until_ready(next(it))
    t0 = time.perf_counter()
    for _ in range(batches):
        jax.block_until_ready(next(it))
    return batches * BATCH * SEQ / (time.perf_counter() - t0)


def trainer_rate(spec: Any, cache: Path, steps: int = TRAIN_STEPS, model: str = "small"
                 ) -> tuple[float, float]:
    """``(tokens/s, data wait share)`` of the Trainer on ``spec``, warm-up steps dropped."""
    from workbench import _runs as runs
    from workbench.train import Trainer, TrainConfig

    cfg = TrainConfig(model=model, mesh={"data": 8}, batch=TRAIN_BATCH, seq=TRAIN_SEQ,
                      steps=steps, checkpoint_every=10_000, data=spec,
                      model_overrides={"seq_len": TRAIN_SEQ})
    with tempfile.TemporaryDirectory() as tmp:
        Trainer(cfg, run_dir=Path(tmp) / "run", progress=None, data_cache=cache,
                compile_cache=False).run()
        recs = [r for r in runs.read_metrics(Path(tmp) / "run") if r["step"] > WARMUP]
    step = statistics.median(r["step_time"] for r in recs)
    wait = sum(r["data_time"] for r in recs) / sum(r["step_time"] for r in recs)
    return TRAIN_BATCH * TRAIN_SEQ / step, wait


def run() -> list[dict[str, Any]]:
    from workbench.data import Dataset

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        jsonl, tok = corpus(root)
        inline = tokenize_rate(jsonl, tok, 0, root / "c0")
        pooled = tokenize_rate(jsonl, tok, WORKERS, root / "c1")
        for name, v in (("tokenize to cache, in process", inline),
                        (f"tokenize to cache, {WORKERS} Grain workers", pooled)):
            rows.append({"name": name, "value": round(v / 1e3, 1), "unit": "k tok/s",
                         "target": "", "ok": None,
                         "notes": f"{CORPUS_BYTES >> 20} MB of stdlib sources, BPE {VOCAB}; "
                                  "once per corpus and tokenizer (cached by content hash)"})
        spec = Dataset(files=str(jsonl), tokenizer=tok)
        read0 = pipeline_rate(spec, 0, root / "c0")
        read2 = pipeline_rate(spec, 2, root / "c0")
        train, wait = trainer_rate(spec, root / "c0")
        best = max(read0, read2)
        for name, v in (("packed batches, inline", read0),
                        ("packed batches, Grain read-ahead threads", read2)):
            rows.append({"name": name, "value": round(v / 1e3, 1), "unit": "k tok/s",
                         "target": ">= 3x Trainer", "ok": v >= 3 * train,
                         "notes": f"batch {BATCH} x seq {SEQ}, shuffled packed rows -> global "
                                  f"arrays; {v / train:.0f}x what small consumes"})
        rows.append({"name": "Trainer consumption, small", "value": round(train / 1e3, 2),
                     "unit": "k tok/s", "target": "", "ok": None,
                     "notes": f"batch {TRAIN_BATCH} x seq {TRAIN_SEQ}, median step after "
                              f"{WARMUP} warm-up; pipeline/Trainer = {best / train:.0f}x"})
        rows.append({"name": "Trainer data wait, small", "value": round(100 * wait, 2),
                     "unit": "% of step", "target": "< 2%", "ok": wait < 0.02,
                     "notes": "sum of data_time / sum of step_time (metrics.jsonl)"})
    return rows
