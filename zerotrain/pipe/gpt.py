"""The repository's GPT (`zerotrain.models.gpt`) as pipeline layers: what the tests and benchmarks pipeline.

`gpt_layers(config)`: a token + position embedding (a `TiedLayerSpec` when the config ties the head to it), the
GPT's own `Block`s, the final LayerNorm and the output head (the same tied embedding, used through
`head_forward`, or a plain bias-free Linear); `gpt_loss(logits, targets)` is the GPT's mean cross entropy.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.gpt import Block, GPTConfig
from .module import LayerSpec, TiedLayerSpec

__all__ = ["Embedding", "Head", "head_forward", "gpt_layers", "gpt_loss"]


class Embedding(nn.Module):
    """Token plus learned absolute position embedding (N(0, 0.02)), then dropout: the GPT's input."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        return self.drop(self.wte(idx.long()) + self.wpe(positions))


class Head(nn.Linear):
    """The untied output head: a bias-free Linear to the vocabulary."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.n_embd, config.vocab_size, bias=False)
        nn.init.normal_(self.weight, std=0.02)


def head_forward(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The tied head: logits through the token embedding's weight."""
    return F.linear(x, embedding.wte.weight)


def gpt_layers(config: GPTConfig) -> list:
    """The GPT as a PipelineModule's layers (see the module docstring)."""
    if config.tie_weights:
        first = TiedLayerSpec("embed", Embedding, config)
        last = TiedLayerSpec("embed", Embedding, config, forward_fn=head_forward)
    else:
        first, last = LayerSpec(Embedding, config), LayerSpec(Head, config)
    return [first, *[LayerSpec(Block, config) for _ in range(config.n_layer)],
            LayerSpec(nn.LayerNorm, config.n_embd, bias=config.bias), last]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every target token (-100 ignored), in fp32: the GPT's loss."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1).long(),
                           ignore_index=-100)
