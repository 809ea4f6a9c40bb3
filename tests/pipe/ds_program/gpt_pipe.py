"""A Megatron-DeepSpeed-style GPT pipeline script, written for tests/pipe/test_deepspeed_pipeline.py (not code from
Megatron-DeepSpeed): DeepSpeed's API only; the test runs it under DeepSpeed and, after `zerotrain port`, under
zerotrain.

What it has of Megatron-DeepSpeed's pipeline scripts: a GPT built from `LayerSpec`s with the word embedding tied to
the output head (`TiedLayerSpec("embed", ..., forward_fn=..., tied_weight_attr="word_embeddings_weight")`) and cut
by `partition_method="type:transformer"`; transformer layers that checkpoint their body through
`deepspeed.checkpointing.checkpoint` after `deepspeed.checkpointing.configure(mpu, deepspeed_config=...,
num_checkpoints=...)` with an mpu-like object (tensor-model-parallel size 1); seeds through
`deepspeed.checkpointing.model_parallel_cuda_manual_seed`; `deepspeed.utils.logger` / `log_dist`;
`deepspeed.runtime.utils.see_memory_usage`; a `RepeatingLoader` over its own loader given to
`engine.train_batch(data_iter=...)`.

It writes each rank's loss of every step, the cut and the layers it built to --out (gpt_rank<r>.json).
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed
from deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.utils import RepeatingLoader, log_dist, logger


class ModelParallelUnit:
    """Megatron's `mpu` as DeepSpeed's checkpointing reads it: no tensor parallelism (pipeline and data
    parallelism are the engine's)."""

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return None

    def get_data_parallel_world_size(self):
        return deepspeed.comm.get_world_size() // 2

    def get_data_parallel_rank(self):
        return 0


class EmbeddingPipe(nn.Module):
    """Word + position embeddings; the word embedding is the output head's weight too (tied)."""

    def __init__(self, vocab, hidden, seq, dropout):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq, hidden)
        self.embedding_dropout = nn.Dropout(dropout)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
        return self.embedding_dropout(self.word_embeddings(tokens) + self.position_embeddings(positions))


def logits_from_embedding(embedding, hidden_states):
    """The tied head: hidden states times the word embedding's transpose (Megatron's parallel_lm_logits)."""
    return F.linear(hidden_states, embedding.word_embeddings_weight)


class ParallelTransformerLayerPipe(nn.Module):
    """Pre-LN causal self-attention and MLP; the body runs under deepspeed.checkpointing.checkpoint."""

    def __init__(self, hidden, heads, dropout, checkpoint_activations):
        super().__init__()
        self.heads = heads
        self.input_layernorm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp_in = nn.Linear(hidden, 4 * hidden)
        self.mlp_out = nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(dropout)
        self.checkpoint_activations = checkpoint_activations

    def _body(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.input_layernorm(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(-1)
        context = (attention @ v).transpose(1, 2).reshape(batch, seq, hidden)
        x = x + self.dropout(self.dense(context))
        return x + self.dropout(self.mlp_out(F.gelu(self.mlp_in(self.post_attention_layernorm(x)))))

    def forward(self, x):
        if self.checkpoint_activations and self.training:
            return deepspeed.checkpointing.checkpoint(self._body, x)
        return self._body(x)


def cross_entropy_for_pipe(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=64)
    parser.add_argument("--hidden-dropout", type=float, default=0.0)
    parser.add_argument("--checkpoint-activations", action="store_true", default=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = ModelParallelUnit()
    # Megatron's _set_random_seed
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    deepspeed.checkpointing.configure(mpu, deepspeed_config=args.deepspeed_config, num_checkpoints=args.num_layers)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(args.seed)

    specs = [TiedLayerSpec("embed", EmbeddingPipe, args.vocab_size, args.hidden_size, args.seq_length,
                           args.hidden_dropout, tied_weight_attr="word_embeddings_weight")]
    specs += [LayerSpec(ParallelTransformerLayerPipe, args.hidden_size, args.num_attention_heads, args.hidden_dropout,
                        args.checkpoint_activations) for _ in range(args.num_layers)]
    specs += [LayerSpec(nn.LayerNorm, args.hidden_size),
              TiedLayerSpec("embed", EmbeddingPipe, args.vocab_size, args.hidden_size, args.seq_length,
                            args.hidden_dropout, forward_fn=logits_from_embedding,
                            tied_weight_attr="word_embeddings_weight")]
    model = PipelineModule(layers=specs, loss_fn=cross_entropy_for_pipe, num_stages=2,
                           partition_method="type:transformer", activation_checkpoint_interval=0)
    see_memory_usage("after building the model", force=False)
    log_dist(f"pipeline stages cut at {model.parts}", ranks=[0])

    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab_size, (32, args.seq_length + 1), generator=generator)
    samples = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])

    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    loader = torch.utils.data.DataLoader(samples, batch_size=engine.train_micro_batch_size_per_gpu(), shuffle=False)
    data_iterator = iter(RepeatingLoader(loader))
    losses = []
    for iteration in range(args.steps):
        loss = engine.train_batch(data_iter=data_iterator)
        losses.append(float(loss))
        if engine.is_last_stage():
            logger.info(f"iteration {iteration + 1}: lm loss {losses[-1]:.6f}")

    rank = deepspeed.comm.get_rank()
    built = sorted({int(name.split(".")[0]) for name in model.state_dict() if name.split(".")[0].isdigit()})
    with open(os.path.join(args.out, f"gpt_rank{rank}.json"), "w") as handle:
        json.dump({"losses": losses, "parts": [int(p) for p in model.parts], "built": built}, handle)


if __name__ == "__main__":
    main()
