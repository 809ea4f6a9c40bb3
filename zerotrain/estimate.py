"""`zerotrain estimate`: the memory each rank needs, per ZeRO stage and offload choice, before a run.

DeepSpeed's `estimate_zero2_model_states_mem_needs_all_live` / `..._zero3_...` count model states
with round per-parameter factors (e.g. stage 3, no offload: 18 bytes per parameter / N on the device,
a largest layer of 4 bytes per element, a 1.5x host margin). They know neither zerotrain's buckets and
their padding, nor its rules for when an fp32 shard is its own master, nor where its offload keeps the
masters, nor activations. This module computes what zerotrain's engine will hold, byte for byte, from
the same rules the engine follows (`tests/test_estimate.py` checks it against `engine.memory_report()`):

- stages 0-2 (`zero.flat.build_buckets`): trainable parameters in reverse registration order, packed
  into buckets of at most `reduce_bucket_size` elements, each padded to a multiple of the partitions
  (1 at stage 0, the data-parallel size at stages 1-2); every rank holds the whole padded buffer;
- stage 3 (`zero.stage3.partition`): each parameter padded and cut on its own; parameters of at most
  `stage3_param_persistence_threshold` elements also stay whole on every rank;
- gradients (after backward): stages 0-1 a full buffer in the training dtype plus the reduced fp32 gradient
  held until the step (stage 1: the shard; stage 0: none in fp32, where it is the buffer, else its fp32
  cast), stage 2 (and 3) the fp32 shard;
- masters: an fp32 shard in device memory is its own master (no copy); any other shard (bf16/fp16, an
  offloaded one) gets a 4-byte copy, on the host when `offload_optimizer` moves the bucket there
  (`offload.cpu_optimizer.choose_offloaded` with `ratio`), in NVMe files with `device: nvme`;
- optimizer states: measured by one step of the config's own optimizer (`optim.build_optimizer`) on a
  two-element tensor: bytes per element (Adam: 8) plus bytes per master tensor (Adam's `step`: 4);
- activations: the model's own forward run on the meta device with a `saved_tensors_hooks` that adds up
  what autograd keeps for backward (parameters excluded), with and without activation checkpointing
  of its repeated blocks. Attention is counted as the math kernel saves it (on a GPU, flash/efficient
  kernels save less), so the number is an upper bound there.

The model is built on the meta device (`torch.device("meta")`): nothing is allocated, a 70B model
estimates in seconds.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

__all__ = ["ModelShape", "Option", "RankMemory", "Activations", "load_meta_model", "model_shape",
           "estimate_option", "default_options", "estimate", "measure_activations", "format_bytes",
           "parse_bytes", "split_tensor_parallel", "shape_comm", "ModelFamily"]

PLACES = ("device", "host", "nvme")
ROWS = ("parameters", "gradients", "loco_errors", "master_weights", "optimizer_states", "buffers", "host_io_buffers")


@dataclass
class ParamInfo:
    """One parameter of the model, as the engine sees it (registration order, duplicates removed)."""
    name: str
    numel: int
    trainable: bool
    floating: bool = True
    expert: bool = False  # a split expert (`ep_slice`): partitioned over its expert-data-parallel group


@dataclass
class ModelShape:
    """What the estimate needs of a model: its parameters in registration order and its buffers' bytes."""
    params: list[ParamInfo]
    buffer_numels: list[tuple[int, bool]]  # (numel, floating) of every module buffer
    name: str = "model"
    ep_size: int = 1  # ranks the split experts are spread over (1: no expert parallelism)
    # a tied parameter's other names (`named_parameters(remove_duplicate=False)`): (the name kept in `params`, the
    # numel) once per other name. Built under zero.Init, each of those modules had its own weight, partitioned
    # (and, with offload_param on NVMe, written) before the tie replaced it (`nvme_files_peak`)
    tied_copies: tuple = ()

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def buffer_bytes(self, dtype: torch.dtype) -> int:
        """Buffers the engine casts to the training dtype (floating ones) or keeps (others: 8 bytes, int64)."""
        return sum(n * (dtype.itemsize if floating else 8) for n, floating in self.buffer_numels)


def model_shape(model: torch.nn.Module, name: str = "model") -> ModelShape:
    """The parameters (`named_parameters()`: tied weights once) and buffers of `model` (any device), as this
    rank holds them: a tensor-parallel model's split layers (`split_tensor_parallel`) count their slices, split
    experts (`ExpertParallelMoE`) this rank's experts, and `ep_size` says over how many ranks they are split."""
    from .parallel.experts import expert_parallel_size, is_split_expert

    params = [ParamInfo(n, p.numel(), p.requires_grad, p.is_floating_point(), is_split_expert(p))
              for n, p in model.named_parameters()]
    first = {id(p): n for n, p in model.named_parameters()}
    tied = tuple((first[id(p)], p.numel()) for n, p in model.named_parameters(remove_duplicate=False)
                 if first[id(p)] != n)
    buffers = [(b.numel(), b.is_floating_point()) for b in model.buffers()]
    return ModelShape(params, buffers, name, expert_parallel_size(model), tied)


def load_meta_model(spec: str, dtype: torch.dtype = torch.float32, layers: Optional[int] = None,
                    width: Optional[int] = None, multiple: int = 1) -> tuple[torch.nn.Module, str]:
    """Build the model `spec` names on the meta device (no weights allocated); returns (model, kind).

    `spec`: a zerotrain GPT preset (`tiny`, `small`, `70m`), a Hugging Face model directory (its
    config.json) or a config.json file. kind is "gpt" or "hf". `layers` / `width` replace its depth /
    hidden size (a width should be a multiple of the head count; the MLP and head sizes scale along, the
    MLP's rounded to a multiple of `multiple`: the tensor-parallel size, which must divide it)."""
    kind, config = _architecture(spec)
    if layers is not None or width is not None:
        config = _resized(kind, config, layers, width, multiple)
    with torch.device("meta"):
        if kind == "gpt":
            from .models import GPT
            model = GPT(config)
        else:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype), kind


def _architecture(spec: str):
    """("gpt", GPTConfig) for a preset, ("hf", transformers config) for a model directory or config.json."""
    from .models import PRESETS, GPTConfig

    if spec in PRESETS:
        return "gpt", GPTConfig.preset(spec)
    path = Path(spec)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"--model {spec!r}: not a GPT preset ({known}), nor a model directory with a "
                         f"config.json, nor a config.json file")
    try:
        from transformers import AutoConfig
    except ImportError as exc:  # pragma: no cover - transformers is in the dev and hf extras
        raise ValueError(f"--model {spec!r}: reading a Hugging Face config needs `transformers` "
                         f"(pip install zerotrain[hf])") from exc
    try:
        json.loads(config_file.read_text(encoding="utf-8"))
        return "hf", AutoConfig.from_pretrained(str(config_file))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file}: not a Hugging Face model config: {exc}") from None


def _depth_width(kind: str, config) -> tuple[int, int, int]:
    """(layers, hidden size, head count) of an architecture."""
    if kind == "gpt":
        return config.n_layer, config.n_embd, config.n_head
    return config.num_hidden_layers, config.hidden_size, config.num_attention_heads


def _resized(kind: str, config, layers: Optional[int], width: Optional[int], multiple: int = 1):
    import copy
    import dataclasses

    depth, hidden, heads = _depth_width(kind, config)
    layers = depth if layers is None else layers
    width = hidden if width is None else max(heads, width // heads * heads)
    if kind == "gpt":
        inner = None if config.n_inner is None else \
            max(multiple, config.n_inner * width // hidden // multiple * multiple)
        return dataclasses.replace(config, n_layer=layers, n_embd=width, n_inner=inner)
    config = copy.deepcopy(config)
    if getattr(config, "head_dim", None) == hidden // heads:  # the default head size follows the width
        config.head_dim = width // heads
    if getattr(config, "intermediate_size", None):
        config.intermediate_size = max(multiple, config.intermediate_size * width // hidden // multiple * multiple)
    config.num_hidden_layers, config.hidden_size = layers, width
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (Qwen, Gemma)
        config.layer_types = (config.layer_types * layers)[:layers]
    return config


def split_tensor_parallel(model: torch.nn.Module, tp_size: int) -> torch.nn.Module:
    """Split `model` in place as `initialize` does at `tensor_parallel.autotp_size` = `tp_size` (its own plan:
    zerotrain's GPT's, a Hugging Face model's `base_model_tp_plan`, or the inferred one; `parallel.autotp`),
    as tensor-parallel rank 0 of a shapes-only group: each planned layer keeps its slice, the rest stays whole.
    A meta model's forward then keeps what one tensor-parallel rank keeps."""
    if tp_size <= 1:
        return model
    from .models import GPT
    from .parallel import apply_tensor_parallel, resolve_plan

    if isinstance(model, GPT) and model.config.n_head % tp_size:  # (a rank must hold whole heads)
        raise ValueError(f"tensor_parallel.autotp_size {tp_size} does not divide the GPT's n_head = "
                         f"{model.config.n_head}: each tensor-parallel rank must hold whole attention heads")
    from .comm import ShapeOnlyComm

    apply_tensor_parallel(model, resolve_plan(model, tp_size), ShapeOnlyComm(tp_size))
    return model


# --- what each option holds ------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One way to run: a ZeRO stage and where optimizer states and (stage 3) parameters live."""
    stage: int
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (stage 3 only)

    @property
    def label(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params->{self.offload_param}")
        return " ".join(parts)


@dataclass
class RankMemory:
    """Bytes one rank holds between steps (gradients: after backward), by row and place."""
    option: Option
    rows: dict[str, dict[str, int]] = field(default_factory=lambda: {r: dict.fromkeys(PLACES, 0) for r in ROWS})
    transient: dict[str, int] = field(default_factory=dict)  # device bytes that exist during a step only
    notes: list[str] = field(default_factory=list)
    # bytes the NVMe swap files take on disk: the rows' nvme bytes plus alignment, equal-chunk padding and the
    # optimizer's spare records (offload.nvme_records)
    nvme_files: int = 0
    # their peak on disk, from zero.Init on: with offload_param on NVMe, zero.Init writes each module's weights as
    # the module is built, so a weight a tie replaces afterwards (an untouched head tied to the embedding) holds
    # its extent in the parameter file until initialize drops it, before the optimizer's files exist
    nvme_files_peak: int = 0
    # stage 3, one micro-step per step: the device gradient shards are made during backward (as its activations are
    # freed) and freed after the step, so they and the activations peak at opposite ends of backward (device_peak)
    gradients_made_in_backward: bool = False
    # a CPU run whose clip takes the norm from a first backward: the parameter cache's bytes (max_in_cpu chosen by
    # the budget) that give way to the micro-batch's activations kept through it (`budget.FirstPassReserve`)
    first_pass_cache: int = 0

    def add(self, row: str, place: str, nbytes: int) -> None:
        self.rows[row][place] += int(nbytes)

    def total(self, place: str) -> int:
        return sum(row[place] for row in self.rows.values())

    def as_dict(self) -> dict:
        return {"option": self.option.label, "stage": self.option.stage,
                "offload_optimizer": self.option.offload_optimizer, "offload_param": self.option.offload_param,
                "rows": self.rows, "totals": {place: self.total(place) for place in PLACES},
                "transient": self.transient, "notes": self.notes, "nvme_files": self.nvme_files,
                "nvme_files_peak": max(self.nvme_files, self.nvme_files_peak),
                "gradients_made_in_backward": self.gradients_made_in_backward,
                "first_pass_cache": self.first_pass_cache}


@dataclass
class OptimizerState:
    """Bytes of optimizer state per element of a master and per master tensor."""
    per_element: int
    per_tensor: int
    name: str = "optimizer"


def probe_optimizer(opt_config) -> OptimizerState:
    """Step the config's optimizer once (as `zerotrain.optim` builds it) over a 2-element fp32 tensor and
    read what it keeps: per-element states (Adam: exp_avg, exp_avg_sq) and per-tensor ones (Adam: step).
    A config without an optimizer block is estimated with AdamW (what the HF Trainer passes)."""
    from .config import OptimizerConfig
    from .optim import build_optimizer

    if opt_config is None:  # no `optimizer` block: the HF Trainer passes AdamW (torch's) to initialize
        opt_config = OptimizerConfig(type="AdamW", params={})
    dummy = torch.zeros(2, requires_grad=True)
    optimizer = build_optimizer(opt_config, [{"params": [dummy]}])
    dummy.grad = torch.ones(2)
    optimizer.step()
    per_element = per_tensor = 0
    for value in optimizer.state[dummy].values():
        if torch.is_tensor(value):
            if tuple(value.shape) == (2,):
                per_element += value.element_size()
            else:
                per_tensor += value.numel() * value.element_size()
    return OptimizerState(per_element, per_tensor, type(optimizer).__name__)


def _offloaded(shards: list[int], ratio: float) -> list[bool]:
    from .offload.cpu_optimizer import choose_offloaded  # the engine's own rule for `ratio`

    class _Shard:
        def __init__(self, numel: int) -> None:
            self.shard_numel = numel
    return choose_offloaded([_Shard(n) for n in shards], ratio)


def estimate_option(shape: ModelShape, config, dp_size: int, option: Option, optimizer: OptimizerState,
                    device_type: str = "cuda", ranks_per_node: Optional[int] = None) -> RankMemory:
    """Bytes per rank of `shape` trained with `config` (dtype, buckets, thresholds, offload and ZeRO++ settings)
    at `dp_size` ZeRO ranks (data-parallel x sequence-parallel: Ulysses' ranks share partitions; with tensor
    parallelism world / tp, and `shape` one tensor-parallel rank's slices) under `option`; `device_type` "cuda"
    or "cpu" (a CPU run keeps no separate host copies of what already is in host memory). Split experts
    (`shape.ep_size` > 1) are partitioned over their expert-data-parallel group of dp_size / ep_size ranks, in
    buckets of their own. `ranks_per_node`: ZeRO ranks per node (qgZ's two hops across nodes; None: one node)."""
    from .offload.aio import round_up
    from .precision import training_dtype
    from .zero.flat import bucket_layout, padded_numel

    zero = config.zero_optimization
    dtype = training_dtype(config.precision)
    d = dtype.itemsize
    memory = RankMemory(option)
    trainable = [p for p in shape.params if p.trainable]
    frozen = [p for p in shape.params if not p.trainable]
    expert_ranks = max(1, dp_size // max(1, shape.ep_size))  # the expert-data-parallel group

    def size(p: ParamInfo) -> int:  # the engine casts floating parameters only
        return d if p.floating else 4

    def ranks(p: ParamInfo) -> int:  # the ranks a parameter's ZeRO group spans
        return expert_ranks if p.expert else dp_size
    memory.add("buffers", "device", shape.buffer_bytes(dtype))

    offload_opt = option.offload_optimizer
    ratio = float(zero.offload_optimizer.ratio) if zero.offload_optimizer is not None else 1.0
    # (shard elements, ranks of its group, dense?) of every reduce of the gradient reducer: qgZ's LoCo buffers
    reduces: list[tuple[int, int, bool]] = []
    in_store: list[bool] = []  # stage 3: whether each shard lives in the NVMe parameter file
    if option.stage < 3:
        buckets, shards, reduced_own = [], [], []
        for members, group, dense in (([p for p in trainable if not p.expert], dp_size, True),
                                      ([p for p in trainable if p.expert], expert_ranks, False)):
            partitions = group if option.stage >= 1 else 1  # zero.flat.build_sharded_buckets / ShardGroup.over
            # the engine's own packing (one dtype and optimizer group here: only the size limit closes a bucket)
            for bucket in bucket_layout([(p.numel, None) for p in members], int(zero.reduce_bucket_size)):
                buckets.append(padded_numel(sum(members[i].numel for i in bucket), partitions))
                shards.append(buckets[-1] // partitions)
                reduces.append((shards[-1], group, dense))
                # stages 0-1 (zero.grads.FullBufferReducer): the reduced gradient is the fp32 buffer itself only
                # when it was all-reduced in place (stage 0) or not reduced at all (experts alone in their group)
                reduced_own.append(not (d == 4 and (option.stage == 0 or (not dense and group == 1))))
        memory.add("parameters", "device", sum(buckets) * d + sum(p.numel * size(p) for p in frozen))
        if option.stage <= 1:
            memory.add("gradients", "device", sum(buckets) * d)
            # ... else an fp32 tensor of its own (the shard, or the cast of a bf16/fp16 buffer), made at the
            # accumulation boundary in backward and held until the step: 4 B/param / ranks at stage 1
            memory.add("gradients", "device", 4 * sum(shard for shard, own in zip(shards, reduced_own) if own))
        else:
            memory.add("gradients", "device", 4 * sum(shards))
        own_master_possible = [dtype == torch.float32] * len(shards)
        if option.stage == 2:  # staging buffers: the bucket being filled and one reduce in flight
            memory.transient["gradient staging"] = min(2 * max(buckets, default=0), sum(buckets)) * d
    else:
        parts = [(p, padded_numel(p.numel, ranks(p))) for p in trainable]
        threshold = int(zero.stage3_param_persistence_threshold)
        persistent = lambda p: p.numel <= threshold  # noqa: E731 - the engine's rule, one line
        all_parts = parts + [(p, padded_numel(p.numel, ranks(p))) for p in frozen]
        offloaded_shards = sum(padded // ranks(p) * d for p, padded in all_parts
                               if option.offload_param != "none" and not persistent(p))
        device_shards = sum(padded // ranks(p) * d for p, padded in all_parts) - offloaded_shards
        whole = sum(padded * d for p, padded in all_parts if persistent(p))
        memory.add("parameters", "device", device_shards + whole)
        if option.offload_param == "cpu":
            memory.add("parameters", "host", offloaded_shards)
        elif option.offload_param == "nvme":
            memory.add("parameters", "nvme", offloaded_shards)
            store = zero.offload_param
            cached = min(offloaded_shards, int(store.max_in_cpu) * d)
            memory.add("parameters", "host", cached)
            largest = max((padded // ranks(p) * d for p, padded in all_parts if not persistent(p)), default=1)
            buffer = min(largest, int(store.buffer_size) * d)  # a larger shard is written in pieces
            memory.add("host_io_buffers", "host", int(store.buffer_count) * round_up(max(buffer, 1)))
            memory.notes.append("NVMe parameters: host cache counted at its max_in_cpu bound")
            # offload.param_store: each shard at a 4 KiB-aligned offset of one file
            memory.nvme_files += sum(round_up(max(padded // ranks(p) * d, 1)) for p, padded in all_parts
                                     if not persistent(p))
            # zero.Init's file before initialize: these shards and those of the weights ties replaced after it
            # partitioned them (each as large as the weight that replaced it; persistent ones are not written)
            by_name = {p.name: (p, padded) for p, padded in all_parts}
            memory.nvme_files_peak = memory.nvme_files + sum(
                round_up(max(by_name[kept][1] // ranks(by_name[kept][0]) * d, 1))
                for kept, numel in shape.tied_copies if kept in by_name and not persistent(by_name[kept][0]))
        shards = [padded // ranks(p) for p, padded in parts]
        in_store = [option.offload_param == "nvme" and not persistent(p) for p, _ in parts]
        reduces = [(padded // ranks(p), ranks(p), not p.expert) for p, padded in parts]  # qgZ: one per parameter
        if _streams_gradients(config, option):  # each final shard is stepped during backward and freed
            memory.notes.append("NVMe optimizer streams gradients: no gradient shard is held after backward")
        elif _takes_norm_first(config, option):  # clipping: the norm from a first backward, then streamed
            reread = sum(round_up(max(padded // ranks(p) * d, 1)) for p, padded in all_parts if not persistent(p)) \
                if option.offload_param == "nvme" else 0
            memory.notes.append(f"NVMe optimizer takes the clip's norm from a first backward, then streams the step "
                                f"in a second: no gradient shard is held or spilled; the first pass reads the NVMe "
                                f"parameter shards once more, up to {reread / 1e9:.2f} GB per rank per step")
            if option.offload_param == "nvme" and device_type == "cpu" and \
                    "max_in_cpu" not in zero.offload_param.model_fields_set:
                memory.first_pass_cache = cached  # (the parameters' host row, above)
                memory.notes.append("the first backward keeps the micro-batch's activations through it: the "
                                    "parameter cache gives them up (budget.FirstPassReserve)")
        elif _spills_gradients(config, option):  # clipping: each final shard written to disk and freed
            memory.notes.append("NVMe optimizer spills gradients to disk for clipping: no gradient shard is held "
                                "after backward (the spill file and its two staging buffers are counted)")
        elif _narrows_gradients(config, option, device_type):  # in the training dtype, cast by the CPU kernel
            memory.add("gradients", "device", d * sum(shards))
            memory.add("host_io_buffers", "host", 4 * max(shards, default=0))  # its fp32 scratch (one shard)
            memory.gradients_made_in_backward = True
        else:
            memory.add("gradients", "device", 4 * sum(shards))
            # (zero.stage3.grads: each shard is a reduce output made in backward, freed after the step; with gradient
            # accumulation they outlive the next backward, under qgZ the stage-2 reducer keeps them)
            memory.gradients_made_in_backward = (config.gradient_accumulation_steps == 1  # (None: unresolved)
                                                 and not zero.zero_quantized_gradients)
        # an fp32 shard is its own master only where it stays in device memory (a CPU run's host store counts)
        in_device = option.offload_param == "none" or (option.offload_param == "cpu" and device_type == "cpu")
        own_master_possible = [dtype == torch.float32 and (in_device or persistent(p)) for p, _ in parts]
        gathered = sum(padded for p, padded in all_parts if not persistent(p))
        prefetch, max_live, reuse = (int(x) for x in zero.stage3_fetch_limits())
        live = min(max_live + prefetch, gathered)
        if reuse == 0:  # (the default) every module's parameters are released after use: the module being
            # computed and the one request prefetched ahead (the two largest modules' parameters, at most)
            per_module: dict[str, int] = {}
            for p, padded in all_parts:
                if not persistent(p):
                    module = p.name.rpartition(".")[0]
                    per_module[module] = per_module.get(module, 0) + padded
            live = min(live, sum(sorted(per_module.values())[-2:]) + prefetch)
        memory.transient["gathered parameters (bound)"] = live * d
        # backward's whole gradient of a parameter (in the training dtype) lives until it is copied into its
        # reduce bucket: the largest one
        memory.transient["whole gradient of the largest parameter"] = max((padded for _, padded in parts),
                                                                          default=0) * d
        memory.transient["gradient staging"] = min(2 * int(zero.reduce_bucket_size),
                                                   sum(padded for _, padded in parts)) * d
        hpz = int(zero.zero_hpz_partition_size or 1)
        if 1 < hpz < dp_size:  # the fetcher's rule: a group of all ZeRO ranks is no secondary partition
            # each gathered dense parameter keeps its 1/hpz slice from forward to the end of backward (experts none)
            memory.transient["hpZ secondary shards"] = sum(padded // hpz * d for p, padded in all_parts
                                                           if not persistent(p) and not p.expert)
        if zero.zero_quantized_weights and dp_size > 1 and gathered:  # qwZ: int8 send + receive of one gather
            bucket = min(int(zero.stage3_prefetch_bucket_size), gathered)
            memory.transient["qwZ gather buffers"] = (dp_size + 1) * _wire(-(-bucket // dp_size), 8)
    _ZeroPP(zero, option.stage, dp_size, ranks_per_node).add(memory, reduces)


    # masters and optimizer states, bucket by bucket (stage 3: parameter by parameter)
    offloaded = _offloaded(shards, ratio) if offload_opt != "none" else [False] * len(shards)
    # the NVMe records' bytes per element: master, per-element states (bf16_master_weights_and_grads /
    # bf16_optimizer_states: bf16, the states' fp32 halved; offload.nvme.record_dtypes)
    # CPU offload stores them alike in host memory: offload.bf16_host)
    narrow = offload_opt in ("nvme", "cpu") and config.bf16_records
    master_bytes = 2 if narrow else 4
    state_bytes = 2 if narrow and config.bf16.bf16_optimizer_states else 4
    stored_states = optimizer.per_element * state_bytes // 4
    for shard, own, off in zip(shards, own_master_possible, offloaded):
        states = shard * optimizer.per_element + optimizer.per_tensor
        if off and offload_opt == "cpu":
            memory.add("master_weights", "host", master_bytes * shard)
            memory.add("optimizer_states", "host", shard * stored_states + optimizer.per_tensor)
        elif off:  # nvme: masters and per-element states in files, per-tensor ones in memory
            memory.add("master_weights", "nvme", master_bytes * shard)
            memory.add("optimizer_states", "nvme", shard * stored_states)
            memory.add("optimizer_states", "host", optimizer.per_tensor)
        else:
            memory.add("master_weights", "device", 0 if own else 4 * shard)
            memory.add("optimizer_states", "device", states)
    host_shards = [s for s, off in zip(shards, offloaded) if off]
    if offload_opt == "cpu" and device_type != "cpu":  # fp32 host copies of the gradient shards (pinned)
        memory.add("host_io_buffers", "host", 4 * sum(host_shards))
    if offload_opt == "nvme" and host_shards:  # the NVMe optimizer's pool of aligned buffers
        from .offload.nvme import DEFAULT_CHUNK_NUMEL
        chunk = round_up(min(DEFAULT_CHUNK_NUMEL, max(host_shards)), 1024)
        region = round_up(chunk * 4)
        record = round_up(chunk * master_bytes) + (optimizer.per_element // 4) * round_up(chunk * state_bytes)
        buffer_count = max(2, int(zero.offload_optimizer.buffer_count))
        memory.add("host_io_buffers", "host", buffer_count * (record + region))
        if narrow:  # the fp32 working copy of one narrow record (NvmeRecords.widen)
            memory.add("host_io_buffers", "host", (1 + optimizer.per_element // 4) * chunk * 4)
        memory.nvme_files += _nvme_optimizer_file(host_shards, chunk, optimizer, master_bytes, state_bytes)
        if option.stage == 3 and _spills_gradients(config, option) and not _takes_norm_first(config, option):
            # offload.nvme_records.GradientSpill
            pieces = [-(-s // chunk) for s in host_shards]  # equal chunks per shard, as NvmeRecords cuts them
            per = [round_up(-(-s // n), 1024) for s, n in zip(host_shards, pieces)]
            # a shard in the NVMe parameter file spills into its own extent: only the others take spill-file bytes
            stored = [st for st, off in zip(in_store or [False] * len(shards), offloaded) if off]
            memory.nvme_files += sum(n * round_up(p * d) for n, p, st in zip(pieces, per, stored) if not st)
            memory.add("host_io_buffers", "host", 2 * round_up(max(per) * d) + (chunk * 4 if d != 4 else 0))
        memory.notes.append("NVMe optimizer: the file holds the records once plus 2 spare records per size class "
                            "(a ring committed by an index flip)")
    return memory


def _streams_gradients(config, option: Option) -> bool:
    """The engine's rule (`offload.nvme.streams_gradients`) for the stage-3 reducer (exact reduce: qgZ's
    per-parameter reducer does not release shards) with the optimizer on NVMe."""
    from .offload.nvme import streams_gradients
    from .zero.stage3.grads import Stage3GradReducer

    return (option.stage == 3 and option.offload_optimizer == "nvme"
            and not config.zero_optimization.zero_quantized_gradients
            and streams_gradients(config, Stage3GradReducer.can_free_final_shards))


def _narrows_gradients(config, option: Option, device_type: str) -> bool:
    """The engine's rule (`offload.cpu_optimizer.narrows_gradients`) for plain CPU offload at stage 3 on a CPU run
    (every offloaded group on the CPU Adam kernel: zerotrain.optim's AdamW)."""
    from .offload.cpu_optimizer import narrows_gradients
    from .zero.stage3.grads import Stage3GradReducer

    offload = config.zero_optimization.offload_optimizer
    return (option.stage == 3 and option.offload_optimizer == "cpu" and device_type == "cpu"
            and not config.zero_optimization.zero_quantized_gradients
            and not (offload is not None and offload.super_offload)
            and narrows_gradients(config, Stage3GradReducer.can_free_final_shards))


def _spills_gradients(config, option: Option) -> bool:
    """The engine's rule (`offload.nvme.spills_gradients`): as `_streams_gradients`, with clipping on."""
    from .offload.nvme import spills_gradients
    from .zero.stage3.grads import Stage3GradReducer

    return (option.stage == 3 and option.offload_optimizer == "nvme"
            and not config.zero_optimization.zero_quantized_gradients
            and spills_gradients(config, Stage3GradReducer.can_free_final_shards))


def _takes_norm_first(config, option: Option) -> bool:
    """The engine's rule (`offload.nvme.takes_norm_first`): where it would spill, the norm from a first backward
    instead ("auto": with the parameters on NVMe too; `offload_optimizer.norm_first_pass`)."""
    from .offload.nvme import takes_norm_first

    return _spills_gradients(config, option) and takes_norm_first(config, True, option.offload_param == "nvme")


def _wire(cols: int, bits: int) -> int:
    """Bytes of one quantized row of `cols` values (data + fp32 block scales), as `comm.quant` lays it out."""
    from .comm.quant import DEFAULT_BLOCK, row_wire_bytes
    return row_wire_bytes(cols, bits, DEFAULT_BLOCK) if cols else 0


@dataclass
class _ZeroPP:
    """qgZ's memory (`zero_quantized_gradients`, stages 1-3, ZeRO ranks > 1), by `zero.reduce.QuantizedReduce`'s
    rules: one quantized reduce-scatter per reduce (a stage 1-2 bucket; at stage 3 each trainable parameter),
    over the dense ZeRO group in two hops across nodes (L ranks per node, M nodes: an L x M·S then an M x S
    exchange) or over a split expert's expert-data-parallel group in one; none over a group of one rank.
    With LoCo (`zeropp_loco_param`) each hop keeps an error buffer of its rows x columns in 8 bits plus an
    fp32 scale per 256 values (`comm.compressed.ErrorFeedback`), on the device, between steps; the
    scratch of the largest reduce in flight (fp32 rows, the compensation, int4 send and receive, the
    dequantized parts) is a transient."""
    zero: object
    stage: int
    dp_size: int
    ranks_per_node: Optional[int]

    def hops(self, shard: int, group: int, dense: bool) -> list[tuple[int, int]]:
        per_node = self.ranks_per_node or self.dp_size  # Topology.node_layout
        if dense and 0 < per_node < self.dp_size and self.dp_size % per_node == 0:
            nodes = self.dp_size // per_node
            return [(per_node, nodes * shard), (nodes, shard)]
        return [(group, shard)]

    def add(self, memory: RankMemory, reduces: list[tuple[int, int, bool]]) -> None:
        zero = self.zero
        if not zero.zero_quantized_gradients or self.stage == 0 or self.dp_size == 1:
            return
        loco = zero.zeropp_loco_param is not None
        scratch = 0
        for shard, group, dense in reduces:
            if group == 1 or shard == 0:
                continue
            for rows, cols in self.hops(shard, group, dense):
                if loco:
                    memory.add("loco_errors", "device", rows * _wire(cols, 8))
                fp32 = rows * cols * 4
                scratch = max(scratch, fp32 * (4 if loco else 2) + 2 * rows * _wire(cols, 4))
        if scratch:
            memory.transient["qgZ scratch (largest reduce)"] = scratch
        if loco:
            memory.notes.append("LoCo error buffers: 8-bit, one per quantized reduce and hop (memory_report: "
                                "inside 'gradients', and as 'loco_errors')")


def _nvme_optimizer_file(shards: list[int], chunk: int, optimizer: OptimizerState, master_bytes: int = 4,
                         state_bytes: int = 4) -> int:
    """Bytes of the NVMe optimizer's swap file (`offload.nvme_records`): each shard cut into equal chunks of
    at most `chunk` elements (rounded to 1024), one record per chunk (the master and each per-element state,
    `master_bytes` / `state_bytes` per element (fp32: 4; bf16 records: 2), each region 4 KiB-aligned) of its size
    class, and `DEFAULT_SPARE_RECORDS` spare records per class."""
    from .offload.aio import round_up
    from .offload.nvme_records import DEFAULT_SPARE_RECORDS

    states = optimizer.per_element // 4  # the fp32 states (Adam: exp_avg, exp_avg_sq)

    def record(per: int) -> int:
        return round_up(per * master_bytes) + states * round_up(per * state_bytes)

    total, classes = 0, set()
    for shard in shards:
        if shard <= 0:
            continue
        pieces = -(-shard // chunk)
        per = round_up(-(-shard // pieces), 1024)
        classes.add(per)
        total += -(-shard // per) * record(per)
    return total + sum(DEFAULT_SPARE_RECORDS * record(per) for per in classes)


def default_options(config) -> list[Option]:
    """The options a table compares: every stage without offload, with the optimizer on CPU, stage 3 with
    parameters on CPU too, and the config's own choice (NVMe included) if it is none of those."""
    options = [Option(s) for s in range(4)] + [Option(s, "cpu") for s in (1, 2, 3)] + [Option(3, "cpu", "cpu")]
    own = config_option(config)
    if own not in options:
        options.append(own)
    return options


def config_option(config) -> Option:
    zero = config.zero_optimization
    opt = zero.offload_optimizer.device if zero.offload_optimizer is not None else "none"
    param = zero.offload_param.device if zero.offload_param is not None and zero.stage == 3 else "none"
    return Option(int(zero.stage), opt, param)


# --- activations -----------------------------------------------------------------------------------


@dataclass
class Activations:
    """Bytes autograd keeps for backward in one micro-batch's forward, with and without checkpointing."""
    micro_batch: int
    seq_len: int
    full: int  # nothing checkpointed
    checkpointed: int  # every repeated block checkpointed: block inputs + one block's recompute + the rest
    blocks: int
    sequence_parallel: int = 1  # ranks each sequence is split over (Ulysses): seq_len is the whole sequence
    all_to_all_buffers: int = 0  # transient: the send and receive buffers of the largest sequence exchange
    per_block: list = field(default_factory=list)     # what each block keeps (a pipeline stage sums its blocks')
    block_inputs: list = field(default_factory=list)  # each block's input (what checkpointing keeps of it)
    outside: int = 0                                  # kept outside the blocks (final norm, head, loss)
    fp8_transient: int = 0  # fp8: the largest converted layer's casts and float8 copies (zerotrain.fp8), transient

    def as_dict(self) -> dict:
        return {"micro_batch": self.micro_batch, "seq_len": self.seq_len, "without_checkpointing": self.full,
                "with_checkpointing": self.checkpointed, "blocks": self.blocks,
                "sequence_parallel": self.sequence_parallel, "all_to_all_buffers": self.all_to_all_buffers,
                "fp8_transient": self.fp8_transient}


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for backward (flash / memory-efficient, CUDA's and the CPU's): its
    inputs, its output and the fp32 log-sum-exp per query row (plus the mask, when one is given). On the meta
    device `scaled_dot_product_attention` decomposes into the math path, which keeps the B x H x S x S
    probabilities and the expanded keys and values as well: 20% more than the real run keeps on a Llama (issue
    #49: the whole-step estimate's activation term)."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        shape = query.shape[:-1] + (value.shape[-1],)  # (grouped keys: the query's heads)
        if query.dim() == 4:  # laid out (batch, seq, heads, dim) as the kernels write it: its usual
            out = query.new_empty(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)  # transpose is free
        else:
            out = query.new_empty(shape)
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse, *([mask] if mask is not None else []))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pragma: no cover - the meta forward is never differentiated
        raise NotImplementedError


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """`scaled_dot_product_attention` as a fused kernel keeps its tensors (`_FusedAttention`), shapes only."""
    return _FusedAttention.apply(query, key, value, attn_mask)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks activation checkpointing wraps: the largest ModuleList (GPT's `h`, HF's `layers`)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def measure_activations(model: torch.nn.Module, kind: str, micro_batch: int, seq_len: int,
                        sequence_parallel: int = 1, tensor_parallel: int = 1,
                        partition_inputs: bool = False) -> Activations:
    """Run the meta model's forward (with its loss) and add up the tensors autograd saves for backward.

    Views are counted once through their base; parameters (and views of them) are not activations. On the meta
    device attention keeps what a fused kernel keeps (`_FusedAttention`), not the meta math path's probabilities.
    With `sequence_parallel` N > 1 the model runs Ulysses as one rank of N does (zerotrain's own wrapping,
    `parallel.sequence`): its shard of ceil(seq_len / N) tokens outside attention, the whole sequence of 1/N
    of the heads inside it (so the attention scores are N x those of a plain run on the shard). The model is
    changed in place: pass a throwaway (meta) model.

    A tensor-parallel model (`split_tensor_parallel`, `tensor_parallel` ranks) keeps what one of its ranks
    keeps: whole inputs of the column-split layers, its slice of their outputs; with `partition_inputs`
    (`activation_checkpointing.partition_activations`) a checkpointed block input is kept 1/tp per rank.
    kind "module" (a model whose forward inputs are unknown): nothing is measured (zeros)."""
    if kind == "module":
        return Activations(micro_batch, seq_len, 0, 0, 0, sequence_parallel)
    exchange = None
    if sequence_parallel > 1:
        from .comm import ShapeOnlyComm
        from .parallel.sequence import enable_sequence_parallel

        exchange = ShapeOnlyComm(sequence_parallel)
        enable_sequence_parallel(model, exchange, tensor_parallel)
    local_len = -(-seq_len // sequence_parallel)
    param_ids = {id(p) for p in model.parameters()}
    blocks = _blocks(model)
    kept: dict[int, tuple[torch.Tensor, int]] = {}  # id(base) -> (base, block index or -1)
    inputs: list[int] = [0] * len(blocks)
    current = [-1]
    handles = []
    for index, block in enumerate(blocks):
        def pre(module, args, kwargs, index=index):
            current[0] = index
            hidden = args[0] if args else next((v for v in kwargs.values() if torch.is_tensor(v)), None)
            if torch.is_tensor(hidden):
                inputs[index] = hidden.numel() * hidden.element_size()

        def post(module, args, output):
            current[0] = -1
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post))

    def pack(tensor: torch.Tensor):
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in param_ids and id(base) not in kept:
            kept[id(base)] = (base, current[0])
        return tensor

    device = next(model.parameters()).device  # meta (a real model too, in the tests)
    tokens = torch.zeros(micro_batch, local_len, dtype=torch.long, device=device)
    def forward() -> None:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if kind == "gpt":
                model(tokens, tokens)
            else:
                # (with use_cache=False transformers looks for packed sequences: an .item() a meta tensor has not)
                extra = {"use_cache": True}  # (a config with use_cache false would reach that .item())
                if exchange is not None:  # what SequenceParallel.shard gives each rank: labels shifted once
                    # (use_cache: as above; the wrapping would turn it off)
                    extra = {"shift_labels": tokens, "num_items_in_batch": torch.tensor(micro_batch * seq_len),
                             "use_cache": True}
                model(input_ids=tokens, labels=tokens, **extra)

    scale = {}  # dtype -> factor: a stand-in dtype's tensors counted at the model's own element size
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if device.type == "meta":  # attention keeps what the fused kernel keeps, not the meta math path's
        torch.nn.functional.scaled_dot_product_attention = _fused_attention
    try:
        try:
            forward()
        except RuntimeError as exc:
            # transformers' grouped-GEMM experts (Mixtral, Qwen-MoE): the meta kernel takes bf16 only. Run the
            # forward in bf16 and count its bf16 tensors at the model's element size.
            own = next(model.parameters()).dtype
            if device.type != "meta" or "BF16" not in str(exc) or own == torch.bfloat16:
                raise
            kept.clear()
            model.to(torch.bfloat16)
            scale[torch.bfloat16] = own.itemsize / 2
            forward()
            inputs[:] = [int(n * scale[torch.bfloat16]) for n in inputs]
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for handle in handles:
            handle.remove()
    per_block = [0] * len(blocks)
    outside = 0
    for base, block in kept.values():
        nbytes = int(base.untyped_storage().nbytes() * scale.get(base.dtype, 1))
        if block >= 0:
            per_block[block] += nbytes
        else:
            outside += nbytes
    full = outside + sum(per_block)
    if partition_inputs and tensor_parallel > 1:  # each tensor-parallel rank keeps its slice of a block input
        inputs = [-(-n // tensor_parallel) for n in inputs]
    checkpointed = outside + sum(inputs) + max(per_block, default=0)
    return Activations(micro_batch, seq_len, full, checkpointed if blocks else full, len(blocks), sequence_parallel,
                       0 if exchange is None else 2 * exchange.largest_all_to_all_bytes, per_block, list(inputs), outside)


# --- the whole estimate ----------------------------------------------------------------------------


def device_peak(memory: dict, activations: dict) -> int:
    """What one option needs on the device at the peak of a step: its states, the activations of one
    micro-batch with checkpointing, and the transient step buffers (with sequence parallelism also those of
    its all-to-all). Stage 3 with one micro-step per step makes its gradient shards during backward, as the
    activations are freed layer by layer, and frees them after the step: the larger of the two counts, not
    their sum (`benchmarks/zero_speed_memory.py --matrix`: the sum overestimated the measured peak by
    15%). A CPU run whose clip takes the norm from a first backward keeps the activations through it, and
    the parameter cache (host) gives up as many bytes (`first_pass_cache`, at most its own): taken off here,
    since a CPU run's host and device are one memory."""
    states, acts = memory["totals"]["device"], activations["with_checkpointing"]
    if memory.get("gradients_made_in_backward"):
        grads = memory["rows"]["gradients"]["device"]
        states, acts = states - grads, max(acts, grads)
    states -= min(memory["first_pass_cache"], acts)
    return (states + acts + sum(memory["transient"].values()) + activations.get("all_to_all_buffers", 0)
            + activations.get("fp8_transient", 0))


def fp8_activations(activations: Activations, model: torch.nn.Module, config, device_type: str,
                    dtype: torch.dtype, zero_ranks: int = 1) -> Optional[dict]:
    """With the config's `fp8` block enabled: the largest float8 transient of one micro-batch (`zerotrain.fp8`'s
    plan and sizes: the layers the engine converts; emulated off a CUDA device, or where `fp8.emulate` says so)
    put into `activations.fp8_transient`; the report's `fp8` entry. None when fp8 is off. float8 adds no state:
    weights, gradients, masters and optimizer states keep their sizes. With `fp8.float8_all_gather` at ZeRO-3 the
    largest float8 gather's own buffers (the float8 shard sent, the float8 whole received; the dequantized whole
    is the gathered parameter the stage-3 row counts anyway) are added too."""
    fp8 = config.fp8
    if not fp8.enabled:
        return None
    from .fp8 import fp8_plan, fp8_transient_bytes

    plan = fp8_plan(model, tuple(fp8.exclude_modules))
    emulate = bool(fp8.emulate) if fp8.emulate is not None else device_type != "cuda"
    tokens = activations.micro_batch * -(-activations.seq_len // activations.sequence_parallel)
    largest = fp8_transient_bytes(plan, tokens, fp8.recipe, emulate, dtype.itemsize)
    gather = 0
    if fp8.float8_all_gather and int(config.zero_optimization.stage) == 3 and zero_ranks > 1:
        from .zero.flat import padded_numel
        whole = max((padded_numel(out_f * in_f, zero_ranks) for out_f, in_f in
                     (plan.shapes[name] for name in plan.converted)), default=0)
        gather = whole + whole // zero_ranks  # 1 byte per element: received whole + sent shard
    activations.fp8_transient = int(largest["bytes"]) + gather
    return {"recipe": fp8.recipe, "emulated": emulate, "converted": len(plan.converted),
            "linear_layers": len(plan.shapes), "transient_bytes": int(largest["bytes"]) + gather,
            "gather_bytes": gather, "largest_layer": largest["layer"], "phase": largest["phase"], "state_bytes": 0}


def _seq_len(model: torch.nn.Module, kind: str) -> int:
    config = getattr(model, "config", None)
    limit = getattr(config, "block_size" if kind == "gpt" else "max_position_embeddings", None)
    return min(2048, int(limit)) if limit else 2048


@dataclass
class ModelFamily:
    """Models of one architecture at any depth and width, for `estimate()` (and its largest-model search) on
    a model no preset or config.json describes, e.g. one with split experts: `build(layers, width)` returns
    the model (it is called under `torch.device("meta")`; build expert-parallel layers over
    `shape_comm(ep_size)`); `layers` / `width` are the model's own, `width_step` the step of the width search
    (a width must be a multiple of it)."""
    build: Callable[[int, int], torch.nn.Module]
    layers: int
    width: int
    width_step: int = 1
    name: str = ""

    def meta(self, dtype: torch.dtype, layers: Optional[int] = None, width: Optional[int] = None) -> torch.nn.Module:
        with torch.device("meta"):
            model = self.build(self.layers if layers is None else layers, self.width if width is None else width)
        return model.to(dtype)


def _whole_numel(shape: ModelShape, trainable: bool = False) -> int:
    """Parameters of the whole model: split experts count every rank's experts (tensor-parallel slices are
    counted before the split)."""
    return sum(p.numel * (shape.ep_size if p.expert else 1) for p in shape.params if p.trainable or not trainable)


def shape_comm(size: int):
    """A shapes-only `Comm` of `size` ranks (this one rank 0) that moves nothing (`comm.ShapeOnlyComm`): build a
    meta model's expert-parallel layers over it (`ExpertParallelMoE(..., shape_comm(ep_size))`) to estimate
    expert parallelism."""
    from .comm import ShapeOnlyComm

    return ShapeOnlyComm(size)


def _kind_of(model: torch.nn.Module) -> str:
    """"gpt" (zerotrain's GPT), "hf" (a transformers causal LM), or "module" (anything else: its forward's
    inputs are unknown, so its activations are not measured)."""
    from .models import GPT

    if isinstance(model, GPT):
        return "gpt"
    config = getattr(model, "config", None)
    return "hf" if config is not None and hasattr(config, "num_hidden_layers") else "module"


def estimate(model_spec, config_source, world_size: int, options: Optional[list[Option]] = None,
             device_type: str = "cuda", seq_len: Optional[int] = None,
             micro_batch: Optional[int] = None, memory: Optional[int] = None,
             ranks_per_node: Optional[int] = None, sizes: Optional[Callable] = None) -> dict:
    """Everything `zerotrain estimate` prints, as a dict: the model, the world, per-option bytes per rank
    (`RankMemory.as_dict()`), the activations of one micro-batch, and with `memory` (device bytes per
    rank) the largest depth and width of this architecture that fit under the config's own option.

    `model_spec`: a preset, a model directory or config.json (built on the meta device), or a model itself
    (built on the meta device by the caller, e.g. `with torch.device("meta"):`; with split experts built over
    a group of ep_size ranks, `ExpertParallelMoE(..., shape_comm(ep_size))`: expert parallelism lives in the
    model, not in the config). The world is data x sequence x tensor parallel: `tensor_parallel.autotp_size`
    splits the model by its plan as `initialize` does (ZeRO then partitions over world / tp ranks), and
    `sequence_parallel_size` splits each sequence. `ranks_per_node`: ranks per node (qgZ's two hops).
    `sizes`: how the size keys the config leaves unset are chosen (`zerotrain.budget.estimate_sizes`, what
    `zerotrain estimate` passes: the memory budget's rules, as the engine applies them; called as
    `sizes(shape, config, zero_ranks, device_type, optimizer, ranks_on_node)` -> (config, plan with `lines()`));
    None: the config's values (DeepSpeed's defaults where unset)."""
    from .config import load_config
    from .precision import training_dtype

    config = load_config(config_source)
    tp = int(config.tensor_parallel.autotp_size)
    sp = int(config.sequence_parallel_size)
    pp = int(config.pipeline_parallel_size)
    if pp > 1:  # what the pipeline engine runs (zerotrain.pipe.check_pipeline_config refuses the rest)
        if tp > 1 or sp > 1:
            raise ValueError("pipeline_parallel_size with tensor_parallel.autotp_size or sequence_parallel_size > 1 "
                             "is not available (the engine refuses it too)")
        if world_size % pp:
            raise ValueError(f"pipeline_parallel_size: {pp} does not divide the world size {world_size}")
        if memory is not None:
            raise ValueError("--memory's largest-model search does not split pipeline stages; estimate without it")
        world_size //= pp  # below: the ranks of one stage
    if world_size % (tp * sp):
        if tp == 1 or sp == 1:
            key, size = ("sequence_parallel_size", sp) if tp == 1 else ("tensor_parallel.autotp_size", tp)
            raise ValueError(f"{key}: {size} does not divide the world size {world_size}")
        raise ValueError(f"sequence_parallel_size: {sp} x tensor_parallel.autotp_size: {tp} does not divide the "
                         f"world size {world_size}")
    # Ulysses: the batch triple counts data-parallel ranks only; ZeRO partitions over data x sequence ranks
    # (of one tensor-parallel index: initialize's Topology.build)
    dp_size, zero_ranks = world_size // (tp * sp), world_size // tp
    per_node = None if ranks_per_node is None else max(1, ranks_per_node // tp)  # Topology: per tp index
    config, batch_note = _batch_for(config, dp_size)
    dtype = training_dtype(config.precision)
    given = isinstance(model_spec, torch.nn.Module)
    family = model_spec if isinstance(model_spec, ModelFamily) else None
    if family is not None:
        model = family.meta(dtype)
        kind, label = _kind_of(model), family.name or type(model).__name__
    elif given:
        model, kind, label = model_spec.to(dtype), _kind_of(model_spec), type(model_spec).__name__
    else:
        (model, kind), label = load_meta_model(model_spec, dtype), model_spec
    whole = model_shape(model, label)  # before the split: the whole model's parameter count
    split_tensor_parallel(model, tp)
    shape = model_shape(model, label)
    stages = pipeline_split(model, kind, config) if pp > 1 else None
    if stages is not None:  # the table: a rank of the stage with the most parameters
        shape = max((stage_shape for _, stage_shape in stages), key=lambda stage_shape: stage_shape.numel)
    if shape.ep_size > 1 and zero_ranks % shape.ep_size:
        raise ValueError(f"the model's experts are split over {shape.ep_size} ranks, which does not divide the "
                         f"{zero_ranks} ZeRO ranks (world / tensor_parallel.autotp_size)")
    optimizer = probe_optimizer(config.optimizer)
    budget_lines = None
    if sizes is not None:  # the unset size keys as the memory budget chooses them
        config, plan = sizes(shape, config, zero_ranks, device_type, optimizer, per_node)
        budget_lines = plan.lines()
    if options is None and pp > 1:  # ZeRO-2/3 with a pipeline are refused
        options = [option for option in default_options(config) if option.stage <= 1]
    per_option = [estimate_option(shape, config, zero_ranks, option, optimizer, device_type, per_node)
                  for option in (options or default_options(config))]
    micro = micro_batch or int(config.train_micro_batch_size_per_gpu)
    seq_len = seq_len or _seq_len(model, kind)
    partition = bool(config.activation_checkpointing.partition_activations)
    activations = measure_activations(model, kind, micro, seq_len, sp, tp, partition)
    fp8_report = fp8_activations(activations, model, config, device_type, dtype, zero_ranks)
    result = {"model": label, "parameters": _whole_numel(whole), "trainable": _whole_numel(whole, trainable=True),
              "dtype": str(dtype).replace("torch.", ""), "world_size": world_size, "dp_size": dp_size,
              "sequence_parallel_size": sp, "tensor_parallel_size": tp, "expert_parallel_size": shape.ep_size,
              "zero_ranks": zero_ranks, "optimizer": optimizer.name, "device": device_type,
              "config_option": config_option(config).label,
              "options": [m.as_dict() for m in per_option], "activations": activations.as_dict()}
    if stages is not None:
        result["world_size"] = world_size * pp
        result["pipeline"] = pipeline_report(stages, config, activations, zero_ranks, optimizer, device_type,
                                             per_node)
    if fp8_report is not None:
        result["fp8"] = fp8_report
    if batch_note:
        result["note"] = batch_note
    if budget_lines is not None:
        result["memory_budget"] = budget_lines
    if memory is not None:
        if given:
            raise ValueError("--memory's largest-model search resizes a preset, a config.json or a ModelFamily; "
                             "a model passed in is estimated as it is (its options' 'fits' still apply)")

        def peak(layers: Optional[int] = None, width: Optional[int] = None) -> tuple[int, int]:
            if family is not None:
                resized = family.meta(dtype, layers, width)
            else:
                resized, _ = load_meta_model(model_spec, dtype, layers, width, multiple=tp)
            numel = _whole_numel(model_shape(resized))
            split_tensor_parallel(resized, tp)
            resized_shape = model_shape(resized)
            states = estimate_option(resized_shape, config, zero_ranks, config_option(config), optimizer,
                                     device_type, per_node)
            acts = measure_activations(resized, kind, micro, seq_len, sp, tp, partition)
            fp8_activations(acts, resized, config, device_type, dtype, zero_ranks)
            return device_peak(states.as_dict(), acts.as_dict()), numel
        if family is not None:
            layers, width, step = family.layers, family.width, family.width_step
        else:
            layers, width, heads = _depth_width(kind, _architecture(model_spec)[1])
            step = heads * (2 if kind == "hf" else 1)
        result["largest"] = largest_fitting(peak, memory, layers, width, step)
        result["searched_from"] = {"layers": layers, "width": width}  # each search keeps one of them
        result["memory"] = memory
    return result



MAX_LAYERS = 1024  # the depth and width searches stop here (a result at the cap means "at least")
MAX_WIDTH = 65536


def largest_fitting(peak, memory: int, layers: int, width: int, step: int) -> dict:
    """The largest depth (at this width) and width (at this depth) whose `peak(layers=, width=)` ->
    (bytes, parameters) is at most `memory`; None where even the smallest does not fit.

    Widths go in steps of `step` (the head count; twice it where rotary embeddings need an even head
    size). Bytes and parameters
    grow by the same amount per layer (padding aside), so each width is probed on 1- and 2-layer models
    and extrapolated to the depth; the answer is then checked on the full model and moved by one step
    while the check disagrees."""
    cache: dict[tuple, tuple[int, int]] = {}
    measure = peak

    def peak(layers: int, width: int) -> tuple[int, int]:  # noqa: F811 - the memoized probe
        if (layers, width) not in cache:
            cache[layers, width] = measure(layers=layers, width=width)
        return cache[layers, width]

    def line(w: int) -> tuple[tuple[int, int], tuple[int, int]]:
        one, two = peak(layers=1, width=w), peak(layers=2, width=w)
        return one, (two[0] - one[0], two[1] - one[1])

    def predicted(n_layers: int, w: int, fit=None) -> int:
        (base, _), (per_layer, _) = fit or line(w)
        return base + (n_layers - 1) * per_layer

    def settle(value: int, exact, lowest: int = 1, cap: int = MAX_LAYERS) -> Optional[int]:
        """The largest n >= lowest that `exact(n)` accepts, searched from the prediction `value`: gallop
        away from it (the prediction is off where a bound saturates, e.g. stage 3's live-parameter limit),
        then bisect; None if even `lowest` is refused."""
        value = min(max(lowest, value), cap)
        if exact(value):
            low, gap = value, 1
            while low + gap <= cap and exact(low + gap):
                low, gap = low + gap, gap * 2
            if low + gap > cap:  # the search stops at the cap
                if low == cap or exact(cap):
                    return cap
                high = cap
            else:
                high = low + gap
        else:
            high, gap = value, 1
            while high - gap >= lowest and not exact(high - gap):
                high, gap = high - gap, gap * 2
            if high - gap < lowest:
                if not exact(lowest):
                    return None
                low = lowest
            else:
                low = high - gap
        while high - low > 1:  # low accepted, high refused
            mid = (low + high) // 2
            low, high = (mid, high) if exact(mid) else (low, mid)
        return low

    # depth: the line through this depth and the next (stage 3's gather bound may saturate below it)
    here, after = peak(layers=layers, width=width), peak(layers=layers + 1, width=width)
    per_layer = after[0] - here[0]
    guess = layers + (memory - here[0]) // per_layer if per_layer > 0 else layers
    depth = settle(int(guess), lambda n: peak(layers=n, width=width)[0] <= memory)

    low, high = 0, max(1, width // step)  # widths in steps: low fits (0: none known), high is the next probe
    while high <= MAX_WIDTH // step and predicted(layers, high * step) <= memory:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if predicted(layers, mid * step) <= memory else (low, mid)
    wide = settle(low, lambda n: peak(layers=layers, width=n * step)[0] <= memory,
                  cap=MAX_WIDTH // step) if low else None
    result = {"layers": None, "width": None}
    if depth is not None:
        result["layers"] = {"layers": depth, "width": width, "parameters": peak(layers=depth, width=width)[1],
                            "at_cap": depth == MAX_LAYERS}
    if wide is not None:
        result["width"] = {"layers": layers, "width": wide * step, "at_cap": wide == MAX_WIDTH // step,
                           "parameters": peak(layers=layers, width=wide * step)[1]}
    return result


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'24GiB', '80GB', '1.5TiB', '1000' -> bytes."""
    import re
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 24GiB, 80GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(nbytes: float) -> str:
    if nbytes == 0:
        return "0"
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    exponent = min(int(math.log(max(nbytes, 1), 1024)), len(units) - 1)
    return f"{nbytes / 1024**exponent:.2f} {units[exponent]}" if exponent else f"{int(nbytes)} B"


# --- pipeline stages -------------------------------------------------------------------------------


def pipeline_split(model: torch.nn.Module, kind: str, config) -> list[tuple[list[int], ModelShape]]:
    """Per pipeline rank (`pipeline_parallel_size`, the config's `pipeline.schedule` and `stages_per_rank`): the
    indices of the layers it holds and their parameters, cut as the engine cuts them (`zerotrain.pipe`: a
    Hugging Face model's split, `pipe.hf`; the GPT's layers, `pipe.gpt`; balanced by parameters). Layer 0 is the
    embedding, layers 1..n the blocks, then the final norm and the head (a tied head counted again on the stage
    holding it: it keeps a copy)."""
    from .pipe import Placement, PipelineModule

    pp, pipe = int(config.pipeline_parallel_size), config.pipeline
    if kind == "hf":
        from .pipe.hf import causal_lm_pipeline
        module = causal_lm_pipeline(model, pp)
    elif kind == "gpt":
        from .pipe.gpt import gpt_layers
        module = PipelineModule(gpt_layers(model.config), num_stages=pp)
    else:
        raise ValueError("pipeline_parallel_size: the estimate splits a GPT preset or a Hugging Face model "
                         "(a PipelineModule of your own layers is not estimated yet)")
    placement = Placement(pp, pipe.pieces_per_rank, v_shape=pipe.schedule == "zbv_zero_bubble")
    bounds = module.partition(placement.pieces)
    layer_params = module.layer_parameters()
    out = []
    for rank in range(pp):
        layers = [i for piece in placement.pieces_of(rank) for i in range(bounds[piece], bounds[piece + 1])]
        params = [ParamInfo(f"{i}.{j}", numel, trainable) for i in layers
                  for j, (numel, trainable) in enumerate(layer_params[i])]
        out.append((layers, ModelShape(params, [], name=f"stage {rank}")))
    return out


def pipeline_report(stages: list[tuple[list[int], ModelShape]], config, activations: Activations, dp_size: int,
                    optimizer: OptimizerState, device_type: str, ranks_per_node: Optional[int]) -> dict:
    """Per stage: its layers and parameters, the config's option's bytes per rank for them, the activations one
    micro-batch leaves on it (its blocks' share of the meta forward's, the final norm, head and loss on the last
    stage; with checkpointing: its blocks' inputs and one block's recompute) and how many micro-batches the
    schedule holds in flight there (`pipe.schedule.in_flight`), so the activations in flight."""
    from .pipe.schedule import in_flight

    pp, pipe = len(stages), config.pipeline
    m = int(config.gradient_accumulation_steps)
    flights = in_flight(pipe.schedule, pp, m, pipe.pieces_per_rank)
    last = max(layer for layers, _ in stages for layer in layers)
    blocks = len(activations.per_block)
    rows = []
    for rank, ((layers, shape), flight) in enumerate(zip(stages, flights)):
        mine = [layer - 1 for layer in layers if 1 <= layer <= blocks]  # layer i is block i - 1
        outside = activations.outside if last in layers else 0
        per_micro = outside + sum(activations.per_block[b] for b in mine)
        checkpointed = outside + sum(activations.block_inputs[b] for b in mine) + \
            max((activations.per_block[b] for b in mine), default=0)
        states = estimate_option(shape, config, dp_size, config_option(config), optimizer, device_type,
                                 ranks_per_node)
        rows.append({"stage": rank, "layers": layers, "parameters": shape.numel,
                     "trainable": shape.trainable_numel, "device_states": states.total("device"),
                     "in_flight": flight, "activations_per_micro_batch": per_micro,
                     "activations_per_micro_batch_checkpointed": checkpointed,
                     "activations_in_flight": int(per_micro * flight),
                     "activations_in_flight_checkpointed": int(checkpointed * flight)})
    theory = (pp - 1) / (m + pp - 1) if pipe.schedule in ("gpipe", "1f1b") else None
    return {"stages": pp, "schedule": pipe.schedule, "stages_per_rank": pipe.pieces_per_rank, "micro_batches": m,
            "bubble_fraction": theory, "ranks_per_stage": dp_size, "per_stage": rows}


# --- the command -----------------------------------------------------------------------------------


def add_estimate_parser(sub) -> None:
    """Add the `estimate` subcommand to `sub` (an argparse subparsers action)."""
    parser = sub.add_parser(
        "estimate", help="memory per rank for each ZeRO stage / offload choice, before training",
        description=("Estimate the bytes each rank holds (parameters, gradients, fp32 masters, optimizer "
                     "states, buffers; on the device, in host memory, in NVMe files) for every ZeRO stage and "
                     "offload choice, by zerotrain's own layout rules, and the activations of one micro-batch "
                     "with and without activation checkpointing. The model is built on the meta device "
                     "(no weights are allocated); dtype, batch, buckets and offload settings come from the "
                     "DeepSpeed config."),
    )
    parser.add_argument("--model", required=True, metavar="PRESET|DIR|CONFIG.json",
                        help="a GPT preset (tiny, small, 70m), a Hugging Face model directory or its config.json")
    parser.add_argument("--config", required=True, metavar="PATH", help="DeepSpeed-style JSON config")
    parser.add_argument("--world", type=int, default=None, metavar="N", help="total number of ranks")
    parser.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (with --gpus-per-node)")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="G", help="ranks per node")
    parser.add_argument("--seq-len", type=int, default=None, metavar="T",
                        help="tokens per sequence for the activations (default: the model's limit, at most 2048)")
    parser.add_argument("--micro-batch", type=int, default=None, metavar="B",
                        help="sequences per micro-batch (default: the config's train_micro_batch_size_per_gpu)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="the training device (cpu: no host copies of what already is in host memory); "
                             "default: cuda when this machine has one, else cpu")
    parser.add_argument("--memory", default=None, metavar="SIZE",
                        help="device memory per rank (e.g. 80GiB): mark which options fit, and find the largest "
                             "depth and width of this architecture that fit under the config's own option")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")


def run_estimate(args, sizes: Optional[Callable] = None) -> int:
    """`zerotrain estimate`: print the table (rich on a terminal) or JSON; 2 on a usage error. `sizes`: see
    `estimate` (the command passes the memory budget's `zerotrain.budget.estimate_sizes`)."""
    if args.world is not None and args.gpus_per_node is not None:
        return _usage("give --world or --nodes/--gpus-per-node, not both")
    world = args.world if args.world is not None else args.nodes * (args.gpus_per_node or 1)
    if world < 1 or args.nodes < 1:
        return _usage(f"the world size must be >= 1, got {world}")
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            return _usage(f"{flag} must be >= 1, got {value}")
    if not Path(args.config).is_file():
        return _usage(f"config file {args.config!r} not found")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    elsewhere = _not_this_machine(args, world, device)
    if sizes is not None and elsewhere is not None:
        sizes = _explicit_budget_only(sizes, elsewhere)  # this machine's memory says nothing of the cluster's
    try:
        memory = parse_bytes(args.memory) if args.memory else None
        result = estimate(args.model, args.config, world, device_type=device, seq_len=args.seq_len,
                          micro_batch=args.micro_batch, memory=memory,
                          ranks_per_node=args.gpus_per_node if args.gpus_per_node is not None else None,
                          sizes=sizes)
    except ValueError as exc:  # ConfigError is one: it names the key and file
        return _usage(str(exc))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_table(result, memory)
    return 0


def _not_this_machine(args, world: int, device: str) -> Optional[str]:
    """Why the estimate is for another machine than this one (several nodes, or more ranks on the node than this
    machine has devices or cores); None when it could be this one."""
    import os

    if args.nodes > 1:
        return f"{args.nodes} nodes"
    here = torch.cuda.device_count() if device == "cuda" else (os.cpu_count() or 1)
    ranks = args.gpus_per_node if args.gpus_per_node is not None else world
    if ranks > here:
        return f"{ranks} ranks on a node, this machine has {here} {'GPUs' if device == 'cuda' else 'cores'}"
    return None


def _explicit_budget_only(sizes: Callable, elsewhere: str) -> Callable:
    """`sizes` where the config sets zero_optimization.memory_budget_bytes (a budget of the target's); else the
    config's own size keys, with the line saying why no budget of this machine's memory is used."""

    class _NoBudget:
        def lines(self) -> list[str]:
            return [f"memory budget: none of this machine's memory (the estimate is for {elsewhere}): the size keys "
                    "the config leaves unset are DeepSpeed's defaults here; set zero_optimization."
                    "memory_budget_bytes to the target's bytes per rank to see what the budget would choose"]

    def cluster_sizes(shape, config, zero_ranks, device_type, optimizer, ranks_on_node):
        if config.zero_optimization.memory_budget_bytes is None:
            return config, _NoBudget()
        return sizes(shape, config, zero_ranks, device_type, optimizer, ranks_on_node)

    return cluster_sizes


def _usage(message: str) -> int:
    import sys
    print(f"zerotrain estimate: error: {message}", file=sys.stderr, flush=True)
    return 2


def _batch_for(config, dp_size: int):
    """``(config, note)``: `config` with its batch triple resolved for `dp_size` data-parallel ranks. Memory per rank
    depends on the micro-batch only, so a global batch written for another world size (`train_batch_size` 16 of
    examples/zero*.json, estimated for 2 nodes x 8) is set aside, with a note, instead of refused."""
    from .config import ConfigError, load_config
    from .config.batch import GAS, MICRO, TBS

    try:
        return load_config(config, dp_world_size=dp_size), None
    except ConfigError as error:
        if error.key not in (TBS, MICRO, GAS) or config.train_micro_batch_size_per_gpu is None:
            raise
    kept = {key: value for key, value in config.raw.items() if key not in (TBS, GAS)}
    resolved = load_config(kept, dp_world_size=dp_size)
    return resolved, (f"the config's {TBS}={config.train_batch_size} does not fit {dp_size} data-parallel ranks of "
                      f"{MICRO}={resolved.train_micro_batch_size_per_gpu} (the run would refuse it); estimated "
                      f"with that micro-batch and no accumulation: memory per rank does not depend on the global "
                      f"batch")


def _print_table(result: dict, memory: Optional[int]) -> None:
    import sys

    acts = result["activations"]
    sp = result.get("sequence_parallel_size", 1)
    tp, ep = result.get("tensor_parallel_size", 1), result.get("expert_parallel_size", 1)
    sp_note = f" x sequence-parallel {sp}" if sp > 1 else ""
    sp_note += f" x tensor-parallel {tp}" if tp > 1 else ""
    sp_note += f"; ZeRO over {result['zero_ranks']} ranks" if sp > 1 or tp > 1 else ""
    sp_note += f"; experts split over {ep} ranks" if ep > 1 else ""
    title = (f"{result['model']}: {result['parameters']:,} parameters ({result['trainable']:,} trainable), "
             f"{result['dtype']}, {result['optimizer']}, world {result['world_size']} "
             f"(data-parallel {result['dp_size']}{sp_note}), bytes per rank on {result['device']}")
    loco = any(o["rows"]["loco_errors"]["device"] for o in result["options"])
    headers = ["option", "params", "grads + LoCo" if loco else "grads", "masters", "optim states", "buffers",
               "device total", "+ act. (ckpt)", "host total", "nvme"]
    if memory is not None:
        headers.append("fits")
    rows = []
    for option in result["options"]:
        r, totals = option["rows"], option["totals"]
        dev = lambda row: format_bytes(r[row]["device"])  # noqa: E731
        peak = device_peak(option, acts)
        mark = " *" if option["option"] == result["config_option"] else ""
        grads = format_bytes(r["gradients"]["device"] + r["loco_errors"]["device"])
        row = [option["option"] + mark, dev("parameters"), grads, dev("master_weights"),
               dev("optimizer_states"), dev("buffers"), format_bytes(totals["device"]), format_bytes(peak),
               format_bytes(totals["host"]), format_bytes(totals["nvme"])]
        if memory is not None:
            row.append("yes" if peak <= memory else "no")
        rows.append(row)
    footer = [
        f"* the config's own choice ({result['config_option']}).",
        f"activations per micro-batch ({acts['micro_batch']} x {acts['seq_len']} tokens"
        + (f", each rank {-(-acts['seq_len'] // sp)} of them; all-to-all buffers "
           f"{format_bytes(acts['all_to_all_buffers'])}" if sp > 1 else "") + "): "
        f"{format_bytes(acts['without_checkpointing'])} without checkpointing, "
        f"{format_bytes(acts['with_checkpointing'])} with it ({acts['blocks']} blocks checkpointed).",
        "'+ act. (ckpt)' = device total + activations with checkpointing + transient step buffers "
        "(gradient staging, stage-3 gathers, ZeRO++ scratch and hpZ secondaries; see --json).",
    ]
    fp8 = result.get("fp8")
    if fp8 is not None:
        footer.append(f"fp8 ({fp8['recipe']}{', emulated' if fp8['emulated'] else ''}): {fp8['converted']} of "
                      f"{fp8['linear_layers']} Linear layers in float8; the largest cast ({fp8['largest_layer']}, "
                      f"{fp8['phase']})" + (f" and float8 gather ({format_bytes(fp8['gather_bytes'])})"
                                            if fp8.get("gather_bytes") else "")
                      + f" add {format_bytes(fp8['transient_bytes'])} to '+ act.'; no state "
                      "(weights, gradients, masters, checkpoints in the training dtype).")
    footer.extend(_pipeline_lines(result.get("pipeline")))
    if result.get("note"):
        footer.append(f"note: {result['note']}.")
    if result.get("memory_budget"):  # the unset size keys, as the engine's memory budget chooses them
        footer.extend(result["memory_budget"])
    files = [(o["option"], o["nvme_files"], o.get("nvme_files_peak", 0)) for o in result["options"]
             if o.get("nvme_files")]
    for label, nbytes, peak in files:
        footer.append(f"{label}: NVMe swap files {format_bytes(nbytes)} per rank (the nvme column plus alignment, "
                      f"equal-chunk padding and the optimizer's spare records)"
                      + (f"; {format_bytes(peak)} at their peak, built under zero.Init (the weights ties replace "
                         f"are written before the tie)." if peak > nbytes else "."))
    largest = result.get("largest")
    if largest is not None:  # two searches, each line saying which: they answer different questions
        under = f"fits {format_bytes(result['memory'])} per rank under {result['config_option']}"
        layers, width = result["searched_from"]["layers"], result["searched_from"]["width"]
        depth, wide = largest["layers"], largest["width"]
        footer.append(f"largest depth at the model's width {width} that {under}: "
                      + ("none (even 1 layer does not fit)" if depth is None else
                         f"{'at least ' if depth['at_cap'] else ''}{depth['layers']} layers "
                         f"({depth['parameters']:,} parameters)"))
        footer.append(f"largest width at the model's depth {layers} layers that {under}: "
                      + ("none (even the narrowest width does not fit)" if wide is None else
                         f"{'at least ' if wide['at_cap'] else ''}width {wide['width']} "
                         f"({wide['parameters']:,} parameters)"))
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table
        table = Table(title=title, title_justify="left")
        for index, header in enumerate(headers):
            table.add_column(header, justify="left" if index == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console = Console()
        console.print(table)
        for line in footer:
            console.print(line, highlight=False)
        return
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    print(title)
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    for row in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for line in footer:
        print(line)


def _pipeline_lines(pipeline: Optional[dict]) -> list[str]:
    """The per-stage lines of `zerotrain estimate` with a pipeline (none without)."""
    if not pipeline:
        return []
    bubble = pipeline["bubble_fraction"]
    lines = [f"pipeline: {pipeline['stages']} stages x {pipeline['ranks_per_stage']} data-parallel ranks, "
             f"{pipeline['schedule']} ({pipeline['stages_per_rank']} piece(s) per rank), "
             f"{pipeline['micro_batches']} micro-batches per step"
             + (f", bubble (p-1)/(m+p-1) = {bubble:.3f}" if bubble is not None else "")
             + "; the table above is a rank of the stage with the most parameters. Per stage:"]
    for row in pipeline["per_stage"]:
        layers = row["layers"]
        span = f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else \
            ",".join(str(layer) for layer in layers)
        lines.append(f"  stage {row['stage']}: layers {span}, {row['parameters']:,} parameters, model states "
                     f"{format_bytes(row['device_states'])}; {row['in_flight']:g} micro-batches in flight x "
                     f"{format_bytes(row['activations_per_micro_batch'])} = "
                     f"{format_bytes(row['activations_in_flight'])} of activations "
                     f"({format_bytes(row['activations_in_flight_checkpointed'])} checkpointed)")
    return lines
