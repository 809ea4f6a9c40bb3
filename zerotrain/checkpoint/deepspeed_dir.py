"""DeepSpeed checkpoint directories, read into and written from the unified checkpoint.

A DeepSpeed 0.19 checkpoint (``save_dir/latest`` naming ``global_stepN/``) holds the model states
(``mp_rank_00_model_states.pt`` at stages 0-2; one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank
at stage 3: module state dict, ``param_shapes`` per group, buffers, frozen parameters, scheduler, counters,
ds_config and the client state as extra top-level keys) and one ``*zero_pp_rank_R_mp_rank_00_optim_states.pt``
per data-parallel rank. Their layout, learned from DeepSpeed's ``zero_to_fp32.py`` and the ``state_dict``
methods of ``runtime/zero/stage_1_and_2.py`` and ``stage3.py`` (the code here is our own):

- stages 1-2: each parameter group is one flat vector of its parameters in order (plus
  ``param_alignment_paddings`` after each), padded to a multiple of 2 x world size and cut into equal
  partitions; a rank keeps its fp32 partition without the padding (``single_partition_of_fp32_groups``) and
  the torch optimizer's state of the padded partition (``base_optimizer_state``: one flat parameter per group);
- stage 3: each parameter is cut on its own into ``ceil(numel / world)`` elements per rank (the last rank's
  piece padded); a rank's ``fp32_flat_groups`` (one per sub-group) concatenate its pieces in ``param_shapes``
  order, and the optimizer state (one flat parameter per sub-group) follows the same layout.

`read_deepspeed` joins those into whole per-parameter tensors (masters and every per-element optimizer
state) and `convert_deepspeed` writes them as a zerotrain checkpoint with the same streaming writer and
manifest as a save, so the usual load reshards them onto any topology. Pickled DeepSpeed objects (its
LossScaler, enums) are read without importing DeepSpeed (`_Unpickler`).
"""
from __future__ import annotations

import glob
import math
import os
import pickle
import re
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import commit
from .format import (FORMAT_NAME, FORMAT_VERSION, LATEST, MASTER, MODEL, OPTIMIZER, TRAINER_STATE, CheckpointError,
                     SafetensorsWriter, dtype_name, index_file, itemsize, numel_of, shard_file, write_json)
from .integrity import crc32_text, write_manifest
from .state import decode, encode

MODEL_STATES = "_model_states.pt"
OPTIM_STATES = "_optim_states.pt"
# Keys of DeepSpeed's model-states file; every other top-level key is the client state.
_DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
            "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
            "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
            "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_autotp_universal_checkpoint_meta"}
# DeepSpeed's own schedulers keep `last_batch_iteration` (i = steps - 1); zerotrain's (torch LRSchedulers)
# keep last_epoch = i + 1 and _step_count = i + 2.
_DS_SCHEDULERS = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}


# --- reading pickles without DeepSpeed ------------------------------------------------------------
class _Foreign:
    """A DeepSpeed object in a pickle (LossScaler, ZeroStageEnum, fragment_address): its arguments and state."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __int__(self) -> int:
        return int(self.args[0])


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "deepspeed" or module.startswith("deepspeed."):
            return type(name, (_Foreign,), {})
        return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except Exception as error:  # noqa: BLE001 - torch and pickle raise many types
        raise CheckpointError(f"{path}: cannot read this DeepSpeed file: {error}") from error


def _rank_of(path: str) -> int:
    found = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path))
    return int(found.group(1)) if found else 0


# --- finding one ------------------------------------------------------------------------------------
def deepspeed_tag_dir(load_dir: str, tag: Optional[str] = None) -> Optional[str]:
    """The DeepSpeed checkpoint directory `load_dir` (with `tag`, or its `latest`) names, or None when it
    is not one (a zerotrain checkpoint, a model directory, nothing)."""
    if not os.path.isdir(load_dir):
        return None
    if tag is None and os.path.isfile(os.path.join(load_dir, LATEST)):
        with open(os.path.join(load_dir, LATEST)) as handle:
            tag = handle.read().strip()
    path = load_dir if tag is None else os.path.join(load_dir, str(tag))
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "manifest.json")):
        return None
    return path if glob.glob(os.path.join(path, "*" + MODEL_STATES)) else None


# --- reading ----------------------------------------------------------------------------------------
@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint as whole tensors: what the unified checkpoint needs."""

    stage: int
    world_size: int
    masters: "OrderedDict[str, torch.Tensor]"            # trainable parameters, fp32, in DeepSpeed's group order
    groups: list                                         # names of each optimizer group
    states: dict                                         # name -> {key: whole tensor}
    scalars: dict                                        # name -> {key: float}
    extras: "OrderedDict[str, torch.Tensor]"             # buffers and frozen parameters, as saved
    aliases: dict                                        # shared (tied) name -> the name it shares
    group_hyper: list                                    # each group's hyperparameters (no params)
    model_states: dict                                   # rank 0's model-states file (counters, scheduler, config)
    client_state: dict = field(default_factory=dict)
    loss_scaler: Optional[object] = None


def _state_split(state: dict, length: int) -> tuple[dict, dict]:
    elementwise, scalars = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() >= length and value.numel() > 1:
            elementwise[key] = value
        elif torch.is_tensor(value) and value.numel() == 1:
            scalars[key] = float(value.item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = float(value)
    return elementwise, scalars


def read_deepspeed(path: str) -> DeepSpeedState:
    """Join a DeepSpeed ZeRO checkpoint tag directory (any stage, any world size) into whole tensors."""
    model_files = sorted(glob.glob(os.path.join(path, "*" + MODEL_STATES)), key=_rank_of)
    if any(re.search(r"mp_rank_(?!00_)", os.path.basename(f)) for f in model_files) or \
            glob.glob(os.path.join(path, "layer_*")) or glob.glob(os.path.join(path, "*expert_*")):
        raise CheckpointError(f"{path}: a DeepSpeed checkpoint with tensor, pipeline or expert parallelism "
                              f"(mp_rank_01, layer_*, expert_* files) cannot be imported; only data-parallel ZeRO")
    optim_files = sorted(glob.glob(os.path.join(path, "*zero_pp_rank_*" + OPTIM_STATES)), key=_rank_of)
    model_states = _load(model_files[0])
    if "param_shapes" not in model_states:
        raise CheckpointError(f"{model_files[0]} is not a DeepSpeed model-states file (no param_shapes)")
    if not optim_files:
        raise CheckpointError(f"{path} has no *_optim_states.pt files: only DeepSpeed ZeRO checkpoints (stages 1-3) "
                              f"are imported")
    optim = [_load(f)["optimizer_state_dict"] for f in optim_files]
    stage = int(optim[0]["zero_stage"])
    world = optim[0]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optim_files):
        raise CheckpointError(f"{path}: the checkpoint was written by {world} ranks but has {len(optim_files)} "
                              f"optimizer files (an interrupted or overwritten save?)")
    shapes = [OrderedDict((n, tuple(s)) for n, s in group.items()) for group in model_states["param_shapes"]]
    module = model_states["module"]
    extras: OrderedDict = OrderedDict()
    for name in model_states.get("buffer_names", []):
        extras[name] = module[name]
    frozen = model_states.get("frozen_param_shapes") or {}
    if stage == 3 and frozen:
        fragments = [_load(f).get("frozen_param_fragments") or {} for f in model_files]
        for name, shape in frozen.items():
            extras[name] = torch.cat([rank[name].reshape(-1) for rank in fragments])[:numel_of(shape)].reshape(shape)
    else:
        for name in frozen:
            extras[name] = module[name]
    if stage <= 2:
        masters, states, scalars, hyper = _join_stage12(optim, shapes, path)
    else:
        masters, states, scalars, hyper = _join_stage3(optim, shapes, world, path)
    client = {k: v for k, v in model_states.items() if k not in _DS_KEYS}
    aliases = {alias: source for alias, source in (model_states.get("shared_params") or {}).items()}
    # DeepSpeed's flat groups may be in round-robin order (zero_optimization.round_robin_gradients: param_shapes,
    # which the joins above follow, records that order); the groups are recorded in the module's order
    order = {name: index for index, name in enumerate(module)}
    groups = [sorted(group, key=lambda name: order.get(name, len(order))) for group in shapes]
    return DeepSpeedState(stage, world, masters, groups, states, scalars, extras, aliases,
                          hyper, model_states, client, optim[0].get("loss_scaler"))


def _join_stage12(optim: list, shapes: list, path: str):
    masters, states, scalars = OrderedDict(), {}, {}
    base0 = optim[0]["base_optimizer_state"]
    if not isinstance(base0, dict):
        raise CheckpointError(f"{path}: an elastic ZeRO checkpoint (zero_optimization.elastic_checkpoint) cannot be "
                              f"imported; save it without elastic_checkpoint")
    for g, group in enumerate(shapes):
        flat, flat_states, group_scalars = [], {}, {}
        for rank, sd in enumerate(optim):
            fp32 = sd["single_partition_of_fp32_groups"][g].reshape(-1)
            flat.append(fp32)
            elementwise, rank_scalars = _state_split(sd["base_optimizer_state"]["state"].get(g, {}), fp32.numel())
            for key, value in elementwise.items():
                flat_states.setdefault(key, []).append(value.reshape(-1)[:fp32.numel()])
            group_scalars.update(rank_scalars)
        whole = torch.cat(flat)
        whole_states = {key: torch.cat(parts) for key, parts in flat_states.items()}
        paddings = optim[0].get("param_alignment_paddings")
        paddings = paddings[g] if paddings else [0] * len(group)
        offset = 0
        for (name, shape), pad in zip(group.items(), paddings):
            count = numel_of(shape)
            if offset + count > whole.numel():
                raise CheckpointError(f"{path}: parameter {name!r} runs past its group's fp32 partitions "
                                      f"({offset + count} > {whole.numel()} elements)")
            masters[name] = whole[offset:offset + count].reshape(shape).clone()
            states[name] = {key: value[offset:offset + count].reshape(shape).clone()
                            for key, value in whole_states.items()}
            scalars[name] = dict(group_scalars)
            offset += count + pad
    return masters, states, scalars, _hyper(base0["param_groups"])


def _join_stage3(optim: list, shapes: list, world: int, path: str):
    masters, states, scalars = OrderedDict(), {}, {}
    streams, state_streams, all_scalars = [], [], {}
    for sd in optim:
        fp32 = torch.cat([t.reshape(-1) for t in sd["fp32_flat_groups"]])
        streams.append(fp32)
        per_key: dict = {}
        inner = sd["optimizer_state_dict"]
        for index, group in enumerate(sd["fp32_flat_groups"]):
            elementwise, rank_scalars = _state_split(inner["state"].get(index, {}), group.numel())
            for key, value in elementwise.items():
                per_key.setdefault(key, []).append(value.reshape(-1)[:group.numel()])
            all_scalars.update(rank_scalars)
        state_streams.append({key: torch.cat(parts) for key, parts in per_key.items()})
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            count = numel_of(shape)
            piece = math.ceil(count / world)
            if offset + piece > streams[0].numel():
                raise CheckpointError(f"{path}: parameter {name!r} runs past the fp32 partitions")
            masters[name] = torch.cat([s[offset:offset + piece] for s in streams])[:count].reshape(shape).clone()
            states[name] = {key: torch.cat([s[key][offset:offset + piece] for s in state_streams])[:count]
                            .reshape(shape).clone() for key in state_streams[0]}
            scalars[name] = dict(all_scalars)
            offset += piece
    if offset != streams[0].numel():
        raise CheckpointError(f"{path}: the parameters take {offset} elements of each rank's fp32 partition, which "
                              f"holds {streams[0].numel()}")
    return masters, states, scalars, _hyper(optim[0]["optimizer_state_dict"]["param_groups"])


def _hyper(param_groups: list) -> list:
    return [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


# --- DeepSpeed -> zerotrain -------------------------------------------------------------------------
def _training_dtype(ds_config: dict) -> torch.dtype:
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        block = ds_config.get(key) if isinstance(ds_config, dict) else None
        if isinstance(block, dict) and block.get("enabled"):
            return dtype
    return torch.float32


def _scheduler_state(model_states: dict) -> Optional[dict]:
    state = model_states.get("lr_scheduler")
    if not isinstance(state, dict):
        return None
    if set(state) == {"last_batch_iteration"}:  # DeepSpeed's own schedulers: the step index only
        index = int(state["last_batch_iteration"])
        return {"last_batch_iteration": index, "last_epoch": index + 1, "_step_count": index + 2}
    return state


def _loss_scaler_state(scaler, global_steps: int) -> dict:
    attrs = getattr(scaler, "__dict__", {}) if scaler is not None else {}
    return {"scale": float(attrs.get("cur_scale", 1.0)), "iteration": int(attrs.get("cur_iter", global_steps)),
            "last_overflow_iteration": int(attrs.get("last_overflow_iter", -1)),
            "hysteresis_left": int(attrs.get("cur_hysteresis", 2))}


def _write_file(directory: str, name: str, entries: list, tensors: dict, kind: str, files: dict) -> None:
    writer = SafetensorsWriter(os.path.join(directory, name), [(k, t.dtype, tuple(t.shape)) for k, t in entries],
                               {"zerotrain": kind})
    try:
        for key, tensor in entries:
            writer.write(key, [tensor.detach().contiguous().reshape(-1)])
        size, crc = writer.close()
    except BaseException:
        writer.abort()
        raise
    files[name] = {"size": size, "crc32": crc32_text(crc)}


def convert_deepspeed(ds_path: str, out_dir: str, tag: Optional[str] = None) -> str:
    """Write the DeepSpeed checkpoint `ds_path` (a save directory with `latest`, or a tag directory) as a
    zerotrain checkpoint in `out_dir/<tag>` (with `latest`); returns the tag directory written."""
    path = deepspeed_tag_dir(ds_path, tag)
    if path is None:
        raise CheckpointError(f"{ds_path} is not a DeepSpeed checkpoint (no `latest` naming a directory with "
                              f"*{MODEL_STATES} files, and none in it)")
    ds = read_deepspeed(path)
    ds_config = ds.model_states.get("ds_config") or {}
    dtype = _training_dtype(ds_config)
    tag = os.path.basename(os.path.normpath(path))
    os.makedirs(out_dir, exist_ok=True)
    final = os.path.join(os.path.abspath(out_dir), tag)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists: import into a new directory")
    save_id = commit.new_save_id()
    with commit.StagedDirectory(final, save_id) as staged:
        temp = staged.path
        files: dict = {}
        model = [(n, t.to(dtype)) for n, t in ds.masters.items()]
        model += [(alias, ds.masters[source].to(dtype)) for alias, source in ds.aliases.items()
                  if source in ds.masters and alias not in ds.masters]
        model += list(ds.extras.items())
        kinds = [(MODEL, model)]
        if dtype != torch.float32:
            kinds.append((MASTER, list(ds.masters.items())))
        optimizer = [(f"{n}/{key}", value.to(torch.float32) if value.is_floating_point() else value)
                     for n in ds.masters for key, value in sorted(ds.states[n].items())]
        optimizer += [(f"{n}/{key}", torch.tensor(value, dtype=torch.float32))
                      for n in ds.masters for key, value in sorted(ds.scalars[n].items())]
        kinds.append((OPTIMIZER, optimizer))
        for kind, entries in kinds:
            name = shard_file(kind, 0, 1)
            _write_file(temp, name, entries, {}, kind, files)
            metadata = {"total_size": sum(numel_of(t.shape) * itemsize(t.dtype) for _, t in entries), "zerotrain": kind}
            if kind == OPTIMIZER:
                metadata.update(optimizer=str((ds_config.get("optimizer") or {}).get("type", "unknown")),
                                param_groups=[{k: encode(v, f"param_groups[{i}][{k!r}]") for k, v in group.items()}
                                              for i, group in enumerate(ds.group_hyper)])
            size, crc = write_json(os.path.join(temp, index_file(kind)),
                                   {"metadata": metadata, "weight_map": {k: name for k, _ in entries}})
            files[index_file(kind)] = {"size": size, "crc32": crc32_text(crc)}
        from ..version import __version__
        steps = int(ds.model_states.get("global_steps", 0))
        trainer_state = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "zerotrain_version": __version__, "tag": tag,
            "global_steps": steps, "global_samples": int(ds.model_states.get("global_samples", 0)),
            "skipped_steps": int(ds.model_states.get("skipped_steps", 0)), "micro_steps": 0,
            "loss_scaler": _loss_scaler_state(ds.loss_scaler, steps),
            "lr_scheduler": encode(_scheduler_state(ds.model_states), "lr_scheduler"),
            "config": encode(ds_config, "ds_config"),
            "topology": {"world_size": ds.world_size, "stage": ds.stage, "dtype": dtype_name(dtype),
                         "written_by": f"deepspeed {ds.model_states.get('ds_version')}"},
            "client_state": encode(ds.client_state, "client_state"),
            "adapters_only": False,
            "param_groups": ds.groups,
            "buffer_names": [name for name in ds.model_states.get("buffer_names") or [] if name in ds.extras],
            "shared_params": dict(ds.aliases),
        }
        size, crc = write_json(os.path.join(temp, TRAINER_STATE), trainer_state)
        files[TRAINER_STATE] = {"size": size, "crc32": crc32_text(crc)}
        write_manifest(temp, files, {"tag": tag, "save_id": save_id, "global_steps": steps,
                                     "world_size": ds.world_size, "imported_from": os.path.abspath(path)})
        staged.commit(latest=True)
    return final


__all__ = ["deepspeed_tag_dir", "read_deepspeed", "convert_deepspeed", "DeepSpeedState"]

