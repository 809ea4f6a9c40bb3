"""A Hugging Face transformers model (built from a config, no download) trains identically under ZeRO."""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed

transformers = pytest.importorskip("transformers")

STEPS, MICRO = 3, 2


def build_model():
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def batches(world: int):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 97, (MICRO * world, 16), generator=generator) for _ in range(STEPS)]


def train_hf(stage: int) -> tuple[list, dict]:
    import torch.distributed as dist

    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
              "steps_per_print": 0}
    engine, *_ = zerotrain.initialize(model=build_model(), config=config)
    losses = []
    for tokens in batches(world):
        ids = tokens[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, engine.full_state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_gpt2_from_config_matches_single_process(stage):
    losses, weights = run_distributed(train_hf, 2, stage)[0]
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_losses = []
    for tokens in batches(2):
        # Mean of the two ranks' mean token losses = what the engine optimizes (equal token counts).
        halves = [model(input_ids=tokens[i * MICRO:(i + 1) * MICRO], labels=tokens[i * MICRO:(i + 1) * MICRO]).loss
                  for i in range(2)]
        loss = (halves[0] + halves[1]) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    for got, ref in zip(losses, ref_losses):
        assert abs(got - ref) / ref <= 1e-5, (losses, ref_losses)
    for name, param in model.named_parameters():
        torch.testing.assert_close(weights[name], param.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
