"""Model merging on the unified format: `zerotrain merge`, streamed tensor by tensor.

Merges unified zerotrain checkpoints or Hugging Face model directories with mergekit's
methods (linear, task_arithmetic, ties, dare_linear, dare_ties, slerp) or folds a PEFT
LoRA adapter (`lora`), reading one tensor at a time so memory holds a few tensors,
never a model. The output is a sharded safetensors model directory that
`from_pretrained` loads, with `merge_config.json` recording how it was made.

Public API: `merge(recipe, out)`, `Recipe`, `ModelSpec`, `recipe_from_yaml`,
`fold_lora` / `LoraAdapter` (also used by `zerotrain ckpt export --merge-lora`), `MergeError`.

Modules, one concept each:
    errors    MergeError
    methods   the merge math on fp32 tensors (mergekit's semantics, our code)
    recipe    what to merge: method, models, parameters (per-layer lists, filters), YAML configs
    (zerotrain.lora: PEFT LoRA adapters folded into weights, shared with `ckpt export --merge-lora`)
    source    lazy tensor sources over unified checkpoints and HF directories
    writer    the sharded safetensors output with its index, committed atomically
    run       one merge: key/shape/vocabulary checks, the streamed loop, side files, merge_config.json
    command   the `zerotrain merge` subcommand
"""
from __future__ import annotations

from .errors import MergeError
from ..lora import LoraAdapter, LoraError, fold_lora
from .recipe import ModelSpec, Recipe, recipe_from_yaml
from .run import merge

__all__ = ["merge", "Recipe", "ModelSpec", "recipe_from_yaml", "fold_lora", "LoraAdapter", "LoraError", "MergeError"]
