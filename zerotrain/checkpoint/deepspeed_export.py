"""A zerotrain checkpoint written as a DeepSpeed 0.19 checkpoint directory, for a chosen world size and stage.

`export_deepspeed` reads whole tensors from a zerotrain checkpoint of any topology (masters, every per-element
optimizer state, the scalars such as Adam's `step`) and cuts them the way DeepSpeed's ZeRO optimizers lay out
their state for `world_size` data-parallel ranks, so that `deepspeed.initialize(...)` +
`engine.load_checkpoint(OUT)` at that world size resumes the run exactly. The layout (learned from DeepSpeed's
`runtime/engine.py` save/load, `runtime/zero/stage_1_and_2.py` and `stage3.py` `state_dict` /
`load_state_dict`, and `utils/zero_to_fp32.py`; the code here is our own):

- ``OUT/latest`` names the tag; ``OUT/<tag>/`` holds the model states and one optimizer file per rank;
- stages 1-2: ``mp_rank_00_model_states.pt`` (the whole module state dict in the training dtype, buffer names,
  ``param_shapes`` per optimizer group, frozen parameters, shared (tied) names, the LR scheduler, the counters,
  the config, and the client state as extra top-level keys). Each optimizer group is one flat vector of its
  parameters in order (``param_alignment_paddings`` after each when ``zero_optimization.parameter_alignment``),
  padded to a multiple of 2 x world size and cut into equal partitions. Rank R's
  ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` holds its fp32 partition without the padding
  (``single_partition_of_fp32_groups``) and the torch optimizer's ``state_dict()`` over the padded partitions
  (``base_optimizer_state``: one flat parameter per group);
- stage 3: one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank (every parameter empty, as DeepSpeed saves
  and loads them partitioned, buffers whole; frozen parameters as rank R's fragments). Each parameter is cut on its own into ``ceil(numel / world)`` elements per rank (the last piece
  zero-padded); an optimizer group is split into sub-groups of ``sub_group_size`` elements, and rank R's
  ``fp32_flat_groups`` (one per sub-group) concatenate its pieces; the optimizer state is the torch optimizer's
  ``state_dict()`` over those flat sub-groups.
- bf16 runs name the optimizer files ``bf16_zero_pp_rank_...`` as DeepSpeed does.

DeepSpeed's own objects inside the pickles (its `LossScaler`, `ZeroStageEnum`) are written by name
(`_DeepSpeedPickler`) so that the export needs no DeepSpeed installed.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import types
import warnings
from collections import OrderedDict
from typing import Any, Optional, Union

import torch

from . import commit
from .format import MASTER, MODEL, OPTIMIZER, CheckpointError, torch_dtype
from .reader import TensorReader
from .source import open_source, resolve
from .state import decode

DEEPSPEED_VERSION = "0.19.8"  # the version the layout was learned from and tested against
_DS_SCHEDULERS = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
_NCCL_START_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: flat groups pad to 2 x world elements
# DeepSpeed's default `gradient_clipping` (0.19.8's GRADIENT_CLIPPING_DEFAULT); its ZeRO-1/2 load takes the clip value
# from the checkpoint
_GRADIENT_CLIPPING_DEFAULT = 1.0


# --- DeepSpeed objects in a pickle, by name --------------------------------------------------------------
class _Global:
    """A DeepSpeed class or enum, named in the pickle (module, qualified name), never imported here."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class _Instance:
    """An instance of a `_Global`: rebuilt by DeepSpeed's unpickler as pickle rebuilds its own objects
    (a plain object: ``cls.__new__(cls)`` then its ``__dict__``; an enum member: ``cls(value)``)."""

    def __init__(self, cls: _Global, state: Optional[dict] = None, value=None):
        self.cls, self.state, self.value = cls, state, value


_LOSS_SCALER = _Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
_DYNAMIC_LOSS_SCALER = _Global("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
_ZERO_STAGE = _Global("deepspeed.runtime.zero.config", "ZeroStageEnum")
_FRAGMENT_ADDRESS = _Global("deepspeed.utils.tensor_fragment", "fragment_address")


class _DeepSpeedPickler(pickle._Pickler):  # the Python pickler: its `save` can write a global by name
    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, (_Global, _Instance)):
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
                return
            if isinstance(obj, _Global):
                self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))
            elif obj.value is not None:  # an enum member: cls(value)
                self.save(obj.cls)
                self.save((obj.value,))
                self.write(pickle.REDUCE)
            else:  # object.__reduce_ex__(2): cls.__new__(cls), then the state
                self.save(obj.cls)
                self.save(())
                self.write(pickle.NEWOBJ)
            self.memoize(obj)
            if isinstance(obj, _Instance) and obj.state is not None:
                self.save(obj.state)
                self.write(pickle.BUILD)
            return
        super().save(obj, save_persistent_id)


_PICKLE = types.SimpleNamespace(Pickler=_DeepSpeedPickler, Unpickler=pickle.Unpickler, dump=pickle.dump,
                                load=pickle.load, __name__="pickle")


def _save(obj: dict, path: str) -> None:
    torch.save(obj, path, pickle_module=_PICKLE)


# --- what the zerotrain checkpoint holds ----------------------------------------------------------------
def _read_all(path: str):
    """(trainer_state, optimizer metadata, model tensors, fp32 masters, per-element states, scalars)."""
    source = open_source(path, load_module_only=False)
    if OPTIMIZER not in source.maps:
        raise CheckpointError(f"{path} holds no optimizer states: a DeepSpeed checkpoint to resume from needs them")
    trainer = source.trainer_state or {}
    if trainer.get("adapters_only"):
        raise CheckpointError(f"{path} was saved with checkpoint.adapters_only (no frozen weights): DeepSpeed needs "
                              f"the whole model")
    with TensorReader(path, source.maps[MODEL], "model weights") as reader:
        model = OrderedDict((name, reader.read(name)) for name in source.maps[MODEL])
    masters: dict = {}
    if MASTER in source.maps:
        with TensorReader(path, source.maps[MASTER], "master weights") as reader:
            masters = {name: reader.read(name).float() for name in source.maps[MASTER]}
    states: dict = {}
    scalars: dict = {}
    with TensorReader(path, source.maps[OPTIMIZER], "optimizer states") as reader:
        for key in source.maps[OPTIMIZER]:
            name, _, state_key = key.rpartition("/")
            if name not in model:
                raise CheckpointError(f"{path}: optimizer state {key!r} belongs to no model weight")
            tensor = reader.read(key)
            if tensor.dim() > 0 and tuple(tensor.shape) == tuple(model[name].shape):
                states.setdefault(name, {})[state_key] = tensor
            elif tensor.numel() == 1:
                scalars.setdefault(name, {})[state_key] = tensor.reshape(())
            else:
                raise CheckpointError(f"{path}: optimizer state {key!r} {list(tensor.shape)} is neither shaped like "
                                      f"{name} {list(model[name].shape)} nor a scalar")
    trainable = [name for name in model if name in states or name in scalars or name in masters]
    for name in trainable:
        masters.setdefault(name, model[name].float())
    return trainer, source.optimizer_meta, model, masters, states, scalars, trainable


def _groups(trainer: dict, optimizer_meta: dict, trainable: list, path: str) -> list[list[str]]:
    hyper = optimizer_meta.get("param_groups") or [{}]
    recorded = trainer.get("param_groups")
    if recorded:
        groups = [list(names) for names in recorded]
        missing = sorted(set(trainable) - {n for names in groups for n in names})
        if missing:
            raise CheckpointError(f"{path}: trainer_state.json's param_groups leave out trainable {missing[0]!r}")
    elif len(hyper) == 1:
        groups = [list(trainable)]
    else:
        raise CheckpointError(f"{path} has {len(hyper)} optimizer groups but does not record their parameters "
                              f"(saved by an older zerotrain): save it again with this version to export it")
    if len(groups) != len(hyper):
        raise CheckpointError(f"{path}: {len(groups)} parameter groups but {len(hyper)} optimizer groups")
    if any(not names for names in groups):
        raise CheckpointError(f"{path}: an optimizer group without trainable parameters cannot be laid out as "
                              f"DeepSpeed's flat groups")
    return groups


def _hyper(group: dict) -> dict:
    out = {}
    for key, value in group.items():
        value = decode(value)
        out[key] = tuple(value) if key == "betas" and isinstance(value, list) else value
    return out


def _scalar_states(scalars: dict, names: list) -> dict:
    """A flat group's scalar states (Adam's `step`): the same for every parameter of the group."""
    out: dict = {}
    for name in names:
        for key, value in scalars.get(name, {}).items():
            out.setdefault(key, value.clone())
    return out


# --- the layouts ---------------------------------------------------------------------------------------
def _stage12_partitions(tensors: list, paddings: list, world: int) -> tuple[list, int]:
    """Each rank's partition of a flat group (zero padding included) and the group's unpadded length."""
    pieces = []
    for tensor, pad in zip(tensors, paddings):
        pieces.append(tensor.reshape(-1))
        if pad:
            pieces.append(torch.zeros(pad, dtype=tensor.dtype))
    flat = torch.cat(pieces)
    used = flat.numel()
    alignment = _NCCL_START_ALIGNMENT * world
    flat = torch.cat([flat, torch.zeros((-used) % alignment, dtype=flat.dtype)])
    size = flat.numel() // world
    return [flat[r * size:(r + 1) * size].clone() for r in range(world)], used


def _param_paddings(numels: list, alignment: int) -> list:
    paddings, offset = [], 0
    for index, numel in enumerate(numels):
        offset += numel
        pad = 0 if index == len(numels) - 1 else (-offset) % alignment
        paddings.append(pad)
        offset += pad
    return paddings


def _stage3_piece(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    flat = tensor.reshape(-1)
    size = math.ceil(flat.numel() / world)
    piece = flat[rank * size:(rank + 1) * size]
    return torch.cat([piece, torch.zeros(size - piece.numel(), dtype=flat.dtype)]) if piece.numel() < size \
        else piece.clone()


def _sub_groups(names: list, numels: dict, world: int, sub_group_size: int) -> list[list[str]]:
    """DeepSpeed's `_create_fp16_sub_groups`: cut a group once its partition reaches `sub_group_size`."""
    per_rank = {name: math.ceil(numels[name] / world) for name in names}
    if sub_group_size >= sum(per_rank.values()):
        return [list(names)]
    groups, current, size = [], [], 0
    for index, name in enumerate(names):
        current.append(name)
        size += per_rank[name]
        if size >= sub_group_size or index == len(names) - 1:
            groups.append(current)
            current, size = [], 0
    return groups


def _loss_scaler(trainer: dict, config: dict, dtype: torch.dtype) -> _Instance:
    fp16 = config.get("fp16") or {}
    state = decode(trainer.get("loss_scaler") or {})
    if dtype == torch.float16 and float(fp16.get("loss_scale", 0) or 0) == 0:
        return _Instance(_DYNAMIC_LOSS_SCALER, {
            "cur_scale": float(state.get("scale", 2.0 ** int(fp16.get("initial_scale_power", 16)))),
            "dynamic": True, "cur_iter": int(state.get("iteration", trainer.get("global_steps", 0))),
            "last_overflow_iter": int(state.get("last_overflow_iteration", -1)), "scale_factor": 2.0,
            "scale_window": int(fp16.get("loss_scale_window", 1000)), "min_scale": float(fp16.get("min_loss_scale", 1)),
            "delayed_shift": int(fp16.get("hysteresis", 2)),
            "cur_hysteresis": int(state.get("hysteresis_left", fp16.get("hysteresis", 2))),
            "consecutive_hysteresis": bool(fp16.get("consecutive_hysteresis", False)),
            "raise_error_at_min_scale": True, "dtype": torch.float16})
    scale = float(fp16.get("loss_scale", 1.0)) if dtype == torch.float16 else 1.0
    return _Instance(_LOSS_SCALER, {"cur_scale": scale, "dynamic": False})


class ExportWarning(UserWarning):
    """What the DeepSpeed export changes or leaves out (zerotrain's HFSchedule, which DeepSpeed does not have);
    `zerotrain ckpt export` prints each as one line."""


def _hf_schedule_as_deepspeed(params: dict, state: dict) -> tuple[Optional[dict], int, str]:
    """DeepSpeed's scheduler block that continues HFSchedule `params` (transformers' curve) from `state` with the same
    lr at every later step, and the `last_batch_iteration` to resume it at; (None, 0, why) where there is none.

    transformers' factor f and DeepSpeed's gamma g are functions of a step index; after t optimizer steps the HF
    schedule sets f(t) for the next step, a DeepSpeed one g(last_batch_iteration + 1) after its next step (the
    optimizer state carries the lr of the step in between). linear with warmup W >= 2 is WarmupDecayLR with a linear
    warmup (g = f), constant_with_warmup WarmupLR (g = f), constant (or any warmup already done) WarmupLR from the lr
    to itself; cosine is WarmupCosineLR one index behind (its progress is (i - W + 1) / (T - W), transformers'
    (i - W) / (T - W)), exact only once the warmup is done. DeepSpeed raises a warmup below 2 steps to 2, which
    changes the decay's span: not exact there."""
    name = str(params.get("name", "linear"))
    warmup = int(params.get("num_warmup_steps", 0))
    total = params.get("num_training_steps")
    steps = int(state.get("last_epoch", 0))
    lrs = [float(lr) for lr in state.get("base_lrs") or ()]
    if not lrs:
        return None, 0, "its state holds no learning rates"
    peak: Any = lrs[0] if len(set(lrs)) == 1 else lrs
    linear = {"warmup_min_lr": 0.0, "warmup_max_lr": peak, "warmup_num_steps": warmup, "warmup_type": "linear"}
    if name == "constant" or (name == "constant_with_warmup" and steps >= warmup):
        return {"type": "WarmupLR", "params": dict(linear, warmup_min_lr=peak, warmup_num_steps=2)}, steps, ""
    if warmup < 2:
        return None, 0, (f"its warmup of {warmup} step(s) is below DeepSpeed's shortest (2), which changes the "
                         f"curve")
    if name == "constant_with_warmup":
        return {"type": "WarmupLR", "params": linear}, steps, ""
    if name == "linear" and total is not None:
        return {"type": "WarmupDecayLR", "params": dict(linear, total_num_steps=int(total))}, steps, ""
    if name == "cosine" and total is not None and steps >= warmup:
        return {"type": "WarmupCosineLR", "params": {"total_num_steps": int(total), "warmup_num_steps": warmup,
                                                     "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0,
                                                     "warmup_type": "linear"}}, steps - 1, ""
    return None, 0, (f"DeepSpeed's WarmupCosineLR follows transformers' cosine one step apart, the same lrs only once "
                     f"the warmup is done (saved at step {steps} of its {warmup})" if name == "cosine"
                     else f"DeepSpeed has no {name!r} schedule")


def _hf_block(config: dict) -> Optional[dict]:
    block = config.get("scheduler") or {}
    return block if str(block.get("type", "")).lower() == "hfschedule" else None


def _scheduler(trainer: dict, config: dict) -> tuple[dict, Optional[dict]]:
    """The DeepSpeed config to record (its `scheduler` block converted where it is zerotrain's HFSchedule) and the LR
    scheduler state DeepSpeed's `load_checkpoint` hands to the resumed run's scheduler."""
    state = decode(trainer.get("lr_scheduler")) if trainer.get("lr_scheduler") is not None else None
    if state is None:
        return config, None
    target = (config.get("scheduler") or {}).get("type")
    source = _hf_block(config) or _hf_block(decode(trainer.get("config") or {}) or {})
    if source is None:
        if target in _DS_SCHEDULERS:  # DeepSpeed's own schedulers keep the step index only (i = steps - 1)
            if "last_batch_iteration" in state:
                return config, {"last_batch_iteration": int(state["last_batch_iteration"])}
            return config, {"last_batch_iteration": int(state["last_epoch"]) - 1}
        return config, state
    # zerotrain's HFSchedule, a type DeepSpeed does not have
    block, index, why = _hf_schedule_as_deepspeed(source.get("params") or {}, state)
    if target is None:
        # no scheduler block: the resumed run brings its own, as the HF Trainer under DeepSpeed does
        # (transformers' get_scheduler: a torch LambdaLR, whose state this is with its lambdas' slots)
        lambdas = {"lr_lambdas": [None] * len(state.get("base_lrs") or ())}
        return config, {**{k: v for k, v in state.items() if k != "name"}, **lambdas}
    if target in _DS_SCHEDULERS:
        if block is not None and block == config["scheduler"]:  # the conversion below, given back: continue it
            return config, {"last_batch_iteration": index}
        return config, {"last_batch_iteration": int(state["last_epoch"]) - 1}  # another schedule: from DeepSpeed's start
    if block is None:
        warnings.warn(f"scheduler: HFSchedule {source.get('params', {}).get('name', 'linear')!r} is left out of the "
                      f"DeepSpeed checkpoint: {why}; the resumed run starts its own scheduler", ExportWarning,
                      stacklevel=3)
        return {k: v for k, v in config.items() if k != "scheduler"}, None
    warnings.warn(f"scheduler: HFSchedule {source.get('params', {}).get('name', 'linear')!r} is written as DeepSpeed's "
                  f"{block['type']} (the same lr at every later step): resume with the scheduler block "
                  f"{json.dumps(block)}", ExportWarning, stacklevel=3)
    return dict(config, scheduler=block), {"last_batch_iteration": index}


# --- writing --------------------------------------------------------------------------------------------
def _target_config(config: Union[dict, str, None], trainer: dict) -> dict:
    if isinstance(config, str):
        try:
            with open(config) as handle:
                config = json.load(handle)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{config}: cannot read the DeepSpeed config: {error}") from None
    if config is None:
        config = decode(trainer.get("config") or {}) or {}
    if not isinstance(config, dict):
        raise CheckpointError(f"the DeepSpeed config must be a JSON object, got {type(config).__name__}")
    return config


def export_deepspeed(directory: str, out_dir: str, world_size: int, stage: Optional[int] = None,
                     tag: Optional[str] = None, config: Union[dict, str, None] = None) -> str:
    """Write the zerotrain checkpoint `directory` (a tag directory, or a save directory with `latest`) as a
    DeepSpeed 0.19 checkpoint in `out_dir/<tag>` (with `out_dir/latest`) that DeepSpeed resumes at data-parallel
    world size `world_size`; returns the tag directory.

    `config` (a dict, or a JSON file) is the DeepSpeed config the resumed run uses (default: the checkpoint's):
    the layout follows its `zero_optimization` (`stage`, `round_robin_gradients`, `parameter_alignment`,
    `sub_group_size`) and `gradient_clipping`. `stage` overrides its ZeRO stage (default: the config's, else the
    checkpoint's)."""
    path = resolve(directory, None)
    if path is None:
        raise CheckpointError(f"no checkpoint in {directory}")
    if world_size < 1:
        raise CheckpointError(f"world size must be at least 1, got {world_size}")
    trainer, optimizer_meta, model, masters, states, scalars, trainable = _read_all(path)
    topology = trainer.get("topology") or {}
    config = _target_config(config, trainer)
    if stage is None:
        stage = (config.get("zero_optimization") or {}).get("stage", topology.get("stage", 0))
    stage = int(stage)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"stage {stage}: only DeepSpeed ZeRO checkpoints (stage 1, 2 or 3) are written; "
                              f"pass the stage DeepSpeed will run")
    dtype = torch_dtype(topology["dtype"]) if topology.get("dtype") else next(iter(model.values())).dtype
    if dtype == torch.bfloat16 and stage == 1:
        raise CheckpointError("bf16 at ZeRO stage 1: DeepSpeed trains it with its BF16_Optimizer, whose checkpoint "
                              "layout is not written here; export at stage 2 or 3")
    for key, what in (("tp_size", "tensor"), ("ep_size", "expert")):
        if topology.get(key, 1) not in (1, None):
            raise CheckpointError(f"{path} was written with {what} parallelism ({key} {topology[key]}); only "
                                  f"data-parallel ZeRO is exported (DeepSpeed keeps those in other files)")
    groups = _groups(trainer, optimizer_meta, trainable, path)
    hyper = [_hyper(group) for group in (optimizer_meta.get("param_groups") or [{}])]
    shared = dict(trainer.get("shared_params") or {})
    buffers = [name for name in trainer.get("buffer_names", []) if name in model]
    frozen = [name for name in model if name not in trainable and name not in buffers]
    if "buffer_names" not in trainer:  # an older checkpoint: every non-trainable tensor is taken for a buffer
        buffers, frozen = frozen, []
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = stage
    ds_config, lr_scheduler = _scheduler(trainer, dict(config, zero_optimization=zero))
    tag = str(tag or trainer.get("tag") or os.path.basename(os.path.normpath(path)))

    out_dir = os.path.abspath(out_dir)
    final = os.path.join(out_dir, tag)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists: export into a new directory or another tag")
    os.makedirs(out_dir, exist_ok=True)
    with commit.StagedDirectory(final) as staged:
        temp = staged.path
        if stage <= 2 and zero.get("round_robin_gradients"):  # the flat groups (and param_shapes) reordered
            groups = [_round_robin(names, world_size) for names in groups]
        common = _model_states(trainer, model, groups, shared, buffers, frozen, ds_config, lr_scheduler, world_size)
        prefix = "bf16_" if dtype == torch.bfloat16 else ""
        loss_scaler = _loss_scaler(trainer, config, dtype)
        if stage <= 2:
            module = OrderedDict((name, tensor) for name, tensor in _module_order(model, shared))
            _save(dict(common, module=module, frozen_param_fragments=_frozen_whole(model, frozen) if stage == 2
                       else None, frozen_param_shapes=common["frozen_param_shapes"] if stage == 2 else None),
                  os.path.join(temp, "mp_rank_00_model_states.pt"))
            ranks = _stage12_optimizer(groups, hyper, masters, states, scalars, world_size,
                                       bool(zero.get("parameter_alignment", False)), dtype, stage, loss_scaler,
                                       float(config.get("gradient_clipping", _GRADIENT_CLIPPING_DEFAULT)))
        else:
            sub_group_size = int(float(zero.get("sub_group_size", 1e9)))
            for rank in range(world_size):
                module = OrderedDict()
                for name, tensor in _module_order(model, shared):  # DeepSpeed saves (and loads) every
                    # parameter partitioned, its persistent ones too (checkpoint_event_prologue): empty here
                    module[name] = tensor if name in buffers else torch.empty(0, dtype=tensor.dtype)
                fragments = OrderedDict((name, _stage3_piece(model[name], rank, world_size)) for name in frozen)
                _save(dict(common, module=module, frozen_param_fragments=fragments),
                      os.path.join(temp, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
            ranks = _stage3_optimizer(groups, hyper, masters, states, scalars, world_size, sub_group_size,
                                      {n: model[n].numel() for n in trainable}, loss_scaler)
        for rank, optimizer_state in enumerate(ranks):
            _save({"optimizer_state_dict": optimizer_state, "ds_config": ds_config, "ds_version": DEEPSPEED_VERSION},
                  os.path.join(temp, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        staged.commit(latest=True)
    return final


def _module_order(model: OrderedDict, shared: dict):
    """The module state dict DeepSpeed saves: every name (tied aliases too, after the tensor they share)."""
    for name, tensor in model.items():
        yield name, tensor
        for alias, source in shared.items():
            if source == name and alias not in model:
                yield alias, tensor


def _frozen_whole(model: OrderedDict, frozen: list) -> OrderedDict:
    return OrderedDict((name, model[name]) for name in frozen)


def _model_states(trainer: dict, model: OrderedDict, groups: list, shared: dict, buffers: list, frozen: list,
                  ds_config: dict, lr_scheduler: Optional[dict], world_size: int) -> dict:
    client = decode(trainer.get("client_state") or {}) or {}
    steps = int(trainer.get("global_steps", 0))
    state = dict(  # DeepSpeed's key order (`_common_checkpoint_state`); module and fragments are set per file
        module=None,
        buffer_names=list(buffers),
        optimizer=None,
        param_shapes=[OrderedDict((name, model[name].shape) for name in names) for names in groups],
        frozen_param_shapes=OrderedDict((name, model[name].shape) for name in frozen),
        shared_params=dict(shared),
        frozen_param_fragments=None,
        lr_scheduler=lr_scheduler,
        data_sampler=None, random_ltd=None,
        skipped_steps=int(trainer.get("skipped_steps", 0)), global_steps=steps,
        global_samples=int(trainer.get("global_samples", 0)),
        dp_world_size=world_size, mp_world_size=1,
        checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
        ds_config=ds_config, ds_version=DEEPSPEED_VERSION)
    clash = sorted(set(client) & set(state))
    if clash:
        raise CheckpointError(f"the client state's key {clash[0]!r} is one of DeepSpeed's own checkpoint keys")
    state.update(client)
    return state


def _round_robin(names: list, world: int) -> list:
    """DeepSpeed's `_round_robin_reorder` (zero_optimization.round_robin_gradients): the i-th parameter goes to
    list i % world, the lists concatenated."""
    return [name for start in range(min(world, len(names))) for name in names[start::world]]


def _slice_mappings(names: list, numels: list, paddings: list, left: int, size: int) -> OrderedDict:
    """`param_slice_mappings` of the partition [left, left + size): each parameter's piece in it."""
    out, offset = OrderedDict(), 0
    for name, numel, pad in zip(names, numels, paddings):
        start, end = max(offset, left), min(offset + numel, left + size)
        if start < end:
            out[name] = _Instance(_FRAGMENT_ADDRESS, {"numel": end - start, "start": start - left})
        offset += numel + pad
    return out


def _stage12_optimizer(groups, hyper, masters, states, scalars, world, parameter_alignment, dtype, stage,
                       loss_scaler, clip_grad) -> list:
    element = torch.tensor([], dtype=dtype).element_size()
    alignment = 16 // math.gcd(16, element) if parameter_alignment else 1
    per_rank = [{"fp32": [], "padding": [], "state": {}, "mappings": []} for _ in range(world)]
    all_paddings = []
    for g, names in enumerate(groups):
        paddings = _param_paddings([masters[n].numel() for n in names], alignment)
        all_paddings.append(paddings)
        fp32, used = _stage12_partitions([masters[n] for n in names], paddings, world)
        keys = sorted({key for n in names for key in states.get(n, {})})
        flats = {key: _stage12_partitions([states[n][key] if key in states.get(n, {}) else torch.zeros_like(masters[n])
                                           for n in names], paddings, world)[0] for key in keys}
        group_scalars = _scalar_states(scalars, names)
        size = fp32[0].numel()
        for rank in range(world):
            left = rank * size
            padding = size if used <= left else (left + size - used if used < left + size else 0)
            per_rank[rank]["fp32"].append(fp32[rank][:size - padding].clone())
            per_rank[rank]["padding"].append(padding)
            per_rank[rank]["mappings"].append(_slice_mappings(names, [masters[n].numel() for n in names], paddings,
                                                              left, size))
            if keys or group_scalars:
                per_rank[rank]["state"][g] = {**{k: v.clone() for k, v in group_scalars.items()},
                                              **{key: flats[key][rank].float() for key in keys}}
    out = []
    for rank in range(world):
        base = {"state": per_rank[rank]["state"],
                "param_groups": [dict(hyper[g], params=[g]) for g in range(len(groups))]}
        out.append({"loss_scaler": loss_scaler, "dynamic_loss_scale": loss_scaler.cls is _DYNAMIC_LOSS_SCALER,
                    "overflow": False, "clip_grad": clip_grad, "base_optimizer_state": base,
                    "single_partition_of_fp32_groups": per_rank[rank]["fp32"],
                    "zero_stage": _Instance(_ZERO_STAGE, value=stage), "group_paddings": per_rank[rank]["padding"],
                    "param_alignment_paddings": all_paddings, "partition_count": [world] * len(groups),
                    "ds_version": DEEPSPEED_VERSION, "param_slice_mappings": per_rank[rank]["mappings"]})
    return out


def _stage3_optimizer(groups, hyper, masters, states, scalars, world, sub_group_size, numels, loss_scaler) -> list:
    out = []
    subs = [_sub_groups(names, numels, world, sub_group_size) for names in groups]
    for rank in range(world):
        flats, state, param_groups, index = [], {}, [], 0
        for g, group_subs in enumerate(subs):
            ids = []
            for names in group_subs:
                flats.append(torch.cat([_stage3_piece(masters[n], rank, world) for n in names]))
                keys = sorted({key for n in names for key in states.get(n, {})})
                entry = {k: v.clone() for k, v in _scalar_states(scalars, names).items()}
                for key in keys:
                    entry[key] = torch.cat([_stage3_piece(states[n][key] if key in states.get(n, {}) else
                                                          torch.zeros_like(masters[n]), rank, world).float()
                                            for n in names])
                if entry:
                    state[index] = entry
                ids.append(index)
                index += 1
            param_groups.append(dict(hyper[g], params=ids))
        out.append({"zero_stage": _Instance(_ZERO_STAGE, value=3), "loss_scaler": loss_scaler,
                    "dynamic_loss_scale": loss_scaler.cls is _DYNAMIC_LOSS_SCALER, "overflow": False,
                    "partition_count": world,
                    "optimizer_state_dict": {"state": state, "param_groups": param_groups},
                    "fp32_flat_groups": flats})
    return out


__all__ = ["export_deepspeed", "DEEPSPEED_VERSION"]
