"""Your own text: tokenizers trained here, local files in four formats, the token cache,
train/eval splits, bad input (file and line named), and TrainConfig round trips."""
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from workbench.data import DataError, Dataset, Tokenizer, build_token_cache, prepare
from workbench.data._files import list_files
from workbench.train import TrainConfig

pytestmark = pytest.mark.usefixtures("wb_cache")


def _documents(n=400):
    """Paragraphs of the standard library's sources: real text, on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.glob("*.py"))[:40]:
        docs += [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    return list(dict.fromkeys(docs))[:n] + ["naïve café — ünïcödé ✓"]   # distinct


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents, a BPE tokenizer.json and a SentencePiece model trained on them, and the
    documents written as JSONL, Parquet, a text folder and ArrayRecord."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm
    from array_record.python.array_record_module import ArrayRecordWriter
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("text")
    docs = _documents()
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(root / "tokenizer.json"))
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_prefix=str(root / "spm"), vocab_size=500,
        pad_id=3, byte_fallback=True, character_coverage=0.9995, minloglevel=2)
    (root / "jsonl").mkdir()
    half = len(docs) // 2
    for name, part in (("a.jsonl", docs[:half]), ("b.jsonl", docs[half:])):
        (root / "jsonl" / name).write_text("".join(json.dumps({"text": d, "id": i}) + "\n"
                                                   for i, d in enumerate(part)))
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}),
                   root / "docs.parquet", row_group_size=100)
    (root / "folder" / "sub").mkdir(parents=True)
    for i, d in enumerate(docs[:30]):
        (root / "folder" / ("sub" if i % 2 else "") / f"{i:03d}.txt").write_text(d)
    w = ArrayRecordWriter(str(root / "docs.array_record"), "group_size:1")
    for d in docs:
        w.write(d.encode())
    w.close()
    return {"root": root, "docs": docs}


# ---------------------------------------------------------------------------- tokenizers
@pytest.mark.parametrize("kind", ["bytes", "hf", "sentencepiece"])
def test_tokenizers_round_trip_and_know_their_special_tokens(corpus, kind):
    import sentencepiece as spm
    from tokenizers import Tokenizer as HF

    root = corpus["root"]
    path = {"bytes": None, "hf": root / "tokenizer.json", "sentencepiece": root / "spm.model"}
    tok = Tokenizer(path[kind])
    text = "def f(x):\n    return x + 'é'  # ✓"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    if kind == "bytes":
        assert ids == list(text.encode()) and tok.vocab_size == 256 and tok.eos_id is None
    elif kind == "hf":
        ref = HF.from_file(str(path[kind]))               # the library's own answer
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert tok.vocab_size == ref.get_vocab_size() == 384
        assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    else:
        ref = spm.SentencePieceProcessor(model_file=str(path[kind]))
        assert ids == ref.encode(text) and tok.vocab_size == 500
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref.bos_id(), ref.eos_id(), 3)
    if kind != "sentencepiece":                           # SentencePiece normalises spaces
        assert tok.decode(ids) == text
    assert tok.document("ab")[-1:] == ([tok.eos_id] if tok.eos_id is not None else [98])
    # pickles by path (Grain workers) and round-trips through JSON
    import pickle

    again = pickle.loads(pickle.dumps(tok))
    assert again.encode(text) == ids and again.fingerprint == tok.fingerprint
    assert Tokenizer.from_dict(json.loads(json.dumps(tok.to_dict()))) == tok


def test_tokenizer_special_tokens_by_name_and_bad_paths(corpus, tmp_path):
    root = corpus["root"]
    tok = Tokenizer(root / "tokenizer.json", eos="<s>", bos="")
    assert tok.eos_id == 1 and tok.bos_id is None
    with pytest.raises(ValueError, match="'<nope>' is not a token"):
        Tokenizer(root / "tokenizer.json", eos="<nope>")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        Tokenizer(tmp_path / "bad.json")


# ---------------------------------------------------------------------------- formats
def _cached_docs(cache, tok):
    """The documents of a token cache, decoded (the cache's own stream and lengths)."""
    from array_record.python.array_record_module import ArrayRecordReader

    r = ArrayRecordReader(str(cache.path))
    stream = np.concatenate([np.frombuffer(b, np.int32) for b in r.read_all()])
    r.close()
    return [stream[a:b] for a, b in zip(cache.offsets[:-1], cache.offsets[1:])]


@pytest.mark.parametrize("files, field, n", [
    ("jsonl/*.jsonl", "text", None), ("docs.parquet", "body", None),
    ("folder", "text", 30), ("docs.array_record", "text", None)])
def test_every_format_gives_the_documents_tokenized_in_file_order(corpus, files, field, n,
                                                                    tmp_path):
    root, docs = corpus["root"], corpus["docs"]
    tok = Tokenizer(root / "tokenizer.json")
    cache = build_token_cache([str(root / files)], tokenizer=tok, field=field,
                              cache_dir=tmp_path)
    if n is not None:        # a folder: files in sorted path order (sub/ after the top level)
        paths = list_files([str(root / files)])
        want_docs = [p.read_text() for p in paths]
    else:
        want_docs = docs
    got = _cached_docs(cache, tok)
    assert len(got) == len(want_docs) == cache.info["documents"]
    for g, d in zip(got, want_docs):
        assert g.tolist() == tok.document(d)              # [bos] + ids + [eos]


def test_the_cache_is_reused_and_keyed_by_content_and_tokenizer(corpus, tmp_path):
    root = corpus["root"]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus["docs"][:50]))
    hf, sp = Tokenizer(root / "tokenizer.json"), Tokenizer(root / "spm.model")
    a = build_token_cache([str(src)], tokenizer=hf, cache_dir=tmp_path / "c")
    assert build_token_cache([str(src)], tokenizer=hf, cache_dir=tmp_path / "c").folder == a.folder
    b = build_token_cache([str(src)], tokenizer=sp, cache_dir=tmp_path / "c")
    assert b.folder != a.folder                            # another tokenizer
    src.write_text(src.read_text() + json.dumps({"text": "one more"}) + "\n")
    c = build_token_cache([str(src)], tokenizer=hf, cache_dir=tmp_path / "c")
    assert c.folder != a.folder and c.info["documents"] == 51    # new content, new cache


@pytest.mark.multiprocess   # Grain worker processes
def test_tokenizing_in_grain_workers_gives_the_same_cache(corpus, tmp_path):
    root = corpus["root"]
    tok = Tokenizer(root / "tokenizer.json")
    files = [str(root / "docs.parquet")]
    inline = build_token_cache(files, tokenizer=tok, field="body", cache_dir=tmp_path / "a")
    workers = build_token_cache(files, tokenizer=tok, field="body", workers=2,
                                cache_dir=tmp_path / "b")
    np.testing.assert_array_equal(inline.lengths, workers.lengths)
    assert inline.path.read_bytes() == workers.path.read_bytes()


# ---------------------------------------------------------------------------- splits
def test_eval_fraction_holds_out_whole_documents_never_trained_on(corpus):
    root = corpus["root"]
    spec = Dataset(files=str(root / "jsonl"), tokenizer=root / "tokenizer.json",
                   eval_fraction=0.1, split_seed=4)
    p = prepare(spec, seq=8192, vocab_size=512)     # long rows: no document is split
    n = p.info["corpus_documents"]
    assert p.info["eval"]["documents"] == int(np.ceil(0.1 * n))
    assert p.info["train"]["documents"] + p.info["eval"]["documents"] == n
    assert p.info["train"]["split_documents"] == p.info["eval"]["split_documents"] == 0

    def whole_docs(ds):
        out = []
        for i in range(len(ds)):
            r = ds[i]
            for s in np.unique(r["segments"][r["segments"] > 0]):
                out.append(tuple(r["tokens"][r["segments"] == s].tolist()))
        return out

    tok = spec.tokenizer
    train, held = whole_docs(p.train), whole_docs(p.eval)
    assert not set(train) & set(held)                     # no document in both
    everything = sorted(tuple(tok.document(d)) for d in corpus["docs"])
    assert sorted(train + held) == everything             # each document exactly once


def test_eval_files_are_the_held_out_split(corpus, tmp_path):
    root, docs = corpus["root"], corpus["docs"]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:7]))
    spec = Dataset(files=str(root / "jsonl" / "b.jsonl"), eval_files=str(held),
                   tokenizer=root / "tokenizer.json")
    p = prepare(spec, seq=8192, vocab_size=512)
    assert p.info["eval"]["documents"] == 7 and p.info["eval"]["rows"] == len(p.eval)
    tok = spec.tokenizer
    rows = [p.eval[i] for i in range(len(p.eval))]
    got = sorted(tuple(r["tokens"][r["segments"] == s].tolist())
                 for r in rows for s in np.unique(r["segments"][r["segments"] > 0]))
    assert got == sorted(tuple(tok.document(d)) for d in docs[:7])
    assert p.info["train"]["documents"] == len(docs) - len(docs) // 2   # b.jsonl, all of it


def test_dataset_json_round_trip_through_trainconfig(corpus):
    root = corpus["root"]
    spec = Dataset(files=[str(root / "docs.parquet")], field="body",
                   tokenizer=Tokenizer(root / "spm.model"), eval_fraction=0.05)
    cfg = TrainConfig(model="tiny", model_overrides={"vocab_size": 512}, data=spec,
                      eval_every=5, eval_batches=2, batch=8, seq=64)
    again = TrainConfig.from_json(cfg.to_json())
    assert again == cfg and again.data == spec and again.hash() == cfg.hash()
    assert TrainConfig(model="tiny").to_dict().keys().isdisjoint({"eval_every"})  # old hashes


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("content, field, match", [
    (b"", "text", r"is empty \(0 bytes\)"),
    (b'{"text": "a"}\n{"text": "b"\n', "text", r"bad\.jsonl:2: not JSON"),
    (b'{"text": "a"}\n\n{"body": "b"}\n', "text", r"bad\.jsonl:3: no field 'text' \(keys: 'body'\)"),
    (b'{"text": 5}\n', "text", r"bad\.jsonl:1: field 'text' is a int"),
    (b'["text"]\n', "text", r"bad\.jsonl:1: a JSON list"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "text", r"bad\.jsonl:2: byte \d+ is not UTF-8"),
    (b'{"text": ""}\n', "text", r"no documents"),
])
def test_bad_jsonl_names_the_file_and_line(tmp_path, content, field, match):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match):
        build_token_cache([str(path)], tokenizer=Tokenizer(), field=field,
                          cache_dir=tmp_path / "c")
    assert not list((tmp_path / "c").glob("tokens-*"))       # nothing half-written


def test_bad_text_and_parquet_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "ok.txt").write_text("fine")
    (tmp_path / "t" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: byte 3 is not UTF-8.*iconv"):
        build_token_cache([str(tmp_path / "t")], tokenizer=Tokenizer(), cache_dir=tmp_path / "c")
    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: no column 'text' \(columns: \['content'\]\)"):
        build_token_cache([str(tmp_path / "p.parquet")], tokenizer=Tokenizer(),
                          cache_dir=tmp_path / "c")
    with pytest.raises(FileNotFoundError, match=r"no files match '.*nothing\*\.jsonl'"):
        Dataset(files=str(tmp_path / "nothing*.jsonl")) and \
            build_token_cache([str(tmp_path / "nothing*.jsonl")], tokenizer=Tokenizer())


def test_tokenizer_larger_than_the_model_is_refused_naming_both(corpus):
    root = corpus["root"]
    spec = Dataset(files=str(root / "docs.parquet"), field="body",
                   tokenizer=root / "spm.model")
    with pytest.raises(ValueError, match=r"vocab_size=500, larger than the model's "
                                         r"vocab_size=256.*'vocab_size': 500"):
        prepare(spec, seq=64, vocab_size=256)


def test_a_tokenizer_larger_than_the_model_is_refused_by_the_config(corpus):
    spec = Dataset(files="anything.jsonl", tokenizer=corpus["root"] / "spm.model")
    with pytest.raises(ValueError, match=r"vocab_size=500, larger than the model's "
                                         r"vocab_size=256"):
        TrainConfig(model="tiny", data=spec)             # tiny: 256 tokens


def test_documents_longer_than_a_row_are_split_and_said(corpus):
    root = corpus["root"]
    p = prepare(Dataset(files=str(root / "docs.parquet"), field="body",
                        tokenizer=root / "tokenizer.json"), seq=32, vocab_size=384)
    n = p.info["train"]["split_documents"]
    assert n > 0 and p.info["note"].startswith(f"{n} document(s) longer than seq+1=33 tokens "
                                               "were split into rows (none dropped)")
    assert p.info["train"]["documents"] == p.info["corpus_documents"]   # none dropped


def test_dataset_arguments_are_checked(corpus):
    with pytest.raises(ValueError, match="eval_fraction=1.5"):
        Dataset(files="x", eval_fraction=1.5)
    with pytest.raises(ValueError, match="not both"):
        Dataset(files="x", eval_fraction=0.1, eval_files="y")
    with pytest.raises(ValueError, match="format='csv'"):
        Dataset(files="x", format="csv")
    with pytest.raises(ValueError, match="eval_every=5 needs held-out data"):
        TrainConfig(model="tiny", data=Dataset(files="x"), eval_every=5)
