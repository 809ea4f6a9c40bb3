"""`zerotrain train`'s model and engine (`zerotrain.run.model`) in the pytest process, a world of one: a random init
kept in fp32 under bf16, a model directory's weights with its vocabulary grown against transformers'
`resize_token_embeddings`, the --lora-* flags reaching peft, the HF Trainer's decay groups, a dict config.

(tests/models/test_hf.py and test_lora.py run the same at world 2 in spawned ranks, minutes.)
"""
from __future__ import annotations

import tempfile

import pytest
import torch

pytest.importorskip("transformers")

CONFIG = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}


def _probe(vocab: int) -> torch.Tensor:
    return torch.arange(24).reshape(2, 12) * 7 % vocab


def test_under_bf16_a_random_init_is_transformers_fp32_init_cast_and_a_directorys_model_is_built_in_bf16(
        tiny_llama_dir, world_of_one):
    """No weights to load (a preset): the model is initialised as transformers does from the seed, and the engine's
    fp32 masters hold that init cast to bf16 (DeepSpeed's: the module cast, its masters copied from it); a dict config
    (parsed here) does as a RunConfig. With a directory's weights to load the model is built in bf16 (never a whole
    fp32 copy on the host)."""
    from transformers import AutoModelForCausalLM

    from zerotrain.models.hf import resolve_model
    from zerotrain.run.model import model_engine, train_model

    config = {**CONFIG, "bf16": {"enabled": True}}
    engine, model = model_engine(resolve_model("tiny"), config, seed=3)
    try:
        torch.manual_seed(3)
        reference = AutoModelForCausalLM.from_config(resolve_model("tiny").config, dtype=torch.float32)
        masters = engine.full_state_dict()
        assert next(model.parameters()).dtype == torch.bfloat16  # the engine trains in bf16
        for name, tensor in reference.named_parameters():
            assert torch.equal(masters[name], tensor.to(torch.bfloat16).float()), name
    finally:
        engine.close()
    built = train_model(resolve_model(str(tiny_llama_dir)), config)
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}


def test_a_directorys_weights_with_a_grown_vocabulary_equal_transformers_resize(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch, world_of_one):
    """--add-tokens: the embedding and head grow as transformers' `resize_token_embeddings` grows them (mean
    resizing from the seed); the overlay goes into the save directory (the temp directory here is unusable:
    another node's) and is removed after the load; the loaded logits are the resized model's."""
    import transformers

    from zerotrain.models.hf import grow_vocab, load_tokenizer, resolve_model
    from zerotrain.run.model import load_weights, model_engine

    tokens = ["<|tool|>", "<|think|>"]
    source = resolve_model(str(tiny_llama_dir))
    vocab = int(source.config.vocab_size)
    old_vocab = grow_vocab(source, load_tokenizer(source), tokens)
    assert old_vocab == vocab
    engine, model = model_engine(source, CONFIG, seed=11)
    save = tmp_path / "save"
    save.mkdir()
    unusable = tmp_path / "a-file"  # nothing can be written under it
    unusable.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(unusable))
    try:
        load_weights(engine, source, model, old_vocab, str(save), seed=11)
        assert list(save.iterdir()) == []  # the overlay is gone
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=_probe(vocab)).logits
    finally:
        engine.close()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    torch.manual_seed(11)
    reference.resize_token_embeddings(vocab + len(tokens))
    with torch.no_grad():
        want = reference(input_ids=_probe(vocab)).logits
    assert logits.shape[-1] == vocab + len(tokens)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_the_lora_flags_give_peft_their_rank_scale_and_modules_and_train_only_the_adapters(tiny_llama_dir,
                                                                                           world_of_one):
    """--lora-r 4 --lora-alpha 16 --lora-target-modules " q_proj, v_proj,": peft's adapter of rank 4 scaled by
    16 / 4 on exactly those modules; the engine trains only the adapters (each a parameter of the step)."""
    from zerotrain.cli import build_parser
    from zerotrain.models.hf import resolve_model
    from zerotrain.run.model import lora_options, model_engine

    args = build_parser().parse_args(["train", "--lora-r", "4", "--lora-alpha", "16", "--lora-dropout", "0.25",
                                      "--lora-target-modules", " q_proj, v_proj,"])
    assert lora_options(build_parser().parse_args(["train"])) is None
    options = lora_options(args)
    engine, model = model_engine(resolve_model(str(tiny_llama_dir)), CONFIG, seed=5, lora=options)
    try:
        peft_config = model.peft_config["default"]
        assert (peft_config.r, peft_config.lora_alpha, peft_config.lora_dropout) == (4, 16, 0.25)
        assert set(peft_config.target_modules) == {"q_proj", "v_proj"}
        adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
        assert adapted and all(m.scaling["default"] == 4.0 for m in adapted)
        trainable = engine.full_state_dict(trainable_only=True)
        assert trainable and all("lora_" in name for name in trainable)
    finally:
        engine.close()


def test_a_run_config_not_yet_laid_over_its_steps_is_refused():
    from zerotrain.run.config import RunConfig
    from zerotrain.run.model import train_engine

    values = {**CONFIG, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    config = RunConfig(values, world_size=1, steps=None, fill=lambda steps: {})
    with pytest.raises(ValueError, match="not laid over its steps"):
        train_engine(torch.nn.Linear(2, 2), config)
