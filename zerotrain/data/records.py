"""Reading local data files into Hugging Face ``datasets``, with bad records named by file and line.

Formats (chosen by suffix; a directory is one written by ``datasets.save_to_disk``):

- ``.txt``: plain text, read by ``datasets``' ``text`` builder; by default the whole file is one
  document (``txt_sample_by="document"``; ``"paragraph"`` or ``"line"`` split it further).
- ``.jsonl`` / ``.json``: one JSON object per line (or, for ``.json``, one top-level array of
  objects), each with a text field (``text_field``, default ``"text"``) or a chat ``messages``
  list of ``{"role": ..., "content": ...}`` turns.
- ``.parquet``, ``.csv``: a column named ``text_field`` or ``messages_field``.
- Compressed ``.txt``, ``.jsonl``, ``.json`` and ``.csv`` files (``.gz``, ``.bz2``, ``.xz``: ``data.jsonl.gz``):
  ``datasets`` decompresses text and csv itself; the JSON validation pass reads them through Python's
  own ``gzip`` / ``bz2`` / ``lzma``.

Every file yields a dataset with ONE column: ``text`` (str) or ``messages`` (list of turns), so the
tokenizer step knows how to treat it. Why a validation pass of our own for JSON: ``datasets``' json
loader (pyarrow underneath) fails on the first malformed line with an offset into a block, not a
file line, and it cannot skip a record; a user with a 10 GB jsonl file needs the line number. For
parquet/csv/saved datasets the loader parses fine and we check the fields row by row afterwards
(naming the row; for csv the file line, counting the header).
"""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

__all__ = ["BadRecordError", "BadRecord", "LoadedFile", "load_data_file", "data_files_in", "data_suffix", "SUFFIXES"]

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".csv")
_COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # a compressed file: its format's suffix first


def data_suffix(path: Union[str, Path]) -> str:
    """The format suffix of a data file: `.jsonl` for `a.jsonl` and for `a.jsonl.gz` (lower case)."""
    suffixes = [suffix.lower() for suffix in Path(path).suffixes]
    if len(suffixes) >= 2 and suffixes[-1] in _COMPRESSED:
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


def _open(path: Union[str, Path], mode: str = "rb", errors: str = "strict"):
    """`path` opened for reading (mode "rb" or "r": UTF-8 text), decompressed when it ends in .gz, .bz2 or .xz."""
    opener = _COMPRESSED.get(Path(path).suffix.lower())
    if "b" in mode:
        return (opener or open)(path, "rb")
    return (opener or open)(path, "rt", encoding="utf-8", errors=errors, newline="")


class BadRecordError(ValueError):
    """A data record that cannot be used; the message names the file and line (or row)."""


@dataclass(frozen=True)
class BadRecord:
    file: str
    where: str  # "line 7" / "row 3"
    reason: str

    def __str__(self) -> str:
        return f"{self.file}, {self.where}: {self.reason}"


@dataclass
class LoadedFile:
    """One input file as a ``datasets.Dataset`` with a single ``text`` or ``messages`` column."""
    path: str
    kind: str  # "text" or "messages"
    dataset: Any
    skipped: list[BadRecord] = field(default_factory=list)


def data_files_in(paths: Sequence[Union[str, Path]]) -> list[Path]:
    """The data paths as given, each checked to exist; a directory not written by ``save_to_disk``
    expands to its data files (sorted) so a folder of jsonl shards works too."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"data path {p} does not exist")
        if p.is_dir() and not _is_saved_dataset(p):
            found = sorted(q for q in p.rglob("*") if q.is_file() and data_suffix(q) in SUFFIXES)
            if not found:
                raise BadRecordError(f"{p}: directory holds no data files ({', '.join(SUFFIXES)}) "
                                     "and was not written by datasets.save_to_disk")
            out.extend(found)
        else:
            out.append(p)
    return out


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists() or (p / "state.json").exists()


def _check_turns(messages: Any) -> Optional[str]:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {role, content} turns"
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            return f"chat turn {i} is not an object"
        for key in ("role", "content"):
            if key not in turn:
                return f"chat turn {i} has no '{key}'"
            if not isinstance(turn[key], str):
                return f"chat turn {i} '{key}' is not a string"
    return None


def _classify(record: Any, text_field: str, messages_field: str) -> tuple[Optional[str], Optional[str]]:
    """(kind, error) of one record."""
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    if messages_field in record and record[messages_field] is not None:
        err = _check_turns(record[messages_field])
        return ("messages", None) if err is None else (None, err)
    if text_field in record:
        value = record[text_field]
        if not isinstance(value, str):
            return None, f"field '{text_field}' is not a string"
        return "text", None
    keys = ", ".join(repr(k) for k in list(record)[:12]) + (", ..." if len(record) > 12 else "")
    return None, (f"missing field '{text_field}' (or chat '{messages_field}'); the record's keys are {keys or 'none'}: "
                  f"name the text field with --text-field (DataConfig.text_field)")


def _fail_or_skip(bad: list[BadRecord], skip: bool) -> None:
    if bad and not skip:
        more = f" (and {len(bad) - 1} more bad records; skip_bad_records skips them)" if len(bad) > 1 else ""
        raise BadRecordError(f"{bad[0]}{more}")


def _clean(rec: dict, kind: str, text_field: str, messages_field: str) -> dict:
    if kind == "text":
        return {"text": rec[text_field]}
    # Keep only role/content: extra keys would make pyarrow's schema differ between rows.
    return {"messages": [{"role": t["role"], "content": t["content"]} for t in rec[messages_field]]}


def _jsonl_good_records(path: str, bad_lines: tuple, kind: str, text_field: str, messages_field: str,
                        digest: str):
    """The valid records of a validated jsonl file (``digest`` only keys datasets' generator cache)."""
    bad = set(bad_lines)
    with _open(path, "r") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip() and lineno not in bad:
                yield _clean(json.loads(line), kind, text_field, messages_field)


def _starts_with_bracket(path: Path) -> bool:
    with _open(path, "r") as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("[")
    return False


def _json_dataset(path: Path, text_field: str, messages_field: str, skip: bool, cache_dir: Optional[str]):
    """Validate a jsonl/json file record by record; returns (kind, dataset, bad).

    JSON lines are validated streaming (one line in memory at a time), then converted by
    ``datasets.Dataset.from_generator`` into an on-disk Arrow table, so a file larger than memory
    works. A ``.json`` top-level array has to be parsed whole.
    """
    import hashlib

    import datasets

    bad: list[BadRecord] = []
    kinds: dict[str, int] = {}
    if data_suffix(path) == ".json" and _starts_with_bracket(path):
        try:
            with _open(path, "r") as f:
                array = json.loads(f.read())
        except json.JSONDecodeError as e:
            raise BadRecordError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None
        good = []
        for i, rec in enumerate(array):
            kind, err = _classify(rec, text_field, messages_field)
            if err is not None:
                bad.append(BadRecord(str(path), f"item {i}", err))
            else:
                kinds[kind] = kinds.get(kind, 0) + 1
                good.append(_clean(rec, kind, text_field, messages_field))
        make = lambda kind: datasets.Dataset.from_list(good)  # noqa: E731
    else:
        digest = hashlib.sha256()
        nonblank = 0
        with _open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                digest.update(raw)
                line = raw.decode("utf-8", errors="replace")
                if not line.strip():
                    continue
                nonblank += 1
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    bad.append(BadRecord(str(path), f"line {lineno}", f"not valid JSON ({e.msg})"))
                    continue
                kind, err = _classify(rec, text_field, messages_field)
                if err is not None:
                    bad.append(BadRecord(str(path), f"line {lineno}", err))
                else:
                    kinds[kind] = kinds.get(kind, 0) + 1
        if not nonblank:
            raise BadRecordError(f"{path}: file is empty")
        bad_lines = tuple(int(b.where.split()[1]) for b in bad)
        make = lambda kind: datasets.Dataset.from_generator(  # noqa: E731
            _jsonl_good_records, cache_dir=cache_dir,
            gen_kwargs={"path": str(path), "bad_lines": bad_lines, "kind": kind, "text_field": text_field,
                        "messages_field": messages_field, "digest": digest.hexdigest()})
    _fail_or_skip(bad, skip)
    if len(kinds) > 1:
        raise BadRecordError(f"{path}: mixes '{text_field}' records and '{messages_field}' chat records; "
                             "put them in separate files")
    if not kinds:
        raise BadRecordError(f"{path}: no usable records" + (f" ({len(bad)} bad ones skipped)" if bad else ""))
    kind = next(iter(kinds))
    return kind, make(kind), bad


def _check_columns(path: Path, ds, text_field: str, messages_field: str, skip: bool, row_offset: int,
                   row_word: str):
    """Pick the column of a parsed table and check it row by row; returns (kind, dataset, bad)."""
    if len(ds) == 0:
        raise BadRecordError(f"{path}: file is empty")
    if messages_field in ds.column_names:
        kind, column = "messages", messages_field
    elif text_field in ds.column_names:
        kind, column = "text", text_field
    else:
        raise BadRecordError(f"{path}: missing field '{text_field}' (or chat '{messages_field}'); "
                             f"columns are {ds.column_names}: name the text field with --text-field "
                             f"(DataConfig.text_field)")
    bad: list[BadRecord] = []
    keep: list[int] = []
    for i, value in enumerate(ds[column]):
        err = _check_turns(value) if kind == "messages" else (
            None if isinstance(value, str) else f"field '{column}' is empty or not a string")
        if err is None:
            keep.append(i)
        else:
            bad.append(BadRecord(str(path), f"{row_word} {i + row_offset}", err))
    _fail_or_skip(bad, skip)
    ds = ds.select_columns([column])
    if bad:
        ds = ds.select(keep)
    if column != kind:
        ds = ds.rename_column(column, kind)
    if len(ds) == 0:
        raise BadRecordError(f"{path}: no usable records ({len(bad)} bad ones skipped)")
    return kind, ds, bad


def load_data_file(path: Union[str, Path], *, text_field: str = "text", messages_field: str = "messages",
                   skip_bad_records: bool = False, txt_sample_by: str = "document",
                   cache_dir: Optional[str] = None) -> LoadedFile:
    """One data file (or ``save_to_disk`` directory) as a :class:`LoadedFile`.

    Raises :class:`BadRecordError` naming the file and line for the first bad record unless
    ``skip_bad_records``, which drops them and lists them in ``LoadedFile.skipped``.
    ``cache_dir`` is where ``datasets`` keeps its arrow conversion of the file.
    """
    import datasets

    path = Path(path)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise BadRecordError(f"{path}: saved DatasetDict has no 'train' split (splits: {list(ds)})")
            ds = ds["train"]
        kind, ds, bad = _check_columns(path, ds, text_field, messages_field, skip_bad_records, 0, "row")
        return LoadedFile(str(path), kind, ds, bad)
    suffix = data_suffix(path)
    if suffix not in SUFFIXES or (suffix == ".parquet" and path.suffix.lower() in _COMPRESSED):
        raise BadRecordError(f"{path}: unsupported data file type '{''.join(path.suffixes[-2:]) or suffix}' "
                             f"(supported: {', '.join(SUFFIXES)}, the text ones also as .gz, .bz2 or .xz, or a "
                             "datasets.save_to_disk directory)")
    if os.path.getsize(path) == 0:
        raise BadRecordError(f"{path}: file is empty")
    if suffix in (".jsonl", ".json"):
        kind, ds, bad = _json_dataset(path, text_field, messages_field, skip_bad_records, cache_dir)
        return LoadedFile(str(path), kind, ds, bad)
    if suffix == ".txt":
        if txt_sample_by not in ("document", "paragraph", "line"):
            raise ValueError(f"txt_sample_by must be document, paragraph or line, got {txt_sample_by!r}")
        ds = datasets.load_dataset("text", data_files=str(path), split="train", sample_by=txt_sample_by,
                                   cache_dir=cache_dir)
        ds = ds.filter(lambda r: bool(r["text"].strip()))
        if len(ds) == 0:
            raise BadRecordError(f"{path}: file is empty")
        return LoadedFile(str(path), "text", ds, [])
    builder = "parquet" if suffix == ".parquet" else "csv"
    ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    # csv: row i is file line i + 2 (1-based, after the header line).
    offset, word = (2, "line") if builder == "csv" else (0, "row")
    kind, ds, bad = _check_columns(path, ds, text_field, messages_field, skip_bad_records, offset, word)
    return LoadedFile(str(path), kind, ds, bad)
