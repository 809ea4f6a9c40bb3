"""Find a tensor-parallel plan for a model that brings none: its own, or one inferred from its layers.

`resolve_plan(model, tp_size, plan=None)` answers, in this order:

1. a plan passed in (`Column`/`Row`/`Vocab` values as given; transformers' style strings are translated);
2. zerotrain's GPT: its built-in `GPT_PLAN`;
3. a Hugging Face model's own plan: `config.base_model_tp_plan`, its patterns prefixed by the base
   model's attribute name (`model.` in `LlamaForCausalLM`, `transformer.` in `GPT2LMHeadModel`), with
   the head model's class `_tp_plan` (`lm_head: colwise_gather_output`) and what transformers resolved
   on the instance (`model.tp_plan`, e.g. `embedding_rowwise` on the input embedding);
4. an AutoTP-style inference over plain linear stacks: in each module whose direct children are linear
   layers with known names, the projections that fan out (attention q/k/v, MLP up/gate, GPT-2's fused
   `c_attn` split per part) are column-split and the ones that fan back in (o_proj, down_proj,
   c_proj, ...) row-split, so each block needs one all-reduce forward and one backward; the output
   head and the vocabulary embedding are vocabulary-split when the vocabulary divides, else kept whole.

Every style string transformers registers is either mapped onto zerotrain's layers or refused naming
the style and the module, never dropped: applying half of a column/row pair would train a different
model. The inference refuses, by name, a module that has only half a pair, or unknown linear layers
next to a pair (their input may be a split activation). Attention heads and key/value heads that do
not divide over the tensor-parallel ranks are refused with the count, since a rank must hold whole
heads. All of this runs before any process group exists, so a bad setup fails at once.

DeepSpeed's AutoTP (`deepspeed/module_inject/auto_tp.py`) and its `tp_plan_converter.py` do the same
job for DeepSpeed's layers; this is zerotrain's own, on its `Column`/`Row`/`Vocab` styles.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Union

import torch.nn as nn

from .adapters import is_lora_wrapped, lora_plan
from .plan import GPT_PLAN, Column, Row, Style, SumGrad, Vocab, is_conv1d

__all__ = ["resolve_plan", "huggingface_plan", "infer_plan", "translate_style", "HF_STYLES", "REFUSED_HF_STYLES"]

_REPLICATE = "replicate"  # a translated style that leaves the module whole

# transformers' style strings (transformers/distributed/tensor_parallel.py and expert_parallel.py, 5.x, and the
# names older 4.x releases registered) that zerotrain's layers compute exactly.
HF_STYLES: dict[str, Union[Style, str]] = {
    "colwise": Column(),
    "colwise_gather_output": Column(gather_output=True),
    "colwise_rep": Column(gather_output=True),  # the older name of colwise_gather_output
    "rowwise": Row(),
    "rowwise_split_input": Row(split_input=True),  # whole input, each rank takes its slice
    "rowwise_rep": Row(split_input=True),  # registered with the same layouts as rowwise_split_input
    "embedding_rowwise": Vocab(),
    # transformers splits the hidden dimension and gathers it; a vocabulary split gives the same whole output.
    "embedding_colwise": Vocab(),
    "packed_colwise": Column(parts=2),  # fused gate|up along the output features (2-D weights only)
    "packed_rowwise": Row(parts=2),  # packed input features (2-D weights only)
    "replicate": _REPLICATE,
    "replicated_with_grad_allreduce": SumGrad(),  # per-head q/k norms: whole, gradients summed over the ranks
}

# The rest, refused by name with the reason.
_LOCAL = ("leaves its reduction to a 'gather' style on an enclosing module (transformers' older plans); "
          "zerotrain's row layers reduce themselves")
REFUSED_HF_STYLES: dict[str, str] = {
    "local_colwise": _LOCAL, "local_rowwise": _LOCAL, "local_packed_rowwise": _LOCAL, "local": _LOCAL,
    "gather": "all-reduces a module output computed from local_* pieces (see local_rowwise)",
    "isolated": "runs a module on a sub-mesh of its own",
    "sequence_parallel": "Megatron-style sequence sharding of norms between tensor-parallel regions is not "
                         "implemented",
    "all_reduce": "all-reduces a partial module output that zerotrain's layers do not produce",
    "mla_kv_a_proj": "multi-head latent attention's split key/rope projection is not implemented",
    "moe_tp_experts": "tensor-parallel experts: use zerotrain's expert parallelism (moe) instead",
    "moe_identity_expert": "tensor-parallel experts: use zerotrain's expert parallelism (moe) instead",
    "grouped_gemm": "expert-parallel weights: use zerotrain's expert parallelism (moe) instead",
    "ep_dispatch_experts": "expert-parallel dispatch: use zerotrain's expert parallelism (moe) instead",
    "ep_router": "expert-parallel routing: use zerotrain's expert parallelism (moe) instead",
    "local_params": "runs a module on its own sharded bare parameters, which zerotrain does not split",
}

# Inference: linear layers by their own name. Fan-out projections (column-split) ...
_COLUMN_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value", "gate_proj", "up_proj",
                           "fc1", "c_fc", "fc_in", "w1", "w3", "wi", "wi_0", "wi_1", "dense_h_to_4h"})
# ... fused q|k|v in equal parts (GPT-2's Conv1D: [q | k | v] along the output features) ...
_FUSED_QKV_NAMES = frozenset({"c_attn"})
# ... and fan-in projections (row-split).
_ROW_NAMES = frozenset({"o_proj", "out_proj", "down_proj", "c_proj", "fc2", "fc_out", "w2", "wo",
                        "dense_4h_to_h"})
_HEAD_NAMES = frozenset({"lm_head", "embed_out"})


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear layer in either weight layout."""
    rows, cols = module.weight.shape
    return (rows, cols) if is_conv1d(module) else (cols, rows)


def _generic(name: str) -> str:
    """A module name with its layer numbers as `*`, the form transformers' plans are written in."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def translate_style(style: str, where: str, module: Optional[nn.Module]) -> Union[Style, str]:
    """zerotrain's style for one of transformers' style strings at `where`, or a ValueError naming both."""
    key = style.lower() if isinstance(style, str) else style
    if key in REFUSED_HF_STYLES:
        raise ValueError(f"tensor-parallel plan: {where} has style {style!r}, which zerotrain does not apply: "
                         f"{REFUSED_HF_STYLES[key]}; pass a zerotrain.initialize(..., tensor_parallel_plan=...) "
                         f"that does not need it (e.g. one leaving that block whole), or use autotp_size 1")
    if key not in HF_STYLES:
        raise ValueError(f"tensor-parallel plan: {where} has unknown style {style!r}; zerotrain knows "
                         f"{sorted(HF_STYLES)} (and refuses {sorted(REFUSED_HF_STYLES)})")
    mapped = HF_STYLES[key]
    if mapped == _REPLICATE:
        return mapped
    if module is None:  # a bare parameter (3-D expert weights, attention sinks): no layer to replace
        raise ValueError(f"tensor-parallel plan: {where} has style {style!r} but names a parameter, not a layer; "
                         f"zerotrain splits nn.Linear / Conv1D / nn.Embedding modules only")
    return mapped


def huggingface_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan with transformers' style strings, patterns prefixed to name modules of `model`:
    `config.base_model_tp_plan` under the base model's attribute, the head class's `_tp_plan`, and what
    transformers resolved on the instance (`tp_plan`), later entries overriding earlier ones."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if isinstance(base, dict) and base:
        prefix = getattr(model, "base_model_prefix", "")
        inside = prefix and isinstance(getattr(model, prefix, None), nn.Module)
        plan.update({(f"{prefix}.{pattern}" if inside else pattern): style for pattern, style in base.items()})
    for source in (getattr(type(model), "_tp_plan", None), model.__dict__.get("_tp_plan")):
        if isinstance(source, dict):
            plan.update(source)
    return plan


def _from_string_plan(model: nn.Module, plan: dict[str, Any], strict: bool) -> dict[str, Union[Style, str]]:
    """A plan in transformers' form (`*` for a layer number) as zerotrain styles keyed by module name.
    transformers skips a model's own rules that match nothing (optional modules), and so does this unless
    `strict` (a plan passed in, where such a rule is a typo)."""
    modules = dict(model.named_modules())
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    by_generic: dict[str, list[str]] = {}
    for name in list(modules) + sorted(parameters):
        by_generic.setdefault(_generic(name), []).append(name)
    resolved: dict[str, Union[Style, str]] = {}
    for pattern, style in plan.items():
        names = by_generic.get(pattern, [])
        if not names and pattern in modules:
            names = [pattern]
        if not names and strict:
            raise ValueError(f"tensor-parallel plan: pattern {pattern!r} matches no module or parameter of "
                             f"{type(model).__name__} (transformers' form: '*' stands for a layer number)")
        if not isinstance(style, str):  # a zerotrain style in a mixed plan
            for name in names:
                resolved[name] = style
            continue
        for name in names:
            resolved[name] = translate_style(style, f"{pattern!r} ({name})", modules.get(name))
    return resolved


def infer_plan(model: nn.Module, tp_size: int) -> dict[str, Style]:
    """The AutoTP-style plan for plain linear stacks (see the module docstring); a ValueError naming the
    modules it cannot place."""
    modules = dict(model.named_modules())
    plan: dict[str, Style] = {}
    refused: list[str] = []
    unknown: list[str] = []
    for parent_name, parent in modules.items():
        linears = {child: module for child, module in parent.named_children() if _is_linear(module)}
        if not linears:
            continue

        def full(child: str, parent_name: str = parent_name) -> str:
            return f"{parent_name}.{child}" if parent_name else child

        columns = [c for c in linears if c in _COLUMN_NAMES or c in _FUSED_QKV_NAMES]
        rows = [c for c in linears if c in _ROW_NAMES]
        others = [c for c in linears if c not in columns and c not in rows and c not in _HEAD_NAMES]
        if not columns and not rows:
            unknown += [full(c) for c in others]
            continue
        if not columns or not rows:
            refused.append(f"{parent_name or type(model).__name__} ({type(parent).__name__}: "
                           f"{'column' if columns else 'row'} layers {columns or rows} without their "
                           f"{'row' if columns else 'column'} partner)")
            continue
        if others:
            refused.append(f"{parent_name or type(model).__name__} ({type(parent).__name__}: linear layers "
                           f"{others} next to the split pair {columns + rows}, their input may be split)")
            continue
        for child in columns:
            if child in _FUSED_QKV_NAMES:
                fan_in, fan_out = _features(linears[child])
                if fan_out != 3 * fan_in:
                    refused.append(f"{full(child)} (fused q/k/v with {fan_out} outputs for {fan_in} inputs, "
                                   f"not three equal parts)")
                    continue
                # GPT-2's attention cuts the fused output by `split_size` (the width of q) and counts
                # `num_heads`: on each rank both become the local ones.
                divide = tuple(a for a in ("split_size", "embed_dim") if getattr(parent, a, None) == fan_in)
                if isinstance(getattr(parent, "num_heads", None), int):
                    divide += ("num_heads",)
                plan[full(child)] = Column(parts=3, divide_parent=divide)
            else:
                plan[full(child)] = Column()
        for child in rows:
            plan[full(child)] = Row()
    if refused:
        raise ValueError(f"tensor_parallel.autotp_size {tp_size}: {type(model).__name__} has no tensor-parallel "
                         f"plan and these modules cannot be split by inference: {'; '.join(refused)}. Pass "
                         f"zerotrain.initialize(..., tensor_parallel_plan={{'layers.*.fc1': Column(), ...}})")
    if not plan:
        raise ValueError(f"tensor_parallel.autotp_size > 1 needs a plan for {type(model).__name__}: it has no "
                         f"tensor-parallel plan and no attention/MLP layers the inference recognizes (linear layers "
                         f"{unknown or 'none'}). Pass zerotrain.initialize(..., tensor_parallel_plan="
                         f"{{'layers.*.fc1': Column(), ...}})")
    _add_vocabulary(model, modules, plan, tp_size)
    return plan


def _add_vocabulary(model: nn.Module, modules: dict[str, nn.Module], plan: dict[str, Style], tp_size: int) -> None:
    """The output head column-split with its logits gathered, and every embedding of the vocabulary split by
    rows, when the vocabulary divides over the ranks; otherwise both stay whole."""
    config = _text_config(model)
    vocab = getattr(config, "vocab_size", None)
    heads = [name for name, module in modules.items()
             if name.rpartition(".")[2] in _HEAD_NAMES and isinstance(module, nn.Linear)]
    if vocab is None and heads:
        vocab = modules[heads[0]].out_features
    if not vocab or vocab % tp_size:
        return
    for name in heads:
        if modules[name].out_features == vocab:
            plan[name] = Column(gather_output=True)
    for name, module in modules.items():
        if isinstance(module, nn.Embedding) and module.num_embeddings == vocab:
            plan[name] = Vocab()


def _complete_ties(model: nn.Module, plan: dict[str, Style]) -> None:
    """A module left out of the plan that shares its weight with a vocabulary-split one (a tied embedding
    and head) is split the same way, so the tie holds; transformers' own plans name only one of the two."""
    modules = dict(model.named_modules())
    split = {id(modules[name].weight): name for name, style in plan.items()
             if isinstance(style, Vocab) or (isinstance(style, Column) and style.gather_output)}
    for name, module in modules.items():
        weight = getattr(module, "weight", None)
        if name in plan or weight is None or id(weight) not in split:
            continue
        if isinstance(module, nn.Embedding):
            plan[name] = Vocab()
        elif isinstance(module, nn.Linear):
            plan[name] = Column(gather_output=True)


def _check_heads(model: nn.Module, plan: dict[str, Style], tp_size: int) -> None:
    """Each rank must hold whole attention heads and whole key/value heads of every attention whose
    projections' outputs stay split (a gathered output, as Phi-3's plan uses for its fused q/k/v, does not
    split heads)."""
    if not any(re.search(r"attn|attention", name, re.IGNORECASE) and isinstance(style, Column)
               and not style.gather_output for name, style in plan.items()):
        return
    config = _text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    for key, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(count, int) and count % tp_size:
            raise ValueError(f"tensor_parallel.autotp_size {tp_size} does not divide {type(model).__name__}'s "
                             f"{key} = {count}: each tensor-parallel rank must hold whole attention heads; use an "
                             f"autotp_size that divides {count}")


def _check_splits(model: nn.Module, plan: dict[str, Style], tp_size: int) -> None:
    """Every split dimension divides evenly, checked before any process group exists."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules.get(name)
        if module is None or isinstance(style, SumGrad):
            continue  # a pattern (matched when the plan is applied), or a module kept whole
        if isinstance(style, Vocab):
            size, what = getattr(module, "num_embeddings", None), "vocabulary rows"
            parts = 1
        elif _is_linear(module):
            fan_in, fan_out = _features(module)
            size, what = (fan_out, "output features") if isinstance(style, Column) else (fan_in, "input features")
            parts = style.parts
        else:
            continue
        if size is not None and size % (parts * tp_size):
            raise ValueError(f"tensor_parallel.autotp_size {tp_size}: {name} has {size} {what}, which do not split "
                             f"into {parts} part(s) over {tp_size} tensor-parallel ranks")


def resolve_plan(model: nn.Module, tp_size: int, plan: Optional[dict] = None) -> dict[str, Style]:
    """The plan `apply_tensor_parallel` splits `model` by at `tp_size` ranks (see the module docstring); a PEFT
    LoRA-wrapped model gets its base model's plan with the adapters split along (`parallel.adapters`)."""
    from ..models import GPT

    if is_lora_wrapped(model):
        return lora_plan(model, tp_size, plan, resolve_plan)

    if plan is not None:
        strings = any(isinstance(style, str) for style in plan.values())
        resolved = _from_string_plan(model, plan, strict=True) if strings else dict(plan)
    elif isinstance(model, GPT):
        resolved = dict(GPT_PLAN)
    else:
        own = huggingface_plan(model)
        resolved = _from_string_plan(model, own, strict=False) if own else infer_plan(model, tp_size)
    final = {name: style for name, style in resolved.items() if style != _REPLICATE}
    if not final:
        raise ValueError(f"tensor_parallel.autotp_size > 1 needs a plan for {type(model).__name__}: the plan splits "
                         f"no module of it")
    _complete_ties(model, final)
    _check_heads(model, final, tp_size)
    _check_splits(model, final, tp_size)
    return final
