"""What real DeepSpeed programs do at ZeRO-3 (issue 28's bugs), at world 2.

- DeepSpeed-Chat's `save_zero_three_model`: `{k: v.cpu()}` of partitioned parameters (inside
  `GatheredParameters`, and outside it) is a dict of plain tensors that `torch.save` writes (no process group
  pickled) and that holds the values after the gather is released.
- A rank-0-only `engine.module.state_dict()` (DeepSpeed-Chat's `save_hf_format`) returns at once, as
  DeepSpeed's does: partitioned parameters are empty placeholders, no collective is run (a collective here
  would wait for the other rank until `comm_timeout_seconds`); inside `GatheredParameters` it has values.
- The activation_checkpointing block of DeepSpeedExamples' Megatron 10B config (contiguous without
  number_checkpoints) initializes.
- A model built under DeepSpeed's own `deepspeed.zero.Init` is refused by `zerotrain.initialize` at once.
- DeepSpeed's names that such programs read: `param.ds_status` / `ds_id`, `engine.tput_timer`.
- `zerotrain.from_pretrained` (HfDeepSpeedConfig's effect) from a sharded safetensors directory: every parameter
  is a released ZeRO-3 parameter holding only its chunk right after the call, the chunks are exactly transformers'
  own `from_pretrained` weights (gathered through the engine), and a training step matches the plain model's
  loss; `HfDeepSpeedConfig` (transformers' name) switches `is_deepspeed_zero3_enabled` and supplies the config.
- DeepSpeed-Chat's sequence `HfDeepSpeedConfig(stage-3 config)` then transformers' own
  `AutoModelForCausalLM.from_pretrained(dir, config=...)`: partitioned, its gathered values transformers' weights;
  once the object is deleted `from_pretrained` is transformers' plain one again.
"""
from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from distributed import run_distributed
from models_for_tests import OddMLP, make_batches, train_global_step

WORLD, MICRO = 2, 2
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 5},  # fc2.bias (3) stays whole
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "comm_timeout_seconds": 15,  # a collective on one rank fails in 15 s, not the 30 min default
    # ds_zero-offload_10B_config.json's block (DeepSpeedExamples Megatron-LM): no number_checkpoints
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                 "cpu_checkpointing": True},
}


def stage3_saves(save_path: str) -> dict:
    import warnings

    import zerotrain
    from zerotrain.zero import GatheredParameters

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=CONFIG)
    for batch in make_batches(2, WORLD * MICRO):
        train_global_step(engine, batch, MICRO)
    rank = engine.global_rank
    full = engine.full_state_dict()  # collective: rank 0 has the whole fp32 weights
    out: dict = {}

    # A rank-0-only state_dict() (the other rank goes straight on to the barrier).
    if rank == 0:
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            alone = engine.module.state_dict()
        out["alone_seconds"] = time.perf_counter() - start
        out["alone"] = {k: (type(v), tuple(v.shape), v.clone()) for k, v in alone.items()}
        out["alone_warning"] = [str(w.message) for w in caught]
    zerotrain.dist.barrier()

    params = dict(engine.module.named_parameters())
    from zerotrain.runtime.zero.partition_parameters import ZeroParamStatus

    out["status_released"] = {k: p.ds_status for k, p in params.items()}
    out["ds_ids"] = [p.ds_id for p in params.values()]
    engine.tput_timer.update_epoch_count()  # DeepSpeed-Chat, once per epoch
    out["epochs"] = engine.tput_timer.epoch_count
    with GatheredParameters(list(params.values())):
        inside = {k: v.cpu() for k, v in params.items()}
        inside_data = {k: v.data.cpu() for k, v in params.items()}  # DeepSpeed-Chat's save_zero_three_model
        out["status_gathered"] = {p.ds_status for p in params.values()} == {ZeroParamStatus.AVAILABLE}
        gathered_state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    outside = {k: v.cpu() for k, v in params.items()}  # gathered on access, all ranks
    if rank == 0:
        torch.save(inside, save_path)
    zerotrain.dist.barrier()
    out.update(full=full, inside_types={type(v) for v in inside.values()},
               outside_types={type(v) for v in outside.values()},
               inside_after_release={k: v.clone() for k, v in inside.items()},
               data_after_release={k: (type(v), v.clone()) for k, v in inside_data.items()},
               outside_values={k: v.detach().clone() for k, v in outside.items()},
               saved=torch.load(save_path), gathered_state=gathered_state,
               partitioned={k for k, p in params.items() if not p._zero.persistent})
    # Training goes on after all that (the one-rank state_dict left nothing half-done).
    out["loss_after"] = train_global_step(engine, make_batches(3, WORLD * MICRO)[2], MICRO)
    return out


def both(save_path: str, model_dir: str) -> tuple[dict, dict]:
    return stage3_saves(save_path), load_partitioned(model_dir)


def test_stage3_saves_of_real_programs_and_from_pretrained(tmp_path):
    """One launch at world 2 (the suite's budget): the saves above, then `zerotrain.from_pretrained`."""
    directory = tiny_llama_dir(tmp_path / "model")
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    both_results = run_distributed(both, WORLD, str(tmp_path / "pytorch_model.bin"), directory, timeout=300)
    check_from_pretrained(directory, [pretrained for _, pretrained in both_results])
    results = [saves for saves, _ in both_results]
    zero = results[0]
    full = zero["full"]
    assert zero["partitioned"] == {"fc1.weight", "fc1.bias", "fc2.weight"}
    # bug 3: no collective (it would have waited comm_timeout_seconds), DeepSpeed's placeholders, one warning
    assert zero["alone_seconds"] < 5
    for name, (kind, shape, value) in zero["alone"].items():
        assert kind is torch.Tensor
        if name in zero["partitioned"]:
            assert shape == (0,), name
        else:
            torch.testing.assert_close(value, full[name], rtol=0, atol=0)
    assert len(zero["alone_warning"]) == 1 and "GatheredParameters" in zero["alone_warning"][0]
    # DeepSpeed's names on partitioned parameters and the engine
    from zerotrain.runtime.zero.partition_parameters import ZeroParamStatus

    assert zero["status_released"] == {name: ZeroParamStatus.NOT_AVAILABLE if name in zero["partitioned"]
                                       else ZeroParamStatus.AVAILABLE for name in full}
    assert zero["status_gathered"] and len(set(zero["ds_ids"])) == 4 and zero["epochs"] == 1
    for rank, result in enumerate(results):
        # bug 1: plain tensors, saved and loaded; the values outlive the gather
        assert result["inside_types"] == {torch.Tensor} and result["outside_types"] == {torch.Tensor}, rank
        for name, want in full.items():
            torch.testing.assert_close(result["saved"][name], want, rtol=0, atol=0)
            torch.testing.assert_close(result["inside_after_release"][name], want, rtol=0, atol=0)
            kind, value = result["data_after_release"][name]
            assert kind is torch.Tensor
            torch.testing.assert_close(value, want, rtol=0, atol=0)
            torch.testing.assert_close(result["outside_values"][name], want, rtol=0, atol=0)
            torch.testing.assert_close(result["gathered_state"][name], want, rtol=0, atol=0)
        assert result["loss_after"] == results[0]["loss_after"]


PRETRAINED_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0}


def tiny_llama_dir(out) -> str:
    """A 2-layer Llama with odd sizes (chunks cut rows), written sharded (several safetensors + index)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=67, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True, max_shard_size="8KB")
    return str(out)


def load_partitioned(directory: str) -> dict:
    import gc

    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel

    import zerotrain
    from zerotrain.pretrained import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    from zerotrain.zero import GatheredParameters
    from zerotrain.zero.stage3 import ZeroParameter

    plain = PreTrainedModel.__dict__["from_pretrained"]
    before = is_deepspeed_zero3_enabled()
    hf_config = HfDeepSpeedConfig(PRETRAINED_CONFIG)  # kept alive, as transformers requires: its config is used below
    model = zerotrain.from_pretrained(AutoModelForCausalLM, directory)
    # DeepSpeed-Chat's create_hf_model: transformers' own call (with the model's config) while the object lives
    # (DeepSpeed-Chat passes from_tf=bool(".ckpt" in path) too: an argument given but off is accepted)
    script = AutoModelForCausalLM.from_pretrained(directory, from_tf=False,
                                                  config=AutoConfig.from_pretrained(directory))
    params = dict(model.named_parameters())
    out = {
        "enabled": (before, is_deepspeed_zero3_enabled()),
        "partitioned": all(isinstance(p, ZeroParameter) and not p._zero.gathered for p in params.values()),
        "held": sum(p._zero.shard.numel() for p in params.values()),
        "total": sum(p.ds_numel for p in params.values()),
        "script_partitioned": [name for name, p in script.named_parameters()
                               if not (isinstance(p, ZeroParameter) and not p._zero.gathered)],
    }
    with GatheredParameters(list(script.parameters())):
        out["script_weights"] = {name: p.detach().clone() for name, p in script.named_parameters()}
    # DeepSpeed-Chat's reward model: the base model (AutoModel) read from a checkpoint of the model with a head,
    # whose names carry the base-model prefix ("model.")
    base = AutoModel.from_pretrained(directory)
    with GatheredParameters(list(base.parameters())):
        out["base_weights"] = {name: p.detach().clone() for name, p in base.named_parameters()}
    del hf_config, script, base
    gc.collect()
    after = AutoModelForCausalLM.from_pretrained(directory)
    out["plain_after"] = (PreTrainedModel.__dict__["from_pretrained"] is plain,
                          any(isinstance(p, ZeroParameter) for p in after.parameters()))
    engine, *_ = zerotrain.initialize(model=model, config=PRETRAINED_CONFIG)
    out["weights"] = engine.full_state_dict()
    ids = torch.arange(12).reshape(2, 6) % 67
    mine = ids[engine.global_rank:engine.global_rank + 1]
    loss = engine(input_ids=mine, labels=mine).loss
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    zerotrain.dist.all_reduce(total)
    out["loss"] = total.item() / 2
    return out


def check_from_pretrained(directory: str, results: list) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    want = {name: tensor for name, tensor in reference.state_dict().items()}
    for rank, result in enumerate(results):
        assert result["enabled"] == (False, True), rank
        assert result["partitioned"], f"rank {rank}: a parameter was whole after from_pretrained"
        assert result["held"] < 0.55 * result["total"], rank  # about half each: its chunks only
        assert result["script_partitioned"] == [], f"rank {rank}: whole after transformers' from_pretrained"
        assert set(result["script_weights"]) == {name for name, _ in reference.named_parameters()}
        for name, tensor in result["script_weights"].items():
            torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
        base = {name: tensor for name, tensor in want.items() if name.startswith("model.")}
        assert {"model." + name for name in result["base_weights"]} == set(base), rank
        for name, tensor in result["base_weights"].items():
            torch.testing.assert_close(tensor, want["model." + name], rtol=0, atol=0, msg=name)
        assert result["plain_after"] == (True, False), rank
    got = results[0]["weights"]
    assert set(got) == {name for name, _ in reference.named_parameters()}
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    ids = torch.arange(12).reshape(2, 6) % 67
    ref_loss = sum(reference(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss.item() for r in range(2)) / 2
    assert abs(results[0]["loss"] - ref_loss) <= 1e-5 * abs(ref_loss)


def build_under_deepspeed_init() -> str:
    import deepspeed

    import zerotrain

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3}}):
        model = OddMLP()
    assert model.fc1.weight.numel() == 0  # DeepSpeed's partitioned parameter
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        zerotrain.initialize(model=model, config=CONFIG)
    assert time.perf_counter() - start < 5
    return str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_model_partitioned_by_deepspeeds_zero_init_is_refused_at_once():
    message = run_distributed(build_under_deepspeed_init, 1, timeout=120)[0]
    assert "fc1.weight" in message and "deepspeed.zero.Init" in message
    assert "zerotrain.zero.Init" in message and "HfDeepSpeedConfig" in message
