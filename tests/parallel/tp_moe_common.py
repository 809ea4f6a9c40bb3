"""Shared pieces of the tensor-parallel + expert-parallel tests: a TP MLP block feeding an ExpertParallelMoE.

TPMoENet is Linear -> tanh -> residual MLP block (fc column-parallel, proj row-parallel by PLAN) -> MoE
(4 experts, top 2, NOT split by tensor parallelism: every tensor-parallel rank holds its data-parallel
rank's experts, the all-to-all runs over the expert-parallel group of its own data-parallel ranks) ->
Linear. The global batch (GLOBAL samples, micro-batches of MICRO) is the same at every grid shape, so the
per-micro-batch aux loss sees the same micro-batches everywhere; the reference is one process with every
expert local, AdamW and clipping at CLIP (small enough to fire every step).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

D_IN, D_MODEL, D_FF, D_OUT, EXPERTS = 6, 8, 16, 3, 4
STEPS, SAVED_AT, MICRO, GLOBAL, LR, WEIGHT_DECAY, CLIP = 3, 2, 2, 8, 1e-2, 0.01, 0.05


def tensor_parallel_plan() -> dict:
    from zerotrain.parallel.plan import Column, Row

    return {"fc": Column(), "proj": Row()}


class TPMoENet(torch.nn.Module):
    """forward(x, y) returns MSE + 0.01 * the MoE's aux loss."""

    def __init__(self, ep_comm) -> None:
        from zerotrain.parallel.moe import ExpertParallelMoE

        super().__init__()
        self.inp = torch.nn.Linear(D_IN, D_MODEL)
        self.fc = torch.nn.Linear(D_MODEL, D_FF)
        self.proj = torch.nn.Linear(D_FF, D_MODEL)
        self.moe = ExpertParallelMoE(D_MODEL, D_FF, EXPERTS, ep_comm, top_k=2)
        self.out = torch.nn.Linear(D_MODEL, D_OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inp(x))
        hidden = hidden + self.proj(F.gelu(self.fc(hidden)))  # after proj's all-reduce: the same on every TP rank
        mixed, aux = self.moe(hidden)
        return F.mse_loss(self.out(mixed), y) + 0.01 * aux


def make_model(ep_comm) -> TPMoENet:
    """Fixed initial weights whatever the grid (experts are seeded per expert index)."""
    torch.manual_seed(0)
    return TPMoENet(ep_comm)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL, D_IN, generator=generator), torch.randn(GLOBAL, D_OUT, generator=generator))
            for _ in range(STEPS)]


def build_engine(stage: int, tp: int, ep_size: int, **zero):
    """The engine over TPMoENet on a (data, tensor) grid of `tp`-rank tensor-parallel blocks, experts split over
    groups of `ep_size` consecutive data-parallel ranks; `zero`: more zero_optimization keys."""
    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60, tp_size=tp)
    ep_comm = Comm.data_parallel(topology).subgroup(*topology.expert_parallel_group(ep_size))
    config = {"train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": GLOBAL // (MICRO * topology.dp_size),
              "gradient_clipping": CLIP, "steps_per_print": 0, "tensor_parallel": {"autotp_size": tp},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200,
                                    "stage3_param_persistence_threshold": 0, **zero}}
    engine, *_ = zerotrain.initialize(model=make_model(ep_comm), config=config,
                                      tensor_parallel_plan=tensor_parallel_plan() if tp > 1 else None)
    return engine


def train_steps(engine, first: int, last: int) -> list[float]:
    """Global steps [first, last) of `batches()`: each data-parallel rank takes its micro-batches (the same on
    every tensor-parallel rank of its block); returns the global mean losses."""
    import torch.distributed as dist

    dp, dp_rank = engine.topology.dp_size, engine.topology.dp_rank
    accumulation = engine.gradient_accumulation_steps()
    losses = []
    for x, y in batches()[first:last]:
        total = torch.zeros(1)
        for index in range(accumulation):
            start = (index * dp + dp_rank) * MICRO
            loss = engine(x[start:start + MICRO], y[start:start + MICRO])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)  # every tensor-parallel rank holds the same loss: divide by the world
        losses.append(total.item() / (accumulation * dist.get_world_size()))
    return losses


def reference() -> tuple[list[float], list[float], dict, dict]:
    """One process, every expert local: losses and pre-clip norms of every step, weights after SAVED_AT and
    after STEPS steps."""
    from zerotrain.comm import Comm

    from moe_common import train_reference

    model = make_model(Comm(None, 0, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return train_reference(model, optimizer, batches(), MICRO, GLOBAL, CLIP, SAVED_AT)


def do_nothing() -> tuple[list[float], dict]:
    """The do-nothing baseline of a lossy check: the same batches with no update at all (losses, weights)."""
    from zerotrain.comm import Comm

    from moe_common import train_reference

    model = make_model(Comm(None, 0, 1))
    losses, _, _, weights = train_reference(model, torch.optim.SGD(model.parameters(), lr=0.0), batches(), MICRO,
                                            GLOBAL, CLIP, SAVED_AT)
    return losses, weights
