"""Local document files: listing, formats, and reading them in units with file:line errors.

Formats (by extension unless given): JSONL (``.jsonl``/``.json``: one JSON object per line,
the document in a named string field), Parquet (``.parquet``: a named string column),
ArrayRecord (``.array_record``: one UTF-8 document per record) and plain text (anything
else: one document per file). A file is read in *units* (a file, a block of lines, a
Parquet row group, a range of records) that Grain maps to token ids; a unit reads only
its own bytes, so units can be tokenized in any process.

Bad input raises :class:`DataError` naming the file (and line or record) and the fix:
an empty file, a line that is not JSON or lacks the field, a field that is not a string
or holds a lone surrogate (``"\\ud800"``), non-UTF-8 bytes, a Parquet file without the
column.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench._validate import check_path, check_str

__all__ = ["DataError", "DataFileNotFound", "FORMATS", "Unit", "check_patterns", "file_format",
           "holds_messages", "list_files", "read_unit", "units"]

#: Values of ``Dataset.format``.
FORMATS: tuple[str, ...] = ("auto", "jsonl", "parquet", "text", "arrayrecord")

#: JSONL lines (or ArrayRecord records) per unit of work.
LINES_PER_UNIT = 1024

Unit = tuple[str, str, int, int]   # (format, path, start, stop): lines / row group / records


class DataError(ValueError):
    """A data file cannot be read as documents (the message names the file and line)."""


class DataFileNotFound(FileNotFoundError):
    """A file, folder or glob given as data names nothing on disk (the message names the
    argument and the working directory)."""


def file_format(path: Path, fmt: str) -> str:
    """The format of ``path``: ``fmt`` unless "auto", else by the file's extension."""
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix == ".array_record" or path.name.endswith(".array_record"):
        return "arrayrecord"
    return "text"


def check_patterns(value: Any, name: str, *, where: str = "") -> tuple[str, ...]:
    """``value`` (a glob, folder or file, or a list of them) as a tuple of strings.

    Raises:
      TypeError: not a path or a list of paths.
      ValueError: an empty list, or a path no file name can hold (empty, a NUL).
    """
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}{name}={value!r} is a {type(value).__name__}; {name} must be "
                        "a glob, a folder, a file or a list of them (e.g. ['data/*.jsonl'])")
    if not value:
        raise ValueError(f"{where}{name}={value!r} names no files; give a glob like "
                         "'data/*.jsonl', a folder, a file, or a list of them")
    return tuple(str(check_path(v, f"{name}[{i}]", where=where)) for i, v in enumerate(value))


def check_format(value: Any, name: str = "fmt", *, where: str = "") -> str:
    """``value`` if it is one of :data:`FORMATS`, else an error naming it and the choices."""
    check_str(value, name, where=where, example="'auto'")
    if value not in FORMATS:
        raise ValueError(f"{where}{name}={value!r} is not a format; choose one of {FORMATS}")
    return value


def list_files(patterns: Sequence[str], name: str = "patterns") -> list[Path]:
    """Files matched by glob ``patterns`` (``**`` recursive) or below folders, sorted.

    Raises:
      DataFileNotFound: a pattern matches nothing (named, with the working directory).
    """
    found: set[Path] = set()
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if path.is_dir():
            hits = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
        else:
            hits = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        if not hits:
            raise DataFileNotFound(
                f"no files match {pattern!r} (from {os.getcwd()}); give {name} as a glob "
                "like 'data/*.jsonl', a folder, or a list of them")
        found.update(p.resolve() for p in hits)
    return sorted(found)


def opened(path: str | Path) -> Any:
    """A context giving what pyarrow reads: the path itself, or for a URL
    (``hf://datasets/...``) a file opened through ``fsspec`` (ranged reads)."""
    import contextlib

    if isinstance(path, str) and "://" in path:
        import fsspec

        return fsspec.open(path, "rb")
    return contextlib.nullcontext(path)


def units(path: Path | str, fmt: str) -> list[Unit]:
    """The units of work of one file (checks it is not empty, reads no documents); a URL
    (:func:`opened`) is a Parquet file read by row groups."""
    if isinstance(path, str) and "://" in path:
        if fmt != "parquet":
            raise DataError(f"{path}: only Parquet files are read over the network; "
                            "download the files instead")
    elif Path(path).stat().st_size == 0:
        raise DataError(f"{path} is empty (0 bytes); remove it from the files, or put "
                        "documents in it")
    if fmt == "text":
        return [("text", str(path), 0, 1)]
    if fmt == "jsonl":
        with open(path, "rb") as f:
            lines = sum(1 for _ in f)
        return [("jsonl", str(path), a, min(a + LINES_PER_UNIT, lines))
                for a in range(0, lines, LINES_PER_UNIT)]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            with opened(path) as src:
                meta = pq.ParquetFile(src).metadata
        except Exception as err:   # pyarrow raises ArrowInvalid and friends
            raise DataError(f"{path} is not a Parquet file ({err})") from err
        return [("parquet", str(path), g, g + 1) for g in range(meta.num_row_groups)]
    if fmt == "arrayrecord":
        from array_record.python.array_record_module import ArrayRecordReader

        reader = ArrayRecordReader(str(path))
        n = reader.num_records()
        reader.close()
        return [("arrayrecord", str(path), a, min(a + LINES_PER_UNIT, n))
                for a in range(0, n, LINES_PER_UNIT)]
    raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: byte {err.start} is not UTF-8 ({err.reason}); convert the "
                        "file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from err


def _field(obj: Any, field: str, where: str, chat: bool = False) -> Any:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object with a "
                        f"{field!r} field; write one object per line")
    if field not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:8])
        raise DataError(f"{where}: no field {field!r} (keys: {keys}); pass "
                        "Dataset(field=...) naming the text field")
    text = obj[field]
    if chat:
        if not isinstance(text, list):
            raise DataError(f"{where}: field {field!r} is a {type(text).__name__}, not a list "
                            "of messages like the file's first row; give every row messages")
        return text
    if not isinstance(text, str):
        hint = " (a list of messages is read only when the first row's is one)" \
            if isinstance(text, list) else ""
        raise DataError(f"{where}: field {field!r} is a {type(text).__name__}, not a "
                        f"string{hint}")
    return text


def holds_messages(path: Path, fmt: str, field: str) -> bool:
    """Whether ``field`` of the file holds chat messages (a list per row: a Parquet list
    column, or the first JSONL row's field a JSON list) rather than text."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            with opened(path) as src:
                schema = pq.read_schema(src)
        except Exception as err:   # pyarrow raises ArrowInvalid and friends
            raise DataError(f"{path} is not a Parquet file ({err})") from err
        if field not in schema.names:
            return False   # read_unit names the missing column
        kind = schema.field(field).type
        return pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if fmt == "jsonl":
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    try:
                        return isinstance(json.loads(raw).get(field), list)
                    except (ValueError, AttributeError, RecursionError):
                        return False   # read_unit names the line
    return False


def _no_lone_surrogates(text: str, field: str, where: str) -> None:
    """Raises for a ``\\udXXX`` escape that is half of a UTF-16 pair: JSON lets it through,
    but it is no character, and no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DataError(
            f"{where}: field {field!r} holds a lone surrogate \\u{ord(text[err.start]):04x} at "
            f"character {err.start} (half of a UTF-16 pair, not a character); fix what wrote "
            "the file (write both halves, or the character itself, e.g. json.dumps of the "
            "decoded text), or drop that line") from None


def read_unit(unit: Unit, field: str, chat: bool = False) -> list[Any]:
    """The documents of one unit, in file order (``chat``: each a list of messages).

    Raises:
      DataError: bad bytes, JSON, field or column (file and line in the message).
    """
    fmt, path, start, stop = unit
    if fmt == "text":
        return [_utf8(Path(path).read_bytes(), path)]
    if fmt == "jsonl":
        return _jsonl_docs(path, start, stop, field, chat)
    if fmt == "parquet":
        return _parquet_docs(path, start, field, chat)
    if fmt == "arrayrecord":
        from array_record.python.array_record_module import ArrayRecordReader

        reader = ArrayRecordReader(path)
        try:
            raws = reader.read(list(range(start, stop)))
        finally:
            reader.close()
        return [_utf8(raw, f"{path} record {start + i}") for i, raw in enumerate(raws)]
    raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")


def _jsonl_docs(path: str, start: int, stop: int, field: str, chat: bool) -> list[Any]:
    """``field`` of lines ``start`` to ``stop`` of a JSONL file (blank lines skipped)."""
    docs = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            if i < start:
                continue
            if i >= stop:
                break
            where = f"{path}:{i + 1}"
            line = _utf8(raw, where).strip()
            if not line:
                continue   # blank lines are allowed (a trailing newline, spacing)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not JSON ({err.msg} at column {err.colno}); "
                                "JSONL needs one JSON object per line") from err
            text = _field(obj, field, where, chat)
            if "\\u" in line and not chat:   # only an escape makes a lone surrogate
                _no_lone_surrogates(text, field, where)
            docs.append(text)
    return docs


def _parquet_docs(path: str, group: int, field: str, chat: bool) -> list[Any]:
    """Column ``field`` of row group ``group`` of a Parquet file (nulls dropped)."""
    import pyarrow.parquet as pq

    with opened(path) as src:
        pf = pq.ParquetFile(src)
        names = pf.schema_arrow.names
        if field not in names:
            raise DataError(f"{path}: no column {field!r} (columns: {names}); pass "
                            "Dataset(field=...) naming the text column")
        column = pf.read_row_group(group, columns=[field]).column(0)
    if chat:
        return [t for t in column.to_pylist() if t is not None]
    if not (str(column.type) in ("string", "large_string", "string_view")):
        raise DataError(f"{path}: column {field!r} is {column.type}, not strings")
    return [t for t in column.to_pylist() if t is not None]
