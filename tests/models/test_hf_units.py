"""`zerotrain.models.hf` in the pytest process: the presets as the README states them, their byte tokenizer, the
LoRA refusals, and a vocabulary grown in a directory stored under the base model's names (issue #48, round 7).

(tests/models/test_hf.py: missing files named and the world-2 loads; tests/test_run_model_units.py: a directory's
vocabulary grown, the LoRA flags, at a world of one.)
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

# README "The demo and CLI": Llama architectures over bytes (vocabulary 256, tied embeddings), of about these sizes;
# (hidden size, layers, attention heads, MLP width, context) as the README's preset table gives them
PRESET_TABLE = {"tiny": ((48, 3, 4, 191, 32), 0.1e6), "small": ((288, 6, 6, 768, 256), 6e6),
                "70m": ((768, 10, 12, 2048, 512), 71e6)}


def test_presets_are_the_readmes_llamas_over_bytes_with_tied_embeddings():
    from transformers import AutoModelForCausalLM

    from zerotrain.models.hf import PRESETS, resolve_model

    assert list(PRESETS) == list(PRESET_TABLE)
    for name, (shape, parameters) in PRESET_TABLE.items():
        source = resolve_model(name)
        assert (source.preset, source.weights_dir, source.tokenizer_dir) == (name, None, None)
        config = source.config
        assert config.model_type == "llama" and config.vocab_size == 256, name
        assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size,
                config.max_position_embeddings) == shape, name
        assert config.num_key_value_heads == config.num_attention_heads and not config.use_cache, name
        with torch.device("meta"):  # the shapes only
            model = AutoModelForCausalLM.from_config(config)
        assert model.lm_head.weight is model.model.embed_tokens.weight, name
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - parameters) < 0.25 * parameters, (name, count)


def test_the_presets_byte_tokenizer_gives_the_utf8_bytes_as_ids_and_reloads_from_its_files(tmp_path):
    # a preset reads bytes (ids = bytes): its tokenizer must give exactly the UTF-8 bytes of any text, decode them
    # back, and be what AutoTokenizer loads from the files saved with a checkpoint
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from zerotrain.models.hf import byte_tokenizer, tokenizer_files

    tokenizer = byte_tokenizer()
    assert len(tokenizer) == 256 and set(tokenizer.get_vocab()) == set(pre_tokenizers.ByteLevel.alphabet())
    text = "".join(chr(c) for c in range(1, 0x800)) + " héllo ¬«®ÿ 你好 😀\n\tend"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    for name, data in tokenizer_files(tokenizer).items():
        (tmp_path / name).write_bytes(data)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again(text, add_special_tokens=False)["input_ids"] == ids and again.decode(ids) == text


def test_lora_ranks_below_one_and_dropouts_outside_0_1_are_refused_naming_the_flag():
    from zerotrain.models.hf import LoraOptions, ModelError, apply_lora, build_model, resolve_model

    source = resolve_model("tiny")
    for options, says in ((LoraOptions(r=0), "--lora-r must be >= 1, got 0"),
                          (LoraOptions(r=2, dropout=1.0), r"--lora-dropout must be in \[0, 1\), got 1.0"),
                          (LoraOptions(r=2, dropout=-0.1), r"--lora-dropout must be in \[0, 1\), got -0.1")):
        with pytest.raises(ModelError, match=says):
            apply_lora(build_model(source), options)
    model = apply_lora(build_model(source), LoraOptions(r=1, dropout=0.0))
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (1, 2, 0.0)  # alpha's default: 2 * r


def test_a_directory_stored_under_the_base_models_names_grows_its_vocabulary_as_transformers_does(tmp_path):
    # a model directory saved from the bare LlamaModel ("embed_tokens.weight", no "model." prefix) with an untied
    # head: --add-tokens' overlay finds each tensor under the stored name and holds transformers' resized rows
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zerotrain.models.hf import build_model, byte_tokenizer, grow_vocab, resolve_model, tokenizer_files, \
        write_resized

    config = LlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    directory = tmp_path / "bare"
    directory.mkdir()
    stored = {name[len("model."):] if name.startswith("model.") else name: tensor.contiguous()
              for name, tensor in model.state_dict().items()}
    assert "embed_tokens.weight" in stored and "lm_head.weight" in stored
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(directory))
    for name, data in tokenizer_files(byte_tokenizer()).items():
        (directory / name).write_bytes(data)

    source = resolve_model(str(directory))
    tokenizer = byte_tokenizer()
    old = grow_vocab(source, tokenizer, ["<|tool|>", "<|think|>"])
    assert old == 256 and source.config.vocab_size == 258
    overlay = write_resized(source, build_model(source), old, tmp_path / "overlay")  # new rows from seed 0
    index = json.loads((tmp_path / "overlay" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["embed_tokens.weight"] == index["lm_head.weight"] == "resized.safetensors"
    resized = load_file(f"{overlay}/resized.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(str(directory))
    assert torch.equal(reference.lm_head.weight, model.lm_head.weight)  # transformers read the bare names
    torch.manual_seed(0)
    reference.resize_token_embeddings(258)
    assert torch.equal(resized["embed_tokens.weight"], reference.model.embed_tokens.weight)
    assert torch.equal(resized["lm_head.weight"], reference.lm_head.weight)
    assert torch.equal(resized["embed_tokens.weight"][:256], model.model.embed_tokens.weight)
