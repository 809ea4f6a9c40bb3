"""A DeepSpeed pipeline training program, written for tests/pipe/test_deepspeed_pipeline.py in the style of
DeepSpeedExamples' training/pipeline_parallelism/train.py and Megatron-DeepSpeed's pipeline scripts (not code
from either): DeepSpeed's API only; the test runs it under DeepSpeed and, after `zerotrain port`, under zerotrain.

It writes rank 0's loss of every step and each rank's cut (`net.parts`, the layers it built) to --out.
"""
import argparse
import json
import os

import torch
import torch.nn as nn

import deepspeed
from deepspeed.pipe import PipelineModule, LayerSpec


class PreActBlock(nn.Module):
    """A residual block that activates its input in place first (ReLU(inplace=True) on what it receives)."""

    def __init__(self, width):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        x = self.act(x)
        return x + self.fc(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.runtime.utils.set_random_seed(1234)

    layers = [
        LayerSpec(nn.Linear, 16, 32),
        LayerSpec(PreActBlock, 32),
        LayerSpec(nn.ReLU, inplace=True),       # ties for the cut (no parameters): DeepSpeed keeps them on the
        LayerSpec(nn.Dropout, p=args.dropout),  # first stage, so the second starts with PreActBlock's ReLU
        LayerSpec(PreActBlock, 32),
        LayerSpec(nn.Linear, 32, 10),
    ]
    net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                         partition_method="parameters", activation_checkpoint_interval=0)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(24, 16, generator=generator)
    labels = torch.randint(0, 10, (24,), generator=generator)
    trainset = torch.utils.data.TensorDataset(inputs, labels)

    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    losses = [float(engine.train_batch()) for _ in range(args.steps)]

    rank = deepspeed.comm.get_rank()
    built = sorted({int(name.split(".")[0]) for name in net.state_dict()})
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as handle:
        json.dump({"losses": losses, "parts": [int(p) for p in net.parts], "built": built}, handle)


if __name__ == "__main__":
    main()
