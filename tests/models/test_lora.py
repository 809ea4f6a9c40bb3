"""LoRA through peft in `zerotrain train` (`--lora-r`, `zerotrain.models.hf.apply_lora`), against peft itself.

One world-2 launch holds every equality:
- ZeRO-3, data-parallel 2, with two tokens added (`--add-tokens`): the frozen base stays partitioned (never
  whole on a rank), has no gradient buffer and no optimizer state; the adapters and the new tokens' rows of
  the embedding and the untied head (peft's trainable tokens) train as single-process peft trains them on the
  same batches (losses 1e-5 relative, weights rtol 1e-5 / atol 1e-6); a `checkpoint.adapters_only` save holds
  only those and their optimizer states, and a fresh engine that loads the base directory and then that
  checkpoint continues exactly; its full save's adapter (PEFT layout) loads with `PeftModel.from_pretrained`
  (on the resized base) and `AutoModelForCausalLM.from_pretrained(checkpoint)`, both giving the engine's
  logits; `ckpt export --merge-lora` gives them too, and peft's merged logits. Between steps 2 and 3 each rank
  calls the training engine's `generate`, finishing after different lengths: the tokens are transformers'
  greedy ones, and the training after it is the reference's, which never generated. The same with a tied
  head (one trained delta for both).
- tensor parallelism 2 (ZeRO stages 0-3), LoRA on every linear layer (column- and row-split bases), with new
  tokens' rows training at stages 0-2 (the embedding and head then whole) and without at stage 3 (both split
  by vocabulary): the same equality with peft, and the save (frozen split base joined whole) loads back exactly.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from models_for_tests import tied_llama_copy

import transformers  # the dev extra has it: a missing install fails, never skips
import peft  # the dev extra has it: a missing install fails, never skips

SEED, R, STEPS = 7, 4, 4
# Tensor parallelism sums the split products in another order. Where an adapter's gradient is a cancellation
# near zero, Adam's m / (sqrt(v) + eps) turns that rounding into an update of full size (a handful of elements
# then differ by ~5e-6 though every loss agrees to 1e-5): the tensor-parallel runs train with SGD + momentum,
# whose update is linear in the gradient, so the comparison stays about the math at the usual tolerances.
TP_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TP_NEW_TOKENS = {0: 2, 1: 2, 2: 2, 3: 0}  # tokens added (their rows training) in the tensor-parallel run per stage


ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}
SGD = {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}


def _config(stage: int, micro: int, optimizer: dict = ADAMW, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "steps_per_print": 0,
            "optimizer": optimizer,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


NEW_TOKENS = ("<|new_a|>", "<|new_b|>")  # added (--add-tokens) for the ZeRO-3 run: their rows train beside LoRA


def _with_new(ids: torch.Tensor, vocab: int, new: int) -> torch.Tensor:
    """`ids` with every 3rd token one of the `new` tokens added after `vocab` (so their rows get gradients)."""
    if new:
        ids[..., ::3] = vocab + torch.arange(ids[..., ::3].numel()).reshape(ids[..., ::3].shape) % new
    return ids


def _batches(vocab: int, new: int = 0) -> torch.Tensor:
    """STEPS global batches of 4 sequences of 16 tokens (every token counts: no -100 labels)."""
    return _with_new(torch.randint(0, vocab, (STEPS, 4, 16), generator=torch.Generator().manual_seed(3)), vocab, new)


def _probe(vocab: int, new: int = 0) -> torch.Tensor:
    return _with_new(torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5)), vocab, new)


GENERATE = (2, 6)  # new tokens per rank: rank 0 finishes first


def _generate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> list[int]:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
                          max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                          **kwargs)[0, ids.shape[1]:].tolist()


def _train(engine, batches: torch.Tensor, steps, rows: slice) -> list[float]:
    losses = []
    for step in steps:
        ids = batches[step][rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# --- every rank of the one world-2 launch ---------------------------------------------------------------------

def _grown_with_new_tokens(directory: str):
    """`train --add-tokens ... --lora-r R`'s setup: the model source with its vocabulary grown by NEW_TOKENS, the
    old vocabulary size, and LoRA options training the new tokens' rows."""
    from zerotrain.models.hf import LoraOptions, grow_vocab, load_tokenizer, resolve_model

    source = resolve_model(directory)
    tokenizer = load_tokenizer(source)
    old_vocab = grow_vocab(source, tokenizer, NEW_TOKENS)
    new_ids = tuple(tokenizer.convert_tokens_to_ids(list(NEW_TOKENS)))
    return source, old_vocab, LoraOptions(r=R, trainable_tokens=new_ids)


def _zero3_data_parallel(directory: str, tmp: str, vocab: int) -> dict:
    from zerotrain.run.model import load_weights, model_engine
    from zerotrain.zero.stage3.partition import ZeroParameter

    # `train --add-tokens ... --lora-r R`: the vocabulary grows, the new tokens' rows train (peft's trainable tokens)
    source, old_vocab, lora = _grown_with_new_tokens(directory)
    batches, rank = _batches(vocab, len(NEW_TOKENS)), int(os.environ["RANK"])
    rows = slice(2 * rank, 2 * rank + 2)
    engine, model = model_engine(source, _config(3, 2, checkpoint={"adapters_only": True}), seed=SEED, lora=lora)
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    load_weights(engine, source, model, old_vocab, tmp, SEED)
    out = {"tokens": lora.trainable_tokens, "initial": engine.full_state_dict(trainable_only=True)}
    out.update({"trainable": sorted(trainable), "frozen": [n for n, _ in frozen]})
    out["losses"] = _train(engine, batches, range(2), rows)
    engine.save_checkpoint(os.path.join(tmp, "adapters"))  # adapters_only
    # Evaluation between steps: the training engine's generate, the ranks finishing after different lengths
    # (synced: rank 0 keeps stepping until rank 1 is done, or rank 1 would hang in the gathers); no_grad, eval
    # mode, the parameters released after; the training that follows is the reference's, which never generated.
    engine.train()
    # (synced_gpus=False as code written for DeepSpeed passes it: `is_deepspeed_zero3_enabled()` is False here)
    out["generated"] = _generate(model, _probe(vocab, len(NEW_TOKENS))[rank:rank + 1], GENERATE[rank],
                                 synced_gpus=False)
    out["mode_after_generate"] = model.training
    out["released_after_generate"] = all(not p._zero.gathered for p in model.parameters()
                                         if isinstance(p, ZeroParameter) and not p._zero.persistent)
    out["losses"] += _train(engine, batches, range(2, STEPS), rows)
    out["order_mismatches"] = engine.work_stats()["gather"]["order_mismatches"]  # the record was left as it was
    # The base: released shards (a one-element placeholder), in the engine's frozen parts (no gradient buffer,
    # no master, no optimizer state); only adapter masters carry optimizer state.
    out["partitioned"] = all(isinstance(p, ZeroParameter) and not p._zero.gathered
                             and p.data.untyped_storage().nbytes() <= p.element_size() for _, p in frozen)
    out["frozen_parts"] = sorted(name for part in engine.stage3.frozen for name in part.names)
    out["trainable_parts"] = sorted(name for part in engine.stage3.trainable for name in part.names)
    out["frozen_grads"] = [n for n, p in frozen if p.grad is not None]
    out["state_numel"] = sum(t.numel() for state in engine.optimizer.state.values() for t in state.values()
                             if torch.is_tensor(t) and t.dim() > 0)
    out["master_numel"] = sum(m.numel() for m in engine.zero_optimizer.masters)
    out["report"] = {k: v for k, v in engine.memory_report().items() if k != "comm"}
    out["weights"] = engine.full_state_dict(trainable_only=True)
    engine.close()

    # A fresh engine: the base directory, then the adapters-only checkpoint of step 2; steps 3-4 again.
    engine, model = model_engine(source, _config(3, 2), seed=SEED + 1, lora=lora)  # another adapter init
    load_weights(engine, source, model, old_vocab, tmp, SEED)
    engine.load_checkpoint(os.path.join(tmp, "adapters"), tag="global_step2")
    out["resumed_losses"] = _train(engine, batches, range(2, STEPS), rows)
    out["resumed_weights"] = engine.full_state_dict(trainable_only=True)
    engine.save_checkpoint(os.path.join(tmp, "full"))  # a whole checkpoint (base + adapter, PEFT adapter files)
    engine.eval()
    with torch.no_grad():
        out["logits"] = engine(input_ids=_probe(vocab, len(NEW_TOKENS))).logits
    engine.close()
    return out


def _tensor_parallel(directory: str, tmp: str, vocab: int, stage: int) -> dict:
    import zerotrain
    from zerotrain.models.hf import LoraOptions, adapter_files, apply_lora

    new = TP_NEW_TOKENS[stage]
    batches = _batches(vocab, new)
    config = _config(stage, 4, SGD, tensor_parallel={"autotp_size": 2})

    def build(seed: int):
        model = _resized(directory, new)
        options = LoraOptions(r=R, target_modules=TP_TARGETS, trainable_tokens=tuple(range(vocab, vocab + new)))
        model = apply_lora(model, options, base_dir=directory, seed=seed)
        engine, *_ = zerotrain.initialize(model=model, config=config)
        engine.add_checkpoint_files(lambda: adapter_files(engine.full_state_dict(trainable_only=True), model))
        return engine, model

    engine, model = build(SEED)
    split = sorted(n for n, p in model.named_parameters() if getattr(p, "tp_slice", None) is not None)
    out = {"split": split, "frozen_split": sorted(n for n, p in model.named_parameters()
                                                  if not p.requires_grad and n in split)}
    out["losses"] = _train(engine, batches, range(3), slice(None))
    out["weights"] = engine.full_state_dict(trainable_only=True)
    save = os.path.join(tmp, f"tp_stage{stage}")
    engine.save_checkpoint(save)
    engine.close()
    engine, model = build(SEED + 1)
    engine.load_checkpoint(save)
    out["loaded"] = engine.full_state_dict(trainable_only=True)
    out["next_loss"] = _train(engine, batches, [3], slice(None))
    engine.close()
    return out


def _tied_new_tokens(directory: str, tmp: str, vocab: int) -> dict:
    """ZeRO-3 LoRA with new tokens on a model with a tied head: one delta, shared by embedding and head."""
    from zerotrain.run.model import load_weights, model_engine

    source, old_vocab, lora = _grown_with_new_tokens(directory)
    engine, model = model_engine(source, _config(3, 2), seed=SEED, lora=lora)
    load_weights(engine, source, model, old_vocab, tmp, SEED)
    rank = int(os.environ["RANK"])
    losses = _train(engine, _batches(vocab, len(NEW_TOKENS)), range(2), slice(2 * rank, 2 * rank + 2))
    weights = engine.full_state_dict(trainable_only=True)
    engine.close()
    return {"losses": losses, "weights": weights}


def _adapters_at_world1(directory: str, tmp: str, checkpoint: str, vocab: int) -> dict:
    """In the test's own process (a world of one): a fresh engine, the base directory, then the world-2
    adapters_only checkpoint of step 2; steps 3-4 on all four rows of each batch."""
    import torch.distributed as dist

    from zerotrain.run.model import load_weights, model_engine

    source, old_vocab, lora = _grown_with_new_tokens(directory)
    started = dist.is_initialized()
    engine, model = model_engine(source, _config(3, 4), seed=SEED + 1, lora=lora)  # another adapter init
    try:
        load_weights(engine, source, model, old_vocab, tmp, SEED)
        engine.load_checkpoint(checkpoint, tag="global_step2")
        losses = _train(engine, _batches(vocab, len(NEW_TOKENS)), range(2, STEPS), slice(0, 4))
        return {"losses": losses, "weights": engine.full_state_dict(trainable_only=True)}
    finally:
        engine.close()
        if not started and dist.is_initialized():  # a world of one, this test's own
            dist.destroy_process_group()


def _lora_world2(directory: str, tmp: str, vocab: int, tied: str) -> dict:
    return {"tied": _tied_new_tokens(tied, tmp, vocab),
            "zero3": _zero3_data_parallel(directory, tmp, vocab),
            "tp": {stage: _tensor_parallel(directory, tmp, vocab, stage) for stage in (0, 1, 2, 3)}}


# --- the reference: peft in one process ------------------------------------------------------------------------

def _resized(directory, new: int):
    """The base model with `new` tokens added as `zerotrain train --add-tokens` adds them (write_resized's rows:
    transformers' mean resizing from the same seed)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    if new:
        torch.manual_seed(SEED)
        model.resize_token_embeddings(model.config.vocab_size + new)
    return model


def _peft_model(directory, targets=None, new: int = 0):
    model = _resized(directory, new)
    vocab = model.config.vocab_size - new
    torch.manual_seed(SEED)
    tokens = {"model.embed_tokens": list(range(vocab, vocab + new)), "lm_head": list(range(vocab, vocab + new))}
    config = peft.LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules=list(targets) if targets else
                             None, task_type="CAUSAL_LM", trainable_token_indices=tokens if new else None)
    return peft.get_peft_model(model, config)


def _peft_training(directory, vocab: int, steps: int, targets=None, sgd: bool = False, new: int = 0):
    model = _peft_model(directory, targets, new)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9) if sgd else \
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses, generated = [], None
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for step, ids in enumerate(_batches(vocab, new)[:steps]):
        if step == 2:  # plain transformers' greedy generate where the engine generates (no effect on training)
            model.eval()
            with torch.no_grad():
                generated = [_generate(model, _probe(vocab, new)[r:r + 1], GENERATE[r]) for r in range(2)]
            model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.generated, model.initial = generated, initial
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, model


def _close(got: dict, want: dict, where: str, per_tensor: bool = False) -> None:
    """Every weight within rtol 1e-5 / atol 1e-6 of the reference's, element by element, or with `per_tensor` as a
    whole tensor: |got - want| <= 1e-5 |want| (Frobenius norms)."""
    assert set(got) == set(want), f"{where}: {sorted(set(got) ^ set(want))[:4]}"
    for name, tensor in want.items():
        if per_tensor:
            error = float((got[name] - tensor).norm() / tensor.norm())
            assert error <= 1e-5, f"{where}: {name}: relative error {error:.2e}"
        else:
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {name}: {m}")


def _safetensors_keys(directory: Path, kind: str = "model") -> set[str]:
    return set(json.loads((directory / f"{kind}.safetensors.index.json").read_text())["weight_map"])


def test_lora_world2_zero3_and_tensor_parallel_equal_peft(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file

    from zerotrain.cli import main

    directory = str(tiny_llama_dir)
    vocab = transformers.AutoConfig.from_pretrained(directory).vocab_size
    tied = str(tied_llama_copy(directory, tmp_path / "tied"))
    results = run_distributed(_lora_world2, 2, directory, str(tmp_path), vocab, tied, timeout=300)

    # --- ZeRO-3, data-parallel 2 == peft on one process ---
    new = len(NEW_TOKENS)
    ref_losses, ref_weights, reference = _peft_training(directory, vocab, STEPS, new=new)
    z3 = [r["zero3"] for r in results]
    assert z3[0]["tokens"] == (vocab, vocab + 1)
    for step in range(STEPS):
        assert (z3[0]["losses"][step] + z3[1]["losses"][step]) / 2 == pytest.approx(ref_losses[step], rel=1e-5)
    assert all(t.abs().sum() > 0 for n, t in ref_weights.items() if ".lora_B." in n), "lora_B left zero: no training"
    # the new tokens' rows of the embedding and of the (untied) head: they start from the resized base rows, as
    # peft's do, and they train
    deltas = sorted(n for n in ref_weights if ".trainable_tokens_delta." in n)
    assert [n.split(".token_adapter.")[0] for n in deltas] == ["base_model.model.lm_head",
                                                                "base_model.model.model.embed_tokens"]
    _close({n: z3[0]["initial"][n] for n in deltas}, {n: reference.initial[n] for n in deltas}, "token rows at start")
    for name in deltas:
        assert (ref_weights[name] - reference.initial[name]).abs().amax() > 1e-3, f"{name}: the new rows never trained"
    _close(z3[0]["weights"], ref_weights, "ZeRO-3 adapters")
    assert z3[0]["trainable"] == sorted(ref_weights)
    assert all(".lora_" in n or ".trainable_tokens_delta." in n for n in ref_weights)
    for rank, out in enumerate(z3):
        assert out["generated"] == reference.generated[rank] and len(out["generated"]) == GENERATE[rank], rank
        assert out["mode_after_generate"] and out["released_after_generate"] and out["order_mismatches"] == 0
        assert out["partitioned"], f"rank {rank}: a frozen base parameter is whole on the rank"
        assert out["frozen_parts"] == sorted(out["frozen"]) and out["trainable_parts"] == out["trainable"]
        assert out["frozen_grads"] == [], "frozen parameters got gradients"
        trainable = sum(t.numel() for t in ref_weights.values())
        report = out["report"]
        assert report["trainable_numel"] == trainable and report["frozen_numel"] == \
            sum(p.numel() for p in reference.parameters() if not p.requires_grad)
        # masters and Adam's two states for this rank's half of the adapters only (the base has none)
        assert out["master_numel"] <= trainable // 2 + 64 and out["state_numel"] == 2 * out["master_numel"]
        assert 0 < report["optimizer_states"] <= 3 * 4 * out["master_numel"]

    # adapters_only: the checkpoint holds the adapters and their optimizer states, nothing of the base; the
    # fresh engine that read the base directory and then it continued exactly.
    adapters = tmp_path / "adapters" / "global_step2"
    assert _safetensors_keys(adapters) == set() and _safetensors_keys(adapters, "master_weights") == set(ref_weights)
    assert {key.split("/")[0] for key in _safetensors_keys(adapters, "optimizer")} == set(ref_weights)
    assert z3[0]["resumed_losses"] == pytest.approx(z3[0]["losses"][2:], rel=1e-5)
    assert z3[1]["resumed_losses"] == pytest.approx(z3[1]["losses"][2:], rel=1e-5)
    _close(z3[0]["resumed_weights"], z3[0]["weights"], "resumed from adapters_only")
    # ... and at another world size: this process (world 1, one micro-batch of the 4 rows the two ranks split) reads
    # the world-2 checkpoint's adapters and their Adam states from the master and optimizer files, and continues
    # exactly (losses the two ranks' mean, weights the world-2 run's)
    world1 = _adapters_at_world1(directory, str(tmp_path / "world1"), str(tmp_path / "adapters"), vocab)
    for step in range(2, STEPS):
        assert world1["losses"][step - 2] == pytest.approx((z3[0]["losses"][step] + z3[1]["losses"][step]) / 2,
                                                           rel=1e-5), f"world 1 from world 2, step {step + 1}"
    _close(world1["weights"], z3[0]["weights"], "adapters_only of world 2 resumed at world 1")

    # Every checkpoint holds the adapter in PEFT's layout: PeftModel.from_pretrained gives the engine's logits.
    # (the base resized to the new vocabulary first, as a user does after adding the tokens to the tokenizer: the
    # trained rows of the new tokens replace whatever the resize gave them)
    full = tmp_path / "full" / "global_step4"
    probe = _probe(vocab, new)
    base = transformers.AutoModelForCausalLM.from_pretrained(directory)
    base.resize_token_embeddings(vocab + new, mean_resizing=False)
    loaded = peft.PeftModel.from_pretrained(base, str(full)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=probe).logits, z3[0]["logits"], rtol=1e-5, atol=1e-5)
    # ... and so does from_pretrained of the checkpoint directory itself (the frozen base is stored under the base
    # model's names, the adapter beside it), and of its plain export (no --merge-lora: the same two parts).
    # The model files hold the base model's names only (the adapter: adapter_model.safetensors, and its fp32 values
    # in the master files, which the resume above read): transformers loads them with no unexpected or missing key.
    base_names = set(transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict())
    assert _safetensors_keys(full) <= base_names and set(ref_weights) <= _safetensors_keys(full, "master_weights")
    plain = tmp_path / "plain"
    assert main(["ckpt", "export", str(full), str(plain)]) == 0
    for directory_of_model in (full, plain):
        as_model, info = transformers.AutoModelForCausalLM.from_pretrained(directory_of_model,
                                                                            output_loading_info=True)
        assert not any(info.get(k) for k in ("unexpected_keys", "missing_keys", "mismatched_keys")), info
        as_model.eval()
        with torch.no_grad():
            torch.testing.assert_close(as_model(input_ids=probe).logits, z3[0]["logits"], rtol=1e-5, atol=1e-5)
    for checkpoint in (full, adapters):  # an adapters_only checkpoint carries it too
        saved = load_file(str(checkpoint / "adapter_model.safetensors"))
        assert set(saved) == {n.replace(".default", "") for n in ref_weights}

    # `ckpt export --merge-lora` (the checkpoint's own adapter): a plain model directory with peft's merged logits.
    out = tmp_path / "merged"
    assert main(["ckpt", "export", str(full), str(out), "--merge-lora"]) == 0
    assert not (out / "adapter_config.json").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    want = peft.PeftModel.from_pretrained(_resized(directory, new), str(full)).merge_and_unload().eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=probe).logits, want(input_ids=probe).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=probe).logits, z3[0]["logits"], rtol=1e-5, atol=1e-5)
    assert main(["ckpt", "export", str(adapters), str(tmp_path / "nope"), "--merge-lora"]) == 1  # no base in it

    # --- a tied head: peft trains one delta for both; the engine names the tied parameter under both names ---
    tied_losses, tied_weights, _ = _peft_training(tied, vocab, 2, new=new)
    assert [n for n in tied_weights if ".trainable_tokens_delta." in n] == \
        ["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"]
    for step in range(2):
        got = [r["tied"]["losses"][step] for r in results]
        assert sum(got) / 2 == pytest.approx(tied_losses[step], rel=1e-5), f"tied head, step {step + 1}"
    # per tensor: Adam's second step on an element whose two gradients nearly cancel turns the last bit of the
    # clipping coefficient (the engine's is computed in double from an fp64 norm and rounded once in the multiply,
    # torch's clip_grad_norm_ computes it in fp32) into 2e-5 of that element (1 of 256 in a LoRA A, since the
    # engine sums the norm's squares in fp64 as DeepSpeed does)
    _close({n: t for n, t in results[0]["tied"]["weights"].items() if n in tied_weights}, tied_weights, "tied head",
           per_tensor=True)

    # --- tensor parallelism 2, LoRA on column- and row-split layers, ZeRO stages 0-3 ---
    # (stages 0-2 with new tokens whose rows train: the embedding and head stay whole; stage 3 without: they are
    # split by vocabulary)
    reference = {new: (_peft_training(directory, vocab, STEPS, TP_TARGETS, sgd=True, new=new)[0],
                       _peft_training(directory, vocab, 3, TP_TARGETS, sgd=True, new=new)[1])
                 for new in set(TP_NEW_TOKENS.values())}
    for stage in (0, 1, 2, 3):
        tp_losses, tp_weights = reference[TP_NEW_TOKENS[stage]]
        assert all(t.abs().sum() > 0 for n, t in tp_weights.items() if ".lora_B." in n), "lora_B left zero"
        assert sum(".trainable_tokens_delta." in n for n in tp_weights) == (2 if TP_NEW_TOKENS[stage] else 0)
        base_weights = _resized(directory, TP_NEW_TOKENS[stage]).state_dict()
        for rank, result in enumerate(results):
            got = result["tp"][stage]
            where = f"TP2 stage {stage} rank {rank}"
            assert any(".base_layer." in n for n in got["frozen_split"]), f"{where}: the base is split"
            assert any("embed_tokens" in n for n in got["split"]) == (TP_NEW_TOKENS[stage] == 0), where
            assert any(".lora_A." in n for n in got["split"]) and any(".lora_B." in n for n in got["split"])
            assert got["losses"] == pytest.approx(tp_losses[:3], rel=1e-5), where
            assert got["next_loss"] == pytest.approx(tp_losses[3:], rel=1e-5), f"{where}: after the load"
        tp = results[0]["tp"][stage]
        _close(tp["weights"], tp_weights, f"TP2 stage {stage}")
        _close(tp["loaded"], tp["weights"], f"TP2 stage {stage} loaded")
        # the frozen split base is saved whole, as it was
        save = tmp_path / f"tp_stage{stage}" / "global_step3"
        files = {}
        for name in sorted(set(json.loads((save / "model.safetensors.index.json").read_text())["weight_map"].values())):
            files.update(load_file(str(save / name)))
        for name, tensor in base_weights.items():
            stored = next(k for k in files if k.replace(".base_layer.", ".").endswith(name))
            torch.testing.assert_close(files[stored], tensor, rtol=0, atol=0, msg=f"stage {stage}: {name}")
        assert (save / "adapter_model.safetensors").exists()


def test_lora_options_reach_the_workers_and_bad_ones_are_named(tmp_path, capsys):
    from zerotrain.cli import build_parser, main
    from zerotrain.run.model import lora_options
    from zerotrain.train.command import worker_argv

    argv = ["train", "--config", "c.json", "--nproc", "2", "--lora-r", "8", "--lora-alpha", "32", "--lora-dropout",
            "0.1", "--lora-target-modules", "q_proj, v_proj,o_proj"]
    args = build_parser().parse_args(argv)
    again = build_parser().parse_args(worker_argv(args))
    assert lora_options(again) == lora_options(args)
    options = lora_options(args)
    assert (options.r, options.alpha, options.dropout, options.target_modules) == \
        (8, 32.0, 0.1, ("q_proj", "v_proj", "o_proj"))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    assert main(["train", "--config", str(config), "--lora-alpha", "16"]) == 2
    assert "--lora-alpha and --lora-target-modules need --lora-r" in capsys.readouterr().err
    assert main(["train", "--config", str(config), "--lora-r", "0"]) == 2
    assert "--lora-r must be >= 1" in capsys.readouterr().err
