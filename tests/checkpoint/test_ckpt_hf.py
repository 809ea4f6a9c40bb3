"""Checkpoints are Hugging Face checkpoints: transformers and safetensors read them; HF directories load back."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from distributed import run_distributed
from models_for_tests import assert_tolerance_discriminates

import transformers  # the dev extra has it: a missing install fails, never skips
from safetensors.torch import load_file  # noqa: E402

VOCAB, SEQ, MICRO = 97, 16, 2


def build_gpt2(seed: int = 0):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=24, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    model.generation_config.max_new_tokens = 7  # not a default: the saved generation_config.json must carry it
    return model


LOGITS_TOL = 1e-2  # bf16 logits through two code paths, relative L2 (measured 0; the untrained model: 0.40)


def probe_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def engine_config(stage: int, precision: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": precision == "bf16"}, "steps_per_print": 0}


def engine_for(stage: int, precision: str, seed: int = 0):
    import zerotrain

    engine, *_ = zerotrain.initialize(model=build_gpt2(seed), config=engine_config(stage, precision))
    return engine


def bf16_save_and_hf_loads(save_dir: str, hf_dir: str, single_dir: str) -> dict:
    from zerotrain.checkpoint import CheckpointError

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    engine = engine_for(stage=2, precision="bf16")
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=generator)[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    path = engine.save_checkpoint(save_dir, tag="hf")
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe_ids()).logits.float()
    out = {"path": path, "logits": logits, "masters": engine.full_state_dict()}

    # A plain Hugging Face directory loads as initial weights (module only) on another stage and precision.
    fresh = engine_for(stage=1, precision="fp32", seed=11)
    try:
        fresh.load_checkpoint(hf_dir)
    except CheckpointError as error:
        out["hf_without_module_only"] = str(error)
    out["hf_load"] = fresh.load_checkpoint(hf_dir, load_module_only=True)
    out["hf_weights"] = fresh.full_state_dict()
    out["hf_steps"] = fresh.global_steps
    # A single model.safetensors (no index) loads the same way.
    out["single_load"] = fresh.load_checkpoint(single_dir, load_module_only=True)
    out["single_weights"] = fresh.full_state_dict()
    # Our own bf16 checkpoint, module only, into fp32: the fp32 masters come back exactly.
    fresh.load_checkpoint(save_dir, load_module_only=True)
    out["own_module_only"] = fresh.full_state_dict()
    out["optimizer_untouched"] = len(fresh.optimizer.state) == 0
    return out


def test_bf16_checkpoint_is_a_hugging_face_checkpoint(tmp_path):
    import zerotrain
    from zerotrain.checkpoint.state import decode

    save_dir, hf_dir, single_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "single")
    reference = build_gpt2(seed=5)
    reference.save_pretrained(hf_dir, max_shard_size="40KB")  # an index and several shards
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    single = build_gpt2(seed=6)
    single.save_pretrained(single_dir)  # one model.safetensors, no index
    assert os.listdir(single_dir) and not glob.glob(os.path.join(single_dir, "*.index.json"))
    assert os.path.exists(os.path.join(single_dir, "model.safetensors"))
    out = run_distributed(bf16_save_and_hf_loads, 2, save_dir, hf_dir, single_dir)[0]
    tag_dir = out["path"]
    masters = out["masters"]

    # Model files in bf16 under the model's names (tied head once), master weights in fp32.
    model_files = sorted(glob.glob(os.path.join(tag_dir, "model-*.safetensors")))
    master_files = sorted(glob.glob(os.path.join(tag_dir, "master_weights-*.safetensors")))
    assert len(model_files) == 2 and len(master_files) == 2  # one per writer rank
    model = {k: v for f in model_files for k, v in load_file(f).items()}
    master = {k: v for f in master_files for k, v in load_file(f).items()}
    trainable = {k for k in masters if k != "lm_head.weight"}
    assert set(master) == trainable and "lm_head.weight" not in model
    assert all(v.dtype == torch.float32 for v in master.values())
    assert all(v.dtype == torch.bfloat16 for k, v in model.items() if k in trainable)
    for name in trainable:
        torch.testing.assert_close(master[name], masters[name], rtol=0, atol=0)
        torch.testing.assert_close(model[name], masters[name].to(torch.bfloat16), rtol=0, atol=0)
    index = json.load(open(os.path.join(tag_dir, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(model)
    optimizer = {k for f in glob.glob(os.path.join(tag_dir, "optimizer-*.safetensors")) for k in load_file(f)}
    assert {f"transformer.wte.weight/{key}" for key in ("exp_avg", "exp_avg_sq", "step")} <= optimizer

    # trainer_state.json names the zerotrain version that wrote it and carries the engine's config.
    trainer_state = json.load(open(os.path.join(tag_dir, "trainer_state.json")))
    assert trainer_state["zerotrain_version"] == zerotrain.__version__
    assert decode(trainer_state["config"]) == engine_config(stage=2, precision="bf16")

    # transformers reads the tag directory directly (generation config included), and computes the same logits.
    assert json.load(open(os.path.join(tag_dir, "generation_config.json")))["max_new_tokens"] == 7
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tag_dir)
    assert loaded.dtype == torch.bfloat16
    assert loaded.generation_config.max_new_tokens == 7 and loaded.generation_config.eos_token_id == 0
    loaded.eval()
    untrained = build_gpt2(seed=0).to(torch.bfloat16).eval()  # what the engine started from: no training
    with torch.no_grad():
        logits = loaded(input_ids=probe_ids()).logits.float()
        untrained_logits = untrained(input_ids=probe_ids()).logits.float()
    # bf16 logits: the loaded model must match the engine's and the untrained model must not (the check can fail)
    assert_tolerance_discriminates("bf16 logits of the loaded model", (None, {"logits": out["logits"]}),
                                   (None, {"logits": logits}), (None, {"logits": untrained_logits}),
                                   loss_tol=None, weight_tol=LOGITS_TOL)

    # A plain HF directory: refused without load_module_only, loaded with it.
    assert "load_module_only=True" in out["hf_without_module_only"]
    assert out["hf_load"] == (hf_dir, {}) and out["hf_steps"] == 0
    for name, param in reference.named_parameters():
        torch.testing.assert_close(out["hf_weights"][name], param.detach(), rtol=0, atol=0)
    assert out["single_load"] == (single_dir, {})
    for name, param in single.named_parameters():
        torch.testing.assert_close(out["single_weights"][name], param.detach(), rtol=0, atol=0)
    for name in trainable:
        torch.testing.assert_close(out["own_module_only"][name], masters[name], rtol=0, atol=0)
    assert out["optimizer_untouched"]


def test_export_fp32_from_masters(tmp_path):
    """`zerotrain ckpt export`'s function: model weights only, cast from the fp32 masters."""
    from zerotrain.checkpoint import export_model, inspect_checkpoint

    save_dir, gpt_dir = str(tmp_path / "ckpt"), str(tmp_path / "gpt")
    run_distributed(_save_small_bf16, 1, save_dir, gpt_dir)
    report = inspect_checkpoint(save_dir)
    assert report["global_steps"] == 0 and report["topology"]["dtype"] == "bfloat16"
    assert set(report["tensors"]) == {"model", "master_weights", "optimizer"}
    build_gpt2().save_pretrained(str(tmp_path / "single"))  # one model.safetensors, no index
    single = inspect_checkpoint(str(tmp_path / "single"))
    assert single["kind"] == "hugging-face" and len(single["tensors"]["model"]) == 28
    out = export_model(save_dir, str(tmp_path / "export"), dtype="fp32")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.float32
    reference = build_gpt2(seed=0)  # the engine cast it to bf16, so its masters start from bf16 values
    for name, param in reference.named_parameters():
        torch.testing.assert_close(dict(exported.named_parameters())[name], param.detach().bfloat16().float(),
                                   rtol=0, atol=0)


    # A model that is not a Hugging Face architecture (zerotrain's GPT) exports, and the command says so.
    import contextlib
    import io

    from zerotrain.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["ckpt", "export", gpt_dir, str(tmp_path / "gpt_export")]) == 0
    assert "not a Hugging Face architecture (no config.json)" in err.getvalue()
    assert not (tmp_path / "gpt_export" / "config.json").exists()


def _save_small_bf16(save_dir: str, gpt_dir: str) -> None:
    import zerotrain
    from zerotrain.models import GPT, GPTConfig

    engine_for(stage=0, precision="bf16").save_checkpoint(save_dir)
    gpt, *_ = zerotrain.initialize(model=GPT(GPTConfig.preset("tiny")), config=engine_config(0, "fp32"))
    gpt.save_checkpoint(gpt_dir)
