"""Shared pieces of the checkpoint tests: a model with every kind of state, configs, a training loop."""
from __future__ import annotations

import torch

from models_for_tests import make_batches, train_global_step

MICRO, GLOBAL_BATCH = 2, 8


class CkptNet(torch.nn.Module):
    """Trainable layers whose sizes do not divide evenly, a frozen layer, a persistent and a scratch buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 7)
        self.fc2 = torch.nn.Linear(7, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("shift", torch.randn(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x, y):
        out = self.frozen(self.fc2(torch.tanh(self.fc1(x)))) + self.shift
        return torch.nn.functional.mse_loss(out, y)


def config(stage: int, precision: str = "fp32", **checkpoint) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 20, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                              "stage3_param_persistence_threshold": 0},  # stage 3: every parameter partitioned
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 0,
        "comm_timeout_seconds": 60,
    }
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    return cfg


def make_engine(stage: int, seed: int = 0, precision: str = "fp32", groups: bool = False, **checkpoint):
    """An engine over a fresh CkptNet; `groups`: weights and biases in two optimizer groups."""
    import zerotrain

    torch.manual_seed(seed)
    model = CkptNet()
    parameters = None
    if groups:
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        parameters = [{"params": [p for n, p in trainable if n.endswith("weight")], "weight_decay": 0.05},
                      {"params": [p for n, p in trainable if n.endswith("bias")], "weight_decay": 0.0}]
    engine, *_ = zerotrain.initialize(model=model, config=config(stage, precision, **checkpoint),
                                      model_parameters=parameters)
    return engine


def train(engine, first: int, count: int, total: int = 12) -> list[float]:
    """Global steps [first, first+count) of a fixed sequence of global batches; the global mean loss of each."""
    return [train_global_step(engine, batch, MICRO) for batch in make_batches(total, GLOBAL_BATCH)[first:first + count]]


def optimizer_state(engine) -> list[dict]:
    """This rank's optimizer state, cloned to CPU (for before/after comparisons)."""
    return [{k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in
             engine.optimizer.state.get(slot.master, {}).items()} for slot in engine.sharded_slots()]


def snapshot(engine) -> dict:
    """What a test compares: full weights (rank 0), extras, optimizer state, counters."""
    from zerotrain.zero import GatheredParameters

    # module.state_dict() of a ZeRO-3 model holds DeepSpeed's empty placeholders unless gathered (every rank)
    with GatheredParameters(list(engine.module.parameters())):
        module = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
    return {
        "weights": engine.full_state_dict(),
        "module": module,
        "optimizer": optimizer_state(engine),
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps),
        "lr": engine.get_lr(),
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "scaler": engine.loss_scaler.state_dict(),
    }


def assert_weights_equal(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6, what: str = "") -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} {name}: {m}")
