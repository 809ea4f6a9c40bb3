"""Encoding texts with our own code, and exporting a trained encoder as a sentence-transformers directory.

The directory is what `SentenceTransformer(path)` loads with no network: the Hugging Face encoder
(config + safetensors weights + tokenizer) at its root as module 0 (`Transformer`), then
`1_Pooling` (our pooling mode as sentence-transformers' flags) and `2_Normalize`, so its `encode`
gives the unit vectors ours does.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence, Union

import torch
import torch.nn.functional as F

from .gradcache import embed
from .pooling import Pooling, _FLAGS

__all__ = ["encode", "export_sentence_transformers"]


@torch.no_grad()
def encode(model: Any, tokenizer: Any, texts: Sequence[str], pooling: Pooling, *, max_length: int = 256,
           batch_size: int = 64, device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """Unit-length embeddings (float32, CPU) of `texts` by `model` (an engine or an encoder module), in eval mode."""
    was_training = model.training  # a module's, or the engine's (TrainingEngine.training)
    model.eval()
    out = []
    try:
        for start in range(0, len(texts), batch_size):
            features = tokenizer(list(texts[start:start + batch_size]), padding=True, truncation=True,
                                 max_length=max_length, return_tensors="pt")
            if device is not None:
                features = {k: v.to(device) for k, v in features.items()}
            out.append(F.normalize(embed(model, dict(features), pooling).float(), dim=-1).cpu())
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.empty(0)


def export_sentence_transformers(out_dir: Union[str, Path], state_dict: dict[str, torch.Tensor], model_config: Any,
                                 tokenizer: Any, pooling: Pooling, max_seq_length: int) -> Path:
    """Write a sentence-transformers model directory: the encoder `state_dict` (full weights, as
    `engine.full_state_dict()` returns on rank 0), its Hugging Face config and tokenizer, pooling, Normalize."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ], indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: mode == pooling.mode for mode, flag in _FLAGS.items()}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": int(model_config.hidden_size), **flags,
         "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                "do_lower_case": False}, indent=2))
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {"model_type": "SentenceTransformer", "similarity_fn_name": "cosine",
         "prompts": {}, "default_prompt_name": None}, indent=2))
    return out
