"""`zerotrain.hf.Trainer` against `transformers.Trainer` + DeepSpeed 0.19.8 on the same script and data.

One launch at world 2 (CPU, gloo, fp32, tiny Llama built offline) runs, in each rank, the same Trainer
script twice per ZeRO stage (2 and 3): once with zerotrain's `Trainer`/`TrainingArguments`, once with
transformers' + DeepSpeed (its CPU accelerator, the Trainer's torch AdamW as under DeepSpeed without an
`optimizer` block, the Trainer's linear scheduler with warmup, gradient accumulation 2, clipping active).
Checked: the logged loss, learning rate and gradient norm of every optimizer step equal DeepSpeed's (1e-5),
and so does `evaluate()`'s loss after training; `predict()` gives the evaluation loss; a run resumed from
its step-2 checkpoint (`resume_from_checkpoint`) continues with the uninterrupted run's losses;
`save_model()` writes a directory `from_pretrained` loads with the trained weights; `save_total_limit`
rotates checkpoint directories.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import warnings

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

STEPS, SAVE_AT, TOL = 4, 2, 1e-5


def _data(n: int = 32, seq: int = 16, vocab: int = 200, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, seq), generator=g)
    return [{"input_ids": r, "labels": r.clone(), "attention_mask": torch.ones_like(r)} for r in ids]


def _config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


def _run(engine: str, stage: int, model_dir: str, out: str, resume: bool = False) -> dict:
    """The same Trainer script on `engine` ("zt" or "ds"); its per-step log, eval loss and (zt) final weights."""
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
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=1e-3, warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
        save_steps=SAVE_AT, use_cpu=True, seed=3, deepspeed=_config(stage), disable_tqdm=True,
        per_device_eval_batch_size=2, **by_stage)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), eval_dataset=_data(8, seed=1),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=3)] if stage == 2 else None)
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_AT}") if resume else None)
    log = [(h["step"], h["loss"], h["learning_rate"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    result = {"log": log, "eval_loss": trainer.evaluate()["eval_loss"], "best": trainer.state.best_model_checkpoint}
    if engine == "zt" and not resume:
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


def _worker(model_dir: str, root: str) -> dict:
    warnings.simplefilter("ignore")
    results = {}
    for stage in (2, 3):
        results[("zt", stage)] = _run("zt", stage, model_dir, os.path.join(root, f"zt{stage}"))
    results[("zt", "resumed")] = _run("zt", 3, model_dir, os.path.join(root, "zt3"), resume=True)
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # before from_pretrained's zero.Init reads the world size
    for stage in (2, 3):
        results[("ds", stage)] = _run("ds", stage, model_dir, os.path.join(root, f"ds{stage}"))
    return results if int(os.environ["RANK"]) == 0 else {}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.timeout(900)  # one launch, five Trainer runs; minutes only on a loaded machine
def test_trainer_matches_transformers_trainer_with_deepspeed(tiny_llama_dir, tmp_path):
    results = run_distributed(_worker, 2, str(tiny_llama_dir), str(tmp_path), timeout=840)[0]
    for stage in (2, 3):
        zt, ds = results[("zt", stage)], results[("ds", stage)]
        assert [s for s, *_ in zt["log"]] == list(range(1, STEPS + 1))
        for (step, loss, lr, norm), (_, ds_loss, ds_lr, ds_norm) in zip(zt["log"], ds["log"], strict=True):
            assert _close(loss, ds_loss), (stage, step, loss, ds_loss)
            assert lr == pytest.approx(ds_lr, rel=1e-12, abs=1e-15), (stage, step, lr, ds_lr)
            assert _close(norm, ds_norm), (stage, step, norm, ds_norm)
        assert norm > 1.0  # clipping is active in these steps (max_grad_norm 1.0)
        assert _close(zt["eval_loss"], ds["eval_loss"]), (stage, zt["eval_loss"], ds["eval_loss"])
        assert _close(zt["test_loss"], zt["eval_loss"])
        # ZeRO-2 ran with save_total_limit=1 and load_best_model_at_end: only the best checkpoint is left
        assert zt["checkpoints"] == ([os.path.basename(zt["best"])] if stage == 2 else
                                     [f"checkpoint-{SAVE_AT}", f"checkpoint-{STEPS}"])
    # ZeRO-2 loaded its best checkpoint at the end (the evaluation above is of those weights, as DeepSpeed's)
    assert results[("zt", 2)]["best"] == results[("ds", 2)]["best"].replace("ds2", "zt2")
    assert results[("zt", 2)]["tensorboard"]
    # resumed from checkpoint-2 of the ZeRO-3 run (a second run kept it): the uninterrupted run's steps 3-4
    full, resumed = results[("zt", 3)], results[("zt", "resumed")]
    assert [s for s, *_ in resumed["log"]] == list(range(1, STEPS + 1))  # steps 1-2 from the checkpoint's state
    for (step, loss, lr, norm), (_, f_loss, f_lr, f_norm) in zip(resumed["log"], full["log"], strict=True):
        assert _close(loss, f_loss) and lr == f_lr and _close(norm, f_norm), (step, loss, f_loss)
    assert _close(resumed["eval_loss"], full["eval_loss"])
    # save_model: an HF directory with the trained weights
    from transformers import AutoModelForCausalLM

    for stage in (2, 3):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / f"zt{stage}" / "final").state_dict()
        weights = results[("zt", stage)]["weights"]
        assert set(weights) <= set(loaded)
        for name, tensor in weights.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
