"""Activation checkpointing (zerotrain.checkpointing) trains exactly as without it, and keeps less for backward.

Two spawns at world 2: data-parallel (GPT at stages 0-3 against single-process PyTorch, GPT with
dropout at stage 3 against the same run without checkpointing, a Hugging Face Llama with gradient
checkpointing at ZeRO-3 against single-process PyTorch without it), and tensor-parallel 2
(partitioned + contiguous inputs against single-process PyTorch; with dropout against the run
without checkpointing). The rest runs in this process.
"""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed

STEPS, MICRO, SEQ, LR = 3, 2, 16, 1e-3
# The attention key bias's gradient is rounding noise (softmax ignores a shift common to all keys); Adam's
# default eps would blow it up to lr-sized, order-dependent updates (see tests/zero/test_hf_parity.py).
EPS = 1e-6
CKPT = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 2}


def gpt(dropout: float = 0.0):
    from zerotrain.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, n_layer=2, n_head=4, n_embd=32, block_size=SEQ, n_inner=64, dropout=dropout))


def llama():
    import transformers  # the dev extra has it: a missing install fails, never skips
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def batches(dp: int):
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, 128, (MICRO * dp, SEQ + 1), generator=generator) for _ in range(STEPS)]


def train(model, stage: int, tp: int, checkpointing: bool, hf: bool = False, seed: int = 5):
    """Losses, full weights and the stage-3 fetcher's stats of one engine run (called on every rank)."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain import checkpointing as ckpt

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}}, "steps_per_print": 0,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                    "stage3_param_persistence_threshold": 0},
              "tensor_parallel": {"autotp_size": tp}}
    if checkpointing:
        config["activation_checkpointing"] = CKPT if tp > 1 else {}
    if hf and checkpointing:
        ckpt.enable_hf_gradient_checkpointing(model)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    ckpt.reset()
    held_after_backward = []  # per step, when backward is done: (gathered non-persistent parameters, holds)
    if engine.stage3 is not None:
        fetcher = engine.stage3.fetcher
        end_micro_step = fetcher.end_micro_step

        def observed_end_micro_step():  # observe, then the real bookkeeping
            held_after_backward.append((sum(p.gathered and not p.persistent for p in fetcher.parts),
                                        sum(fetcher.holds.values())))
            end_micro_step()
        fetcher.end_micro_step = observed_end_micro_step
    dp, dp_rank, world = engine.topology.dp_size, engine.topology.dp_rank, int(os.environ["WORLD_SIZE"])
    torch.manual_seed(seed + dp_rank)  # dropout: each data-parallel rank its own masks, alike over tp ranks
    losses = []
    for tokens in batches(dp):
        micro = tokens[dp_rank * MICRO:(dp_rank + 1) * MICRO]
        if hf:
            loss = engine(input_ids=micro[:, :-1], labels=micro[:, :-1]).loss
        else:
            _, loss = engine(micro[:, :-1], micro[:, 1:])
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    fetch_stats = engine.work_stats()["gather"]
    return {"losses": losses, "weights": engine.full_state_dict(), "fetch": fetch_stats,
            "held": held_after_backward, "ckpt": ckpt.stats()}


def reference(model, dp: int, hf: bool = False):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for tokens in batches(dp):
        if hf:  # the mean over ranks of per-rank mean losses (labels shift inside the model)
            loss = sum(model(input_ids=t[:, :-1], labels=t[:, :-1]).loss for t in tokens.split(MICRO)) / dp
        else:
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def data_parallel_runs() -> dict:
    results = {f"gpt{stage}": train(gpt(), stage, 1, True) for stage in range(4)}
    results["dropout"] = train(gpt(0.1), 3, 1, True)
    results["dropout_plain"] = train(gpt(0.1), 3, 1, False)
    results["llama"] = train(llama(), 3, 1, True, hf=True)
    return results


def megatron_mpu_partitions() -> dict:
    """Megatron-LM's mpu getters (the whole world of 2 is the tensor-parallel group) given to `configure`: a
    checkpointed function's input is kept in halves, and its gradient is the plain one."""
    import torch.distributed as dist
    from types import SimpleNamespace

    from zerotrain import checkpointing as ckpt

    mpu = SimpleNamespace(get_tensor_model_parallel_group=lambda: dist.group.WORLD,
                          get_tensor_model_parallel_rank=dist.get_rank,
                          get_tensor_model_parallel_world_size=dist.get_world_size)
    ckpt.configure(mpu, partition_activations=True)
    ckpt.reset()
    weight = torch.nn.Parameter(torch.randn(6, 6, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)  # 30: not a multiple of 4
    ckpt.checkpoint(lambda t: (t @ weight).tanh(), x).sum().backward()
    out = {"tp": (ckpt._state.tp.rank, ckpt._state.tp.size), "stats": ckpt.stats(), "grad": weight.grad.clone(),
           "want": torch.autograd.grad((x.detach() @ weight).tanh().sum(), weight)[0]}
    ckpt.configure(None)
    return out


def tensor_parallel_runs() -> dict:
    return {"gpt": train(gpt(), 1, 2, True), "dropout": train(gpt(0.1), 1, 2, True),
            "dropout_plain": train(gpt(0.1), 1, 2, False), "megatron": megatron_mpu_partitions()}


def assert_same(got: dict, losses, weights, where: str) -> None:
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], losses)) <= 1e-5, (where, got["losses"], losses)
    assert set(weights) <= set(got["weights"]), where  # the engine's also names a tied weight twice
    for name, want in weights.items():
        torch.testing.assert_close(got["weights"][name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{where}, {name}: {m}")


def test_checkpointing_data_parallel_stages_dropout_and_hf_llama_zero3():
    import transformers  # noqa: F401 - in the dev extra: a missing install fails, never skips
    results = run_distributed(data_parallel_runs, 2, timeout=300)[0]
    ref_losses, ref_weights = reference(gpt(), 2)
    for stage in range(4):
        run = results[f"gpt{stage}"]
        assert_same(run, ref_losses, ref_weights, f"GPT stage {stage}")
        assert run["ckpt"]["recomputes"] == run["ckpt"]["forwards"] == 2 * STEPS  # two blocks a step
    # Dropout: the recompute replays the forward's masks (a different mask would change the gradients).
    dropout, plain = results["dropout"], results["dropout_plain"]
    assert_same(dropout, plain["losses"], plain["weights"], "GPT dropout 0.1, stage 3")
    assert dropout["losses"] != results["gpt3"]["losses"]  # dropout really drew masks
    # ZeRO-3: the recorded order (forward, then recompute + backward) is followed every later step,
    # prefetch runs, and nothing stays gathered after backward.
    for name in ("gpt3", "dropout", "llama"):
        fetch = results[name]["fetch"]
        assert fetch["order_mismatches"] == 0 and fetch["prefetch_hits"] > 0, (name, fetch)
        assert fetch["live_numel"] == 0 and fetch["inflight_numel"] == 0, (name, fetch)
        assert results[name]["held"] == [(0, 0)] * STEPS, (name, results[name]["held"])
    llama_losses, llama_weights = reference(llama(), 2, hf=True)
    assert_same(results["llama"], llama_losses, llama_weights, "Llama, gradient checkpointing, ZeRO-3")
    assert results["llama"]["ckpt"]["recomputes"] == 2 * STEPS


def test_checkpointing_tensor_parallel_partitions_inputs():
    results = run_distributed(tensor_parallel_runs, 2, timeout=300)[0]
    ref_losses, ref_weights = reference(gpt(), 1)
    run = results["gpt"]
    assert_same(run, ref_losses, ref_weights, "GPT tp 2, partition_activations + contiguous")
    # Each tensor-parallel rank kept half of every checkpointed input.
    assert run["ckpt"]["input_bytes"] == 2 * STEPS * MICRO * SEQ * 32 * 4
    assert run["ckpt"]["kept_device_bytes"] * 2 == run["ckpt"]["input_bytes"]
    dropout, plain = results["dropout"], results["dropout_plain"]
    assert_same(dropout, plain["losses"], plain["weights"], "GPT tp 2, dropout 0.1")
    assert dropout["losses"] != run["losses"]
    megatron = results["megatron"]  # rank 0's: configured from a Megatron-style mpu
    assert megatron["tp"] == (0, 2) and megatron["stats"]["input_bytes"] == 30 * 4
    assert megatron["stats"]["kept_device_bytes"] == 15 * 4  # its half of the 30 elements
    torch.testing.assert_close(megatron["grad"], megatron["want"], rtol=1e-6, atol=1e-7)


def saved_bytes(model, checkpointing: bool, tokens) -> int:
    """Bytes autograd keeps for backward during one forward (tensors counted once by storage)."""
    from zerotrain import checkpointing as ckpt

    seen: dict[int, int] = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    if checkpointing:
        ckpt.enable_hf_gradient_checkpointing(model)
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return sum(seen.values())


def test_hf_gradient_checkpointing_keeps_less_for_backward():
    import transformers  # the dev extra has it: a missing install fails, never skips
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    tokens = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = saved_bytes(transformers.LlamaForCausalLM(config), False, tokens)
    torch.manual_seed(0)
    checkpointed = saved_bytes(transformers.LlamaForCausalLM(config), True, tokens)
    # Checkpointed: the layers' inputs and the head's activations; plain: every layer's activations too.
    assert checkpointed < 0.5 * plain, (checkpointed, plain)


def test_rng_tracker_replays_a_forked_dropout_in_the_recompute():
    from zerotrain import checkpointing as ckpt

    ckpt.model_parallel_manual_seed(7, tp_rank=1)
    tracker = ckpt.get_rng_tracker()
    weight = torch.randn(64, 64, requires_grad=True)

    def region(x):  # a tensor-parallel region's dropout draws from the tracked state
        with tracker.fork():
            return torch.nn.functional.dropout(x @ weight, 0.5)

    x = torch.randn(8, 64)
    states = tracker.get_states()
    region(x).sum().backward()
    want = weight.grad.clone()
    weight.grad = None
    tracker.set_states(states)
    ckpt.checkpoint(region, x).sum().backward()
    torch.testing.assert_close(weight.grad, want, rtol=0, atol=0)
    # The tracked state is not the default one: the tp-rank seed draws another mask.
    tracker.set_states(states)
    with tracker.fork():
        forked = torch.rand(16)
    assert not torch.equal(forked, torch.rand(16))


def test_rng_tracker_after_backward_is_where_the_forward_left_it_over_several_regions():
    """Three checkpointed regions, each with a forked dropout: after backward (three recomputes, the last
    replaying the first region's snapshot) the tracker holds the state the forward advanced it to, as without
    checkpointing, so the next step draws new masks: two steps' gradients equal plain autograd's."""
    from zerotrain import checkpointing as ckpt

    tracker = ckpt.get_rng_tracker()
    weights = [torch.randn(32, 32, requires_grad=True) for _ in range(3)]

    def region(x, weight):
        with tracker.fork():
            return torch.nn.functional.dropout(torch.tanh(x @ weight), 0.5)

    def run(checkpointed: bool) -> tuple[list, dict]:
        ckpt.model_parallel_manual_seed(11, tp_rank=0)
        torch.manual_seed(3)
        grads, after = [], None
        for _ in range(2):
            x = torch.randn(4, 32)
            for weight in weights:
                x = ckpt.checkpoint(region, x, weight) if checkpointed else region(x, weight)
            x.sum().backward()
            grads.append([weight.grad.clone() for weight in weights])
            for weight in weights:
                weight.grad = None
            after = after or tracker.get_states()  # after the first step's backward
        return grads, after

    want_grads, want_after = run(False)
    got_grads, got_after = run(True)
    assert want_after.keys() == got_after.keys()
    for name, state in want_after.items():
        assert torch.equal(got_after[name], state), name
    for got, want in zip(got_grads, want_grads):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_configure_reads_the_block_and_refuses_contiguous_without_partition():
    from zerotrain import checkpointing as ckpt
    from zerotrain.config import load_config

    config = load_config({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                                       "profile": True}})
    assert "activation_checkpointing" not in config.unimplemented
    ckpt.configure(None, deepspeed_config=config, checkpoint_in_cpu=False)
    assert ckpt.is_configured() and ckpt._state.partition and not ckpt._state.cpu and ckpt._state.profile
    with pytest.raises(ValueError, match="contiguous_memory_optimization needs partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True)
    with pytest.raises(Exception, match="activation_checkpointing.number_checkpoint"):
        load_config({"activation_checkpointing": {"number_checkpoint": 2}})
    with pytest.raises(ValueError, match="use_reentrant=True"):
        ckpt.checkpoint(torch.sin, torch.ones(2), use_reentrant=True)
    ckpt.configure(None)


# The shape of DeepSpeedExamples' Megatron-LM `ds_zero-offload_10B_config.json`: contiguous_memory_optimization
# without number_checkpoints (Megatron passes configure(num_checkpoints=num_layers) itself).
MEGATRON_10B_SHAPE = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1,
    "zero_optimization": {"stage": 2, "cpu_offload": True, "contiguous_gradients": True, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 50000000, "allgather_bucket_size": 500000000},
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                 "cpu_checkpointing": True},
    "wall_clock_breakdown": False,
}


def test_contiguous_without_number_checkpoints_loads_and_is_checked_on_use():
    """As DeepSpeed: the config loads and configures; only a checkpoint before the number is known raises."""
    from zerotrain import checkpointing as ckpt
    from zerotrain.config import ConfigWarning, load_config

    with pytest.warns(ConfigWarning, match="zero_optimization.cpu_offload is a legacy DeepSpeed key"):
        config = load_config(MEGATRON_10B_SHAPE)  # Megatron's own config: its legacy key read as DeepSpeed reads it
    assert config.activation_checkpointing.contiguous_memory_optimization
    assert config.activation_checkpointing.number_checkpoints is None
    try:
        ckpt.configure(None, deepspeed_config=config)  # what the engine does at initialize
        weight = torch.nn.Parameter(torch.randn(4, 4))
        with pytest.raises(ValueError, match="contiguous_memory_optimization needs number_checkpoints"):
            ckpt.checkpoint(lambda x: x @ weight, torch.randn(3, 4, requires_grad=True))
        ckpt.set_num_layers(2)  # Megatron: configure(mpu, deepspeed_config=..., num_checkpoints=num_layers)
        x = torch.randn(3, 4, requires_grad=True)
        ckpt.checkpoint(lambda t: (t @ weight).tanh(), x).sum().backward()
        want = torch.autograd.grad((x.detach() @ weight).tanh().sum(), weight)[0]
        torch.testing.assert_close(weight.grad, want)
    finally:
        ckpt.configure(None)
