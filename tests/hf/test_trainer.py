"""`zerotrain.hf.Trainer` against `transformers.Trainer` + DeepSpeed 0.19.8 on the same script and data.

One launch at world 2 (CPU, gloo, fp32, tiny Llama built offline) runs, in each rank, the same Trainer
script twice per ZeRO stage (2 and 3): once with zerotrain's `Trainer`/`TrainingArguments`, once with
transformers' + DeepSpeed (its CPU accelerator, the Trainer's torch AdamW as under DeepSpeed without an
`optimizer` block, the Trainer's linear scheduler with warmup, gradient accumulation 2, clipping active).
Checked: the logged loss, learning rate and gradient norm of every optimizer step equal DeepSpeed's (1e-5),
and so does `evaluate()`'s loss after training; `predict()` gives the evaluation loss; `save_model()` writes
a directory `from_pretrained` loads with the trained weights; `save_total_limit` rotates checkpoint
directories. A peft LoRA model passed in trains at ZeRO-3 (its frozen base partitioned) as under transformers'
own Trainer (DDP): the same steps and adapters. A model built partitioned under `zerotrain.zero.Init` with
the (sharded) pretrained directory loaded by `trainer.zerotrain_load_pretrained` trains as from_pretrained's.
transformers' own `from_pretrained` inside `zerotrain.zero.Init` gives a partitioned model holding a whole
`from_pretrained`'s weights exactly (what it cannot honour refused by name); `resize_token_embeddings` on it
(ranks drawing differently: rank 0's rows kept) equals a whole model resized alike, and trains the same steps;
`generate` at world 2 with prompts and lengths differing by rank (one rank finishing first) does not hang and
gives each rank a whole copy's tokens.

A second launch at world 1 (the same global batch: per-device 4) resumes the world-2 ZeRO-3 run from its
step-2 checkpoint (`resume_from_checkpoint` at another world size) and continues with the uninterrupted
run's losses, learning rates and norms (1e-5); and trains with `fp16=True` (the config's fp16 block "auto",
the engine's loss scaling) reporting to W&B offline: by the lossy-mode rule near the fp32 run, unlike the
untrained weights, and the W&B run file holds every logged loss.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import warnings

import pytest
import torch

from distributed import run_distributed
from hf_compare import assert_same_steps, close, trainer_log
from models_for_tests import assert_tolerance_discriminates

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

STEPS, SAVE_AT = 4, 2


def _data(n: int = 32, seq: int = 16, vocab: int = 200, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, seq), generator=g)
    return [{"input_ids": r, "labels": r.clone(), "attention_mask": torch.ones_like(r)} for r in ids]


def _config(stage: int, **blocks) -> dict:
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto", **blocks}


def _run(engine: str, stage: int, model_dir: str, out: str, resume: bool = False, per_device: int = 2,
         partitioned: bool = False, **more) -> dict:
    """The same Trainer script on `engine` ("zt" or "ds"); its per-step log, eval loss and (zt) final weights.
    `per_device`: the micro-batch (4 at world 1 keeps world 2's global batch); `more`: other arguments."""
    from transformers import AutoModelForCausalLM

    if engine == "zt":
        from zerotrain.hf import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    from transformers import EarlyStoppingCallback

    # ZeRO-2: evaluation every SAVE_AT steps, the best model loaded at the end, early stopping, TensorBoard and
    # rotation (save_total_limit 1 keeps the best and the last); ZeRO-3: activation checkpointing.
    by_stage = dict(eval_strategy="steps", eval_steps=SAVE_AT, load_best_model_at_end=True,
                    metric_for_best_model="eval_loss", save_total_limit=1, report_to="tensorboard") if stage == 2 \
        else dict(gradient_checkpointing=True, report_to="none")
    arguments = dict(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=1e-3, warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
        save_steps=SAVE_AT, use_cpu=True, seed=3, deepspeed=_config(stage), disable_tqdm=True,
        per_device_eval_batch_size=2, **by_stage)
    args = TrainingArguments(**{**arguments, **more})
    if partitioned:  # too large to build whole: built partitioned, the pretrained shards loaded into it
        import zerotrain
        from transformers import AutoConfig

        with zerotrain.zero.Init(config_dict_or_path=args.zerotrain_config):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), eval_dataset=_data(8, seed=1),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=3)] if stage == 2 else None)
    if partitioned:
        trainer.zerotrain_load_pretrained(model_dir)
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_AT}") if resume else None)
    result = {"log": trainer_log(trainer), "eval_loss": trainer.evaluate()["eval_loss"],
              "best": trainer.state.best_model_checkpoint}
    if engine == "zt" and more.get("fp16"):
        result["fp16"] = (trainer._zt_engine.fp16_enabled(), trainer._zt_engine.loss_scale)
        result["weights"] = {k: v.float() for k, v in trainer._zt_engine.full_state_dict().items()}
    elif engine == "zt" and not resume:
        result["test_loss"] = trainer.predict(_data(8, seed=1)).metrics["test_loss"]
        trainer.save_model(os.path.join(out, "final"))
        result["weights"] = trainer._zt_engine.full_state_dict()
        result["checkpoints"] = sorted(p.name for p in pathlib.Path(out).glob("checkpoint-*"))
        result["tensorboard"] = [p.name for p in pathlib.Path(out).rglob("events.out.tfevents*")]
    del trainer, args
    if engine == "ds":
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    return result


def _lora(engine: str, model_dir: str, out: str) -> dict:
    """A peft LoRA model passed in: on zerotrain at ZeRO-3 (the frozen base partitioned) or transformers' own
    Trainer (DDP); its per-step log and trained adapter weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if engine == "zt":
        from zerotrain.hf import Trainer, TrainingArguments
        more = {"deepspeed": _config(3)}
    else:
        from transformers import Trainer, TrainingArguments
        more = {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)  # the adapters' initialization
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                             learning_rate=1e-2, warmup_steps=1, logging_steps=1, save_strategy="no", use_cpu=True,
                             seed=3, disable_tqdm=True, report_to="none", **more)
    trainer = Trainer(model=model, args=args, train_dataset=_data())
    trainer.train()
    if engine == "zt":
        adapters = trainer._zt_engine.full_state_dict(trainable_only=True)
    else:
        adapters = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    return {"log": trainer_log(trainer), "adapters": adapters}


VOCAB = 530  # resized from the tiny Llama's 512


def _gathered_state(model: torch.nn.Module) -> dict:
    """The model's whole state dict on every rank (its partitioned parameters gathered): collective."""
    from zerotrain.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _from_pretrained_under_init(model_dir: str, root: str) -> dict:
    """transformers' own `from_pretrained` inside `zerotrain.zero.Init` (the sharded directory): the loaded model
    against a whole one; refusals by name; `resize_token_embeddings` on it (each rank's generator different: rank
    0's new rows are kept) trained 2 steps against a whole model resized the same way; then `generate` at world 2
    with the ranks' prompts and lengths differing (the default `synced_gpus`, True as under DeepSpeed) against a
    whole copy of the trained weights generating alone on each rank."""
    import zerotrain
    from transformers import AutoModelForCausalLM

    rank = int(os.environ["RANK"])
    args = dict(output_dir=root, max_steps=2, save_strategy="no")
    whole = AutoModelForCausalLM.from_pretrained(model_dir)
    with zerotrain.zero.Init(config_dict_or_path=_config(3)):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        refused = []
        for bad in (dict(device_map="cpu"), dict(state_dict={"lm_head.weight": torch.zeros(1)}), dict(quantization_config={"load_in_8bit": True})):
            try:
                AutoModelForCausalLM.from_pretrained(model_dir, **bad)
            except ValueError as error:
                refused.append(str(error))
    loaded = _gathered_state(model)
    result = {"loaded_equal": sorted(loaded) == sorted(whole.state_dict()) and all(
                  torch.equal(loaded[name], tensor) for name, tensor in whole.state_dict().items()),
              "partitioned": all(type(p).__name__ == "ZeroParameter" for p in model.parameters()),
              "eval_mode": not model.training, "refused": refused,
              "generation_config": model.generation_config.to_dict() == whole.generation_config.to_dict()}
    torch.manual_seed(5 + rank)
    model.resize_token_embeddings(VOCAB)  # mean resizing: a random draw per rank
    torch.manual_seed(5)
    whole.resize_token_embeddings(VOCAB)
    resized = _gathered_state(model)
    result["resized_equal"] = all(torch.equal(resized[name], tensor) for name, tensor in whole.state_dict().items())
    result["vocab"] = (model.config.vocab_size, model.get_input_embeddings().weight.shape[0])
    trainer = _train(model, **args)
    result["resized"] = trainer_log(trainer)
    result["resized_whole"] = trainer_log(_train(whole, **{**args, "output_dir": root + "_whole"}))
    try:
        model.resize_token_embeddings(VOCAB + 8)
    except RuntimeError as error:
        result["resize_after_engine"] = str(error)
    # generate: rank r prompts 5 + 4r tokens and stops after 3 + 4r new ones (rank 0 finishes first)
    prompt = torch.randint(3, VOCAB, (1, 5 + 4 * rank), generator=torch.Generator().manual_seed(11 + rank))
    state = _gathered_state(model)
    model.eval()
    with torch.no_grad():
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3 + 4 * rank,
                                do_sample=False)
    reference = AutoModelForCausalLM.from_config(model.config)
    reference.load_state_dict(state)
    reference.generation_config = model.generation_config
    with torch.no_grad():
        expected = reference.eval().generate(prompt, attention_mask=torch.ones_like(prompt),
                                             max_new_tokens=3 + 4 * rank, do_sample=False)
    result["generate"] = (tokens.tolist(), expected.tolist())
    return result


def _train(model: torch.nn.Module, **more) -> object:
    """`zerotrain.hf.Trainer` at ZeRO-3 on `model` (the `_run` script's arguments, `more` over them): trained."""
    from zerotrain.hf import Trainer, TrainingArguments

    args = TrainingArguments(per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
                             warmup_steps=1, max_grad_norm=1.0, logging_steps=1, use_cpu=True, seed=3,
                             disable_tqdm=True, report_to="none", deepspeed=_config(3), **more)
    trainer = Trainer(model=model, args=args, train_dataset=_data())
    trainer.train()
    return trainer


def _worker(model_dir: str, root: str) -> dict:
    from distributed import freeze_imports

    # out of the garbage collector's walks: each Trainer run calls gc.collect() (tests/distributed.py)
    freeze_imports("accelerate", "peft", "transformers.trainer")
    warnings.simplefilter("ignore")
    results = {}
    for stage in (2, 3):
        results[("zt", stage)] = _run("zt", stage, model_dir, os.path.join(root, f"zt{stage}"))
    results[("zt", "partitioned")] = _run("zt", 3, model_dir, os.path.join(root, "zt3_init"), partitioned=True,
                                          max_steps=2, save_strategy="no")
    results[("zt", "from_pretrained")] = _from_pretrained_under_init(model_dir, os.path.join(root, "zt3_hf_init"))
    if int(os.environ["RANK"]) == 1:
        results[("zt", "generate_rank1")] = results[("zt", "from_pretrained")]["generate"]
    results[("zt", "lora")] = _lora("zt", model_dir, os.path.join(root, "zt_lora"))
    results[("hf", "lora")] = _lora("hf", model_dir, os.path.join(root, "hf_lora"))
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # before from_pretrained's zero.Init reads the world size
    freeze_imports("deepspeed")
    for stage in (2, 3):
        results[("ds", stage)] = _run("ds", stage, model_dir, os.path.join(root, f"ds{stage}"))
    return results if int(os.environ["RANK"]) == 0 else {"generate_rank1": results[("zt", "generate_rank1")]}


def _worker_world1(model_dir: str, root: str) -> dict:
    """At world 1: resume the world-2 ZeRO-3 run's step-2 checkpoint; train in fp16 reporting to W&B offline."""
    from distributed import freeze_imports

    freeze_imports("accelerate", "transformers.trainer")  # as _worker: each Trainer run calls gc.collect()
    warnings.simplefilter("ignore")
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=root, WANDB_SILENT="true")
    resumed = _run("zt", 3, model_dir, os.path.join(root, "zt3"), resume=True, per_device=4)
    fp16 = _run("zt", 3, model_dir, os.path.join(root, "fp16"), per_device=4, fp16=True, report_to=["wandb"],
                save_strategy="no", deepspeed=_config(3, fp16={"enabled": "auto", "initial_scale_power": 8}))
    import wandb

    wandb.finish()  # as the script's end would (a spawned rank exits without running atexit)
    os.environ.pop("WANDB_MODE")
    return {"resumed": resumed, "fp16": fp16}


@pytest.mark.timeout(1500)  # two launches, six Trainer runs; minutes only on a loaded machine
def test_trainer_matches_transformers_trainer_with_deepspeed(tiny_llama_dir, tmp_path):
    results, rank1 = run_distributed(_worker, 2, str(tiny_llama_dir), str(tmp_path), timeout=840)
    for stage in (2, 3):
        zt, ds = results[("zt", stage)], results[("ds", stage)]
        assert_same_steps(f"ZeRO-{stage} vs Trainer + DeepSpeed", zt["log"], ds["log"], steps=STEPS)
        assert zt["log"][-1][3] > 1.0  # clipping is active in these steps (max_grad_norm 1.0)
        assert close(zt["eval_loss"], ds["eval_loss"]), (stage, zt["eval_loss"], ds["eval_loss"])
        assert close(zt["test_loss"], zt["eval_loss"])
        # ZeRO-2 ran with save_total_limit=1 and load_best_model_at_end: only the best checkpoint is left
        assert zt["checkpoints"] == ([os.path.basename(zt["best"])] if stage == 2 else
                                     [f"checkpoint-{SAVE_AT}", f"checkpoint-{STEPS}"])
    # ZeRO-2 loaded its best checkpoint at the end (the evaluation above is of those weights, as DeepSpeed's)
    assert results[("zt", 2)]["best"] == results[("ds", 2)]["best"].replace("ds2", "zt2")
    assert results[("zt", 2)]["tensorboard"]
    # built under zerotrain.zero.Init, the sharded safetensors directory loaded by each rank: as from_pretrained
    assert_same_steps("built partitioned", results[("zt", "partitioned")]["log"], results[("zt", 3)]["log"][:2], steps=2)
    # transformers' own from_pretrained inside zerotrain.zero.Init: partitioned, the checkpoint's weights exactly
    hf_init = results[("zt", "from_pretrained")]
    assert hf_init["partitioned"] and hf_init["loaded_equal"] and hf_init["eval_mode"] and hf_init["generation_config"]
    assert len(hf_init["refused"]) == 3 and all(f"{name}=...) inside zerotrain.zero.Init" in error for name, error in
                                                zip(("device_map", "state_dict", "quantization_config"), hf_init["refused"]))
    # resize_token_embeddings on it: rank 0's new rows, as a whole model resized alike; the same training steps
    assert hf_init["resized_equal"] and hf_init["vocab"] == (VOCAB, VOCAB), hf_init["vocab"]
    assert_same_steps("resized partitioned vs whole", hf_init["resized"], hf_init["resized_whole"], steps=2)
    assert "before zerotrain.initialize" in hf_init["resize_after_engine"]
    # generate at world 2 (prompts and lengths differ by rank): no hang, a whole model's tokens on every rank
    for tokens, expected in (hf_init["generate"], rank1["generate_rank1"]):
        assert tokens == expected, (tokens, expected)
    assert [len(hf_init["generate"][0][0]), len(rank1["generate_rank1"][0][0])] == [8, 16]
    # a peft LoRA model at ZeRO-3: transformers' own Trainer's steps and adapters
    zt_lora, hf_lora = results[("zt", "lora")], results[("hf", "lora")]
    assert_same_steps("LoRA at ZeRO-3 vs transformers.Trainer", zt_lora["log"], hf_lora["log"], steps=3)
    assert sorted(zt_lora["adapters"]) == sorted(hf_lora["adapters"]) and hf_lora["adapters"]
    for name, tensor in hf_lora["adapters"].items():
        torch.testing.assert_close(zt_lora["adapters"][name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    # save_model: an HF directory with the trained weights
    from transformers import AutoModelForCausalLM

    for stage in (2, 3):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / f"zt{stage}" / "final").state_dict()
        weights = results[("zt", stage)]["weights"]
        assert set(weights) <= set(loaded)
        for name, tensor in weights.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)

    world1 = run_distributed(_worker_world1, 1, str(tiny_llama_dir), str(tmp_path), timeout=600)[0]
    # resumed at world 1 from checkpoint-2 of the world-2 ZeRO-3 run: the uninterrupted run's steps 3-4
    full, resumed = results[("zt", 3)], world1["resumed"]
    assert_same_steps("resumed at world 1", resumed["log"], full["log"], steps=STEPS)  # 1-2 from the checkpoint
    assert close(resumed["eval_loss"], full["eval_loss"])
    # fp16 through TrainingArguments: the engine's loss scaling, near the fp32 run, unlike no training
    fp16 = world1["fp16"]
    assert fp16["fp16"][0] and fp16["fp16"][1] > 1.0, fp16["fp16"]
    initial = {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict().items()
               if k in full["weights"]}
    losses = [loss for _, loss, *_ in fp16["log"]]
    assert max(abs(a - b) / b for a, (_, b, *_) in zip(losses, full["log"], strict=True)) <= 1e-2, (losses, full["log"])
    assert_tolerance_discriminates("Trainer fp16 vs fp32", ([l for _, l, *_ in full["log"]], full["weights"]),
                                   (losses, fp16["weights"]), (None, initial), loss_tol=None, weight_tol=4e-3)
    # W&B offline: the run's file holds every logged loss (its records keep the values as JSON text)
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    recorded = runs[0].read_bytes()
    assert b"train/loss" in recorded and all(json.dumps(loss).encode() in recorded for loss in losses), losses
