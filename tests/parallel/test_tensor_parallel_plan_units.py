"""`parallel.plan` in-process: what `apply_tensor_parallel` builds for one rank of a group of two (building needs no
collective), checked against slices of the unsplit model's own weights; the refusals name the module; a SumGrad module
hooks only its trainable parameters; `assemble_full_tensors` at a group of one. The split model's training (and the
assembly at TP > 1) is checked at TP2 and TP4 by test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zerotrain.comm import Comm
from zerotrain.parallel import GPT_PLAN, Column, Row, SumGrad, Vocab, apply_tensor_parallel


def _gpt():
    from zerotrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=4, n_embd=16, block_size=8, n_inner=32))


def test_gpt_plan_gives_rank_one_its_slices_and_keeps_the_tie():
    whole = _gpt()
    full = {name: p.detach().clone() for name, p in whole.named_parameters()}
    model = apply_tensor_parallel(_gpt(), GPT_PLAN, Comm(None, 1, 2))
    got = dict(model.named_parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one split parameter
    assert torch.equal(got["transformer.wte.weight"], full["transformer.wte.weight"][32:])  # rows of rank 1
    # fused q/k/v: rank 1 holds the second half of each of the three parts
    qkv = full["transformer.h.0.attn.c_attn.weight"]
    assert torch.equal(got["transformer.h.0.attn.c_attn.weight"], torch.cat([qkv[8:16], qkv[24:32], qkv[40:48]]))
    assert torch.equal(got["transformer.h.0.mlp.c_fc.weight"], full["transformer.h.0.mlp.c_fc.weight"][16:])
    assert torch.equal(got["transformer.h.0.mlp.c_proj.weight"], full["transformer.h.0.mlp.c_proj.weight"][:, 16:])
    assert torch.equal(got["transformer.h.0.mlp.c_proj.bias"], full["transformer.h.0.mlp.c_proj.bias"])  # whole
    assert model.lm_head.gather_output and not model.transformer.h[0].mlp.c_fc.gather_output
    assert model.transformer.h[0].attn.c_attn.weight.tp_slice.pieces == ((8, 8), (24, 8), (40, 8))
    assert torch.equal(got["transformer.ln_f.weight"], full["transformer.ln_f.weight"])  # outside the plan


class _Attention(nn.Module):
    """GPT-2's shape: a Conv1D fused projection (weight [in, out]) whose parent reads `split_size`."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.c_attn, self.c_proj = Conv1D(3 * 8, 8), Conv1D(8, 8)
        self.split_size, self.heads = 8, 4


def test_conv1d_is_split_along_its_stored_layout_and_the_parent_counts_are_divided():
    torch.manual_seed(0)
    module = _Attention()
    qkv, proj = module.c_attn.weight.detach().clone(), module.c_proj.weight.detach().clone()
    plan = {"c_attn": Column(parts=3, divide_parent=("split_size", "heads")), "c_proj": Row()}
    apply_tensor_parallel(module, plan, Comm(None, 1, 2))
    assert torch.equal(module.c_attn.weight, torch.cat([qkv[:, 4:8], qkv[:, 12:16], qkv[:, 20:24]], dim=1))
    assert torch.equal(module.c_proj.weight, proj[4:])  # [in, out]: the input rows of rank 1
    assert (module.split_size, module.heads) == (4, 2)
    with pytest.raises(ValueError, match=r"_Attention\.heads is 3, not a whole number divisible by the tensor-parallel size 2"):
        broken = _Attention()
        broken.heads = 3
        apply_tensor_parallel(broken, plan, Comm(None, 0, 2))


def test_refusals_name_the_module_and_the_tie():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    with pytest.raises(ValueError, match=r"head shares its weight with another module but splits it differently"):
        apply_tensor_parallel(Tied(), {"embed": Vocab(), "head": Column(parts=2)}, Comm(None, 0, 2))
    with pytest.raises(ValueError, match=r"head\.weight shares its weight with embed, which the plan splits; add head"):
        apply_tensor_parallel(Tied(), {"embed": Vocab()}, Comm(None, 0, 2))
    with pytest.raises(ValueError, match=r"head matches several patterns \['he\*', '\*ad'\]"):
        apply_tensor_parallel(Tied(), {"he*": Column(), "*ad": Column()}, Comm(None, 0, 2))
    with pytest.raises(TypeError, match=r"head is Linear, Vocab needs nn.Embedding"):
        apply_tensor_parallel(Tied(), {"head": Vocab()}, Comm(None, 0, 2))
    tied = apply_tensor_parallel(Tied(), {"embed": Vocab(), "head": Column(gather_output=True)}, Comm(None, 0, 2))
    assert tied.head.weight is tied.embed.weight


def test_sum_grad_hooks_only_trainable_parameters_and_only_in_a_group():
    """A frozen parameter of a SumGrad module takes no hook (torch refuses one on it); the module still runs."""
    norm = nn.LayerNorm(4)
    norm.bias.requires_grad_(False)
    model = apply_tensor_parallel(nn.Sequential(norm), {"0": SumGrad()}, Comm(None, 0, 2))
    assert model[0] is norm  # kept whole
    out = model(torch.randn(2, 4))
    assert out.shape == (2, 4) and norm.weight._backward_hooks and not norm.bias._backward_hooks
    alone = nn.LayerNorm(4)
    apply_tensor_parallel(nn.Sequential(alone), {"0": SumGrad()}, Comm(None, 0, 1))(torch.randn(2, 4))
    assert not alone.weight._backward_hooks  # a group of one sums nothing


def test_a_group_of_one_assembles_its_own_tensors():
    """`assemble_full_tensors` at tensor-parallel size 1 (full_state_dict without TP): every tensor, as it is."""
    from zerotrain.parallel import assemble_full_tensors

    local = {"a": torch.ones(2), "b": torch.zeros(3)}
    full = assemble_full_tensors(local, {}, Comm(None, 0, 1))
    assert full == local and full is not local


def _lora_llama(new_tokens: bool, targets=("q_proj", "o_proj", "gate_proj", "down_proj")):
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=24, tie_word_embeddings=False))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(targets),
                             init_lora_weights=False,  # lora_B drawn too: every slice below is of distinct values
                             trainable_token_indices={"model.embed_tokens": [30, 31]} if new_tokens else None)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("new_tokens", [False, True])
def test_lora_adapters_are_split_along_their_base_layer_for_rank_one(new_tokens):
    """`parallel.adapters` in-process: a peft LoRA Llama at rank 1 of 2 (transformers' own plan): a column-split
    base layer's lora_B holds the same output rows and lora_A stays whole; a row-split one's lora_A holds the same
    input columns and lora_B stays whole; an embedding with trainable tokens stays whole (else split by rows); plan
    names are exact; LoRA on a vocabulary-split layer is refused naming it."""
    import copy

    from zerotrain.parallel.adapters import is_lora_wrapped
    from zerotrain.parallel.autotp import resolve_plan

    model = _lora_llama(new_tokens)
    assert is_lora_wrapped(model) and not is_lora_wrapped(model.get_base_model())
    full = {name: p.detach().clone() for name, p in copy.deepcopy(model).named_parameters()}
    plan = resolve_plan(model, 2)
    layer = "base_model.model.model.layers.0"
    assert not any("*" in name for name in plan)
    assert isinstance(plan[f"{layer}.self_attn.q_proj.base_layer"], Column)
    assert isinstance(plan[f"{layer}.self_attn.k_proj"], Column)  # not adapted: the base plan's entry, exact
    assert f"{layer}.self_attn.q_proj" not in plan and f"{layer}.self_attn.o_proj.lora_B.default" not in plan
    apply_tensor_parallel(model, plan, Comm(None, 1, 2))
    got = dict(model.named_parameters())
    for module, rows in (("self_attn.q_proj", slice(8, 16)), ("mlp.gate_proj", slice(12, 24))):
        name = f"{layer}.{module}"
        assert torch.equal(got[f"{name}.base_layer.weight"], full[f"{name}.base_layer.weight"][rows]), name
        assert torch.equal(got[f"{name}.lora_B.default.weight"], full[f"{name}.lora_B.default.weight"][rows]), name
        assert torch.equal(got[f"{name}.lora_A.default.weight"], full[f"{name}.lora_A.default.weight"]), name
    for module, columns in (("self_attn.o_proj", slice(8, 16)), ("mlp.down_proj", slice(12, 24))):
        name = f"{layer}.{module}"
        assert torch.equal(got[f"{name}.base_layer.weight"], full[f"{name}.base_layer.weight"][:, columns]), name
        assert torch.equal(got[f"{name}.lora_A.default.weight"], full[f"{name}.lora_A.default.weight"][:, columns]), name
        assert torch.equal(got[f"{name}.lora_B.default.weight"], full[f"{name}.lora_B.default.weight"]), name
    embed = "base_model.model.model.embed_tokens" + (".token_adapter.base_layer.weight" if new_tokens else ".weight")
    # the vocabulary split (rank 1: rows 16-31), unless new tokens' rows train: then whole
    assert torch.equal(got[embed], full[embed] if new_tokens else full[embed][16:])
    with pytest.raises(ValueError, match=r"LoRA on model.embed_tokens \(Vocab\) is not supported with tensor "
                                         r"parallelism; leave it out of --lora-target-modules"):
        resolve_plan(_lora_llama(False, ("q_proj", "embed_tokens")), 2,
                     {"model.embed_tokens": Vocab(), "model.layers.0.self_attn.q_proj": Column()})
