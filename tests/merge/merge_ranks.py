"""What merge tests run inside spawned ranks: a module of its own, importable in a rank without the
tests' conftest (two conftest modules share that name, so a rank may import the other one)."""
from __future__ import annotations

import torch


def real_checkpoint(model_dir: str, save_dir: str) -> str:
    """A checkpoint as `zerotrain train` writes it: the model directory under the engine, one step, saved."""
    import transformers

    import zerotrain

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    engine, *_ = zerotrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1}, "steps_per_print": 0})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    path = engine.save_checkpoint(save_dir)
    engine.close()
    return path
