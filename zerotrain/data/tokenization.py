"""Tokenization of loaded records, cached on disk, built by one rank per node.

Text records become ``input_ids`` (+ the tokenizer's eos) with ``labels == input_ids``. Chat
records are rendered with the tokenizer's chat template and labelled ``-100`` everywhere except
the assistant's tokens. Which tokens are the assistant's comes from transformers itself
(``apply_chat_template(..., return_assistant_tokens_mask=True)``) when the template marks them
with ``{% generation %}``; for templates without that marker we render growing prefixes of the
conversation and take the assistant turn's span from the difference (everything the turn adds
to the rendering, so also what the template writes after the turn, e.g. a newline) (this needs the template to
render a conversation's prefix as a prefix of the whole, which is checked, with an error otherwise).

The cache lives in ``cache_dir/<key>`` (a ``datasets.save_to_disk`` directory + ``meta.json``),
where the key hashes the data files' bytes, the tokenizer (its serialized vocabulary/merges,
special tokens and chat template) and every setting that changes the result. It is written to a
temporary directory and renamed into place (atomic), under a file lock, so two builders that
share a file system (two nodes on NFS) never both write it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from zerotrain.data.records import BadRecordError, data_files_in, load_data_file

__all__ = ["TokenizeSettings", "TokenizedData", "tokenize_files", "tokenizer_fingerprint", "files_fingerprint",
           "default_cache_dir", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_FORMAT_VERSION = 1  # bump when the cached layout or the tokenization rules change
_POLL_SECONDS = 2.0  # how often waiting ranks meet the builders


def default_cache_dir() -> Path:
    """``$ZEROTRAIN_DATA_CACHE`` or ``~/.cache/zerotrain/data``."""
    env = os.environ.get("ZEROTRAIN_DATA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "zerotrain" / "data"


@dataclass(frozen=True)
class TokenizeSettings:
    """Everything besides data and tokenizer that changes the tokenized result (part of the cache key)."""
    text_field: str = "text"
    messages_field: str = "messages"
    add_eos: bool = True
    skip_bad_records: bool = False
    txt_sample_by: str = "document"


@dataclass
class TokenizedData:
    """The tokenized documents (``input_ids``, ``labels`` columns) and what happened building them."""
    dataset: Any  # datasets.Dataset
    files: list[str]
    num_documents: int
    num_tokens: int
    skipped: list[str] = field(default_factory=list)  # "file, line N: reason"
    cache_path: str = ""
    cache_hit: bool = False  # True when this call did not tokenize (cache found, or built by another rank)


def _hash_file(h, path: Path) -> None:
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def files_fingerprint(paths: Sequence[Union[str, Path]]) -> str:
    """sha256 over the data files' bytes (a directory: every file in it, by relative name)."""
    h = hashlib.sha256()
    for p in map(Path, paths):
        if p.is_dir():
            for q in sorted(x for x in p.rglob("*") if x.is_file()):
                h.update(q.relative_to(p).as_posix().encode() + b"\0")
                _hash_file(h, q)
        else:
            h.update(p.suffix.encode() + b"\0")
            _hash_file(h, p)
        h.update(b"\1")
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the tokenizer's output: its serialized model, specials and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow (python) tokenizer: the vocabulary is the best identity we have
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()}, sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(str(len(tokenizer)).encode())
    return h.hexdigest()


# --- the tokenizing functions (run inside datasets.map, possibly in worker processes) -------------------------

class _TextTokenizer:
    def __init__(self, tokenizer, add_eos: bool):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id if add_eos else None

    def __call__(self, batch: dict) -> dict:
        ids = self.tokenizer(batch["text"], add_special_tokens=True)["input_ids"]
        if self.eos is not None:
            ids = [x + [self.eos] for x in ids]
        return {"input_ids": ids, "labels": ids}


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _ChatTokenizer:
    def __init__(self, tokenizer, path: str):
        self.tokenizer = tokenizer
        self.path = path
        self.marked = _GENERATION_TAG.search(tokenizer.chat_template or "") is not None

    def _render(self, messages: list, **kw) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
        return list(out["input_ids"])

    def _one(self, messages: list) -> tuple[list[int], list[int]]:
        if self.marked:
            out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
            return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        ids = self._render(messages)
        labels = [IGNORE_INDEX] * len(ids)
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            start = len(self._render(messages[:i], add_generation_prompt=True)) if i else 0
            upto = self._render(messages[: i + 1])
            if ids[: len(upto)] != upto or start > len(upto):
                raise BadRecordError(
                    f"{self.path}: the chat template does not render a conversation's prefix as a prefix of the "
                    "whole, so assistant tokens cannot be located; mark them with {% generation %} in the template")
            labels[start:len(upto)] = ids[start:len(upto)]
        return ids, labels

    def __call__(self, batch: dict) -> dict:
        pairs = [self._one(m) for m in batch["messages"]]
        return {"input_ids": [p[0] for p in pairs], "labels": [p[1] for p in pairs]}


# --- cache ----------------------------------------------------------------------------------------------------

@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(files: list[Path], tokenizer, settings: TokenizeSettings, target: Path, num_proc: Optional[int],
           hf_cache: Path) -> None:
    import datasets
    from datasets import Features, Sequence as HFSequence, Value

    features = Features({"input_ids": HFSequence(Value("int32")), "labels": HFSequence(Value("int32"))})
    parts, skipped = [], []
    for path in files:
        loaded = load_data_file(path, text_field=settings.text_field, messages_field=settings.messages_field,
                                skip_bad_records=settings.skip_bad_records, txt_sample_by=settings.txt_sample_by,
                                cache_dir=str(hf_cache))
        skipped += [str(b) for b in loaded.skipped]
        if loaded.kind == "messages" and not getattr(tokenizer, "chat_template", None):
            raise BadRecordError(f"{path}: has chat 'messages' records but the tokenizer has no chat template")
        fn = _TextTokenizer(tokenizer, settings.add_eos) if loaded.kind == "text" else _ChatTokenizer(tokenizer, str(path))
        procs = num_proc if num_proc and num_proc > 1 and len(loaded.dataset) >= 2 * num_proc else None
        parts.append(loaded.dataset.map(fn, batched=True, batch_size=256, num_proc=procs,
                                        remove_columns=loaded.dataset.column_names, features=features,
                                        desc=f"tokenizing {path.name}"))
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    num_tokens = sum(int(c.value_lengths().to_numpy(zero_copy_only=False).sum())
                     for c in ds.data.column("input_ids").chunks)
    meta = {"version": _FORMAT_VERSION, "files": [str(f) for f in files], "num_documents": len(ds),
            "num_tokens": num_tokens, "skipped": skipped}
    tmp = target.parent / f"{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    (tmp / "zerotrain_meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp, target)  # atomic: a reader sees no cache or a complete one
    except OSError:
        if not (target / "zerotrain_meta.json").exists():
            raise
        # Another builder finished first (a file system where flock does not reach across hosts):
        # same key, same content, keep theirs.
        shutil.rmtree(tmp, ignore_errors=True)


def _load(target: Path, cache_hit: bool) -> TokenizedData:
    import datasets

    meta = json.loads((target / "zerotrain_meta.json").read_text())
    ds = datasets.load_from_disk(str(target))
    return TokenizedData(ds, meta["files"], meta["num_documents"], meta["num_tokens"], meta["skipped"],
                         str(target), cache_hit)


def tokenize_files(paths: Sequence[Union[str, Path]], tokenizer, settings: TokenizeSettings = TokenizeSettings(),
                   *, cache_dir: Optional[Union[str, Path]] = None, num_proc: Optional[int] = None,
                   comm=None, local_rank: Optional[int] = None) -> TokenizedData:
    """Tokenize ``paths`` (cached), the same result on every rank.

    ``comm`` (a :class:`zerotrain.comm.Comm` over every rank of the job) makes this collective:
    only the node's local rank 0 (``local_rank``, default ``$LOCAL_RANK``) builds the cache
    while the others wait (in short rounds of a collective, so a long build does not hit the
    process group's timeout), then all read it. ``cache_dir`` must therefore be
    visible to every rank of a node. A builder's error is raised on every rank, naming the rank.
    """
    files = data_files_in(paths)
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key_src = json.dumps({"v": _FORMAT_VERSION, "files": files_fingerprint(files),
                          "tokenizer": tokenizer_fingerprint(tokenizer), "settings": settings.__dict__},
                         sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    target = cache_root / key
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    builder = comm is None or comm.size == 1 or local_rank == 0
    outcome: dict = {}

    def build() -> None:
        try:
            with _file_lock(cache_root / f"{key}.lock"):
                if not (target / "zerotrain_meta.json").exists():
                    _build(files, tokenizer, settings, target, num_proc, cache_root / "hf")
                    outcome["built"] = True
        except BaseException as e:  # reported to the waiting ranks before it is raised here
            outcome["error"] = e

    if comm is None or comm.size == 1:
        build()
    else:
        # The barrier. Tokenizing a large corpus can outlast the process group's timeout, so no
        # rank blocks in one long collective: the builder tokenizes in a thread while every rank
        # meets in short rounds until no builder is busy any more.
        worker = threading.Thread(target=build, name="zerotrain-tokenize", daemon=True) if builder else None
        if worker is not None:
            worker.start()
        while True:
            if worker is not None:
                worker.join(timeout=_POLL_SECONDS)
            if worker is not None and worker.is_alive():
                mine = "busy"
            else:
                error = outcome.get("error")
                # a bad record is the same one-line error on every rank (not a wrapped one on the waiting ranks)
                mine = None if error is None else (isinstance(error, BadRecordError), f"{type(error).__name__}: {error}",
                                                   str(error))
            status = comm.all_gather_object(mine)
            if "busy" not in status:
                break
        if "error" not in outcome:
            failed = [(r, m) for r, m in enumerate(status) if m]
            if failed:
                rank, (bad_record, message, text) = failed[0]
                if bad_record:
                    raise BadRecordError(text)
                raise RuntimeError(f"rank {rank} failed to build the tokenized data cache: {message}")
    if "error" in outcome:
        raise outcome["error"]
    built = outcome.get("built", False)
    data = _load(target, cache_hit=not built)
    data.files = [str(f) for f in files]  # the same content may have been cached under other paths
    return data
