"""A small decoder-only transformer (GPT) over bytes.

Pre-LayerNorm blocks, learned absolute positions, causal self-attention through
:func:`torch.nn.functional.scaled_dot_product_attention`, a GELU MLP and, by default,
an output head that shares its weight with the input embedding.

The model is the workload for zerotrain's tests, demo and benchmarks, so it stays plain
PyTorch: every parameter lives in an ``nn.Linear``, ``nn.Embedding`` or ``nn.LayerNorm``
and is reached through ordinary module attributes, which is what ZeRO stage 3's
per-module hooks expect. When the weights are tied, the shared ``nn.Parameter`` is a direct
parameter of both ``transformer.wte`` and ``lm_head`` (``model.parameters()`` yields it once).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "PRESETS"]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`.

    ``n_inner`` is the MLP hidden width; ``None`` means ``4 * n_embd``.
    """

    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    block_size: int = 32
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True
    n_inner: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if self.n_inner is not None and self.n_inner <= 0:
            raise ValueError(f"GPTConfig.n_inner must be positive, got {self.n_inner!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def mlp_hidden(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named shape: ``"tiny"`` (tests), ``"small"`` (demo), ``"70m"`` (benchmarks).

        Keyword arguments replace fields of the preset, e.g. ``preset("small", dropout=0.1)``.
        """
        try:
            base = PRESETS[name]
        except KeyError:
            known = ", ".join(sorted(PRESETS))
            raise ValueError(f"unknown GPT preset {name!r} (known: {known})") from None
        return dataclasses.replace(base, **overrides)


PRESETS: dict[str, GPTConfig] = {
    # ~0.1M parameters. The MLP width is deliberately odd (191) so several tensors, and the
    # model's total parameter count, are not divisible by 2 or 4: flat-buffer sharding has to pad.
    "tiny": GPTConfig(n_layer=3, n_head=4, n_embd=48, block_size=32, n_inner=191),
    # ~6.1M parameters: the demo model.
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=288, block_size=256),
    # ~72M parameters: the benchmark model (head dim 64).
    "70m": GPTConfig(n_layer=12, n_head=11, n_embd=704, block_size=512),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # Ulysses sequence parallelism (zerotrain.parallel.sequence sets it): x is this rank's sequence shard
        self.sequence_parallel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        head_dim = self.n_embd // self.n_head
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        heads = q.shape[-1] // head_dim  # this rank's heads: fewer when c_attn is tensor-parallel
        # (B, T, heads*hd) -> (B, heads, T, hd)
        q = q.view(batch, seq, heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq, heads, head_dim).transpose(1, 2)
        sp = self.sequence_parallel
        if sp is not None:  # whole sequence, 1/N of the heads
            q, k, v = sp.gather_heads(q), sp.gather_heads(k), sp.gather_heads(v)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        if sp is not None:
            y = sp.scatter_heads(y)
        y = y.transpose(1, 2).contiguous().view(batch, seq, heads * head_dim)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.act = nn.GELU()
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``forward(idx, targets=None)`` returns ``(logits, loss)``; ``loss`` is the mean
    cross entropy over all target tokens (``None`` without targets). Targets equal to
    ``-100`` are ignored. ``position_ids`` (batch or 1, seq) default to ``0..seq-1``; under
    sequence parallelism ``idx`` is this rank's shard, positions default to its global offsets and
    the loss is the mean over the whole sequences of the group.

    ``activation_checkpointing = True`` (set by the engine when the config has an
    ``activation_checkpointing`` block) runs each block through
    :func:`zerotrain.checkpointing.checkpoint` while training: only block inputs are kept
    for backward, the rest is recomputed.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.activation_checkpointing = False
        self.sequence_parallel = None  # see CausalSelfAttention.sequence_parallel
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02) weights, zero biases, residual projections scaled
        by ``1/sqrt(2 * n_layer)``. Deterministic under ``torch.manual_seed``."""
        std = 0.02
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=resid_std)
        if self.config.tie_weights:
            # The shared weight was drawn twice above (as embedding and as head); redraw it
            # once so the result does not depend on module order.
            nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=std)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameter elements (a tied weight counts once)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.transformer.wpe.weight.numel()
            if not self.config.tie_weights:
                total -= self.transformer.wte.weight.numel()
        return total

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if idx.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape (batch, seq), got {tuple(idx.shape)}")
        seq = idx.size(1)
        sp = self.sequence_parallel
        if seq * (sp.size if sp is not None else 1) > self.config.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds the model's block_size {self.config.block_size}"
            )
        idx = idx.long()
        if position_ids is not None:
            pos = position_ids
        elif sp is not None:
            pos = sp.local_positions(seq, idx.device)
        else:
            pos = torch.arange(seq, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        checkpointed = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        if checkpointed:
            from ..checkpointing import checkpoint
        for block in self.transformer.h:
            x = checkpoint(block, x) if checkpointed else block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None and sp is not None:
            flat = targets.reshape(-1).long()
            loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat,
                                       ignore_index=-100, reduction="sum")
            loss = sp.mean_loss(loss_sum, (flat != -100).sum())
        elif targets is not None:
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(),
                targets.reshape(-1).long(),
                ignore_index=-100,
            )
        return logits, loss
