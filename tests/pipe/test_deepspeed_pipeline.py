"""A DeepSpeed pipeline program runs unchanged after `zerotrain port` and trains as under DeepSpeed (issue 44).

- tests/pipe/ds_program/train.py (DeepSpeed's API only: `deepspeed.init_distributed()`, seeds through
  `deepspeed.runtime.utils.set_random_seed`, a `PipelineModule` of LayerSpecs cut by "parameters" with ties and a
  block that applies ReLU(inplace=True) to what it receives at the start of stage 1, a Dropout (p=0 for the
  comparison), `model_parameters=[p for p in net.parameters() if p.requires_grad]`, `training_data=`, one
  micro-batch per step at pipeline size 2, `engine.train_batch()` with no argument, torch Adam) runs at world 2
  under DeepSpeed 0.19.8 on the CPU and, after `zerotrain port` (the only change), under zerotrain: losses equal
  step for step within 1e-5 (8 steps: the loader wraps around), the same cut, each rank building the same layers.
- The cut is DeepSpeed's `partition_balanced` / `partition_uniform`, tie-breaking included, on weight lists
  with ties (and the AlexNet-style example of DeepSpeed's pipeline example: [0, 19, 22]).
- A run whose `model_parameters` hold none of the parameters that require grad (a PipelineModule built before
  torch.distributed was up holds none yet) fails in one line naming model_parameters; built after
  `init_distributed()`, the filtered list is the stage's own parameters and trains, `train_batch()` /
  `eval_batch()` reading `training_data` in order.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from distributed import run_cli, run_distributed

PROGRAM = Path(__file__).parent / "ds_program"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed")


def run_program(directory: str, out: str, deepspeed_accelerator: bool) -> None:
    """On each rank: the program's `__main__` with its command line (what torchrun would start)."""
    import multiprocessing

    if deepspeed_accelerator:
        os.environ["DS_ACCELERATOR"] = "cpu"
    # run_distributed's ranks are daemonic; DeepSpeed's pipeline loader starts worker processes, as under torchrun
    multiprocessing.current_process()._config["daemon"] = False
    os.chdir(directory)
    sys.path.insert(0, directory)
    for script, config in (("train.py", "ds_config.json"), ("gpt_pipe.py", "ds_config_gpt.json")):
        sys.argv = [script, "--local_rank", os.environ["LOCAL_RANK"], "--deepspeed_config", config, "--out", out]
        runpy.run_path(os.path.join(directory, script), run_name="__main__")


def _results(out: Path, prefix: str = "") -> list[dict]:
    return [json.loads((out / f"{prefix}rank{rank}.json").read_text()) for rank in range(2)]


@needs_deepspeed
def test_a_deepspeed_pipeline_program_runs_after_port_as_under_deepspeed(tmp_path):
    theirs_dir, ours_dir = tmp_path / "deepspeed", tmp_path / "zerotrain"
    shutil.copytree(PROGRAM, theirs_dir)
    shutil.copytree(PROGRAM, ours_dir)
    ported = run_cli(["port", "--write", str(ours_dir)], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert ported.returncode == 0 and ported.stderr == "", ported.stderr  # nothing left to edit by hand
    for name in ("theirs", "ours"):
        (tmp_path / name).mkdir()
    run_distributed(run_program, 2, str(theirs_dir), str(tmp_path / "theirs"), True, timeout=300)
    run_distributed(run_program, 2, str(ours_dir), str(tmp_path / "ours"), False, timeout=300)
    theirs, ours = _results(tmp_path / "theirs"), _results(tmp_path / "ours")
    assert theirs[0]["parts"] == [0, 4, 6]  # the ReLU and the Dropout (no parameters) stay on the first stage
    for rank in range(2):
        assert ours[rank]["parts"] == theirs[rank]["parts"]
        assert ours[rank]["built"] == theirs[rank]["built"] == [[0, 1], [4, 5]][rank]
        assert len(ours[rank]["losses"]) == len(theirs[rank]["losses"]) == 8
        for step, (a, b) in enumerate(zip(ours[rank]["losses"], theirs[rank]["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, step, ours[rank]["losses"], theirs[rank]["losses"])
    assert theirs[0]["losses"][-1] < theirs[0]["losses"][0] - 0.5  # it trains
    # the Megatron-DeepSpeed-style GPT (gpt_pipe.py): tied embedding/head across the two stages, the
    # "type:transformer" cut, deepspeed.checkpointing around each transformer layer's body, 4 micro-batches a step
    theirs, ours = _results(tmp_path / "theirs", "gpt_"), _results(tmp_path / "ours", "gpt_")
    assert theirs[0]["parts"] == [0, 3, 7]  # 2 transformer layers a stage; the embedding first, norm + head last
    for rank in range(2):
        assert ours[rank]["parts"] == theirs[rank]["parts"]
        assert ours[rank]["built"] == [[0, 1, 2], [3, 4, 5, 6]][rank], ours[rank]["built"]
        assert len(ours[rank]["losses"]) == len(theirs[rank]["losses"]) == 6
        for step, (a, b) in enumerate(zip(ours[rank]["losses"], theirs[rank]["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, step, ours[rank]["losses"], theirs[rank]["losses"])
    assert theirs[1]["losses"][-1] < theirs[1]["losses"][0] - 0.2  # it trains


def _alexnet_layers() -> list:
    """DeepSpeedExamples' pipeline example's layer list (torchvision's AlexNet: features, avgpool, flatten,
    classifier), built on the meta device."""
    with torch.device("meta"):
        features = [nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(True), nn.MaxPool2d(3, 2), nn.Conv2d(64, 192, 5, padding=2),
                    nn.ReLU(True), nn.MaxPool2d(3, 2), nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(True),
                    nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(True), nn.Conv2d(256, 256, 3, padding=1),
                    nn.ReLU(True), nn.MaxPool2d(3, 2)]
        classifier = [nn.Dropout(), nn.Linear(256 * 36, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, 4096),
                      nn.ReLU(True), nn.Linear(4096, 10)]
    return [*features, nn.AdaptiveAvgPool2d((6, 6)), lambda x: torch.flatten(x, 1), *classifier]


@needs_deepspeed
def test_the_cut_is_deepspeeds_partition_ties_included():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from deepspeed.runtime import utils as ds_utils

    from zerotrain.pipe import PipelineModule
    from zerotrain.runtime.utils import partition_balanced, partition_uniform

    rng = random.Random(44)
    weights = [[1, 1, 1, 1, 1], [10, 1, 1, 1, 10], [0, 5, 5, 0], [3, 3, 3, 3, 3, 3], [0, 0, 0, 5, 0, 0],
               [544, 1056, 0, 0, 1056, 330], [7], [2, 2]]
    weights += [[rng.choice([0, 1, 2, 5, 100]) for _ in range(rng.randint(1, 12))] for _ in range(60)]
    for weight in weights:
        for parts in range(1, 5):
            assert partition_balanced(weight, parts) == [int(b) for b in ds_utils.partition_balanced(weight, parts)], \
                (weight, parts)
            assert partition_uniform(len(weight), parts) == \
                [int(b) for b in ds_utils.partition_uniform(len(weight), parts)]
    module = PipelineModule(_alexnet_layers(), num_stages=2)  # "parameters" by default, as DeepSpeed's
    assert module.partition(2) == [0, 19, 22]  # the example: zerotrain cut [0, 17, 22] before
    assert PipelineModule(_alexnet_layers(), num_stages=2, partition_method="uniform").partition(2) == [0, 11, 22]


def frozen_and_built() -> dict:
    """World 1: an unbuilt PipelineModule's filtered parameter list is refused; built after init_distributed,
    the list trains, train_batch()/eval_batch() reading training_data in order."""
    import zerotrain
    from zerotrain.pipe import LayerSpec, PipelineModule

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    layers = [LayerSpec(nn.Linear, 3, 4), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, 4, 2)]
    out: dict = {}
    early = PipelineModule(layers, num_stages=1, loss_fn=nn.MSELoss())  # no process group yet: nothing built
    out["early_params"] = len([p for p in early.parameters() if p.requires_grad])
    try:
        zerotrain.initialize(model=early, config=config,
                             model_parameters=[p for p in early.parameters() if p.requires_grad])
        out["early_error"] = None
    except ValueError as err:
        out["early_error"] = str(err)
    zerotrain.init_distributed()
    torch.manual_seed(0)
    net = PipelineModule(layers, num_stages=1, loss_fn=nn.MSELoss())
    params = [p for p in net.parameters() if p.requires_grad]
    out["built_params"] = len(params)
    # the plain model the cut builds (same generator draws: every layer once for the count, then the stage's)
    torch.manual_seed(0)
    for spec in layers:
        spec.build()
    reference = nn.Sequential(*(spec.build() for spec in layers))
    out["same_init"] = all(torch.equal(a, b) for a, b in zip(params, reference.parameters()))
    data = torch.utils.data.TensorDataset(torch.randn(12, 3, generator=torch.Generator().manual_seed(1)),
                                          torch.randn(12, 2, generator=torch.Generator().manual_seed(2)))
    engine, _, loader, _ = zerotrain.initialize(model=net, config=config, model_parameters=params, training_data=data)
    out["losses"] = [float(engine.train_batch()) for _ in range(4)]  # 3 batches of 4 samples: wraps once
    out["eval"] = float(engine.eval_batch())  # the next 2 micro-batches of the same loader (samples 4..7)
    # an iterator given to train_batch is kept for the calls without one (DeepSpeed's); eval_batch's is not
    own = [(torch.randn(2, 3, generator=torch.Generator().manual_seed(10 + i)), torch.randn(2, 2)) for i in range(4)]
    engine.train_batch(iter(own))  # own[0:2]
    out["eval_own"] = float(engine.eval_batch(iter(own[2:4])))
    out["after_own"] = float(engine.train_batch())  # own[2:4], on the same weights as the eval
    # plain PyTorch: the same samples in order, the mean loss of 2 micro-batches per step, SGD
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    order = [(4 * step + i) % 12 for step in range(5) for i in range(4)]
    for step in range(4):
        idx = order[4 * step: 4 * step + 4]
        optimizer.zero_grad()
        losses = [nn.functional.mse_loss(reference(data[idx[2 * m: 2 * m + 2]][0]), data[idx[2 * m: 2 * m + 2]][1])
                  for m in range(2)]
        (sum(losses) / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # the config's default gradient_clipping
        optimizer.step()
        expected.append(float(sum(losses) / 2))
    with torch.no_grad():
        idx = order[16:20]
        out["expected_eval"] = float(sum(nn.functional.mse_loss(reference(data[idx[2 * m: 2 * m + 2]][0]),
                                                                data[idx[2 * m: 2 * m + 2]][1]) for m in range(2)) / 2)
    out["expected"] = expected
    # a group whose params are a generator: read once by the check, still the optimizer's (it trains)
    lin = nn.Linear(2, 1)
    plain, *_ = zerotrain.initialize(model=lin, config=dict(config, gradient_accumulation_steps=1),
                                     model_parameters=[{"params": (p for p in lin.parameters())}])
    before = plain.module.weight.detach().clone()
    plain.backward(plain(torch.ones(2, 3)[:, :2]).sum())
    plain.step()
    out["generator_group_trains"] = not torch.equal(before, plain.module.weight.detach())
    return out


def test_a_run_that_would_train_nothing_fails_and_a_built_stage_trains():
    out = run_distributed(frozen_and_built, 1, timeout=180)[0]
    assert out["early_params"] == 0
    assert out["early_error"] is not None and "model_parameters is empty" in out["early_error"] and \
        "init_distributed" in out["early_error"] and "\n" not in out["early_error"]
    assert out["built_params"] == 4 and out["same_init"]
    assert out["losses"] == pytest.approx(out["expected"], rel=1e-5)
    assert out["eval"] == pytest.approx(out["expected_eval"], rel=1e-5)
    assert out["after_own"] == pytest.approx(out["eval_own"], rel=1e-6)
    assert out["generator_group_trains"]


class _Act(nn.Module):
    """A parameterless layer that counts its forwards (a checkpointed run forwards again in backward)."""

    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def forward(self, x):
        self.calls.append(type(self).__name__)
        return torch.tanh(x)


class _Linear(nn.Linear):
    def __init__(self, calls: list, *args):
        super().__init__(*args)
        self.calls = calls

    def forward(self, x):
        self.calls.append(type(self).__name__)
        return super().forward(x)


class ParallelTransformerLayerPipe(_Linear):
    """Named as Megatron's transformer layer: the only layer a GPTModelPipe checkpoints."""


def test_pipeline_module_takes_deepspeeds_checkpointing_and_seed_arguments():
    """`activation_checkpoint_func`, `checkpointable_layers` and `seed_fn` as DeepSpeed's PipelineModule takes them
    (a program passing them failed with a TypeError), DeepSpeed's rule for which runs are checkpointed (runs holding
    parameters; only the listed classes; a Megatron GPTModelPipe only its ParallelTransformerLayerPipes), the same
    gradients as without checkpointing; `dynamic_shape=True` refused in one line."""
    import zerotrain.checkpointing
    from zerotrain.pipe import LayerSpec, PipelineModule

    def run(cls=PipelineModule, **kwargs):
        calls, used = [], []

        def func(function, *args):
            used.append(len(args))
            return zerotrain.checkpointing.checkpoint(function, *args)

        torch.manual_seed(0)
        layers = [LayerSpec(_Linear, calls, 4, 4), LayerSpec(_Act, calls), LayerSpec(ParallelTransformerLayerPipe,
                                                                                   calls, 4, 4), LayerSpec(_Act, calls)]
        module = cls(layers, num_stages=1, activation_checkpoint_interval=1, activation_checkpoint_func=func,
                     **kwargs)
        module.build([0], lambda piece: 0, 1)
        module.train()
        module(torch.ones(2, 4, requires_grad=True)).pow(2).sum().backward()
        recomputed = sorted(calls[4:])  # the second forwards, in backward
        return recomputed, len(used), [p.grad.clone() for p in module.parameters()], module

    recomputed, used, grads, _ = run()
    assert recomputed == ["ParallelTransformerLayerPipe", "_Linear"] and used == 2  # runs holding parameters
    recomputed, used, grads_listed, _ = run(checkpointable_layers=["_Act"])
    assert recomputed == ["_Act", "_Act"] and used == 2
    gpt_model_pipe = type("GPTModelPipe", (PipelineModule,), {})
    recomputed, used, _, _ = run(cls=gpt_model_pipe)
    assert recomputed == ["ParallelTransformerLayerPipe"] and used == 1
    recomputed, used, grads_none, _ = run(checkpointable_layers=[])
    assert recomputed == [] and used == 0
    for a, b, c in zip(grads, grads_listed, grads_none):  # checkpointing changes no number
        assert torch.equal(a, c) and torch.equal(b, c)

    seeds = []
    _, _, _, seeded = run(seed_layers=True, seed_fn=lambda seed: (seeds.append(seed), torch.manual_seed(seed)))
    assert seeds == [1234, 1235, 1236, 1237]
    torch.manual_seed(1234)
    assert torch.equal(seeded.get_submodule("0").weight, nn.Linear(4, 4).weight)

    with pytest.raises(ValueError, match="dynamic_shape=True") as err:
        PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1, dynamic_shape=True)
    assert "\n" not in str(err.value)


def test_dotted_layer_names_and_tied_owner_names():
    """Layers registered under dotted names (pipe.hf's `model.layers.3`) are reachable as parameters and state;
    a tied layer's parameter is saved under the key's first position, `10.weight` not taken for layer 1's."""
    from zerotrain.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    layers = [LayerSpec(nn.Linear, 2, 2) for _ in range(3)] + [LayerSpec(nn.Linear, 2, 2, bias=False)]
    module = PipelineModule(layers, num_stages=1, layer_names=names)
    module.build([0], lambda piece: 0, 1)
    assert sorted(module.state_dict()) == ["lm_head.weight", "model.embed_tokens.bias", "model.embed_tokens.weight",
                                           "model.layers.0.bias", "model.layers.0.weight", "model.layers.1.bias",
                                           "model.layers.1.weight"]
    assert len(list(module.parameters())) == 7

    tied = [TiedLayerSpec("embed", nn.Linear, 2, 2, bias=False)] + [LayerSpec(nn.Linear, 2, 2) for _ in range(9)] + \
        [TiedLayerSpec("embed", nn.Linear, 2, 2, bias=False, forward_fn=lambda m, x: x @ m.weight)]
    module = PipelineModule(tied, num_stages=1)
    module.build([0], lambda piece: 0, 1)
    assert module.tied_owner_name("10.weight") == "0.weight"
    assert module.tied_owner_name("1.weight") == "1.weight"  # not layer 10's prefix
    assert module.tied_owner_name("0.weight") == "0.weight"
