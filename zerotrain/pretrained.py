"""A Hugging Face model partitioned from the start: `zerotrain.from_pretrained`, and `HfDeepSpeedConfig`.

With DeepSpeed a user's script makes transformers' `from_pretrained` build a ZeRO-3 model partitioned
(never whole on one rank) by keeping a `transformers.integrations.HfDeepSpeedConfig(ds_config)` alive;
transformers then builds under DeepSpeed's `zero.Init` and loads the weights one gathered module at a
time. Here the same effect is one call:

    model = zerotrain.from_pretrained(AutoModelForCausalLM, "path/to/dir", config=ds_config)

At ZeRO stage 3 the model is built under `zerotrain.zero.Init(config)` without running transformers'
initializers, and each rank reads only its own chunk of every weight from the directory's safetensors
files (sharded or not; rows covering the chunk, through safetensors' slices), so no rank ever holds a
whole weight matrix, let alone the model. Below stage 3 it is transformers' `from_pretrained`. The model
goes to `zerotrain.initialize(model=...)` as any other.

`HfDeepSpeedConfig` / `is_deepspeed_zero3_enabled` are transformers' names (what `zerotrain port` maps
their imports to): while an `HfDeepSpeedConfig` with stage 3 is alive, `is_deepspeed_zero3_enabled()` is
True, `zerotrain.from_pretrained(..., config=None)` uses its config, and transformers' own
`from_pretrained` (any Auto class or model class) builds partitioned under `zerotrain.zero.Init` of that
config, as DeepSpeed scripts (DeepSpeed-Chat) expect; when the object is collected it is plain again.

transformers' own `from_pretrained` called inside `zerotrain.zero.Init` (as DeepSpeed users write it inside
`deepspeed.zero.Init`) is routed here too (`partitioned_from_pretrained`, through `zero`'s Init extension),
never through transformers' DeepSpeed branch: the same partitioned build and chunked read, with
`from_pretrained`'s own handling of the config, its keyword overrides, `dtype`, the generation config and
`eval()`. What it cannot do partitioned (quantization, device maps, a `state_dict`, hub ids, ...) is refused
by the argument's name.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from .zero import Init
from .zero.stage3 import ZeroParameter
from .zero.stage3.context import register_init_extension

__all__ = ["from_pretrained", "partitioned_from_pretrained", "install_transformers_zero3_branches", "HfDeepSpeedConfig", "is_deepspeed_zero3_enabled"]

_live: Optional["weakref.ref[HfDeepSpeedConfig]"] = None


class HfDeepSpeedConfig:
    """transformers' `HfDeepSpeedConfig(config_file_or_dict)`: keeps the config of the run; while it is alive
    `is_deepspeed_zero3_enabled()` says whether it is stage 3 (the object must be kept referenced, as
    transformers requires)."""

    def __init__(self, config_file_or_dict: Union[dict, str, os.PathLike]) -> None:
        global _live
        self.config = _read(config_file_or_dict)
        _live = weakref.ref(self)
        _sync_config_redirect()
        weakref.finalize(self, _sync_config_redirect)  # plain from_pretrained again once it is collected

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at a dotted key (`zero_optimization.stage`), or `default`."""
        node: Any = self.config
        for key in ds_key_long.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node

    def is_zero3(self) -> bool:
        return self.get_value("zero_optimization.stage", 0) == 3

    def is_zero2(self) -> bool:
        return self.get_value("zero_optimization.stage", 0) == 2

    def is_offload(self) -> bool:
        return any(self.get_value(f"zero_optimization.{key}.device", "none") in ("cpu", "nvme")
                   for key in ("offload_optimizer", "offload_param"))


def is_deepspeed_zero3_enabled() -> bool:
    """True while an `HfDeepSpeedConfig` of stage 3 is alive (transformers' function of the same name)."""
    live = _live() if _live is not None else None
    return live is not None and live.is_zero3()


def _read(config: Union[dict, str, os.PathLike]) -> dict:
    if isinstance(config, dict):
        return config
    with open(config, encoding="utf-8") as handle:
        return json.load(handle)


def _dtype_of(config: dict) -> torch.dtype:
    """The training dtype a DeepSpeed config asks for (bf16 / fp16 blocks), fp32 otherwise."""
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        if (config.get(key) or {}).get("enabled") is True:
            return dtype
    return torch.float32


def from_pretrained(model_class: Any, pretrained_model_name_or_path: Union[str, os.PathLike],
                    config: Union[dict, str, os.PathLike, None] = None, dtype: Optional[torch.dtype] = None,
                    **kwargs: Any) -> torch.nn.Module:
    """`model_class.from_pretrained(path)` for a ZeRO run (`model_class`: an Auto class or a model class).

    At ZeRO stage 3 (`config`, or a live `HfDeepSpeedConfig`'s) the model is built under `zerotrain.zero.Init`
    and every rank reads only its shard of each weight from the local directory's safetensors files: the model
    is never whole on one rank. Collective at stage 3 (every rank calls it). `dtype`: the weights' dtype (default:
    the config's bf16/fp16, else fp32). Other keywords are `from_pretrained`'s (at stage 3 as
    `partitioned_from_pretrained` takes them: config overrides, `attn_implementation`, ...).
    """
    if config is None and _live is not None and _live() is not None:
        config = _live().config
    raw = _read(config) if config is not None else {}
    dtype = dtype or _dtype_of(raw)
    if (raw.get("zero_optimization") or {}).get("stage", 0) != 3:
        return model_class.from_pretrained(pretrained_model_name_or_path, dtype=dtype, **kwargs)
    from transformers import AutoConfig
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    if isinstance(model_class, type) and issubclass(model_class, _BaseAutoModelClass):
        hf_config = AutoConfig.from_pretrained(pretrained_model_name_or_path, local_files_only=True)
        model_class = model_class._model_mapping[type(hf_config)]
    return _stage3_from_pretrained(model_class, pretrained_model_name_or_path, raw, dtype, (), kwargs)


def _stage3_from_pretrained(model_class: Any, pretrained_model_name_or_path: Union[str, os.PathLike], raw: dict,
                            dtype: torch.dtype, model_args: tuple, kwargs: dict) -> torch.nn.Module:
    """`model_class` (a model class) loaded partitioned under `zerotrain.zero.Init(raw, dtype)`; `kwargs` are
    transformers' `from_pretrained` keywords (its `config` is the model's config, not the ZeRO one)."""
    with Init(config=raw, dtype=dtype) as init:
        return partitioned_from_pretrained(model_class, pretrained_model_name_or_path, *model_args, init=init,
                                           **kwargs)


def _build_and_load(model_class: Any, hf_config: Any, files: dict[str, Path], dtype: torch.dtype,
                    model_kwargs: dict) -> torch.nn.Module:
    """Build `model_class` from `hf_config` inside the caller's `zero.Init` (partitioned as each module is made,
    transformers' initializers skipped), tie its weights, and write every rank's chunks from `files`."""
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten by the load below
        model = model_class._from_config(hf_config, dtype=dtype, **model_kwargs)
    model.tie_weights()  # no_init_weights skipped init_weights, which also ties the embeddings
    _load_shards(model, files)
    return model


# transformers' from_pretrained arguments a partitioned load cannot honour (name -> why / what to do instead).
_REFUSED_UNDER_INIT = {
    "state_dict": "the weights are read from the directory's safetensors files, each rank its own chunks",
    "device_map": "zerotrain places the partitioned model (the engine moves each shard)",
    "max_memory": "zerotrain places the partitioned model",
    "offload_folder": "use the config's offload_param instead",
    "quantization_config": "quantized loading is not supported partitioned",
    "gguf_file": "GGUF files are not read partitioned",
    "tp_plan": "use the config's tensor_parallel block",
    "tp_size": "use the config's tensor_parallel block",
    "device_mesh": "use the config's tensor_parallel block",
    "distributed_config": "use the config's tensor_parallel block",
    "use_kernels": "hub kernels are not supported partitioned",
    "key_mapping": "checkpoint names are read as the model names them",
    "output_loading_info": "missing weights are refused by name instead",
    "ignore_mismatched_sizes": "a weight whose shape differs from the model's is an error",
    "from_tf": "only safetensors directories are read",
    "from_flax": "only safetensors directories are read",
}
# Download/cache arguments that mean nothing for a local directory (accepted, as transformers does offline).
_HUB_ONLY = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "_from_auto",
             "_from_pipeline", "trust_remote_code", "use_safetensors", "weights_only", "variant", "tqdm_class",
             "low_cpu_mem_usage", "adapter_name", "disable_mmap")


def partitioned_from_pretrained(model_class: Any, pretrained_model_name_or_path: Union[str, os.PathLike],
                                *model_args: Any, init: Init, **kwargs: Any) -> torch.nn.Module:
    """`model_class.from_pretrained(path, **kwargs)` (transformers' arguments) built partitioned inside the
    active `init` (a `zerotrain.zero.Init`), every rank reading only its chunk of each weight: what transformers'
    own `from_pretrained` does inside `zerotrain.zero.Init`, and the call a live stage-3 `HfDeepSpeedConfig`
    routes it to. As transformers': the config (or `config=`, a config or a path) with keyword overrides,
    `attn_implementation`, `dtype` ("auto": the checkpoint's; `Init(dtype=)` casts over it), the generation
    config, `eval()` mode. Refused by name: what a partitioned load cannot honour (`_REFUSED_UNDER_INIT`), a
    name that is not a local directory of safetensors files. Collective: every rank calls it."""
    if model_args:
        raise TypeError(f"{model_class.__name__}.from_pretrained inside zerotrain.zero.Init: positional model "
                        "arguments are not supported; pass them as keywords (they go to the config)")
    for name, why in _REFUSED_UNDER_INIT.items():
        if kwargs.get(name) not in (None, False, {}):
            raise ValueError(f"{model_class.__name__}.from_pretrained(..., {name}=...) inside zerotrain.zero.Init: "
                             f"not supported ({why})")
        kwargs.pop(name, None)  # given but off (DeepSpeed-Chat passes from_tf=False): not a model argument
    adapter = (kwargs.pop("adapter_kwargs", None) or {}).get("_adapter_model_path")  # the Auto classes' lookup
    if adapter is not None or (Path(pretrained_model_name_or_path) / "adapter_config.json").is_file():
        raise ValueError(f"{pretrained_model_name_or_path}: a PEFT adapter directory; inside zerotrain.zero.Init "
                         "load its base model with from_pretrained, then the adapter with peft")
    hub = {name: kwargs.pop(name) for name in _HUB_ONLY if name in kwargs}
    if hub.get("variant"):
        raise ValueError(f"{model_class.__name__}.from_pretrained(..., variant=...) inside zerotrain.zero.Init: "
                         "not supported (the directory's model.safetensors / its index are read)")
    directory = Path(pretrained_model_name_or_path) / kwargs.pop("subfolder", "")
    if not directory.is_dir():
        raise FileNotFoundError(f"{pretrained_model_name_or_path}: not a local directory; from_pretrained inside "
                                "zerotrain.zero.Init reads a local model directory (download it first, e.g. "
                                "huggingface_hub.snapshot_download)")
    files = _weight_files(directory)
    generation_config = kwargs.pop("generation_config", None)
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)  # transformers' older name
    dtype = dtype if dtype is not None else torch_dtype
    config = kwargs.pop("config", None)
    from transformers import PretrainedConfig

    if isinstance(config, PretrainedConfig):
        config, model_kwargs = copy.deepcopy(config), kwargs
    else:
        config, model_kwargs = model_class.config_class.from_pretrained(
            config if config is not None else directory, return_unused_kwargs=True, **kwargs)
    if init.dtype is not None:
        dtype = init.dtype  # Init casts every parameter it partitions to its dtype
    elif dtype is None or dtype == "auto":
        dtype = _checkpoint_dtype(config, files)
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config.name_or_path = str(pretrained_model_name_or_path)
    init.wrap_new_classes()  # the model's classes, imported by an Auto class after Init was entered
    model = _build_and_load(model_class, config, files, dtype, model_kwargs)
    model.eval()  # as from_pretrained leaves it
    if model.can_generate():
        from transformers import GenerationConfig

        if generation_config is not None:
            model.generation_config = generation_config
        elif (directory / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(directory)
    return model


def _checkpoint_dtype(config: Any, files: dict[str, Path]) -> torch.dtype:
    """transformers' `dtype="auto"`: the config's `dtype`, else the first floating weight's in the files."""
    given = getattr(config, "dtype", None)
    if isinstance(given, str):
        given = getattr(torch, given)
    if isinstance(given, torch.dtype):
        return given
    from safetensors import safe_open

    for name, path in files.items():
        with safe_open(path, "pt") as handle:
            dtype = handle.get_slice(name).get_dtype()
        floating = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
        if dtype in floating:
            return floating[dtype]
    return torch.float32


def _redirect_from_pretrained(load: Callable[..., torch.nn.Module]) -> Callable[[], None]:
    """Make transformers' `PreTrainedModel.from_pretrained` (and every Auto class, which calls it on the model
    class it picks) call `load(plain, cls, path, *model_args, **kwargs)`, `plain` being the function it replaced;
    returns the undo, which restores that unless another redirect has replaced this one since (redirects nest:
    an Init inside a live config's load)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]

    def redirected(cls: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        return load(original.__func__, cls, *args, **kwargs)

    redirect = classmethod(redirected)
    PreTrainedModel.from_pretrained = redirect
    install_transformers_zero3_branches()

    def undo() -> None:
        if PreTrainedModel.__dict__.get("from_pretrained") is redirect:
            PreTrainedModel.from_pretrained = original

    return undo


@contextlib.contextmanager
def _route_from_pretrained(init: Init) -> Any:
    """While `init` is active, transformers' `PreTrainedModel.from_pretrained` (and every Auto class, which calls
    it) builds partitioned through `partitioned_from_pretrained`. Only when transformers is already imported (a
    script calling it has imported it before entering Init)."""
    import sys

    if "transformers" not in sys.modules:
        yield
        return

    def from_pretrained_under_init(plain: Any, cls: Any, pretrained_model_name_or_path: Any, *model_args: Any,
                                   **kwargs: Any) -> torch.nn.Module:
        return partitioned_from_pretrained(cls, pretrained_model_name_or_path, *model_args, init=init, **kwargs)

    undo = _redirect_from_pretrained(from_pretrained_under_init)
    try:
        yield
    finally:
        undo()


_config_redirect: list = []  # the undo of the redirect a live stage-3 HfDeepSpeedConfig installed


def _sync_config_redirect() -> None:
    """Redirect transformers' `from_pretrained` to a partitioned load while a stage-3 `HfDeepSpeedConfig` is
    alive (transformers builds under DeepSpeed's zero.Init then), undo it when none is (the object collected,
    or a later one below stage 3 replacing it)."""
    if is_deepspeed_zero3_enabled() and not _config_redirect:
        _config_redirect.append(_redirect_from_pretrained(_from_pretrained_under_config))
    elif not is_deepspeed_zero3_enabled() and _config_redirect:
        _config_redirect.pop()()


def _from_pretrained_under_config(plain: Any, cls: Any, pretrained_model_name_or_path: Any, *model_args: Any,
                                  **kwargs: Any) -> torch.nn.Module:
    """transformers' `from_pretrained` while a stage-3 `HfDeepSpeedConfig` is alive: built partitioned under
    `zerotrain.zero.Init` of its config (its bf16/fp16 dtype, as DeepSpeed's zero.Init casts)."""
    live = _live() if _live is not None else None
    if live is None or not live.is_zero3():  # collected while a nested redirect (an Init's) kept this one in place
        return plain(cls, pretrained_model_name_or_path, *model_args, **kwargs)
    return _stage3_from_pretrained(cls, pretrained_model_name_or_path, live.config, _dtype_of(live.config),
                                   model_args, kwargs)


register_init_extension(_route_from_pretrained)

_installed: list = []


def install_transformers_zero3_branches() -> None:
    """Make transformers' `resize_token_embeddings`, whose ZeRO-3 handling keys on DeepSpeed
    (`is_deepspeed_zero3_enabled()`), right on a model holding zerotrain's partitioned parameters
    (`resize_partitioned_token_embeddings`), without switching transformers into DeepSpeed mode. Installed once,
    by `zerotrain.zero.Init` entered with transformers imported and by `zerotrain.hf`; on a model whose embeddings
    are not partitioned it is transformers' own. (`generate`'s other DeepSpeed branch, `synced_gpus`, is the
    engine's: `zero.forward_only` sets it on the model it partitions.)"""
    if _installed:
        return
    from transformers import PreTrainedModel

    resize = PreTrainedModel.__dict__["resize_token_embeddings"]

    @functools.wraps(resize)
    def resize_token_embeddings(self: Any, *args: Any, **kwargs: Any) -> Any:
        return resize_partitioned_token_embeddings(self, resize, *args, **kwargs)

    PreTrainedModel.resize_token_embeddings = resize_token_embeddings
    _installed.append(resize)


def resize_partitioned_token_embeddings(model: Any, resize: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' `resize_token_embeddings` (`resize`, called with `args`/`kwargs`) on a model whose embeddings
    `zero.Init` partitioned: gather them whole, resize them with transformers' own code (new rows initialised as it
    initialises them on a whole model; rank 0's draw kept, as DeepSpeed's branch does), partition the results
    again. transformers' branch for this keys on DeepSpeed (`is_deepspeed_zero3_enabled()`); on zerotrain's
    partitioned parameters its whole-model branch would read the released placeholders. Before the engine is
    built only (it holds the shards' optimizer state). Collective: every rank calls it."""
    from .zero import GatheredParameters
    from .zero.stage3.partition import partition_parameter, state_dict_placeholders

    embeddings = [module for module in (model.get_input_embeddings(), model.get_output_embeddings())
                  if module is not None]
    partitioned = {id(module.weight): module.weight for module in embeddings
                   if isinstance(module.weight, ZeroParameter)}
    if not partitioned:
        return resize(model, *args, **kwargs)
    parts = [param._zero for param in partitioned.values()]
    for part in parts:
        if part.owner.fetcher is not None:
            raise RuntimeError("resize_token_embeddings on a model an engine already trains: resize before "
                               "zerotrain.initialize (with zerotrain.hf.Trainer: before trainer.train())")
        if part.offloaded:
            raise NotImplementedError("resize_token_embeddings on a model whose zero.Init wrote its shards to NVMe "
                                      "(offload_param): build it without the offload config, resize, then train")
    group, owner = parts[0].group, parts[0].owner
    whole = {}
    with GatheredParameters(list(partitioned.values())), torch._C.DisableTorchFunctionSubclass():
        for key, param in partitioned.items():
            whole[key] = torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
    for module in model.modules():  # every module holding one (tied weights: the same whole parameter)
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in whole:
                setattr(module, name, whole[id(param)])
    result = resize(model, *args, **kwargs)
    resized = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None and not isinstance(module.weight, ZeroParameter):
            resized[id(module.weight)] = module.weight
    with torch.no_grad():
        for param in resized.values():
            values = param.data.contiguous()
            group.comm.broadcast(values, src=0)  # rank 0's new rows (their draw uses each rank's generator)
            param.data = values
            partition_parameter("weight", param, group, owner=owner)
    state_dict_placeholders(model)
    return result


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (`model.safetensors`, or the index's shards)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json "
                                "(zerotrain.from_pretrained reads local safetensors directories)")
    from safetensors import safe_open

    with safe_open(single, "pt") as handle:
        return {name: single for name in handle.keys()}


def _load_shards(model: torch.nn.Module, files: dict[str, Path]) -> None:
    """Write each parameter's values from the files: a partitioned one only its chunk (read as the rows that
    cover it), a whole one (and each persistent buffer) entirely. Tied parameters are read once."""
    from safetensors import safe_open

    handles: dict[Path, Any] = {}
    key_of = _checkpoint_keys(model, files)
    with contextlib.ExitStack() as stack:
        def open_slice(name: str):
            key = key_of(name)
            path = files[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, "pt"))
            return handles[path].get_slice(key)

        missing = [name for name, _ in model.named_parameters() if key_of(name) not in files]
        if missing:
            raise KeyError(f"zerotrain.from_pretrained: {missing[:5]} are not in the checkpoint's files")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if isinstance(param, ZeroParameter):
                    part = param._zero
                    part.write_shard(_read_chunk(open_slice(name), part.numel, *part.shard_bounds(),
                                                 part.dtype, part.device))
                else:
                    param.data.copy_(open_slice(name)[...])  # `[...]`: a 0-dim slice refuses `[:]`
            buffers = {name: buffer for name, buffer in model.named_buffers() if key_of(name) in files}
            for name, buffer in buffers.items():
                buffer.copy_(open_slice(name)[...])


def _checkpoint_keys(model: torch.nn.Module, files: dict[str, Path]):
    """The checkpoint's name for each of the model's names, by transformers' base-model prefix rule: a base
    model (`AutoModel`, e.g. DeepSpeed-Chat's reward model) read from a checkpoint of its model with a head has
    its names under `base_model_prefix.` there; a model with a head read from a base model's checkpoint has
    them without it."""
    prefix = model.base_model_prefix + "." if model.base_model_prefix else ""
    names = [name for name, _ in model.named_parameters()]
    model_prefixed = bool(prefix) and any(name.startswith(prefix) for name in names)
    files_prefixed = bool(prefix) and any(key.startswith(prefix) for key in files)
    if prefix and files_prefixed and not model_prefixed:
        return lambda name: prefix + name
    if prefix and model_prefixed and not files_prefixed:
        return lambda name: name[len(prefix):] if name.startswith(prefix) else name
    return lambda name: name


def _read_chunk(tensor_slice: Any, numel: int, start: int, end: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Elements [start, end) of the flattened tensor (zeros past `numel`: the shard's padding), reading only
    the rows of dimension 0 that hold them."""
    chunk = torch.zeros(end - start, dtype=dtype, device=device)
    stop = min(end, numel)
    if start >= stop:
        return chunk
    shape = tensor_slice.get_shape()
    row = numel // shape[0] if shape else 1
    if not shape:  # a scalar
        chunk[0] = tensor_slice[...]  # safetensors' 0-dim slice refuses `[:]`
        return chunk
    first, last = start // row, -(-stop // row)
    rows = tensor_slice[first:last].reshape(-1)
    chunk[:stop - start] = rows[start - first * row:stop - first * row].to(dtype)
    return chunk
