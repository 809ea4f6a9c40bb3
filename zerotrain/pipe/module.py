"""`PipelineModule`: a model as a list of layers, cut into pipeline pieces (DeepSpeed's `deepspeed.pipe` API).

`PipelineModule(layers, num_stages, loss_fn, partition_method)` only records the layers: `LayerSpec`s (built
later, only on the rank that runs them), `TiedLayerSpec`s (one module per rank shared by every position with the
same key; across stages kept equal by `zerotrain.pipe.engine`), ready modules, or plain callables. `initialize`
cuts the list into `num_stages × pieces_per_rank` contiguous pieces (`partition`) and `build(...)` builds this
rank's pieces: each piece is a `Piece` module (the `submodule` of one `torch.distributed.pipelining`
`PipelineStage`), and the PipelineModule itself holds this rank's layers as children named by their global index
(DeepSpeed's names), so the engine's ZeRO buckets, the optimizer and `named_parameters()` see them once.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "Piece", "checkpointable", "partition_balanced",
           "partition_uniform"]


class LayerSpec:
    """A layer to build later (`typename(*args, **kwargs)`), only on the rank whose piece holds it."""

    def __init__(self, typename: type, *args: Any, **kwargs: Any) -> None:
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename, self.args, self.kwargs = typename, args, kwargs
        self.forward_fn: Optional[Callable] = None  # how the position runs its module (TiedLayerSpec, pipe.hf)

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared by every position with the same `key` (an embedding on the first stage
    and the output head on the last): one module per rank; `forward_fn(module, x)` (default: `module(x)`) is how
    this position uses it; `tied_weight_attr` names the shared parameters (default: every parameter)."""

    def __init__(self, key: str, typename: type, *args: Any, forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Union[str, Sequence[str], None] = None, **kwargs: Any) -> None:
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn = str(key), forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's `partition_uniform` (`deepspeed.runtime.utils`): boundaries of `num_parts` runs of
    `num_items // num_parts` items, the first `num_items % num_parts` runs one longer."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced` (`deepspeed.runtime.utils`), cut for cut: boundaries [0, b1, ...,
    len(weights)] of `parts` contiguous runs minimizing the spread (largest run's sum minus smallest's), ties
    going to the later start of the last run (DeepSpeed's `>=`); `partition_uniform` when there are no more
    weights than parts. An exact dynamic program: O(n² · parts), fine for layer lists."""
    n = len(weights)
    if n <= parts:
        return partition_uniform(n, parts)
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + float(weight))
    inf = float("inf")
    # [i][j]: the first i layers cut into j runs: the spread, the largest and smallest run, where run j starts
    cost = [[inf] * (parts + 1) for _ in range(n + 1)]
    high = [[inf] * (parts + 1) for _ in range(n + 1)]
    low = [[inf] * (parts + 1) for _ in range(n + 1)]
    start = [[0] * (parts + 1) for _ in range(n + 1)]
    cost[0][0] = high[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                largest, smallest = max(high[k][j - 1], run), min(low[k][j - 1], run)
                spread = largest - smallest
                if cost[i][j] >= spread:  # DeepSpeed's tie rule: the later k wins
                    cost[i][j], high[i][j], low[i][j], start[i][j] = spread, largest, smallest, k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(start[bounds[-1]][j])
    return bounds[::-1]


def checkpointable(layers: Sequence[Any], checkpointable_layers: Optional[Sequence[str]] = None,
                   model_class: str = "") -> bool:
    """DeepSpeed's rule for whether a run of layers is checkpointed (`PipelineModule._is_checkpointable`): only
    layers whose class is in `checkpointable_layers` when given; in a Megatron `GPTModelPipe` / `GPT2ModelPipe`,
    only `ParallelTransformerLayerPipe`s (and the listed classes); otherwise a run holding any parameter."""
    names = [type(layer).__name__ for layer in layers]
    if model_class in ("GPTModelPipe", "GPT2ModelPipe"):
        return all("ParallelTransformerLayerPipe" in name or name in (checkpointable_layers or ()) for name in names)
    if checkpointable_layers is not None:
        return all(name in checkpointable_layers for name in names)
    return any(any(True for _ in layer.parameters()) for layer in layers if isinstance(layer, nn.Module))


class Piece(nn.Module):
    """One pipeline piece (torch's stage): its layers in order; activation checkpointing every `interval` layers,
    of the runs `checkpointable` admits, through `checkpoint_func(run, *inputs)` (None: torch's non-reentrant
    checkpoint)."""

    def __init__(self, index: int, layers: list[tuple[int, Any, Optional[Callable]]], interval: int,
                 checkpoint_func: Optional[Callable] = None,
                 is_checkpointable: Callable[[Sequence[Any]], bool] = checkpointable) -> None:
        super().__init__()
        self.index = index
        # (global layer index, module or callable, forward_fn or None); modules are registered on the
        # PipelineModule, not here, so each parameter has one name
        self._layers = layers
        self._interval = interval
        self._checkpoint_func = checkpoint_func
        self._is_checkpointable = is_checkpointable

    def parameters(self, recurse: bool = True):  # torch's PipelineStage scales and inspects these
        seen: set[int] = set()
        for _, layer, _ in self._layers:
            if isinstance(layer, nn.Module):
                for param in layer.parameters(recurse):
                    if id(param) not in seen:
                        seen.add(id(param))
                        yield param

    def _run(self, start: int, end: int, x: Any) -> Any:
        for _, layer, forward_fn in self._layers[start:end]:
            x = forward_fn(layer, x) if forward_fn is not None else layer(x)
        return x

    def forward(self, *args: Any) -> Any:
        # a clone of what arrives (DeepSpeed's): torch's PipelineStage hands a received activation over as a
        # leaf that requires grad, which an in-place first layer (ReLU(inplace=True)) may not modify
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        x = args[0] if len(args) == 1 else args
        interval = self._interval
        if interval <= 0 or not (self.training and torch.is_grad_enabled()):
            return self._run(0, len(self._layers), x)
        for start in range(0, len(self._layers), interval):
            end = min(start + interval, len(self._layers))
            if not self._is_checkpointable([layer for _, layer, _ in self._layers[start:end]]):
                x = self._run(start, end, x)
            elif self._checkpoint_func is not None:  # the program's (DeepSpeed's activation_checkpoint_func)
                def run(*inputs: Any, start: int = start, end: int = end) -> Any:
                    return self._run(start, end, inputs[0] if len(inputs) == 1 else inputs)

                x = self._checkpoint_func(run, *(x if isinstance(x, tuple) else (x,)))
            else:
                # torch's non-reentrant checkpoint: works under torch.autograd.grad (zero-bubble's input passes)
                x = checkpoint(self._run, start, end, x, use_reentrant=False)
        return x


class PipelineModule(nn.Module):
    """Layers cut into `num_stages` pipeline stages (DeepSpeed's `PipelineModule`). `loss_fn(output, labels)`
    runs on the last stage. `partition_method`: "parameters" (balance trainable parameter counts, DeepSpeed's
    default), "uniform" (balance layer counts) or "type:REGEX" (balance the layers whose class name matches).
    `seed_layers`: build LayerSpec i under seed `base_seed + i` (through `seed_fn(seed)` when given), so a layer's
    initial weights do not depend on which rank builds it. `activation_checkpoint_interval` (layers; 0: none; the
    config's `pipeline.activation_checkpoint_interval` when 0 here), each run of that many layers checkpointed
    through `activation_checkpoint_func(run, *inputs)` (default: torch's non-reentrant checkpoint, e.g.
    `zerotrain.checkpointing.checkpoint`) when DeepSpeed's rule admits it (`checkpointable`: the classes named in
    `checkpointable_layers`, else runs holding parameters). `dynamic_shape=True` (activations whose shape changes
    between steps) is refused. Train it with `zerotrain.initialize(model=...)` and `engine.train_batch(data_iter)`."""

    build_at_construction = True  # this rank's stage built in __init__ when torch.distributed is up

    def __init__(self, layers: Sequence[Any], num_stages: int, loss_fn: Optional[Callable] = None,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 seed_layers: bool = False, base_seed: int = 1234, topology: Any = None,
                 layer_names: Optional[Sequence[str]] = None, seed_fn: Optional[Callable[[int], Any]] = None,
                 activation_checkpoint_func: Optional[Callable] = None,
                 checkpointable_layers: Optional[Sequence[str]] = None, dynamic_shape: bool = False) -> None:
        super().__init__()
        if topology is not None:
            raise ValueError("PipelineModule(topology=...): zerotrain builds the grid from the config and "
                             "num_stages (pipeline x data x sequence x tensor); leave topology out")
        if dynamic_shape:
            raise ValueError("PipelineModule(dynamic_shape=True): zerotrain's pipeline stages send activations of "
                             "the shape of the first micro-batch; pad the inputs to one shape and leave dynamic_shape "
                             "out")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, (list, tuple)):
            raise TypeError(f"PipelineModule: checkpointable_layers must be a list of class names, got "
                            f"{type(checkpointable_layers).__name__}")
        if activation_checkpoint_func is not None and not callable(activation_checkpoint_func):
            raise TypeError("PipelineModule: activation_checkpoint_func must be callable")
        self.seed_fn = seed_fn
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = None if checkpointable_layers is None else list(checkpointable_layers)
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineModule: num_stages must be a positive int, got {num_stages!r}")
        self._specs = list(layers)
        if not self._specs:
            raise ValueError("PipelineModule: layers is empty")
        for index, layer in enumerate(self._specs):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"PipelineModule: layers[{index}] is {type(layer).__name__}, not a LayerSpec, "
                                "TiedLayerSpec, nn.Module or callable")
        if len(self._specs) < num_stages:
            raise ValueError(f"PipelineModule: {len(self._specs)} layers cannot fill num_stages={num_stages} "
                             "pipeline stages (each stage needs at least one layer)")
        self.num_stages = num_stages
        # the dotted name each layer is registered under (default: its index, DeepSpeed's names; pipe.hf: the
        # Hugging Face model's own, `model.layers.3`, so checkpoints carry the plain model's names)
        self.layer_names = [str(i) for i in range(len(self._specs))] if layer_names is None else list(layer_names)
        if len(self.layer_names) != len(self._specs):
            raise ValueError(f"PipelineModule: {len(self.layer_names)} layer_names for {len(self._specs)} layers")
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self._check_partition_method(partition_method)
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.seed_layers, self.base_seed = bool(seed_layers), int(base_seed)
        self.pieces: list[Piece] = []       # this rank's pieces, after build()
        self.bounds: list[int] = []         # piece p holds layers [bounds[p], bounds[p + 1])
        self.tied_owners: dict[str, list[int]] = {}  # tied key -> the pipeline ranks holding it (sorted)
        self._built_as: Optional[tuple] = None  # (piece indices, pieces, seeded) of the build, once built
        self._engine_built = False              # built by initialize (not only at construction)
        self._count_like_deepspeed = False      # the "parameters" count builds each layer for real (construction)
        self._build_at_construction()

    def _build_at_construction(self) -> None:
        """With torch.distributed up (DeepSpeed programs call `deepspeed.init_distributed()` first), build this
        rank's stage now, as DeepSpeed's PipelineModule does: one piece per rank, stage = rank // (world /
        num_stages) (zerotrain's grid, pipeline outermost, is DeepSpeed's), so `self.parameters()` is the stage's
        own (a program passes `model_parameters=[p for p in net.parameters() if p.requires_grad]`). The
        "parameters" cut builds every layer once on the CPU to count it, as DeepSpeed does (same draws from
        torch's generator: the same initial weights). `initialize` keeps this build when the config's placement
        is the same, else builds again (`build`)."""
        import torch.distributed as dist

        if not (self.build_at_construction and dist.is_available() and dist.is_initialized()):
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % self.num_stages or len(self._specs) < self.num_stages:
            return  # refused by initialize's checks, naming the key
        stage = rank // (world // self.num_stages)
        self._count_like_deepspeed = True
        try:
            self.build([stage], lambda piece: piece, self.num_stages)
        finally:
            self._count_like_deepspeed = False

    @property
    def parts(self) -> list[int]:
        """DeepSpeed's name for the cut: stage s holds layers [parts[s], parts[s + 1]) (empty before the build)."""
        return list(self.bounds)

    @staticmethod
    def _check_partition_method(method: str) -> None:
        if method in ("parameters", "uniform") or (isinstance(method, str) and method.startswith("type:")):
            if isinstance(method, str) and method.startswith("type:"):
                try:
                    re.compile(method[5:])
                except re.error as err:
                    raise ValueError(f"PipelineModule: partition_method {method!r}: bad regular expression ({err})")
            return
        raise ValueError(f"PipelineModule: partition_method must be 'parameters', 'uniform' or 'type:REGEX', "
                         f"got {method!r}")

    # --- the cut ------------------------------------------------------------------
    def _layer_weights(self) -> list[float]:
        method = self.partition_method  # "uniform" is cut by layer counts (`partition`), without weights
        if method.startswith("type:"):
            pattern = re.compile(method[5:], re.IGNORECASE)
            names = [(spec.typename if isinstance(spec, LayerSpec) else type(spec)).__name__ for spec in self._specs]
            weights = [1.0 if pattern.search(name) else 0.0 for name in names]
            if not any(weights):
                raise ValueError(f"PipelineModule: partition_method {method!r} matches no layer ({sorted(set(names))})")
            return weights
        if self._count_like_deepspeed:  # each layer built on the CPU, one at a time (DeepSpeed's
            out = []                                         # _count_layer_params: the same generator draws)
            for spec in self._specs:
                module = spec.build() if isinstance(spec, LayerSpec) else spec
                out.append(float(sum(p.numel() for p in module.parameters() if p.requires_grad))
                           if isinstance(module, nn.Module) else 0.0)
                del module
            return out
        # "parameters": the trainable ones, counted on the meta device (nothing allocated)
        return [float(sum(numel for numel, trainable in layer if trainable)) for layer in self.layer_parameters()]

    def layer_parameters(self) -> list[list[tuple[int, bool]]]:
        """(numel, requires_grad) of each layer's parameters, layer by layer (a LayerSpec built on the meta
        device, nothing allocated; a tied layer's copy counted at every position: each stage holding it keeps
        one): what `zerotrain estimate` counts per stage."""
        out = []
        for spec in self._specs:
            if isinstance(spec, LayerSpec):
                with torch.device("meta"):
                    module = spec.build()
            else:
                module = spec
            out.append([(p.numel(), p.requires_grad) for p in module.parameters()]
                       if isinstance(module, nn.Module) else [])
        return out

    def partition(self, pieces: int) -> list[int]:
        """Boundaries of `pieces` contiguous non-empty pieces balanced by `partition_method`."""
        if len(self._specs) < pieces:
            raise ValueError(f"PipelineModule: {len(self._specs)} layers cannot fill {pieces} pipeline pieces "
                             f"(num_stages={self.num_stages} x pipeline.stages_per_rank="
                             f"{pieces // self.num_stages}; each piece needs at least one layer)")
        if self.partition_method == "uniform":  # DeepSpeed's: layer counts, no weights
            return partition_uniform(len(self._specs), pieces)
        return partition_balanced(self._layer_weights(), pieces)

    # --- building this rank's pieces -------------------------------------------------
    def build(self, piece_indices: Sequence[int], rank_of_piece: Callable[[int], int], pieces: int,
              interval: int = 0, seed_layers: bool = False) -> list[Piece]:
        """Build the layers of this rank's pieces (`piece_indices`, in order) out of `pieces`; register them as
        children named by global layer index; record which pipeline ranks hold each tied key."""
        interval = self.activation_checkpoint_interval or int(interval)
        seed = self.seed_layers or seed_layers
        wanted = (tuple(piece_indices), int(pieces), bool(seed))
        if self.pieces and self._built_as == wanted and not self._engine_built:
            for piece in self.pieces:  # built at construction as this config places it: kept
                piece._interval = interval
            self._engine_built = True
            return self.pieces
        if self.pieces and self._engine_built:
            raise RuntimeError("PipelineModule.build: already built (one engine per PipelineModule)")
        if self.pieces:  # built at construction, placed otherwise by the config: built again
            self._unbuild()
        self.bounds = self.partition(pieces)
        for piece in range(pieces):
            for index in range(self.bounds[piece], self.bounds[piece + 1]):
                spec = self._specs[index]
                if isinstance(spec, TiedLayerSpec):
                    owners = self.tied_owners.setdefault(spec.key, [])
                    if rank_of_piece(piece) not in owners:
                        owners.append(rank_of_piece(piece))
        for owners in self.tied_owners.values():
            owners.sort()
        tied: dict[str, nn.Module] = {}
        built: list[Piece] = []
        for piece in piece_indices:
            layers = []
            for index in range(self.bounds[piece], self.bounds[piece + 1]):
                spec = self._specs[index]
                forward_fn = spec.forward_fn if isinstance(spec, LayerSpec) else None
                if isinstance(spec, TiedLayerSpec):
                    if spec.key not in tied:
                        tied[spec.key] = self._build_one(index, spec, seed)
                    layer = tied[spec.key]
                elif isinstance(spec, LayerSpec):
                    layer = self._build_one(index, spec, seed)
                else:
                    layer = spec
                if isinstance(layer, nn.Module):
                    self._register(self.layer_names[index], layer)
                layers.append((index, layer, forward_fn))
            built.append(Piece(piece, layers, interval, self.activation_checkpoint_func, self._is_checkpointable))
        self.pieces = built
        self._built_as, self._engine_built = wanted, not self._count_like_deepspeed
        self._tied_modules = tied
        self._tied_specs = {spec.key: spec for spec in self._specs if isinstance(spec, TiedLayerSpec)}
        return built

    def _unbuild(self) -> None:
        """Drop this rank's built layers (a construction-time build the config places otherwise)."""
        for piece in self.pieces:
            for index, layer, _ in piece._layers:
                if isinstance(layer, nn.Module):
                    self._modules.pop(self.layer_names[index].split(".")[0], None)
        self.pieces, self.bounds, self.tied_owners, self._built_as = [], [], {}, None

    def _register(self, name: str, layer: nn.Module) -> None:
        """Register `layer` under the dotted `name`, making plain container modules for its parents."""
        parent: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        parent.add_module(leaf, layer)

    def _build_one(self, index: int, spec: LayerSpec, seed: bool) -> nn.Module:
        if not seed:
            return spec.build()
        with torch.random.fork_rng(devices=[]):
            (self.seed_fn or torch.manual_seed)(self.base_seed + index)
            return spec.build()

    def _is_checkpointable(self, layers: Sequence[Any]) -> bool:
        """Whether a run of this model's layers is checkpointed (`checkpointable`, DeepSpeed's rule)."""
        return checkpointable(layers, self.checkpointable_layers, type(self).__name__)

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """This rank's parameters of tied key `key` (empty when it holds none), in a fixed order."""
        module = self._tied_modules.get(key)
        if module is None:
            return []
        attrs = self._tied_specs[key].tied_weight_attr
        if attrs is None:
            return [param for _, param in sorted(module.named_parameters())]
        params = []
        for attr in attrs:
            obj: Any = module
            for part in attr.split("."):
                obj = getattr(obj, part)
            params.append(obj)
        return params

    def tied_owner_name(self, name: str) -> str:
        """The name a tied layer's parameter `name` (\"<layer name>.<attr>\") has at the key's first position
        (`4.wte.weight` -> `0.wte.weight`; pipe.hf: `lm_head.weight` -> `model.embed_tokens.weight`): where one
        copy of it is saved; other names are returned as they are."""
        index = max((i for i, layer in enumerate(self.layer_names) if name.startswith(layer + ".")),
                    key=lambda i: len(self.layer_names[i]), default=None)
        spec = self._specs[index] if index is not None else None
        if not isinstance(spec, TiedLayerSpec):
            return name
        first = next(i for i, s in enumerate(self._specs) if isinstance(s, TiedLayerSpec) and s.key == spec.key)
        return self.layer_names[first] + name[len(self.layer_names[index]):]

    def train(self, mode: bool = True) -> "PipelineModule":
        super().train(mode)
        for piece in self.pieces:  # not children (their layers are ours): follow our mode
            piece.training = mode
        return self

    def forward(self, *args: Any) -> Any:
        """This rank's pieces in order: the whole model when one rank holds every piece (pipeline size 1)."""
        if not self.pieces:
            raise RuntimeError("PipelineModule runs through zerotrain.initialize(model=...) and "
                               "engine.train_batch(data_iter) / eval_batch(data_iter)")
        out = args
        for piece in self.pieces:
            out = piece(*(out if isinstance(out, tuple) else (out,)))
        return out
