"""Tiny Hugging Face models for the merge tests, built offline once per session (random init, sharded)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file


def build_llama(path: str, seed: int, vocab: int = 64, layers: int = 3, intermediate: int = 32,
                dtype: torch.dtype = torch.float32) -> str:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, max_shard_size="20KB")
    return path


def load_dir(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded safetensors model directory (the index's weight map)."""
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as handle:
        files = set(json.load(handle)["weight_map"].values())
    out = {}
    for file in files:
        out.update(load_file(os.path.join(path, file)))
    return out


def derive(source: str, path: str, seed: int, edit=None, config_edit=None, shards: int = 3) -> str:
    """A sibling model dir: `source`'s tensors plus seeded noise (a fine-tune's task vector), edited, sharded.

    Building one model with transformers and deriving the others is much cheaper than
    instantiating a model per directory; the layout (names, index, config) is the same.
    """
    g = torch.Generator().manual_seed(seed)
    tensors = {n: (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(t.dtype)
               for n, t in load_dir(source).items()}
    config = json.load(open(os.path.join(source, "config.json")))
    if edit:
        tensors = edit(tensors)
    if config_edit:
        config_edit(config)
    os.makedirs(path)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(path, "model.safetensors.index.json"), "w"))
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    return path


def _pad_rows(tensors: dict, rows: int) -> dict:
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = tensors[name]
        tensors[name] = torch.cat([t, 0.02 * torch.randn(rows - t.shape[0], t.shape[1])])
    return tensors


def _widen(tensors: dict) -> dict:
    for name in list(tensors):
        if "mlp.up_proj" in name or "mlp.gate_proj" in name:
            tensors[name] = torch.cat([tensors[name], tensors[name][:16]])
    return tensors


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, str]:
    """Model dirs: base, a, b (same architecture), vocab80, layers2, wide (other mlp size), bf16."""
    root = tmp_path_factory.mktemp("merge_models")
    base = build_llama(str(root / "base"), 0)
    return {
        "base": base,
        "a": derive(base, str(root / "a"), 1),
        "b": derive(base, str(root / "b"), 2),
        "vocab80": derive(base, str(root / "vocab80"), 3, edit=lambda t: _pad_rows(t, 80),
                          config_edit=lambda c: c.update(vocab_size=80)),
        "layers2": derive(base, str(root / "layers2"), 4,
                          edit=lambda t: {n: v for n, v in t.items() if "layers.2." not in n},
                          config_edit=lambda c: c.update(num_hidden_layers=2)),
        "wide": derive(base, str(root / "wide"), 5, edit=_widen),
        "bf16": derive(base, str(root / "bf16"), 6, edit=lambda t: {n: v.bfloat16() for n, v in t.items()},
                       config_edit=lambda c: c.update(dtype="bfloat16")),
    }
