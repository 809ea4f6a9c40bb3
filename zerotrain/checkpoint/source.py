"""Finding what to load: the tag directory, what kind of checkpoint it is, and whether it is intact.

`resolve` turns (load_dir, tag) into a directory: first it restores a checkpoint
whose re-save was interrupted between its two renames (`commit.recover_replaced`),
then `tag=None` reads `latest`; a
directory without `latest` that holds a checkpoint itself (a tag directory, or a
Hugging Face model directory) is used as is; nothing there means nothing to load.

`open_source` classifies the directory. A zerotrain checkpoint must have its
manifest, and every file the load will read must exist with the recorded size
(checksums are computed too, by `verify`, when `checkpoint.verify_on_load` is set, and
compared once every rank's share is in).
A directory with model safetensors but no zerotrain files is a plain Hugging Face
checkpoint, loadable only with `load_module_only=True`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from .commit import read_latest, recover_replaced
from .format import (HF_CONFIG, MANIFEST, MASTER, MODEL, OPTIMIZER, TRAINER_STATE, CheckpointError, index_file,
                     is_side_name, read_header, read_json, rng_file)
from .integrity import check_sizes, checksum_share, read_manifest

ZEROTRAIN, HUGGING_FACE = "zerotrain", "hugging-face"
_HF_SINGLE = "model.safetensors"


@dataclass
class Source:
    path: str
    kind: str
    manifest: Optional[dict] = None
    maps: dict = field(default_factory=dict)       # MODEL / MASTER / OPTIMIZER -> {tensor: file}
    optimizer_meta: dict = field(default_factory=dict)
    trainer_state: Optional[dict] = None

    def files_of(self, kind: str) -> set[str]:
        return set(self.maps.get(kind, {}).values())


def _holds_checkpoint(path: str) -> bool:
    names = (MANIFEST, TRAINER_STATE, _HF_SINGLE, index_file(MODEL), index_file(OPTIMIZER))
    return any(os.path.exists(os.path.join(path, name)) for name in names)


def _check_not_temporary(path: str) -> None:
    name = os.path.basename(os.path.normpath(path))
    if is_side_name(name):
        raise CheckpointError(f"{path} is the temporary directory of an unfinished or replaced save; "
                              f"it is never loaded")


def resolve(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The directory to load, or None when `load_dir` holds nothing to load."""
    load_dir = os.path.abspath(load_dir)
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory {load_dir} does not exist")
    recover_replaced(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            if _holds_checkpoint(load_dir):
                _check_not_temporary(load_dir)
                return load_dir
            return None
        path = os.path.join(load_dir, tag)
        if not os.path.isdir(path):
            raise CheckpointError(f"{os.path.join(load_dir, 'latest')} names {tag!r}, but {path} does not exist")
    else:
        path = os.path.join(load_dir, str(tag))
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint {path} does not exist")
    _check_not_temporary(path)
    return path


def _read_index(path: str, kind: str) -> tuple[dict, dict]:
    index = read_json(os.path.join(path, index_file(kind)))
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{os.path.join(path, index_file(kind))} has no weight_map")
    return weight_map, index.get("metadata", {}) or {}


def open_source(path: str, load_module_only: bool) -> Source:
    """Classify and open `path`; checks the manifest and file sizes of a zerotrain checkpoint."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        return _open_zerotrain(path)
    zerotrain_marks = [name for name in (TRAINER_STATE, index_file(OPTIMIZER), index_file(MASTER), rng_file(0))
                       if os.path.exists(os.path.join(path, name))]
    if zerotrain_marks:
        read_manifest(path)  # raises: no manifest, no checkpoint
    if os.path.exists(os.path.join(path, index_file(MODEL))):
        weight_map, _ = _read_index(path, MODEL)
    elif os.path.exists(os.path.join(path, _HF_SINGLE)):
        weight_map = {name: _HF_SINGLE for name in read_header(os.path.join(path, _HF_SINGLE))}
    else:
        hint = " (only safetensors weights are read)" if any(
            name.endswith((".bin", ".pt", ".pth")) for name in os.listdir(path)) else ""
        raise CheckpointError(f"no checkpoint in {path}: no {MANIFEST}, no model safetensors{hint}")
    if not load_module_only:
        raise CheckpointError(f"{path} is a plain Hugging Face model directory (no {MANIFEST}, no optimizer or "
                              f"trainer state); load it with load_module_only=True")
    return Source(path, HUGGING_FACE, maps={MODEL: weight_map})


def _open_zerotrain(path: str) -> Source:
    manifest = read_manifest(path)
    listed = manifest["files"]
    source = Source(path, ZEROTRAIN, manifest=manifest)
    for kind in (MODEL, MASTER, OPTIMIZER):
        if index_file(kind) in listed:
            check_sizes(path, manifest, [index_file(kind)])
            source.maps[kind], metadata = _read_index(path, kind)
            if kind == OPTIMIZER:
                source.optimizer_meta = metadata
        elif kind == MODEL:
            raise CheckpointError(f"{path}: the manifest lists no {index_file(MODEL)}")
    check_sizes(path, manifest, [TRAINER_STATE])
    source.trainer_state = read_json(os.path.join(path, TRAINER_STATE))
    return source


def needed_files(source: Source, load_optimizer_states: bool, load_module_only: bool) -> list[str]:
    """The files of a zerotrain checkpoint this load reads (all ranks together)."""
    listed = source.manifest["files"]
    needed = {index_file(MODEL), TRAINER_STATE} | source.files_of(MODEL) | source.files_of(MASTER)
    if MASTER in source.maps:
        needed.add(index_file(MASTER))
    if load_optimizer_states and not load_module_only and OPTIMIZER in source.maps:
        needed |= {index_file(OPTIMIZER)} | source.files_of(OPTIMIZER)
    if not load_module_only:
        needed |= {name for name in listed if name.startswith(("rng_state_", "loco_state_"))}
    if HF_CONFIG in listed:
        needed.add(HF_CONFIG)
    missing = sorted(name for name in needed if name not in listed)
    if missing:
        raise CheckpointError(f"{source.path}: {missing[0]} is used by the checkpoint but not listed in its manifest")
    return sorted(needed)


def verify(source: Source, names: list[str], rank: int, world: int, checksums: bool,
           skip: Optional[dict] = None, loads: Optional[list[int]] = None) -> Optional[dict]:
    """Sizes of every needed file (all ranks); with `checksums`, the crc32 pieces of this rank's share of
    their bytes (`integrity.checksum_share`; `skip`: the byte ranges some rank checksums as it reads them,
    `loads`: the bytes each rank reads that way, which the shares balance), which the load joins across
    ranks (`integrity.check_pieces`)."""
    check_sizes(source.path, source.manifest, names)
    return checksum_share(source.path, source.manifest, names, rank, world, skip=skip, loads=loads) \
        if checksums else None
