"""Sequence packing: hand-counted rows, and a packed row's loss against each document alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._tolerance import assert_close_at_scale
from workbench.data._packing import PackedRows, pack, row_batch
from workbench.models import GPT, GPTConfig
from workbench._step import lm_loss

RECORD = 8   # tokens per record of the in-memory stream


def _rows(docs, *, seq, seed=None):
    """Packed rows of ``docs`` (lists of ids) read through an in-memory record source."""
    flat = np.concatenate([np.asarray(d, np.int32) for d in docs])
    records = [flat[a:a + RECORD].tobytes() for a in range(0, flat.size, RECORD)]
    lengths = np.array([len(d) for d in docs], np.int64)
    packing = pack(lengths, np.arange(len(docs)), seq=seq, seed=seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    reader = PackedRows(records, offsets, packing, seq=seq, record_tokens=RECORD, pad_id=0)
    return packing, [reader(i) for i in range(packing.rows)]


def test_every_prediction_of_every_document_appears_exactly_once():
    # token = 1000 * doc + position: a (input, target) pair names its document and place
    lengths = [5, 40, 1, 12, 17, 9, 2, 33, 16]        # 40 and 33 > seq + 1: split
    docs = [[1000 * d + t for t in range(n)] for d, n in enumerate(lengths)]
    seq = 16
    packing, rows = _rows(docs, seq=seq, seed=3)
    want = sorted((1000 * d + t, 1000 * d + t + 1)
                  for d, n in enumerate(lengths) for t in range(n - 1))
    got = []
    for r in rows:
        b = row_batch({k: v[None] for k, v in r.items()})
        m = b["mask"][0].astype(bool)
        got += list(zip(b["inputs"][0][m].tolist(), b["targets"][0][m].tolist()))
        # positions count within each segment; segment ids 1, 2, ... then 0 (padding)
        seg, pos, tok = r["segments"], r["positions"], r["tokens"]
        assert np.all(np.diff(seg[seg > 0]) >= 0) and np.all((seg == 0) == (np.cumsum(seg == 0) > 0))
        for s in np.unique(seg[seg > 0]):
            np.testing.assert_array_equal(pos[seg == s], np.arange(np.sum(seg == s)))
            piece = tok[seg == s]
            np.testing.assert_array_equal(np.diff(piece), 1)   # consecutive tokens of one doc
    assert sorted(got) == want                   # none lost, none twice, none across docs
    assert packing.info["split_documents"] == 2                 # 40 and 33 tokens
    assert packing.info["dropped_documents"] == 1               # the 1-token document
    n_pieces = sum(max(1, -(-(n - 1) // seq)) for n in lengths if n >= 2)
    assert len(packing.doc) == n_pieces
    assert all(len(r["tokens"]) == seq + 1 for r in rows)


def test_a_split_document_overlaps_by_one_token():
    packing, rows = _rows([list(range(1, 41))], seq=16)   # 40 tokens: 39 predictions
    pieces = sorted(zip(packing.start.tolist(), packing.length.tolist()))
    assert pieces == [(0, 17), (16, 17), (32, 8)]           # starts k * seq, one shared token


class Jitted:
    """A GPT whose forward and loss are jitted (eager op-by-op calls are slow on CPU)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.graphdef, self.params = nnx.split(nnx.jit(lambda: GPT(cfg, rngs=nnx.Rngs(0)))())
        self._fwd = jax.jit(lambda p, x, kw: nnx.merge(self.graphdef, p)(x, **kw))
        self._loss = jax.jit(lambda p, b: lm_loss(nnx.merge(self.graphdef, p), b))

    def __call__(self, x, **packed):
        return self._fwd(self.params, x, packed)

    def loss(self, batch):
        return self._loss(self.params, {k: jnp.asarray(v) for k, v in batch.items()})


@pytest.fixture(scope="module")
def model():
    return Jitted(GPTConfig.preset("tiny", n_layers=2))


def _alone(model, doc, width=40):
    """Mean loss and count of one document's next-token predictions, computed alone: the
    document right-padded to ``width`` tokens (one compile for all documents; causal
    attention: the padding after it cannot change its logits) and the padding masked."""
    d = np.zeros((1, width + 1), np.int32)
    d[0, :len(doc)] = doc
    mask = (np.arange(width) < len(doc) - 1).astype(np.int32)[None]      # (1, width)
    return float(model.loss({"inputs": d[:, :-1], "targets": d[:, 1:], "mask": mask})), \
        len(doc) - 1


@pytest.mark.slow
def test_packed_loss_is_the_token_weighted_loss_of_each_document_alone(model):
    rng = np.random.default_rng(0)
    lengths = [9, 23, 5, 14, 30, 3, 11]
    docs = [rng.integers(1, 256, n).tolist() for n in lengths]
    seq = 32
    _, rows = _rows(docs, seq=seq, seed=1)
    batch = row_batch({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    packed = float(model.loss(batch))
    alone = [_alone(model, d) for d in docs]
    want = sum(loss * n for loss, n in alone) / sum(n for _, n in alone)
    # float32: each document's mean loss is a sum of O(10) terms of size ~5.5
    assert_close_at_scale(packed, want, rtol=1e-5)


@pytest.mark.slow   # the splash kernel in Pallas interpret mode on CPU
def test_packed_logits_equal_each_document_alone_xla_and_splash(model):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 256, n).tolist() for n in (40, 50, 38)]   # fits 128 + 1
    _, rows = _rows(docs, seq=128)
    assert len(rows) == 1
    r = rows[0]
    b = row_batch({k: v[None] for k, v in r.items()})
    x = jnp.asarray(b["inputs"])
    seg, pos = jnp.asarray(b["segment_ids"]), jnp.asarray(b["positions"])
    splash = Jitted(model.cfg.replace(attention="splash", attention_block_sizes=(128, 128)))
    for m in (model, splash):
        logits = np.asarray(m(x, segment_ids=seg, positions=pos))[0]     # (T, V)
        at = 0
        for d in docs:
            padded = np.zeros((1, 50), np.int32)
            padded[0, :len(d)] = d                   # causal: the padding after d is unseen
            alone = np.asarray(model(jnp.asarray(padded)))[0, :len(d)]      # (L, V)
            assert_close_at_scale(logits[at:at + len(d)], alone, rtol=2e-5,
                                  err_msg=f"{m.cfg.attention} document of {len(d)} tokens")
            at += len(d)


def test_segment_ids_without_positions_is_an_error(model):
    x = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="both segment_ids and positions"):
        nnx.merge(model.graphdef, model.params)(x, segment_ids=jnp.ones((1, 8), jnp.int32))


def test_loss_ignores_padding_tokens(model):
    docs = [list(range(1, 12))]
    _, rows = _rows(docs, seq=32)
    b = row_batch({k: v[None] for k, v in rows[0].items()})
    b2 = dict(b, inputs=np.where(b["segment_ids"] == 0, 77, b["inputs"]),
              targets=np.where(b["mask"] == 0, 91, b["targets"]))   # change padding only
    l1, l2 = float(model.loss(b)), float(model.loss(b2))
    assert l1 == l2 and np.sum(b["mask"]) == 10
