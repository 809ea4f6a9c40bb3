"""`zerotrain.hf.Trainer` in the pytest process (a world of one) against transformers' own Trainer (plain PyTorch).

test_trainer.py compares the Trainer with transformers + DeepSpeed in spawned ranks (minutes); this file checks the
same seams in seconds, on a tiny Llama built from its config: the config read from a JSON file with its "auto"
values filled as transformers fills them for DeepSpeed (the model's hidden size included), an evaluation before
any training, a gradient accumulation whose last step of the epoch takes fewer micro-batches, active clipping,
label smoothing (the Trainer's loss on the unwrapped model's logits, shifted for a causal LM),
the Trainer's warm-up scheduler, a checkpoint resumed, `save_model` read back by `from_pretrained`, a model built
partitioned under `zerotrain.zero.Init` with its weights loaded by `zerotrain_load_pretrained`, and
`zerotrain_gathered`.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from hf_compare import assert_same_steps, close, trainer_log  # noqa: E402

HIDDEN = 16
# 10 samples of micro-batch 2: five micro-batches an epoch, accumulated 2 by 2: the epoch's third step takes one
EPOCHS, STEPS, SAVE_AT = 2, 6, 3


def _model_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32)


def _data(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (n, 8), generator=g)
    return [{"input_ids": r, "labels": r.clone(), "attention_mask": torch.ones_like(r)} for r in ids]


def _arguments(out: str, **more) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                num_train_epochs=EPOCHS, learning_rate=5e-3, warmup_steps=2, weight_decay=0.01, max_grad_norm=0.5,
                logging_steps=1, save_steps=SAVE_AT, use_cpu=True, seed=3, disable_tqdm=True, report_to="none",
                per_device_eval_batch_size=4, label_smoothing_factor=0.1, **more)


def _reference(pretrained: str, out: str) -> dict:
    """transformers' Trainer, no DeepSpeed: its log, its evaluation before and after training, its weights."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(**_arguments(out))
    trainer = Trainer(model=model, args=args, train_dataset=_data(10, 0), eval_dataset=_data(4, 1))
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    return {"log": trainer_log(trainer), "before": before, "after": trainer.evaluate()["eval_loss"],
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A pretrained directory (a random tiny Llama) and transformers' own Trainer's run from it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf_trainer_units")
    torch.manual_seed(0)
    pretrained = str(root / "pretrained")
    AutoModelForCausalLM.from_config(_model_config()).save_pretrained(pretrained)
    ref = _reference(pretrained, str(root / "ref"))
    assert [s for s, *_ in ref["log"]] == list(range(1, STEPS + 1))
    return pretrained, ref


def test_trainer_at_a_world_of_one_steps_saves_and_resumes_as_transformers_trainer(tmp_path, reference, world_of_one):
    """ZeRO-3 from a JSON config file of "auto" values, the model built partitioned and its pretrained weights
    loaded by the engine: every logged step (loss, learning rate, clipped norm) as transformers' Trainer's, the
    evaluations before and after training too; the saved model and a resumed run equal the uninterrupted one."""
    import zerotrain
    from transformers import AutoModelForCausalLM

    from zerotrain.hf import Trainer, TrainingArguments

    pretrained, ref = reference

    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto"}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))

    def run(out: str, resume: bool = False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = TrainingArguments(**_arguments(out, deepspeed=str(path)))
        with zerotrain.zero.Init(config_dict_or_path=args.zerotrain_config):
            torch.manual_seed(1)  # other weights than the pretrained ones: the engine loads those
            model = AutoModelForCausalLM.from_config(_model_config(), dtype=torch.float32)
        trainer = Trainer(model=model, args=args, train_dataset=_data(10, 0), eval_dataset=_data(4, 1))
        trainer.zerotrain_load_pretrained(pretrained)
        return trainer, (trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_AT}"))
                         if resume else trainer.train())

    out = str(tmp_path / "zt")
    trainer, _ = run(out)
    assert_same_steps("zerotrain", trainer_log(trainer), ref["log"], steps=STEPS)
    assert close(trainer.evaluate()["eval_loss"], ref["after"])
    engine = trainer._zt_engine
    weights = engine.full_state_dict()
    for name, tensor in ref["weights"].items():
        if name in weights:
            assert torch.allclose(weights[name], tensor, rtol=1e-5, atol=1e-6), name
    trainer.save_model(str(tmp_path / "final"))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[name], tensor) for name, tensor in weights.items())
    # the "auto" values as transformers fills them for DeepSpeed from the model's hidden size
    # (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize)
    zero = engine.config.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == \
        (HIDDEN * HIDDEN, int(0.9 * HIDDEN * HIDDEN), 10 * HIDDEN)
    with trainer.zerotrain_gathered(trainer.model.parameters()):
        whole = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    assert all(torch.equal(whole[name], weights[name]) for name in whole)
    engine.close()

    resumed, _ = run(out, resume=True)
    # steps 1-3 from the checkpoint's trainer state, 4-6 trained after the resume
    assert_same_steps("resumed", trainer_log(resumed), ref["log"], steps=STEPS)
    resumed._zt_engine.close()


def test_trainer_without_a_config_evaluates_before_training_and_steps_as_transformers_trainer(tmp_path, reference,
                                                                                             world_of_one):
    """No `deepspeed` config (ZeRO-3 from the arguments alone), the model loaded whole: `evaluate()` before any
    training runs the model as it is, then every step and the final evaluation as transformers' Trainer's."""
    from transformers import AutoModelForCausalLM

    from zerotrain.hf import Trainer, TrainingArguments

    pretrained, ref = reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(**_arguments(str(tmp_path / "zt"), save_strategy="no"))
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    trainer = Trainer(model=model, args=args, train_dataset=_data(10, 0), eval_dataset=_data(4, 1))
    assert close(trainer.evaluate()["eval_loss"], ref["before"])
    trainer.train()
    assert trainer._zt_engine.zero_optimization_stage() == 3
    assert_same_steps("no config", trainer_log(trainer), ref["log"], steps=STEPS)
    assert close(trainer.evaluate()["eval_loss"], ref["after"])
    trainer._zt_engine.close()
