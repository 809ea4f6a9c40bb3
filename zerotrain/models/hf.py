"""Hugging Face causal LMs for ``zerotrain train``: model directories, config files and presets.

``--model PATH`` names either an existing directory (a local Hugging Face model directory:
``config.json``, ``model.safetensors`` or sharded ``model-*.safetensors`` + index, tokenizer
files) or a preset (:data:`PRESETS`); ``--model-config PATH`` names a ``config.json`` alone
(random init). :func:`resolve_model` turns these into a :class:`ModelSource`, checking every
file a run will read before any process group exists, so a missing or incomplete directory is
one error naming the missing file. :func:`build_model` constructs the model from its config
(any architecture ``AutoModelForCausalLM`` knows; never the hub, never remote code).

Weights are not read here: the caller builds the model (at ZeRO-3 inside ``zerotrain.zero.Init``,
so the whole model never exists on one rank) and then loads the directory with
``engine.load_checkpoint(dir, load_module_only=True)``, whose reader copies exactly each rank's
shard ranges out of the safetensors files (``zerotrain.checkpoint.reader``). transformers' own
ZeRO-3 loading (``from_pretrained`` under ``deepspeed.zero.Init``) switches on only when
DeepSpeed itself is configured, so it cannot do this for us.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

__all__ = ["PRESETS", "ModelError", "ModelSource", "resolve_model", "preset_over_directory", "build_model", "load_tokenizer",
           "preset_config", "tokenizer_files", "byte_tokenizer", "grow_vocab", "write_resized", "check_weights",
           "count_parameters", "LoraOptions", "apply_lora", "adapter_files", "trained_token_rows"]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Any one of these makes a directory loadable with AutoTokenizer (fast tokenizer, or a slow one's config).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")

# The built-in presets, as Llama architectures (so their checkpoints load with from_pretrained).
# They read the byte-level standard-library corpus, hence a 256-entry vocabulary (ids = bytes).
PRESETS: dict[str, dict] = {
    # ~0.1M parameters: tests. Odd MLP width so flat-buffer sharding has to pad.
    "tiny": dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=191,
                 max_position_embeddings=32),
    # ~6M parameters: the demo.
    "small": dict(hidden_size=288, num_hidden_layers=6, num_attention_heads=6, intermediate_size=768,
                  max_position_embeddings=256),
    # ~72M parameters: benchmarks.
    "70m": dict(hidden_size=768, num_hidden_layers=10, num_attention_heads=12, intermediate_size=2048,
                max_position_embeddings=512),
}
_PRESET_COMMON = dict(vocab_size=256, tie_word_embeddings=True, rms_norm_eps=1e-5, use_cache=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)


class ModelError(ValueError):
    """A model, config or tokenizer the run cannot use; the message names the file or preset."""


@dataclass
class ModelSource:
    """What ``--model`` / ``--model-config`` / ``--tokenizer`` resolved to."""

    config: Any                       # a transformers PretrainedConfig
    weights_dir: Optional[str]        # a directory whose safetensors to load; None: random init
    tokenizer_dir: Optional[str]      # a directory AutoTokenizer reads; None: the preset's byte tokenizer
    name: str                         # for messages: the preset name or the path
    preset: Optional[str] = None


def preset_config(name: str):
    """The ``LlamaConfig`` of preset ``name``; an unknown name lists the presets."""
    if name not in PRESETS:
        raise ModelError(f"--model {name!r} is neither an existing directory nor a preset "
                         f"(presets: {', '.join(PRESETS)})")
    from transformers import LlamaConfig

    return LlamaConfig(**PRESETS[name], **_PRESET_COMMON)


def _read_config(path: Path, what: str):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"cannot read {what} {path}: {error}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise ModelError(f"{path} has no 'model_type': not a Hugging Face model config")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        remote = " (its code would have to come from the hub: remote code is not run)" if raw.get("auto_map") else ""
        raise ModelError(f"{path}: model_type {model_type!r} is not a causal-LM architecture this transformers "
                         f"ships{remote}")
    try:
        # A directory's config reads its own file; a lone config file goes through from_dict.
        if path.name == CONFIG:
            return AutoConfig.from_pretrained(str(path.parent), local_files_only=True, trust_remote_code=False)
        from transformers import CONFIG_MAPPING
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds
        raise ModelError(f"cannot read {what} {path}: {error}") from None


def check_weights(directory: Path) -> None:
    """The directory has safetensors weights and every file its index names; else an error naming the file."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ModelError(f"cannot read {index}: {error!r}") from None
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise ModelError(f"model directory {directory} is incomplete: {missing[0]} (named in {INDEX}) is "
                             f"missing" + (f", and {len(missing) - 1} more" if len(missing) > 1 else ""))
        return
    if (directory / SINGLE).is_file():
        return
    others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    hint = f" (found {', '.join(others[:3])}; only {SINGLE} or a sharded {INDEX} set is read)" if others else ""
    raise ModelError(f"model directory {directory} has no weights: {SINGLE} or {INDEX} is missing{hint}")


def _check_tokenizer(directory: Path, flag: str) -> None:
    if not directory.is_dir():
        raise ModelError(f"{flag} {directory}: no such directory")
    if not any((directory / name).is_file() for name in TOKENIZER_MARKERS):
        raise ModelError(f"{flag} {directory} has no tokenizer: {' or '.join(TOKENIZER_MARKERS)} is missing "
                         f"(give one with --tokenizer DIR)")


def preset_over_directory(model: Optional[str]) -> Optional[str]:
    """When `model` names a preset and also a directory without config.json (e.g. the README's own `tiny/` run
    directory): the line saying the preset is used, as a directory that is no model cannot be what was meant; None
    otherwise (a directory with config.json is the model, whatever its name)."""
    if model is None or model not in PRESETS or not Path(model).is_dir() or (Path(model) / CONFIG).is_file():
        return None
    return (f"--model {model}: ./{model} is a directory without {CONFIG}, not a model; using the built-in preset "
            f"{model!r} (give ./{model} a {CONFIG}, or another name, to train a directory)")


def resolve_model(model: Optional[str], model_config: Optional[str] = None,
                  tokenizer: Optional[str] = None) -> ModelSource:
    """Resolve the command line's model arguments, checking every file they name."""
    if model is not None and model_config is not None:
        raise ModelError("give either --model or --model-config, not both")
    tok_dir = Path(tokenizer).resolve() if tokenizer is not None else None
    if tok_dir is not None:
        _check_tokenizer(tok_dir, "--tokenizer")
    if model_config is not None:
        path = Path(model_config)
        if path.is_dir():
            path = path / CONFIG
        if not path.is_file():
            raise ModelError(f"--model-config {model_config}: {path} does not exist")
        config = _read_config(path.resolve(), "model config")
        if tok_dir is None:
            raise ModelError("--model-config needs --tokenizer DIR (a config file has no tokenizer)")
        return ModelSource(config, None, str(tok_dir), str(path))
    name = model if model is not None else "small"
    directory = Path(name)
    if not directory.is_dir() or preset_over_directory(name) is not None:
        return ModelSource(preset_config(name), None, str(tok_dir) if tok_dir else None, name, preset=name)
    directory = directory.resolve()
    if not (directory / CONFIG).is_file():
        raise ModelError(f"model directory {directory} has no {CONFIG}")
    config = _read_config(directory / CONFIG, "model config")
    check_weights(directory)
    if tok_dir is None:
        _check_tokenizer(directory, "--model")
    return ModelSource(config, str(directory), str(tok_dir or directory), str(directory))


def build_model(source: ModelSource, dtype: torch.dtype = torch.float32, init: Any = None,
                seed: int = 0) -> torch.nn.Module:
    """Construct the model from its config inside the context ``init`` (e.g. ``zerotrain.zero.Init``).

    With weights to load, transformers' initializers are skipped (every weight is overwritten by
    the load); otherwise the model is initialised as transformers does, from ``seed``.
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    torch.manual_seed(seed)
    skip = no_init_weights() if source.weights_dir is not None else contextlib.nullcontext()
    with (init if init is not None else contextlib.nullcontext()), skip:
        model = AutoModelForCausalLM.from_config(source.config, dtype=dtype, trust_remote_code=False)
    if source.weights_dir is not None:
        model.tie_weights()  # no_init_weights skips transformers' init_weights, which also ties the embeddings
    model.config.use_cache = False  # training never uses the KV cache (and packing needs it off)
    return model


def load_tokenizer(source: ModelSource):
    """The run's tokenizer: AutoTokenizer of the tokenizer directory, or the presets' byte tokenizer."""
    if source.tokenizer_dir is None:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.tokenizer_dir, local_files_only=True, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001
        # one line: the file a fast tokenizer needs when it is missing, else transformers' first line
        if not (Path(source.tokenizer_dir) / "tokenizer.json").is_file():
            raise ModelError(f"{source.tokenizer_dir} has no tokenizer.json, and transformers cannot build the "
                             "tokenizer from its other files; add tokenizer.json, or give a tokenizer directory with "
                             "--tokenizer DIR") from None
        why = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ModelError(f"cannot load the tokenizer of {source.tokenizer_dir}: {why}") from None


def byte_tokenizer():
    """A tokenizer whose ids are the UTF-8 bytes (0-255), as the presets' standard-library corpus is.

    Built with ``tokenizers`` (a byte-level BPE with no merges over the 256-symbol byte alphabet), so
    a preset's checkpoint carries a tokenizer ``AutoTokenizer`` loads: ``decode(ids)`` gives the text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one ``pre_tokenizers.ByteLevel`` maps bytes through
    (transformers 5 no longer exports it; ``tokenizers`` exposes only the alphabet, not the order)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files ``tokenizer.save_pretrained`` writes, by name (to be copied into every checkpoint)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zerotrain-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        return {name: Path(tmp, name).read_bytes() for name in sorted(os.listdir(tmp))
                if Path(tmp, name).is_file()}


def grow_vocab(source: ModelSource, tokenizer, add_tokens: Sequence[str] = ()) -> Optional[int]:
    """Add ``add_tokens`` (as special tokens) to the tokenizer; when it then has more tokens than the model's
    vocabulary, set ``config.vocab_size`` to its length and return the old size (None: no resize)."""
    if add_tokens:
        tokenizer.add_tokens(list(add_tokens), special_tokens=True)
    old = int(source.config.vocab_size)
    if len(tokenizer) <= old:
        return None
    source.config.vocab_size = len(tokenizer)
    return old


def write_resized(source: ModelSource, model: torch.nn.Module, old_vocab: int, out_dir: Union[str, Path],
                  seed: int = 0) -> str:
    """Write into the new directory ``out_dir`` an overlay of ``source.weights_dir`` (after :func:`grow_vocab`)
    whose input embedding and output head (weight and bias) have ``config.vocab_size`` rows; returns it.

    The new rows are what transformers' ``resize_token_embeddings`` (``mean_resizing=True``) gives: its own
    ``_get_resized_embeddings`` / ``_get_resized_lm_head`` run on CPU stand-ins holding the file's tensors, from
    ``seed`` (a tied head follows the embedding). Only these tensors are read whole; the overlay links every
    other file, so the loader still reads each rank's shard ranges. Why not resize the model: at ZeRO-3 its
    embedding is partitioned and the engine's optimizer built over it; resizing the file side keeps one
    loading path for every stage. One rank writes it where every rank can read it.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory = Path(source.weights_dir)
    weight_map = _weight_map(directory)
    new_vocab = int(source.config.vocab_size)
    rows = trained_token_rows(model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT-wrapped one: its base
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    # peft's trainable-tokens wrapper (LoRA with new tokens) holds the layer as `original_module`
    embedding, head = (getattr(m, "original_module", m) if m is not None else None for m in (embedding, head))
    names.update({id(getattr(m, "original_module", None)): n for n, m in model.named_modules()
                  if hasattr(m, "original_module")})

    def stored(param_name: str) -> str:
        prefix = getattr(model, "base_model_prefix", "") or ""
        candidates = [param_name, param_name[len(prefix) + 1:] if param_name.startswith(prefix + ".") else
                      f"{prefix}.{param_name}"]
        found = next((c for c in candidates if c in weight_map), None)
        if found is None:
            raise ModelError(f"{directory}: no tensor {param_name!r} to resize to {new_vocab} tokens")
        return found

    def read(name: str) -> torch.Tensor:
        with safe_open(str(directory / weight_map[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    tied = head is not None and head.weight is embedding.weight
    resized: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        emb_name = stored(f"{names[id(embedding)]}.weight")
        old = read(emb_name)
        if old.shape[0] != old_vocab:
            raise ModelError(f"{directory}: {emb_name} has {old.shape[0]} rows, config.json says vocab_size {old_vocab}")
        stand_in = torch.nn.utils.skip_init(torch.nn.Embedding, old.shape[0], old.shape[1], dtype=old.dtype)
        stand_in.weight.data = old
        resized[emb_name] = model._get_resized_embeddings(stand_in, new_vocab, mean_resizing=True).weight.data
        if head is not None and not tied:
            head_name = stored(f"{names[id(head)]}.weight")
            weight = read(head_name)
            bias_name = stored(f"{names[id(head)]}.bias") if head.bias is not None else None
            stand_in = torch.nn.utils.skip_init(torch.nn.Linear, weight.shape[1], weight.shape[0],
                                                bias=bias_name is not None, dtype=weight.dtype)
            stand_in.weight.data = weight
            if bias_name is not None:
                stand_in.bias.data = read(bias_name)
            new_head = model._get_resized_lm_head(stand_in, new_vocab, mean_resizing=True)
            resized[head_name] = new_head.weight.data
            if bias_name is not None:
                resized[bias_name] = new_head.bias.data
        # The rows peft's trainable tokens train start from the (resized) base rows: stored under the deltas'
        # own names, the loader reads them like any weight.
        for delta, module, indices in rows:
            name = stored(f"{module}.weight")
            resized[delta] = (resized[name] if name in resized else read(name))[indices].clone()
    overlay = Path(out_dir)
    overlay.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in resized.items()}, str(overlay / "resized.safetensors"))
    for file in set(weight_map.values()):
        (overlay / file).symlink_to(directory / file)
    index = {name: ("resized.safetensors" if name in resized else file) for name, file in weight_map.items()}
    index.update({name: "resized.safetensors" for name in resized})
    (overlay / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return str(overlay)


def _weight_map(directory: Path) -> dict[str, str]:
    if (directory / INDEX).is_file():
        return json.loads((directory / INDEX).read_text(encoding="utf-8"))["weight_map"]
    from safetensors import safe_open

    with safe_open(str(directory / SINGLE), framework="pt") as handle:
        return {name: SINGLE for name in handle.keys()}


def count_parameters(model: torch.nn.Module) -> int:
    """Whole-model parameter count, also at ZeRO-3 (a partitioned parameter reports its full size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


# --- LoRA through peft --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoraOptions:
    """`zerotrain train --lora-*`: rank, alpha (default 2 * r: a scale of 2, as common LoRA recipes use; peft's
    own default is a fixed 8), dropout, and the modules to adapt (default: peft's per-architecture list, e.g.
    q_proj and v_proj for Llama; ``all-linear`` adapts every linear layer but the output head).
    ``trainable_tokens``: token ids whose rows of the input embedding (and of an untied output head) train in
    full beside the adapter (peft's ``trainable_token_indices``): the tokens ``--add-tokens`` / a chat
    template added, which would otherwise keep their initial rows."""

    r: int
    alpha: Optional[float] = None
    dropout: float = 0.0
    target_modules: Optional[tuple[str, ...]] = None
    trainable_tokens: tuple[int, ...] = ()


def apply_lora(model: torch.nn.Module, options: LoraOptions, base_dir: Optional[str] = None,
               seed: int = 0) -> torch.nn.Module:
    """``model`` wrapped by peft's ``get_peft_model`` with a LoRA adapter: the base frozen, the adapters trainable.

    Runs before ``zerotrain.initialize``: at ZeRO-3 the base was built partitioned under ``zero.Init`` and stays
    so (peft reads only the layers' in/out features; the engine keeps frozen parameters partitioned with no
    gradient buffer and no optimizer state). The adapters are initialised from ``seed``, the same on every rank.
    ``base_dir`` goes into the adapter's config (``base_model_name_or_path``)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModelError("--lora-r needs the `peft` package: pip install 'zerotrain[hf]'") from None
    if options.r < 1:
        raise ModelError(f"--lora-r must be >= 1, got {options.r}")
    if not 0.0 <= options.dropout < 1.0:
        raise ModelError(f"--lora-dropout must be in [0, 1), got {options.dropout}")
    targets = options.target_modules
    if targets is not None and list(targets) == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(r=options.r, lora_alpha=options.alpha if options.alpha is not None else 2 * options.r,
                        lora_dropout=options.dropout, target_modules=list(targets) if isinstance(targets, tuple)
                        else targets, task_type="CAUSAL_LM", base_model_name_or_path=base_dir,
                        trainable_token_indices=_token_rows(model, options.trainable_tokens))
    torch.manual_seed(seed)
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # targets that match no module, a model type peft has no default for
        raise ModelError(f"--lora-target-modules {','.join(targets) if isinstance(targets, tuple) else targets}: "
                         f"{error}") from None


def _token_rows(model: torch.nn.Module, tokens: tuple[int, ...]):
    """peft's ``trainable_token_indices`` for ``tokens``: a list (the input embedding; peft ties a tied head to
    it), or, with an untied output head, the same rows of both by module name (its new rows must learn too)."""
    if not tokens:
        return None
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is embedding.weight:
        return list(tokens)
    names = {id(module): name for name, module in model.named_modules()}
    return {names[id(embedding)]: list(tokens), names[id(head)]: list(tokens)}


def trained_token_rows(model: torch.nn.Module) -> list[tuple[str, str, list[int]]]:
    """``(parameter name, module name in the base model, rows)`` of each peft trainable-tokens delta of a
    PEFT-wrapped ``model`` (``apply_lora`` with ``trainable_tokens``); [] without any."""
    if not hasattr(model, "get_base_model"):
        return []
    base = model.get_base_model()
    prefix = next(name for name, module in model.named_modules() if module is base)
    out = []
    for name, module in base.named_modules():
        adapter = getattr(module, "token_adapter", None)
        if adapter is None or not hasattr(adapter, "token_indices") or getattr(adapter, "tied_adapter", None):
            continue  # a tied head's adapter shares the embedding's rows (and parameter)
        for key, rows in adapter.token_indices.items():
            out.append((f"{prefix}.{name}.token_adapter.trainable_tokens_delta.{key}", name, list(rows)))
    return out


def adapter_files(trainable: dict, model: torch.nn.Module) -> dict[str, bytes]:
    """The PEFT layout of a LoRA adapter (``adapter_model.safetensors`` + ``adapter_config.json``, what
    ``PeftModel.from_pretrained(base, dir)`` reads) from the whole trainable weights under the wrapped model's
    names (``engine.full_state_dict(trainable_only=True)`` on rank 0); {} for an empty dict (other ranks).
    peft itself turns the names into its saved layout (adapter name dropped)."""
    if not trainable:
        return {}
    import tempfile

    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    # save_embedding_layers=False: trainable-token rows are saved as their deltas (peft would otherwise look up
    # the base model's config to see whether the vocabulary grew, and save the whole embedding if it did)
    adapter = get_peft_model_state_dict(model, state_dict=trainable, save_embedding_layers=False)
    files = {"adapter_model.safetensors": save({k: v.contiguous() for k, v in adapter.items()},
                                               metadata={"format": "pt"})}
    with tempfile.TemporaryDirectory() as tmp:
        model.peft_config["default"].save_pretrained(tmp)
        files["adapter_config.json"] = Path(tmp, "adapter_config.json").read_bytes()
    return files
