"""Hugging Face models split by `tensor_parallel.autotp_size` alone (no plan passed) train like one process.

Llama (grouped-query attention: 4 heads, 2 key/value heads), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k
norms, whose gradients are summed over the tensor-parallel ranks) are split by their own
`config.base_model_tp_plan`; GPT-2 has none and is split by the inference (its fused q/k/v `Conv1D` per part,
its tied embedding and head by vocabulary). One world-2 launch trains all four at TP2 x ZeRO-3, saves Llama
and GPT-2 there and loads each at TP1 x DP2, where training goes on like the single-process run (and checks
a `colwise_gather_output` / `rowwise_split_input` pair against the whole layers); one world-4 launch trains
Llama and Qwen3 at TP2 x DP2 x ZeRO-3. The plan resolution itself (heads that do not divide, refused styles) runs
before any process group, so it is tested in this process.
"""
from __future__ import annotations

import functools
import glob
import os

import pytest
import torch

from distributed import run_distributed
from models_for_tests import adamw_reference_steps, assert_same_training

import transformers  # the dev extra has it: a missing install fails, never skips

STEPS, GLOBAL, SEQ, VOCAB, LR, CLIP = 2, 4, 8, 128, 1e-3, 1.0
# Adam turns a gradient's rounding noise into an update error of up to lr/eps times it. Split layers sum in
# another order (noise ~1e-7 of the gradient's scale), and some elements have a near-zero gradient (a key
# bias's is exactly zero; here an embedding element's is 5e-7 against 5e-2 in its row, so its noise is 1%):
# eps=1e-6 (as in test_tensor_parallel_engine.py) lets that reach 9e-6 in two steps, 1e-5 1.4e-6 in three;
# 1e-4 holds it well under the 1e-6 weight tolerance while every ordinary gradient (>= 1e-3) stays Adam's.
EPS = 1e-4
MODELS = ("llama", "qwen2", "qwen3", "gpt2")
WORLD4_MODELS = ("llama", "qwen3")


def build(kind: str, seed: int = 0, **overrides):
    """A tiny random-init model (hidden 64, 2 layers, 4 heads) with fixed weights; no download."""
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        config = transformers.LlamaConfig(**{**shape, **overrides})
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**{**shape, **overrides})
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**{**shape, "head_dim": 16, **overrides})
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                         n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0, **overrides)
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(seed)
    return cls(config)


def batches(steps: int):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=generator) for _ in range(steps)]


def make_engine(kind: str, tp: int, stage: int, seed: int = 0):
    import zerotrain
    dp = int(os.environ["WORLD_SIZE"]) // tp
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // dp, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                    "stage3_param_persistence_threshold": 0},
              "tensor_parallel": {"autotp_size": tp}, "steps_per_print": 0, "comm_timeout_seconds": 60}
    engine, *_ = zerotrain.initialize(model=build(kind, seed), config=config)
    return engine


def train(engine, first: int, last: int) -> list[float]:
    """Global steps [first, last): each data-parallel rank its share of the global batch; the global mean loss."""
    import torch.distributed as dist
    dp, dp_rank = engine.topology.dp_size, engine.topology.dp_rank
    micro = GLOBAL // dp
    losses = []
    for tokens in batches(last)[first:last]:
        ids = tokens[dp_rank * micro:(dp_rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)  # every tensor-parallel rank holds its data-parallel rank's loss
        losses.append(total.item() / dist.get_world_size())
    return losses


def split_input_pair() -> tuple:
    """transformers' `colwise_gather_output` then `rowwise_split_input` (a whole input each rank slices), applied
    by string: (output, input gradient, each weight's local gradient and its slice of the whole one)."""
    from zerotrain.parallel import apply_tensor_parallel, resolve_plan, tensor_parallel_comm
    from zerotrain.topology import Topology

    def pair():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    whole, split = pair(), pair()
    plan = resolve_plan(split, 2, {"0": "colwise_gather_output", "1": "rowwise_split_input"})
    apply_tensor_parallel(split, plan, tensor_parallel_comm(Topology.build(tp_size=2)))
    results = []
    for model in (whole, split):
        inputs = x.clone().requires_grad_(True)
        out = model(inputs)
        out.pow(2).sum().backward()
        results.append((out.detach(), inputs.grad))
    grads = [(p.grad, p.tp_slice.take(w.grad) if hasattr(p, "tp_slice") else w.grad)
             for p, w in zip(split.parameters(), whole.parameters())]
    return results, grads


def tp2_world2(save_root: str) -> dict:
    """Every model at TP2 x ZeRO-3; Llama and GPT-2 saved there and resumed at TP1 x DP2 (ZeRO-1)."""
    results = {"split input": split_input_pair()}
    for kind in MODELS:
        engine = make_engine(kind, tp=2, stage=3)
        assert engine.topology.tp_size == 2 and engine.topology.dp_size == 1
        losses = train(engine, 0, STEPS)
        results[kind] = (losses, engine.full_state_dict())
        if kind.startswith("qwen"):
            continue
        directory = os.path.join(save_root, kind)
        engine.save_checkpoint(directory, tag="tp2")
        resumed = make_engine(kind, tp=1, stage=1, seed=7)  # other initial weights: the load must replace them
        resumed.load_checkpoint(directory, tag="tp2")
        results[f"{kind} resumed at TP1 x DP2"] = (train(resumed, STEPS, STEPS + 1), resumed.full_state_dict())
    return results


def tp2_dp2_world4() -> dict:
    results = {}
    for kind in WORLD4_MODELS:
        engine = make_engine(kind, tp=2, stage=3)
        assert engine.topology.tp_size == 2 and engine.topology.dp_size == 2
        results[kind] = (train(engine, 0, STEPS), engine.full_state_dict())
    return results


@functools.lru_cache(maxsize=None)
def reference(kind: str) -> tuple[list[float], dict, dict]:
    """Plain single-process AdamW over the global batches: the losses of STEPS + 1 steps, the weights after
    STEPS steps and after STEPS + 1."""
    model = build(kind)
    losses, weights = adamw_reference_steps(model, batches(STEPS + 1),
                                            lambda model, tokens: model(input_ids=tokens, labels=tokens).loss,
                                            LR, EPS, CLIP)
    return losses, weights[STEPS - 1], weights[STEPS]


def check(where: str, got: tuple, want: tuple) -> None:
    """(losses, weights) of a run equal the single-process reference's at the project's fp32 tolerance (the
    reference's named parameters: GPT-2's lm_head.weight is transformer.wte.weight, tied, compared once)."""
    assert_same_training(*got, *want, where=where)


def test_hf_models_split_by_their_own_or_an_inferred_plan_train_like_one_process(tmp_path):
    from safetensors.torch import load_file

    results = run_distributed(tp2_world2, 2, str(tmp_path), timeout=240)
    for rank in results:
        (whole, split), grads = rank.pop("split input")
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)  # outputs, then input gradients
        for local, expected in grads:
            torch.testing.assert_close(local, expected, rtol=1e-5, atol=1e-6)
    assert all(not weights for rank in results[1:] for _, weights in rank.values())  # whole weights on rank 0 only
    for kind in MODELS:
        losses, at_steps, after_one_more = reference(kind)
        check(f"{kind} TP2 x ZeRO-3", results[0][kind], (losses[:STEPS], at_steps))
        if kind.startswith("qwen"):
            continue
        check(f"{kind} saved at TP2, resumed at TP1 x DP2", results[0][f"{kind} resumed at TP1 x DP2"],
              (losses[STEPS:], after_one_more))
        saved = {}
        for path in glob.glob(str(tmp_path / kind / "tp2" / "model*.safetensors")):
            saved.update(load_file(path))
        whole = results[0][kind][1]
        for name, tensor in saved.items():  # whole tensors in the model's own layout (Conv1D: [in, out])
            assert torch.equal(tensor, whole[name]), f"{kind}: saved {name} differs from the TP2 weights"
        assert set(whole) - set(saved) <= {"lm_head.weight"}, sorted(set(whole) - set(saved))  # tied: saved once
        loaded = type(build(kind)).from_pretrained(str(tmp_path / kind / "tp2")).state_dict()
        for name, tensor in whole.items():
            assert torch.equal(loaded[name], tensor), f"{kind}: from_pretrained {name} differs from the TP2 weights"
    if "gpt2" in MODELS:
        assert results[0]["gpt2"][1]["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)

    for kind, got in run_distributed(tp2_dp2_world4, 4, timeout=240)[0].items():
        losses, at_steps, _ = reference(kind)
        check(f"{kind} TP2 x DP2 x ZeRO-3", got, (losses[:STEPS], at_steps))


def test_plans_are_resolved_or_refused_by_name_before_any_process_group():
    from zerotrain.parallel import Column, Row, Vocab, resolve_plan

    llama = build("llama")
    plan = resolve_plan(llama, 2)  # the config's base_model_tp_plan, prefixed by the base model's attribute
    assert plan["model.layers.1.self_attn.k_proj"] == Column() and plan["model.layers.0.mlp.down_proj"] == Row()
    assert plan["lm_head"] == Column(gather_output=True) and plan["model.embed_tokens"] == Vocab()
    gpt2 = resolve_plan(build("gpt2"), 2)  # no plan: inferred
    assert gpt2["transformer.h.0.attn.c_attn"].parts == 3 and gpt2["transformer.h.1.mlp.c_proj"] == Row()
    assert gpt2["transformer.wte"] == Vocab() and gpt2["lm_head"] == Column(gather_output=True)
    assert "transformer.wpe" not in gpt2  # position embeddings stay whole

    with pytest.raises(ValueError, match="autotp_size 4 does not divide LlamaForCausalLM's num_key_value_heads = 2"):
        resolve_plan(llama, 4)
    with pytest.raises(ValueError, match="autotp_size 8 does not divide GPT2LMHeadModel's num_attention_heads = 4"):
        resolve_plan(build("gpt2"), 8)
    for style in ("sequence_parallel", "all_reduce", "local_rowwise", "moe_tp_experts"):
        with pytest.raises(ValueError, match=rf"model.layers.0.mlp.down_proj\) has style '{style}'"):
            resolve_plan(llama, 2, {"model.layers.*.mlp.down_proj": style})
    with pytest.raises(ValueError, match=r"pattern 'layers.\*.mlp.down_proj' matches no module"):  # prefix missing
        resolve_plan(llama, 2, {"layers.*.mlp.down_proj": "rowwise"})
    with pytest.raises(ValueError, match="unknown style 'diagonal'"):
        resolve_plan(llama, 2, {"model.layers.*.mlp.down_proj": "diagonal"})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight\) has style 'packed_rowwise' but "
                                         "names a parameter"):
        resolve_plan(llama, 2, {"model.layers.*.mlp.down_proj.weight": "packed_rowwise"})

    class HalfPair(torch.nn.Module):  # an MLP whose fan-in layer has a name the inference does not know
        def __init__(self):
            super().__init__()
            self.up_proj, self.squeeze = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    with pytest.raises(ValueError, match=r"HalfPair \(HalfPair: column layers \['up_proj'\] without their row "
                                         "partner\\)"):
        resolve_plan(HalfPair(), 2)


    class RowOnly(torch.nn.Module):  # the mirror case: a fan-out layer without its fan-in partner
        def __init__(self):
            super().__init__()
            self.down_proj, self.squeeze = torch.nn.Linear(8, 4), torch.nn.Linear(4, 8)

    with pytest.raises(ValueError, match=r"RowOnly \(RowOnly: row layers \['down_proj'\] without their column "
                                         "partner\\)"):
        resolve_plan(RowOnly(), 2)

    # a linear layer sharing the split embedding's weight, outside the plan, is split with it: a gathered column
    tied = build("llama")
    tied.extra_head = torch.nn.Linear(64, VOCAB, bias=False)
    tied.extra_head.weight = tied.model.embed_tokens.weight
    assert resolve_plan(tied, 2)["extra_head"] == Column(gather_output=True)
