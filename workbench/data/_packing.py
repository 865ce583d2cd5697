"""Sequence packing: documents into rows of ``seq + 1`` tokens with segment ids and positions.

A row holds whole documents one after another (segment ids 1, 2, ... in the row; 0 is
padding at its end) and each token's position within its document. A document of ``L``
tokens gives ``L - 1`` next-token predictions; one longer than a row (``L > seq + 1``) is
**split** into pieces of ``seq + 1`` tokens that overlap by one token (piece ``k`` starts
at token ``k * seq``), so none of its predictions is lost; each piece is its own segment
(attention does not reach back into the previous piece; RoPE is relative, so restarting
its positions at 0 changes nothing else). Documents of fewer than 2 tokens are dropped.
``Packing.info`` counts the split documents and the padding.

Pieces are placed in an order drawn from ``seed`` and packed *first-fit* over the newest
``OPEN_ROWS`` rows (a piece goes into the first of them with room, else starts a new row):
linear time, and every row is fixed once packed, so rows can be read in any order (a
``grain.MapDataset``) and globally reshuffled every epoch.

From a row the train step gets ``inputs = tokens[:-1]``, ``targets = tokens[1:]``,
``segment_ids`` and ``positions`` of the inputs, and ``mask`` = 1 where the target is the
next token of the same document (:func:`row_batch`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from workbench._validate import check_int

__all__ = ["OPEN_ROWS", "Packing", "PackedRows", "pack", "row_batch"]

#: Rows still open to new pieces while packing (first-fit over the newest ones).
OPEN_ROWS = 64

#: The longest sequence (a row of ``seq + 1`` int32 ids stays addressable).
MAX_SEQ = 2**31 - 2


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each row's pieces come from.

    Attributes:
      doc, start, length: per piece, in row order: the document, the first token within
        it, and the tokens (int64 ``(pieces,)`` each).
      row_ptr: row ``i`` holds pieces ``row_ptr[i]:row_ptr[i+1]`` (``(rows + 1,)``).
      info: ``rows``, ``documents``, ``split_documents``, ``dropped_documents``,
        ``tokens``, ``padding_fraction``.
    """

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    row_ptr: np.ndarray
    info: dict[str, Any]

    @property
    def rows(self) -> int:
        """Number of packed rows."""
        return len(self.row_ptr) - 1


def pack(lengths: np.ndarray, docs: np.ndarray, *, seq: int, seed: int | None) -> Packing:
    """Packs documents ``docs`` (indices into ``lengths``) into rows of ``seq + 1`` tokens.

    Args:
      lengths: tokens of every document.
      docs: the documents to pack.
      seq: tokens per training sequence (a row has ``seq + 1``).
      seed: order of the pieces (None: the order of ``docs``).

    Raises:
      TypeError, ValueError: an argument of the wrong type, shape or range (named).
    """
    seq = check_int(seq, "seq", maximum=MAX_SEQ, fix="give the tokens per training sequence")
    if seed is not None:
        check_int(seed, "seed", minimum=0, fix="give a seed >= 0, or None for docs' order")
    lengths = _int_vector(lengths, "lengths")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"lengths holds a negative length ({int(lengths.min())}); lengths "
                         "are the tokens of each document (>= 0)")
    docs = _int_vector(docs, "docs")
    if docs.size and not (0 <= docs.min() and docs.max() < lengths.size):
        bad = int(docs.max()) if docs.max() >= lengths.size else int(docs.min())
        raise ValueError(f"docs holds {bad}, not the index of a document: lengths has "
                         f"{lengths.size}; give indices from 0 to {lengths.size - 1}")
    cap = seq + 1
    lens = lengths[docs].astype(np.int64)
    keep = lens >= 2
    docs, lens = docs[keep], lens[keep]
    n_pieces = np.maximum(1, -(-(lens - 1) // seq))                 # ceil((L - 1) / seq)
    p_doc = np.repeat(docs, n_pieces)
    first = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    k = np.arange(p_doc.size) - first                                # piece index in its doc
    p_start = k * seq
    p_len = np.minimum(cap, np.repeat(lens, n_pieces) - p_start)
    if seed is not None:
        order = np.random.default_rng(seed).permutation(p_doc.size)
        p_doc, p_start, p_len = p_doc[order], p_start[order], p_len[order]
    row_of = _first_fit(p_len, cap)
    order = np.argsort(row_of, kind="stable")                        # pieces grouped by row
    p_doc, p_start, p_len = p_doc[order], p_start[order], p_len[order]
    rows = int(row_of.max()) + 1 if row_of.size else 0
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=rows))])
    info = {"rows": rows, "documents": int(docs.size),
            "split_documents": int(np.sum(n_pieces > 1)),
            "dropped_documents": int(np.sum(~keep)), "tokens": int(p_len.sum()),
            "padding_fraction": float(1 - p_len.sum() / (rows * cap)) if rows else 0.0}
    return Packing(doc=p_doc, start=p_start, length=p_len,
                   row_ptr=row_ptr.astype(np.int64), info=info)


def _int_vector(value: Any, name: str) -> np.ndarray:
    """``value`` as a 1-D int64 array (a scalar is one entry), or an error naming it."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}; {name} must be a "
                        "1-D array of integers")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as err:   # ragged nesting
        raise TypeError(f"{name}={value!r} is not an array of integers ({err})") from None
    if arr.size == 0:
        arr = arr.astype(np.int64)     # np.asarray([]) is float64
    if arr.ndim > 1 or arr.dtype.kind not in "iu":
        raise TypeError(f"{name}={value!r} is a {arr.ndim}-D {arr.dtype} array; {name} must "
                        "be a 1-D array of integers")
    return np.atleast_1d(arr).astype(np.int64)


def _first_fit(lengths: np.ndarray, cap: int, window: int = OPEN_ROWS) -> np.ndarray:
    """Row of each piece: the first of the newest ``window`` rows it fits in, else a new
    row (first-fit over a bounded window: linear time, rows fixed once out of it)."""
    row_of = np.empty(lengths.size, np.int64)
    room = np.zeros(0, np.int64)             # free tokens of rows lo .. lo + len(room) - 1
    lo = 0
    for i, n in enumerate(lengths.tolist()):
        fits = np.flatnonzero(room >= n)
        if fits.size:
            j = int(fits[0])
        else:
            if room.size == window:
                room, lo = room[1:], lo + 1
            room = np.append(room, cap)
            j = room.size - 1
        room[j] -= n
        row_of[i] = lo + j
    return row_of


class PackedRows:
    """Row ``i`` of a packing: ``{"tokens", "segments", "positions"}``, int32 ``(seq + 1,)``.

    Args:
      source: records of ``record_tokens`` int32 ids (``grain.sources.ArrayRecordDataSource``).
      offsets: each document's start in the stream (``TokenCache.offsets``).
      packing: the rows.
      seq: tokens per training sequence.
      record_tokens: ids per record.
      pad_id: the id padding gets (never a target).
    """

    def __init__(self, source: Any, offsets: np.ndarray, packing: Packing, *, seq: int,
                 record_tokens: int, pad_id: int) -> None:
        self.source, self.offsets, self.packing = source, offsets, packing
        self.seq, self.record_tokens, self.pad_id = seq, record_tokens, pad_id

    def _tokens(self, begin: int, n: int) -> np.ndarray:
        r = self.record_tokens
        first, last = begin // r, (begin + n - 1) // r
        raw = np.concatenate([np.frombuffer(self.source[j], np.int32)
                              for j in range(first, last + 1)])
        return raw[begin - first * r: begin - first * r + n]

    def __call__(self, i: int) -> dict[str, np.ndarray]:
        p = self.packing
        cap = self.seq + 1
        tokens = np.full(cap, self.pad_id, np.int32)                    # (seq + 1,)
        segments = np.zeros(cap, np.int32)
        positions = np.zeros(cap, np.int32)
        at = 0
        for s, j in enumerate(range(int(p.row_ptr[i]), int(p.row_ptr[i + 1]))):
            n = int(p.length[j])
            begin = int(self.offsets[p.doc[j]] + p.start[j])
            tokens[at:at + n] = self._tokens(begin, n)
            segments[at:at + n] = s + 1
            positions[at:at + n] = np.arange(n, dtype=np.int32)
            at += n
        return {"tokens": tokens, "segments": segments, "positions": positions}


def row_batch(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A train-step batch from stacked rows ``(B, seq + 1)``: inputs, targets, mask,
    segment_ids and positions, each int32 ``(B, seq)``.

    Raises:
      TypeError, ValueError: ``rows`` is not such a dict of equal-shaped 2-D arrays.
    """
    tok, seg, pos = _rows(rows)
    same = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0)               # (B, seq)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:], "mask": same.astype(np.int32),
            "segment_ids": seg[:, :-1], "positions": pos[:, :-1]}


def _rows(rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rows``' tokens, segments and positions, each a 2-D array of one shape."""
    keys = ("tokens", "segments", "positions")
    if not isinstance(rows, Mapping) or any(k not in rows for k in keys):
        raise TypeError(f"rows={rows!r} must be a dict of {list(keys)} (stacked packed rows, "
                        "each (batch, seq + 1))")
    arrays = []
    for k in keys:
        try:
            a = np.asarray(rows[k])
        except (ValueError, TypeError) as err:
            raise TypeError(f"rows[{k!r}] is not an array ({err})") from None
        if a.ndim != 2 or a.shape[1] < 2 or a.dtype.kind not in "iu":
            raise ValueError(f"rows[{k!r}] is a {a.dtype} array of shape {a.shape}; rows "
                             "needs integer arrays of shape (batch, seq + 1), seq >= 1")
        arrays.append(a)
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"rows' arrays differ in shape ({[a.shape for a in arrays]}); give "
                         "rows of one shape (batch, seq + 1)")
    return arrays[0], arrays[1], arrays[2]
