"""A Hugging Face causal LM split into pipeline layers, under its own parameter names.

`causal_lm_pipeline(model, num_stages)` turns a transformers causal LM with Llama's decoder stack (`model_type`
llama, qwen2, qwen3: `<base>.embed_tokens`, `<base>.layers`, `<base>.norm`, `<base>.rotary_emb`, `lm_head`) into
a `PipelineModule`: the token embedding, each decoder layer, the final norm and the head as layers, balanced by
parameter count (`partition_method`), the embedding on the first stage and the norm and head on the last. With
`tie_word_embeddings` the head is a `TiedLayerSpec` of the embedding (kept equal across stages as DeepSpeed's tied
layers). Every layer is registered under its name in the Hugging Face model (`model.layers.3.mlp.up_proj.weight`,
`lm_head.weight`), so a pipeline checkpoint holds the plain model's names: `from_pretrained` reads it and a plain
ZeRO run resumes it (and the reverse); the tied head's copy on the last stage is an alias of
`model.embed_tokens.weight`, which is how transformers saves a tied model.

The first stage takes `(input_ids[, attention_mask[, position_ids]])` (the forward's order; `pipeline_inputs`
makes it from a batch dict). Between stages the hidden states travel with the 2-D `attention_mask` and the
`position_ids` (all ones and 0..seq-1 when not given, as the model's forward assumes): every stage rebuilds the
rotary cos/sin (the model's own `rotary_emb`) and the causal mask (transformers' `create_causal_mask`, for the
model's attention implementation; packed position ids mark documents) for its layers; the loss is the model's
own `loss_function` (labels shifted inside), without a cache (`use_cache=False`: how packed documents stay apart
in transformers too). Micro-batches must have one shape (pad to the sequence length). Written here because
transformers' `_pp_plan` only names the layer boundaries; torchtitan's split is for its own Llama.

LoRA: a peft `PeftModel` of such a model (`get_peft_model`, adapters applied before the split) is split the same
way, its decoder layers holding peft's adapted linears; every layer is registered under the wrapped model's names
(`base_model.model.model.layers.3.self_attn.q_proj.lora_A.default.weight`), so a pipeline's checkpoint, its
adapter files and `zerotrain merge` see what a run without a pipeline saves. Only the adapters train (the base is
frozen by peft). Adapters on the embedding or the head (peft wrappers around them, trainable tokens) are refused.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError
from .module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["SPLIT_MODEL_TYPES", "CausalLMPipeline", "causal_lm_pipeline", "pipeline_model", "pipeline_inputs",
           "splittable"]

# model types whose causal LM is Llama's stack (every layer full causal attention, no embedding scale)
SPLIT_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class _Built(LayerSpec):
    """A layer that exists already (a submodule of the Hugging Face model)."""

    def __init__(self, module: Optional[nn.Module], forward_fn: Optional[Callable] = None) -> None:
        self.typename, self.args, self.kwargs = type(module), (), {}
        self.module, self.forward_fn = module, forward_fn

    def build(self) -> nn.Module:
        if self.module is None:
            raise RuntimeError("pipe.hf: a layer of another stage was released after the build")
        return self.module


class _TiedBuilt(TiedLayerSpec, _Built):
    """An existing module shared by two positions (the embedding and the tied head)."""

    def __init__(self, key: str, module: nn.Module, forward_fn: Optional[Callable] = None) -> None:
        _Built.__init__(self, module, forward_fn)
        self.key, self.tied_weight_attr = key, ["weight"]


def _embed(module: nn.Module, x: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids[, attention_mask[, position_ids]]) -> (hidden, attention_mask, position_ids): the mask all ones
    and the positions 0..seq-1 when not given, as the model's forward takes them."""
    ids, *rest = x if isinstance(x, tuple) else (x,)
    mask = rest[0] if rest else torch.ones_like(ids)
    positions = rest[1] if len(rest) > 1 else torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
    return module(ids.long()), mask, positions


class _DecoderStep:
    """Runs one decoder layer on (hidden, attention_mask, position_ids): the rotary cos/sin and the causal mask
    rebuilt as the model's forward builds them (an all-ones mask counts as none, so packed position ids mark
    the document boundaries as they do in transformers without a mask)."""

    def __init__(self, config: Any, rotary: nn.Module) -> None:
        self.config, self.rotary = config, rotary

    def __call__(self, layer: nn.Module, x: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers.masking_utils import create_causal_mask
        hidden, mask, positions = x
        causal = create_causal_mask(config=self.config, inputs_embeds=hidden,
                                    attention_mask=None if bool(mask.all()) else mask, cache=None,
                                    position_ids=positions)
        out = layer(hidden, attention_mask=causal, position_ids=positions,
                    position_embeddings=self.rotary(hidden, position_ids=positions))
        return out[0] if isinstance(out, tuple) else out, mask, positions


def _norm(module: nn.Module, x: tuple) -> torch.Tensor:
    return module(x[0])


def _tied_head(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, embedding.weight)


def _peft_inner(model: nn.Module) -> tuple[nn.Module, str]:
    """(the Hugging Face model, the prefix of its names) of a peft `PeftModel`, or (model, "") for any other."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is an optional dependency
        return model, ""
    if not isinstance(model, PeftModel):
        return model, ""
    inner = model.get_base_model()
    prefix = next(name for name, module in model.named_modules() if module is inner)
    return inner, prefix + "."


def _parts(model: nn.Module) -> tuple[str, nn.Module]:
    """(the base model's attribute name, the base model), or a ConfigError naming what is missing."""
    config = model.config
    model_type = str(config.model_type)
    if model_type not in SPLIT_MODEL_TYPES:
        raise ConfigError(f"pipeline_parallel_size: splitting a {type(model).__name__} (model_type {model_type!r}) "
                          f"into pipeline stages is not available; supported: {', '.join(SPLIT_MODEL_TYPES)} (or "
                          "build a zerotrain.pipe.PipelineModule)", key="pipeline_parallel_size")
    layer_types = config.to_dict().get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ConfigError(f"pipeline_parallel_size: {type(model).__name__} has sliding-window layers "
                          f"({sorted(set(layer_types))}); the pipeline split runs full causal attention only",
                          key="pipeline_parallel_size")
    base = model.get_decoder()
    name = next(n for n, child in model.named_children() if child is base)
    return name, base


def splittable(model: nn.Module) -> bool:
    """Whether `model` is a Hugging Face causal LM of a model type the split supports (or a peft model of one)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    model = _peft_inner(model)[0]
    return isinstance(model, PreTrainedModel) and str(model.config.model_type) in SPLIT_MODEL_TYPES


class CausalLMPipeline(PipelineModule):
    """A Hugging Face causal LM as a `PipelineModule` (see the module docstring): its `config` and
    `generation_config` are the model's (the checkpoint's config.json), its parameter names the model's."""

    build_at_construction = False  # built by initialize only (its build releases the other stages' layers)

    def __init__(self, model: nn.Module, num_stages: int, partition_method: str = "parameters") -> None:
        model, prefix = _peft_inner(model)  # LoRA: the adapted model, its layers named as inside the PeftModel
        base_name, base = _parts(model)
        config = model.config
        head = model.get_output_embeddings()
        embed = model.get_input_embeddings()
        if not (isinstance(embed, nn.Embedding) and isinstance(head, nn.Linear)):
            raise ConfigError(f"pipeline_parallel_size: the {type(model).__name__}'s embedding or head is wrapped "
                              f"({type(embed).__name__}, {type(head).__name__}: LoRA on them or peft's trainable "
                              "tokens); a pipeline runs LoRA on the decoder layers only", key="pipeline_parallel_size")
        tied = head.weight is embed.weight
        layers: list[LayerSpec] = [_TiedBuilt("embed", embed, _embed) if tied else _Built(embed, _embed)]
        names = [f"{prefix}{base_name}.embed_tokens"]
        step = _DecoderStep(config, base.rotary_emb)
        for index, layer in enumerate(base.layers):
            layers.append(_Built(layer, step))
            names.append(f"{prefix}{base_name}.layers.{index}")
        layers.append(_Built(base.norm, _norm))
        names.append(f"{prefix}{base_name}.norm")
        layers.append(_TiedBuilt("embed", embed, _tied_head) if tied else _Built(head))
        names.append(f"{prefix}lm_head")
        loss = functools.partial(model.loss_function, vocab_size=config.vocab_size)
        super().__init__(layers, num_stages=num_stages, loss_fn=loss, partition_method=partition_method,
                         layer_names=names)
        # "parameters": every parameter counted, frozen ones too (a LoRA base's weights are what fills the memory;
        # without LoRA all train), once here: the modules of other stages are released after the build
        self._weights = [float(sum(p.numel() for p in spec.module.parameters())) for spec in layers]
        self.config = config
        if not config.architectures:
            config.architectures = [type(model).__name__]
        self.generation_config = model.generation_config
        self._rotary_name, self._rotary = f"{prefix}{base_name}.rotary_emb", base.rotary_emb

    def _layer_weights(self) -> list[float]:
        return self._weights if self.partition_method == "parameters" else super()._layer_weights()

    def build(self, *args: Any, **kwargs: Any):
        pieces = super().build(*args, **kwargs)
        self._register(self._rotary_name, self._rotary)  # buffers only (not saved): moves with the module
        kept = {id(layer) for piece in pieces for _, layer, _ in piece._layers}
        for spec in self._specs:  # another stage's layers: no reference left, so their memory goes
            if isinstance(spec, _Built) and id(spec.module) not in kept:
                spec.module = None
        return pieces


def causal_lm_pipeline(model: nn.Module, num_stages: int, partition_method: str = "parameters") -> CausalLMPipeline:
    """`model` (a Hugging Face causal LM) cut into `num_stages` pipeline stages (see the module docstring)."""
    return CausalLMPipeline(model, num_stages, partition_method)


def pipeline_inputs(batch: dict) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A causal-LM batch dict (`input_ids`, `labels`, optional `attention_mask` / `position_ids`) as a pipeline
    micro-batch `((input_ids, attention_mask, position_ids), labels)`."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
    return (ids, torch.ones_like(ids) if mask is None else mask, positions), batch["labels"]


def pipeline_model(model: nn.Module, pipeline_parallel_size: int) -> nn.Module:
    """The model `initialize` pipelines: a Hugging Face model (or a peft LoRA model of one) split into
    `pipeline_parallel_size` stages (refused by name when its architecture cannot be), anything else as it is."""
    if pipeline_parallel_size <= 1:  # no import: transformers' import costs every rank ~140 MiB of RSS (issue #27)
        return model
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return model
    if not isinstance(_peft_inner(model)[0], PreTrainedModel):
        return model
    return causal_lm_pipeline(model, pipeline_parallel_size)
