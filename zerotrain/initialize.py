"""`zerotrain.initialize`: config, process group, engine, data loader — in that order.

The config is read and checked before any process-group work starts, so a bad
file fails fast on every rank with a message naming the key.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from .cluster import adopt_cluster_ranks
from .config import ConfigError, load_config
from .config.base import job_rank
from .config.batch import GAS, MICRO, TBS
from .parallel import apply_tensor_parallel, tensor_parallel_comm
from .parallel.autotp import resolve_plan
from .parallel.sequence import check_sequence_parallel
from .engine import OptimizerLike, ZeroTrainEngine
from .lifecycle import die_with_parent, under_torchrun
from .pipe import (PipelineEngine, PipelineModule, check_pipeline_config, pipeline_model, pipeline_size,
                   prepare_pipeline)
from .topology import Topology
from .zero import GatheredParameters
from .zero.stage3 import check_init_partitions


def _dp_size_hint() -> int:
    """The data-parallel size this job will have, known before any process group exists."""
    if dist.is_initialized():
        return dist.get_world_size()
    # The same rule as topology.init_distributed: a launcher world needs both RANK and WORLD_SIZE.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


# DeepSpeed's initialize() keywords that do nothing here: a warning names them when given a value that
# would change DeepSpeed's behaviour (value -> why). Anything else unknown is a TypeError.
_IGNORED_DEEPSPEED_KEYWORDS = {
    "distributed_port": "the rendezvous port comes from the launcher (MASTER_PORT)",
    "mpu": "model parallelism comes from the config's tensor_parallel block",
    "mesh_param": "the data/sequence/tensor grid comes from the config (sequence_parallel_size, tensor_parallel)",
    "dist_init_required": "zerotrain starts torch.distributed when it is not running yet",
}


def _check_keywords(unused: dict) -> None:
    """A misspelt keyword is a TypeError naming it (with the closest known name); DeepSpeed's keywords
    without effect here are a warning naming them (global rank 0 only)."""
    import difflib
    import inspect
    import warnings

    known = [n for n in inspect.signature(initialize).parameters if n != "unused"] + list(_IGNORED_DEEPSPEED_KEYWORDS)
    for name in unused:
        if name not in _IGNORED_DEEPSPEED_KEYWORDS:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; it accepts {sorted(known)}"
            raise TypeError(f"zerotrain.initialize() got an unexpected keyword argument {name!r}{hint}")
    if job_rank() != 0:
        return  # once per job, as the config's warnings: every rank is given the same keywords
    for name, value in unused.items():
        if value is None or (name == "dist_init_required" and value is True):
            continue  # what zerotrain does anyway
        warnings.warn(f"zerotrain.initialize({name}=...) has no effect: {_IGNORED_DEEPSPEED_KEYWORDS[name]}",
                      stacklevel=3)


def _refuse_deepspeed_partitions(model: torch.nn.Module) -> None:
    """A model that DeepSpeed's own `deepspeed.zero.Init` partitioned (its parameters hold 0 elements, the
    values sit in DeepSpeed's `ds_tensor` shards) cannot be trained here: say so at once, not as a shape
    error deep in the engine. transformers' `from_pretrained` builds under it whenever `HfDeepSpeedConfig` (or
    the HF Trainer's DeepSpeed path) is active and the deepspeed package is installed."""
    for name, param in model.named_parameters():
        if "ds_tensor" in vars(param):  # DeepSpeed's attribute on the parameters it partitioned (not ours)
            raise ValueError(
                f"zerotrain.initialize: parameter {name} was partitioned by DeepSpeed's deepspeed.zero.Init "
                f"(it holds {param.numel()} of its {vars(param).get('ds_numel', '?')} elements here; DeepSpeed keeps "
                "them in its own shards, which zerotrain cannot adopt). Build the model under zerotrain.zero.Init "
                "(or without it) instead; for transformers' from_pretrained drop HfDeepSpeedConfig / "
                "is_deepspeed_zero3_enabled and use zerotrain.from_pretrained (docs/porting.md; `zerotrain port` "
                "rewrites these imports)")


def _check_trainable(model: torch.nn.Module, model_parameters: Optional[Iterable], optimizer: OptimizerLike
                     ) -> Optional[list]:
    """`model_parameters` as a list; a ConfigError (one line under the launchers) when it (or a ready torch
    optimizer's groups) holds none of the model's parameters that require grad: every one would stay frozen and
    the run would train nothing."""
    if model_parameters is not None:  # a generator is read once: kept as a list (group dicts' params too)
        model_parameters = [dict(item, params=[item["params"]] if isinstance(item["params"], torch.Tensor)
                                 else list(item["params"])) if isinstance(item, dict) and "params" in item else item
                            for item in model_parameters]
        groups = model_parameters
    elif isinstance(optimizer, torch.optim.Optimizer):
        groups = optimizer.param_groups
    else:
        return None
    given: set[int] = set()
    for item in groups:
        params = item.get("params", []) if isinstance(item, dict) else [item]
        params = [params] if isinstance(params, torch.Tensor) else params
        given.update(id(p) for p in params)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if trainable and not any(id(p) in given for p in model.parameters() if p.requires_grad):
        what = "model_parameters" if model_parameters is not None else "the optimizer's param_groups"
        held = f"holds {len(given)} tensors, none of them" if given else "is empty: none of"
        pipeline = (" A PipelineModule builds its stage's layers at construction only when torch.distributed is "
                    "already up: call deepspeed.init_distributed() / zerotrain.init_distributed() before "
                    "building it." if isinstance(model, PipelineModule) else "")
        raise ConfigError(f"zerotrain.initialize: {what} {held} the model's {len(trainable)} parameters that "
                         f"require grad ({', '.join(trainable[:3])}{', ...' if len(trainable) > 3 else ''}), so "
                         f"every one would stay frozen and nothing would train. Pass the model's own parameters "
                         f"(built before the list is made) or leave model_parameters out.{pipeline}",
                          key="model_parameters")
    return model_parameters


def _config_from_args(args: Any) -> Any:
    """`args.zerotrain_config`, `args.deepspeed_config` or (deprecated) `args.deepscale_config`: the paths
    `add_config_arguments` adds; two different ones are an error."""
    paths = {name: getattr(args, name, None) for name in ("zerotrain_config", "deepspeed_config", "deepscale_config")}
    given = {name: path for name, path in paths.items() if path is not None}
    if len(set(map(str, given.values()))) > 1:
        raise ValueError(f"initialize(args=...): {sorted(given)} name different config files; give one")
    return next(iter(given.values()), None)


def initialize(model: torch.nn.Module = None, config: Union[dict, str, os.PathLike, None] = None,
               model_parameters: Optional[Iterable] = None, optimizer: OptimizerLike = None,
               lr_scheduler: Any = None, training_data: Optional[Dataset] = None,
               collate_fn: Optional[Callable] = None, config_params: Optional[dict] = None,
               tensor_parallel_plan: Optional[dict] = None, args: Any = None,
               **unused: Any) -> tuple[ZeroTrainEngine, torch.optim.Optimizer, Optional[DataLoader], Any]:
    """Build the engine; returns (engine, optimizer, dataloader or None, lr_scheduler or None).

    `config` is a dict or a path to a (DeepSpeed-style) JSON file; `config_params`
    is DeepSpeed's older name for it, and `args` (an argparse namespace from a parser given to
    `zerotrain.add_config_arguments`) may carry the path instead; `args.local_rank` is set to this
    process's local rank, as DeepSpeed does. `optimizer` may be a torch optimizer over the
    model's parameters or a callable building one from parameter groups. With no optimizer passed and
    no `optimizer` block in the config the engine is forward-only (ZeRO-Inference, docs/inference.md):
    no gradients, masters or optimizer states; `backward`/`step` raise; the optimizer returned is None.
    With `tensor_parallel.autotp_size` > 1 the model is split by `tensor_parallel_plan`
    (module-name pattern → `zerotrain.parallel.Column/Row/Vocab`, or transformers' style strings)
    or, without one, by the model's own plan (zerotrain's GPT; a Hugging Face model's
    `config.base_model_tp_plan`) or a plan inferred from its linear layers
    (`zerotrain.parallel.autotp`), and ZeRO shards across the data-parallel groups of the grid.
    An unknown keyword is a TypeError; DeepSpeed's `distributed_port`, `mpu`, `mesh_param` and
    `dist_init_required` are accepted with a warning (rank 0 only) when they would change anything.
    """
    _check_keywords(unused)
    if not dist.is_initialized():
        adopt_cluster_ranks()  # mpirun / srun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR before anything reads them
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zerotrain.initialize needs model= a torch.nn.Module, got {type(model).__name__} "
                        "(pass arguments by keyword: its first positional parameter is the model, not args)")
    _refuse_deepspeed_partitions(model)
    if config is None:
        config = config_params
    from_args = _config_from_args(args) if args is not None else None
    if config is not None and from_args is not None:
        raise ValueError("zerotrain.initialize got both config= and a config path in args; give one")
    if config is None:
        config = from_args
    if config is None:
        raise ValueError("zerotrain.initialize needs a config (config= a dict or a path to a JSON file, or "
                         "args with --deepspeed_config / --zerotrain_config)")
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = _dp_size_hint()
    try:
        cfg = load_config(config)
    except ConfigError as err:
        if err.key not in (TBS, MICRO, GAS):
            raise
        # The data-parallel size also depends on tensor_parallel; name the world size this job has.
        raise ConfigError(f"{err}; this job has world size {world}", key=err.key, file=err.file) from None
    tp_size = int(cfg.tensor_parallel.autotp_size)
    sp_size = int(cfg.sequence_parallel_size)
    model = pipeline_model(model, int(cfg.pipeline_parallel_size))  # a Hugging Face LM split (pipe.hf)
    pp_size = pipeline_size(model, cfg)  # a PipelineModule's num_stages (docs/pipeline.md)
    if isinstance(model, PipelineModule):
        check_pipeline_config(model, cfg, world)
        world //= pp_size  # below: the ranks of one pipeline stage
    if world % tp_size:
        raise ConfigError(f"tensor_parallel.autotp_size: {tp_size} does not divide the world size {world}",
                          key="tensor_parallel.autotp_size")
    if world % (tp_size * sp_size):
        raise ConfigError(f"sequence_parallel_size: {sp_size} x tensor_parallel.autotp_size: {tp_size} does not "
                          f"divide the world size {world}", key="sequence_parallel_size")
    # the batch triple counts data-parallel ranks (sequence-parallel ranks share their samples)
    cfg = load_config(cfg, dp_world_size=world // (tp_size * sp_size))
    if tp_size > 1:  # before any process group: a model that cannot be split fails fast
        tensor_parallel_plan = resolve_plan(model, tp_size, tensor_parallel_plan)
        # ZeRO shards over a stage's world / tp ranks (Topology's dp_size). Checked before the groups exist: a
        # rank that refused after creating them could exit while a slower peer still connects (gloo: "closed by peer").
        check_init_partitions(model, world // tp_size)
    check_sequence_parallel(model, sp_size, tp_size)
    if under_torchrun() and os.environ.get("ZEROTRAIN_DIE_WITH_PARENT", "1") != "0":
        die_with_parent()  # an orphaned rank must not train on into the directory a restart resumes from
    topology = Topology.build(timeout_seconds=cfg.comm_timeout_seconds, tp_size=tp_size,
                              same_host_transport=cfg.comm_same_host_transport, sp_size=sp_size, pp_size=pp_size)
    plan = prepare_pipeline(model, cfg, topology) if isinstance(model, PipelineModule) else None
    if tp_size > 1:
        # Layers built under zero.Init are gathered one at a time to be sliced (the slices are plain tensors
        # again, which the engine partitions over the data-parallel group like any other parameter).
        apply_tensor_parallel(model, tensor_parallel_plan, tensor_parallel_comm(topology), whole=GatheredParameters)
    if optimizer is not None or cfg.optimizer is not None:  # a forward-only engine trains nothing by design
        model_parameters = _check_trainable(model, model_parameters, optimizer)
    # the engine sizes the keys left unset from the memory budget (zerotrain.budget) and refuses a run that cannot fit
    engine = ZeroTrainEngine(model, cfg, topology, model_parameters=model_parameters,
                             optimizer=optimizer, lr_scheduler=lr_scheduler)
    dataloader = engine.use_training_data(training_data, collate_fn) if training_data is not None else None
    if plan is not None:  # DeepSpeed's PipelineEngine: train_batch / eval_batch over the ZeRO engine
        pipe = PipelineEngine(engine, plan, training_data=training_data, collate_fn=collate_fn)
        # DeepSpeed returns the pipeline engine's own loader (repeating, in order) on the first and last stage
        loader = pipe.training_dataloader if pipe.training_dataloader is not None else dataloader
        return pipe, engine.optimizer, loader, engine.lr_scheduler
    return engine, engine.optimizer, dataloader, engine.lr_scheduler
