"""Offline tools over a checkpoint directory, for `zerotrain ckpt inspect|verify|export`.

They need no engine and no process group. Each accepts a tag directory, or a save
directory with a `latest` file.
"""
from __future__ import annotations

import functools
import os
import shutil
from typing import Optional

import torch

from . import commit
from .format import (HF_CONFIG, HF_GENERATION_CONFIG, MANIFEST, MASTER, MODEL, TRAINER_STATE, CheckpointError,
                     SafetensorsWriter, dtype_name, index_file, itemsize, numel_of, plan_shards, read_header, read_json,
                     shard_file, st_dtype, write_json)
from .directio import run_parallel
from .integrity import check_sizes, checksum_share, corrupt_files, read_manifest
from .reader import TensorReader
from .source import open_source, resolve

# Threads that checksum in `verify_checkpoint`, each one sequential stream (capped by the CPU count). Measured
# (0.86 GB, cold, load average 10): see benchmarks/RESULTS_checkpoint.md, run 12.
VERIFY_THREADS = 4


def _path(directory: str) -> str:
    if os.path.isfile(directory):
        parent = os.path.dirname(os.path.abspath(directory))
        raise CheckpointError(f"{directory} is a file; give the checkpoint directory that holds it ({parent}) "
                              f"or the save directory above it")
    path = resolve(directory, None)
    if path is None:
        raise CheckpointError(f"no checkpoint in {directory}")
    return path


def latest_step(save_dir: str) -> Optional[tuple[str, int]]:
    """``(path, global step)`` of the checkpoint `save_dir`'s `latest` names, None when there is none; read only
    (nothing recovered or checked: what a command says before it starts its ranks, which then load it)."""
    tag = commit.read_latest(save_dir)
    path = os.path.join(save_dir, tag) if tag else None
    if path is None or not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        return None
    try:
        return path, int(read_json(os.path.join(path, TRAINER_STATE))["global_steps"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return None  # the load itself reports what is wrong with it


def intact_tags(save_dir: str) -> list[tuple[str, int]]:
    """``(tag, global step)`` of every committed checkpoint in `save_dir` whose manifest and listed files (by size)
    are all there, the newest step first: what a run can resume from when `latest` names a damaged one. Read only."""
    from .format import is_side_name

    found = []
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    for name in names:
        path = os.path.join(save_dir, name)
        if is_side_name(name) or not os.path.isdir(path) or commit._intact(path) is None:
            continue
        try:
            found.append((name, int(read_json(os.path.join(path, TRAINER_STATE))["global_steps"])))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return sorted(found, key=lambda item: -item[1])


def saved_config(path: str) -> Optional[dict]:
    """The config a checkpoint directory was trained with (its trainer state's), None where it has none."""
    try:
        config = read_json(os.path.join(path, TRAINER_STATE)).get("config")
    except (CheckpointError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def inspect_checkpoint(directory: str) -> dict:
    """Tensors (dtype, shape, bytes) per kind, the step, and the topology that wrote the checkpoint."""
    path = _path(directory)
    source = open_source(path, load_module_only=True)
    report = {"path": path, "kind": source.kind, "tensors": {}, "bytes": {}}
    for kind, weight_map in source.maps.items():
        rows = []
        headers: dict = {}
        for name, file in weight_map.items():
            header = headers.setdefault(file, read_header(os.path.join(path, file)))
            if name not in header:
                raise CheckpointError(f"tensor {name!r} is missing from {os.path.join(path, file)}")
            entry = header[name]
            dtype = st_dtype(entry["dtype"])
            rows.append({"name": name, "dtype": dtype_name(dtype), "shape": entry["shape"],
                         "bytes": numel_of(entry["shape"]) * itemsize(dtype), "file": file})
        report["tensors"][kind] = rows
        report["bytes"][kind] = sum(row["bytes"] for row in rows)
    if source.trainer_state is not None:
        state = source.trainer_state
        report.update(global_steps=state.get("global_steps"), global_samples=state.get("global_samples"),
                      topology=state.get("topology"), zerotrain_version=state.get("zerotrain_version"))
    if source.manifest is not None:
        report["files"] = len(source.manifest["files"])
        report["total_file_bytes"] = sum(int(e["size"]) for e in source.manifest["files"].values())
    return report


def verify_checkpoint(directory: str) -> dict:
    """Check every file in the manifest (sizes, checksums, safetensors headers); raises CheckpointError if bad.

    The checksums are computed as a load computes them (`integrity.checksum_share`): the files laid end to
    end and cut into one equal byte range per thread, each mapped sequentially through the page cache,
    the pieces joined per file with crc32_combine, so every bad file is named, not only the first."""
    path = _path(directory)
    manifest = read_manifest(path)
    names = sorted(manifest["files"])
    problems: dict[str, str] = {}
    for name in names:
        try:
            check_sizes(path, manifest, [name])
        except CheckpointError as error:
            problems[name] = str(error)
    sized = [name for name in names if name not in problems]
    threads = max(1, min(VERIFY_THREADS, os.cpu_count() or 1))
    shares = run_parallel([functools.partial(checksum_share, path, manifest, sized, rank, threads)
                           for rank in range(threads)], threads)
    problems.update(corrupt_files(path, shares))
    for name in sized:
        if name not in problems and name.endswith(".safetensors"):
            try:
                read_header(os.path.join(path, name))
            except CheckpointError as error:
                problems[name] = str(error)
    if problems:
        listed = [problems[name] for name in names if name in problems]
        raise CheckpointError(f"{len(listed)} of {len(names)} files are bad:\n  " + "\n  ".join(listed)
                              if len(listed) > 1 else listed[0])
    return {"path": path, "ok": True, "files": len(names),
            "bytes": sum(int(manifest["files"][n]["size"]) for n in names)}


def export_model(directory: str, out: str, dtype: Optional[str] = None,
                 max_file_bytes: int = 5 * 1024 ** 3, merge_lora: Optional[str] = None) -> str:
    """Write the model weights only, in Hugging Face layout (optionally cast), to the new directory `out`.

    Trained weights are taken from the fp32 master weights when the checkpoint has them,
    so an export to another dtype is cast once from full precision. `merge_lora` names a
    PEFT LoRA adapter directory folded into the weights on the way (`zerotrain.merge.lora`,
    the same folding `zerotrain merge` does).
    """
    path = _path(directory)
    source = open_source(path, load_module_only=True)
    if source.manifest is not None:
        verify_checkpoint(path)
    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"export target {out} exists and is not empty")
    target = None if dtype is None else {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        dtype, getattr(torch, str(dtype), None))
    if dtype is not None and not isinstance(target, torch.dtype):
        raise CheckpointError(f"unknown dtype {dtype!r} (use bf16, fp16 or fp32)")
    adapter = None
    # A checkpoint of a PEFT-wrapped model (`train --lora-r`) holds the base under PEFT's names and the adapter
    # weights beside it: merged, it is written under the base model's names without the adapter weights.
    names = {name: name for name in source.maps[MODEL]}
    from ..lora import base_weight_name, is_adapter_weight
    # (the adapter's trained weights are in the master files, older checkpoints had them in the model files too)
    lora_checkpoint = any(is_adapter_weight(name) for name in (*names, *source.maps.get(MASTER, {})))
    if merge_lora is None and lora_checkpoint:
        # Not merged: the base weights under the base model's names and PEFT's adapter files beside them, as the
        # checkpoint directory holds them (from_pretrained(out) gives the LoRA model, PeftModel.from_pretrained
        # the adapter); the adapter's weights are in adapter_model.safetensors, not in the model files.
        names = {name: base_weight_name(name) for name in names if not is_adapter_weight(name)}
    if merge_lora is not None:
        from ..lora import LoraAdapter, LoraError
        names = {name: base_weight_name(name) for name in source.maps[MODEL] if not is_adapter_weight(name)}
        if (source.trainer_state or {}).get("adapters_only"):
            raise CheckpointError(f"{path} was saved with checkpoint.adapters_only: it holds no base weights to "
                                  f"merge into (export the base model's directory with --merge-lora {path})")
        try:
            adapter = LoraAdapter(merge_lora or path)
            adapter.check_targets(dict.fromkeys(names.values()), path)
        except LoraError as error:
            raise CheckpointError(str(error)) from None
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with commit.StagedDirectory(out) as staged:
        temp = staged.path
        with TensorReader(path, source.maps[MODEL], "model weights") as model, \
                TensorReader(path, source.maps.get(MASTER, {}), "master weights") as masters:
            entries, stored_as = [], {}
            for stored_name, name in names.items():
                stored, shape, _ = model.entry(stored_name)
                wanted = target if (target is not None and stored.is_floating_point) else stored
                entries.append((name, wanted, shape))
                stored_as[name] = stored_name
            files = plan_shards(entries, max_file_bytes)
            weight_map = {}
            for index, chunk in enumerate(files):
                name = shard_file(MODEL, index, len(files))
                writer = SafetensorsWriter(os.path.join(temp, name), chunk)
                for key, wanted, _ in chunk:
                    stored_name = stored_as[key]
                    reader = masters if (masters.has(stored_name) and wanted.is_floating_point) else model
                    tensor = reader.read(stored_name)
                    if adapter is not None and tensor.is_floating_point():
                        tensor = adapter.fold(key, tensor.float())
                    writer.write(key, [tensor.to(wanted).contiguous()])
                    weight_map[key] = name
                writer.close()
        total = sum(numel_of(shape) * itemsize(d) for _, d, shape in entries)
        write_json(os.path.join(temp, index_file(MODEL)), {"metadata": {"total_size": total},
                                                           "weight_map": weight_map})
        for name in (HF_CONFIG, HF_GENERATION_CONFIG):
            if os.path.exists(os.path.join(path, name)):
                payload = read_json(os.path.join(path, name))
                if name == HF_CONFIG and target is not None:
                    payload["dtype" if "dtype" in payload or "torch_dtype" not in payload else "torch_dtype"] = \
                        dtype_name(target)
                write_json(os.path.join(temp, name), payload)
        for name in _side_files(path):  # the tokenizer's files and the like: from_pretrained(out) finds them
            if adapter is not None and name == "adapter_config.json":
                continue  # merged: transformers would take the export for an adapter of another model
            shutil.copyfile(os.path.join(path, name), os.path.join(temp, name))
        if adapter is None and lora_checkpoint and os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            shutil.copyfile(os.path.join(path, "adapter_model.safetensors"),
                            os.path.join(temp, "adapter_model.safetensors"))
        if os.path.exists(out):
            os.rmdir(out)
        staged.commit()
    return out


def _side_files(path: str) -> list[str]:
    """Files of a model directory that are neither weights, nor the configs written above, nor zerotrain's own
    state: the tokenizer's (tokenizer.json, tokenizer_config.json, chat_template.jinja, ...)."""
    own = {MANIFEST, TRAINER_STATE, HF_CONFIG, HF_GENERATION_CONFIG}
    return sorted(name for name in os.listdir(path)
                  if os.path.isfile(os.path.join(path, name)) and name not in own and not name.startswith(".")
                  and not name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth"))
                  and not name.startswith(("rng_state_", "loco_state_")))


def is_hugging_face_model(path: str) -> bool:
    """Whether a model directory (an export, a tag directory) has the config.json transformers needs to load it."""
    return os.path.exists(os.path.join(path, HF_CONFIG))


__all__ = ["inspect_checkpoint", "verify_checkpoint", "export_model", "is_hugging_face_model"]
