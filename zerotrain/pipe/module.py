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

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "Piece", "partition_balanced"]


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


def partition_balanced(weights: Sequence[float], parts: int) -> list[int]:
    """Boundaries [0, b1, ..., len(weights)] of `parts` non-empty contiguous runs minimizing the largest run's
    sum (ties: earlier boundaries). An exact dynamic program: O(n² · parts), fine for layer lists."""
    n = len(weights)
    if parts > n:
        raise ValueError(f"{n} layers cannot fill {parts} pipeline pieces")
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + float(weight))
    inf = float("inf")
    # best[k][i]: the smallest largest-run over the first i layers cut into k runs; cut[k][i]: where run k starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


class Piece(nn.Module):
    """One pipeline piece (torch's stage): its layers in order; activation checkpointing every `interval`."""

    def __init__(self, index: int, layers: list[tuple[int, Any, Optional[Callable]]], interval: int) -> None:
        super().__init__()
        self.index = index
        # (global layer index, module or callable, forward_fn or None); modules are registered on the
        # PipelineModule, not here, so each parameter has one name
        self._layers = layers
        self._interval = interval

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
        x = args[0] if len(args) == 1 else args
        interval = self._interval
        if interval <= 0 or not (self.training and torch.is_grad_enabled()):
            return self._run(0, len(self._layers), x)
        for start in range(0, len(self._layers), interval):
            end = min(start + interval, len(self._layers))
            # torch's non-reentrant checkpoint: works under torch.autograd.grad (zero-bubble's input passes)
            x = checkpoint(self._run, start, end, x, use_reentrant=False)
        return x


class PipelineModule(nn.Module):
    """Layers cut into `num_stages` pipeline stages (DeepSpeed's `PipelineModule`). `loss_fn(output, labels)`
    runs on the last stage. `partition_method`: "parameters" (balance trainable parameter counts, DeepSpeed's
    default), "uniform" (balance layer counts) or "type:REGEX" (balance the layers whose class name matches).
    `seed_layers`: build LayerSpec i under seed `base_seed + i`, so a layer's initial weights do not depend on
    which rank builds it. `activation_checkpoint_interval` (layers; 0: none; the config's
    `pipeline.activation_checkpoint_interval` when 0 here). Train it with `zerotrain.initialize(model=...)`
    and `engine.train_batch(data_iter)`."""

    def __init__(self, layers: Sequence[Any], num_stages: int, loss_fn: Optional[Callable] = None,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 seed_layers: bool = False, base_seed: int = 1234, topology: Any = None,
                 layer_names: Optional[Sequence[str]] = None) -> None:
        super().__init__()
        if topology is not None:
            raise ValueError("PipelineModule(topology=...): zerotrain builds the grid from the config and "
                             "num_stages (pipeline x data x sequence x tensor); leave topology out")
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
        method = self.partition_method
        if method == "uniform":
            return [1.0] * len(self._specs)
        if method.startswith("type:"):
            pattern = re.compile(method[5:], re.IGNORECASE)
            names = [(spec.typename if isinstance(spec, LayerSpec) else type(spec)).__name__ for spec in self._specs]
            weights = [1.0 if pattern.search(name) else 0.0 for name in names]
            if not any(weights):
                raise ValueError(f"PipelineModule: partition_method {method!r} matches no layer ({sorted(set(names))})")
            return weights
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
        return partition_balanced(self._layer_weights(), pieces)

    # --- building this rank's pieces -------------------------------------------------
    def build(self, piece_indices: Sequence[int], rank_of_piece: Callable[[int], int], pieces: int,
              interval: int = 0, seed_layers: bool = False) -> list[Piece]:
        """Build the layers of this rank's pieces (`piece_indices`, in order) out of `pieces`; register them as
        children named by global layer index; record which pipeline ranks hold each tied key."""
        if self.pieces:
            raise RuntimeError("PipelineModule.build: already built (one engine per PipelineModule)")
        self.bounds = self.partition(pieces)
        interval = self.activation_checkpoint_interval or int(interval)
        seed = self.seed_layers or seed_layers
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
            built.append(Piece(piece, layers, interval))
        self.pieces = built
        self._tied_modules = tied
        self._tied_specs = {spec.key: spec for spec in self._specs if isinstance(spec, TiedLayerSpec)}
        return built

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
            torch.manual_seed(self.base_seed + index)
            return spec.build()

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
