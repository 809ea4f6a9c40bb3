"""A Hugging Face transformers model (built from a config, no download) trains identically under ZeRO."""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed

import transformers  # the dev extra has it: a missing install fails, never skips

STEPS, MICRO, WORLD, LR = 5, 2, 2, 1e-3
# GPT-2's attention key bias has a gradient that is exactly zero in exact arithmetic (softmax ignores a
# shift common to all keys), so in floating point it is pure rounding noise, which Adam's normalization
# with the default eps=1e-8 would blow up to ~lr-sized, order-dependent updates. eps=1e-6 keeps such
# noise-only elements at noise size, so every weight can be held to the 1e-5 / 1e-6 tolerance.
EPS = 1e-6
# (stage, gradient accumulation steps): every stage, accumulation 2 at a sharded-optimizer and a sharded-param stage.
CASES = [(0, 1), (1, 2), (2, 1), (3, 2)]


def build_model():
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def batches(world: int, accumulation: int):
    """One global batch per step: `accumulation` micro-steps x `world` ranks x MICRO sequences."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 97, (MICRO * accumulation * world, 16), generator=generator) for _ in range(STEPS)]


def micro_tokens(tokens: torch.Tensor, micro_step: int, rank: int, world: int) -> torch.Tensor:
    start = (micro_step * world + rank) * MICRO
    return tokens[start:start + MICRO]


def train_hf_cases(cases: list) -> list:
    """Every (stage, accumulation) case in one spawn: (losses per step, full fp32 weights on rank 0)."""
    import torch.distributed as dist

    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = []
    for stage, accumulation in cases:
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
                  "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}},
                  "zero_optimization": {"stage": stage}, "steps_per_print": 0}
        engine, *_ = zerotrain.initialize(model=build_model(), config=config)
        losses = []
        for tokens in batches(world, accumulation):
            total = torch.zeros(1)
            for micro_step in range(accumulation):
                ids = micro_tokens(tokens, micro_step, rank, world)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                total += loss.detach()
            dist.all_reduce(total)
            losses.append(total.item() / (world * accumulation))
        assert engine.global_steps == STEPS
        results.append((losses, engine.full_state_dict()))
    return results


def reference(accumulation: int) -> tuple[list, dict]:
    """Single-process AdamW on the union of the same batches."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for tokens in batches(WORLD, accumulation):
        # Mean of the micro-batches' mean token losses = what the engine optimizes (equal token counts).
        parts = [model(input_ids=ids, labels=ids).loss
                 for ids in (micro_tokens(tokens, m, r, WORLD) for m in range(accumulation) for r in range(WORLD))]
        loss = torch.stack(parts).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: param.detach().clone() for name, param in model.named_parameters()}


def test_gpt2_from_config_matches_single_process():
    """Stages 0-3 (accumulation 1 and 2) at world size 2: 5 steps equal single-process AdamW."""
    results = run_distributed(train_hf_cases, WORLD, CASES)[0]
    references = {accumulation: reference(accumulation) for accumulation in {a for _, a in CASES}}
    for (stage, accumulation), (losses, weights) in zip(CASES, results):
        what = f"stage {stage}, accumulation {accumulation}"
        ref_losses, ref_weights = references[accumulation]
        assert len(losses) == len(ref_losses) == STEPS
        for got, ref in zip(losses, ref_losses):
            assert abs(got - ref) / ref <= 1e-5, (what, losses, ref_losses)
        assert set(weights) >= set(ref_weights), what
        for name, ref in ref_weights.items():
            torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {name}: {m}")
    assert references[1][0] != references[2][0], "the two accumulation settings train on different batches"
