"""Shared pieces of the split-expert engine tests (offload, qgZ): MoENet on the engine and its one-process reference.

The global batch (GLOBAL samples, micro-batches of MICRO) is the same at every world size, so the
per-micro-batch aux loss sees the same micro-batches everywhere; the reference is the same MoENet with
every expert local, trained on each step's whole batch (the loss = the mean of every micro-batch's
loss), AdamW with clipping at CLIP (it fires on step 1 only).
"""
from __future__ import annotations

from typing import Optional

import torch

from models_for_tests import MOE_D_IN as D_IN
from models_for_tests import MOE_D_OUT as D_OUT
from models_for_tests import make_moe_model as make_model

STEPS, SAVED_AT, MICRO, GLOBAL, LR, WEIGHT_DECAY, CLIP = 4, 2, 2, 16, 1e-2, 0.01, 0.3


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(GLOBAL, D_IN, generator=generator), torch.randn(GLOBAL, D_OUT, generator=generator))
            for _ in range(STEPS)]


def build_engine(stage: int, ep_size: int, sgd_lr: Optional[float] = None, frozen: frozenset = frozenset(),
                 top: Optional[dict] = None, **zero):
    """The engine over MoENet with its experts split over groups of `ep_size` consecutive ranks, AdamW (plain
    SGD with `sgd_lr`), the parameters named in `frozen` frozen; `top`: more top-level config keys (bf16,
    fp16); `zero`: more keys of the zero_optimization block."""
    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60)
    comm = Comm.data_parallel(topology)
    ep_comm = comm.subgroup(*topology.expert_parallel_group(ep_size))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL // (MICRO * comm.size),
              "gradient_clipping": CLIP, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}} if sgd_lr is None
              else {"type": "SGD", "params": {"lr": sgd_lr}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, **zero}, **(top or {})}
    model = make_model(ep_comm)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return engine


def initial_weights() -> dict[str, torch.Tensor]:
    """The whole weights every run starts from."""
    from zerotrain.comm import Comm

    return {name: p.detach().clone() for name, p in make_model(Comm(None, 0, 1)).named_parameters()}


def reference(sgd_lr: Optional[float] = None) -> tuple[list[float], list[float], dict, dict]:
    """Single-process losses and pre-clip norms of every step, the weights after SAVED_AT and after STEPS steps
    (AdamW, or plain SGD with `sgd_lr`)."""
    from zerotrain.comm import Comm

    model = make_model(Comm(None, 0, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY) if sgd_lr is None \
        else torch.optim.SGD(model.parameters(), lr=sgd_lr)
    return train_reference(model, optimizer, batches(), MICRO, GLOBAL, CLIP, SAVED_AT)


EXPERT_PARAMETERS = frozenset({"moe.w_in", "moe.b_in", "moe.w_out", "moe.b_out"})


def do_nothing(frozen: Optional[frozenset] = None) -> tuple[list[float], dict]:
    """The do-nothing baseline of a lossy check on the same batches (losses, final weights): no update at all,
    or with `frozen` only those parameters frozen (e.g. EXPERT_PARAMETERS)."""
    from zerotrain.comm import Comm

    model = make_model(Comm(None, 0, 1))
    if frozen is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    else:
        for name, param in model.named_parameters():
            param.requires_grad_(name not in frozen)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                      weight_decay=WEIGHT_DECAY)
    losses, _, _, weights = train_reference(model, optimizer, batches(), MICRO, GLOBAL, CLIP, SAVED_AT)
    return losses, weights


def train_reference(model: torch.nn.Module, optimizer: torch.optim.Optimizer, global_batches: list, micro: int,
                    global_batch: int, clip: float, saved_at: int) -> tuple[list[float], list[float], dict, dict]:
    """Plain single-process training: the mean of the micro-batch losses of each global batch, clipping at `clip`;
    returns losses, pre-clip norms, the weights after `saved_at` steps and at the end."""
    losses, norms, at_save = [], [], {}
    for step, (x, y) in enumerate(global_batches):
        loss = sum(model(x[i:i + micro], y[i:i + micro]) for i in range(0, global_batch, micro)) / \
            (global_batch // micro)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == saved_at:
            at_save = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, norms, at_save, {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_matches(where: str, losses, weights, ref_losses, ref_weights, loss_rtol: float = 1e-5,
                   weight_rtol: float = 1e-5, weight_atol: float = 1e-6) -> None:
    """Losses within `loss_rtol` relative; whole `(num_experts, ...)` weights under every reference name, close."""
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= loss_rtol, (where, losses, ref_losses)
    assert sorted(weights) == sorted(ref_weights), where
    for name, expected in ref_weights.items():
        assert weights[name].shape == expected.shape, (where, name)
        torch.testing.assert_close(weights[name], expected, rtol=weight_rtol, atol=weight_atol,
                                   msg=lambda m, name=name: f"{where}, {name}: {m}")


def resume_segment(engine, directory: str, tag: str, first: int, last: int, micro: int) -> list[float]:
    """Train global steps [first, last) of `batches()`: load `directory` first when first > 0, else save
    it under `tag` after. Returns the losses."""
    from models_for_tests import train_global_step

    if first > 0:
        path, _ = engine.load_checkpoint(directory)
        assert path is not None, f"nothing loaded from {directory}"
    losses = [train_global_step(engine, batch, micro) for batch in batches()[first:last]]
    if first == 0:
        engine.save_checkpoint(directory, tag=tag)
    return losses
