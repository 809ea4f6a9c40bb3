"""The DeepSpeed API surface a training script touches (issue #20): engine attributes and methods,
`zerotrain.dist`, `initialize`'s keyword checks, steps_per_print, the fp16 floor, and `zerotrain launch`
running a DeepSpeed-style script ported by its import alone."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import warnings

import pytest
import torch

from distributed import run_cli, run_distributed
from models_for_tests import OddMLP, make_batches, micro_slice

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
MICRO = 2


def _config(stage: int, accumulation: int = 1, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 0}
    config.update(extra)
    return config


def _engine(stage: int, accumulation: int = 1, seed: int = 0, **extra):
    import zerotrain

    torch.manual_seed(seed)
    return zerotrain.initialize(model=OddMLP(), config=_config(stage, accumulation, **extra))[0]


def _micro(batch, index: int, rank: int, world: int = 2):
    return micro_slice(batch, index, rank, world, MICRO)


def _full(engine) -> dict:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def _loud_batch():
    """A global batch whose targets are far off: the gradient norm is well above 1."""
    x, y = make_batches(1, MICRO * 2)[0]
    return x, 50 * y


def _check_default_clipping(weights: dict, norm: float) -> None:
    """The engine's step without a gradient_clipping key equals plain torch SGD clipped at 1.0 (DeepSpeed 0.19.8's
    default), not unclipped."""
    steps = {}
    for clip in (None, 1.0):
        torch.manual_seed(0)
        model = OddMLP()
        x, y = _loud_batch()
        model(x, y).backward()
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        steps[clip] = {k: v.detach() for k, v in model.state_dict().items()}
    assert total > 10 and norm == pytest.approx(float(total), rel=1e-5), (norm, total)
    for name, value in steps[1.0].items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(steps[None][name], value) for name, value in steps[1.0].items())


# --- one world-2 launch for the engine API and zerotrain.dist --------------------------------

def engine_api_world2(save_dir: str, config_path: str) -> dict:
    import zerotrain
    from zerotrain import dist
    from zerotrain.precision import LossScaleError
    from zerotrain.trainer import Trainer

    out: dict = {"from_args": initialize_from_args(config_path)}
    rank = int(os.environ["RANK"])
    batches = make_batches(3, MICRO * 2 * 2)

    # ranks, device, precision and stage queries
    engine = _engine(1, steps_per_print=1)
    out["ranks"] = (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size,
                    str(engine.device), dist.get_rank(), dist.get_world_size(), dist.get_local_rank())
    out["queries"] = (engine.zero_optimization_stage(), engine.bf16_enabled(), engine.bfloat16_enabled(),
                      engine.fp16_enabled(), engine.training_dataloader, engine.zero_optimization())
    out["more_queries"] = (engine.get_mom(), engine.mp_world_size, engine.steps_per_print(),
                           engine.gradient_clipping(), engine.zero_optimization_partition_gradients(),
                           engine.zero_optimization_partition_weights(),
                           engine.zero_gather_16bit_weights_on_model_save(), engine.get_wall_clock_timers())
    # train()/eval() and `training` as on DeepSpeed's engine (an nn.Module); attributes the engine lacks come
    # from its module, as DeepSpeed's __getattr__ does (DeepSpeed-Chat: engine.gradient_checkpointing_enable())
    modes = [(engine.eval().training, engine.module.training)]
    modes.append((engine.train().training, engine.module.training))
    try:
        engine.no_such_attribute
    except AttributeError as error:
        missing = str(error)
    out["modes"] = (modes, engine.fc1 is engine.module.fc1, missing)
    out["io"] = [b.tolist() for b in engine.deepspeed_io(list(range(8)), batch_size=2, collate_fn=torch.tensor)]
    timed = _engine(1, wall_clock_breakdown=True)
    x, y = _micro(batches[0], 0, rank)
    timed.backward(timed(x, y))
    timed.step()
    out["timers"] = timed.get_wall_clock_timers()

    # zerotrain.dist over the world, a torch group and the engine's Comm
    summed = torch.tensor([rank + 1.0])
    dist.all_reduce(summed)
    on_dp = torch.tensor([rank + 1.0])
    dist.all_reduce(on_dp, op=dist.ReduceOp.MAX, group=engine.data_parallel_group)
    on_comm = torch.tensor([rank + 1.0])
    dist.all_reduce(on_comm, group=engine.comm)
    sent = torch.tensor([10.0 * (rank + 1)])
    dist.broadcast(sent, src=1)
    gathered = dist.all_gather([torch.zeros(2), torch.zeros(2)], torch.tensor([rank, rank + 0.5]))
    dist.barrier()
    from_first = torch.tensor([5.0 + rank])
    dist.broadcast(from_first)  # DeepSpeed's default source: rank 0
    waited = torch.tensor([rank + 1.0])
    dist.all_reduce(waited, async_op=True).wait()
    out["dist"] = (summed.item(), on_dp.item(), on_comm.item(), sent.item(), [g.tolist() for g in gathered],
                   from_first.item(), waited.item())

    # steps_per_print: rank 0 prints a DeepSpeed-style line per step; nothing under the Trainer
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for index in range(2):
            x, y = _micro(batches[0], index, rank)
            engine.backward(engine(x, y))
            engine.step()
    out["printed"] = printed.getvalue()
    from rich.console import Console
    quiet = io.StringIO()
    loader = [(_micro(batches[1], 0, rank)[0], _micro(batches[1], 0, rank)[1])]

    with contextlib.redirect_stdout(quiet):
        Trainer(_TrainerView(engine), loader, total_steps=engine.global_steps + 1,
                console=Console(file=io.StringIO())).train()
    out["printed_under_trainer"] = quiet.getvalue()
    out["printing_restored"] = engine._print_progress

    # state_dict / load_state_dict (stage 1 and stage 3): DeepSpeed's `module.` keys, masters follow
    out["state_keys"] = sorted(engine.state_dict())
    torch.manual_seed(7)
    other = OddMLP().state_dict()
    loaded = {}
    for stage in (1, 3):
        target = engine if stage == 1 else _engine(3)
        if stage == 1:
            out["module_state_keys"] = sorted(engine.module_state_dict())
        else:
            out["stage3_queries"] = (target.zero_optimization_partition_gradients(),
                                     target.zero_optimization_partition_weights())
            with pytest.raises(RuntimeError, match="consolidated_16bit_state_dict"):
                target.module_state_dict()
        target.load_state_dict({f"module.{k}": v for k, v in other.items()})
        before = _full(target)
        x, y = _micro(batches[2], 0, rank)
        target.backward(target(x, y))
        target.step()  # a step from the loaded masters, not from the old weights
        loaded[stage] = (before, _full(target))
        # HF transformers' Trainer saves a ZeRO-3 model through DeepSpeed's private name: the same whole
        # weights on rank 0, {} elsewhere (collective)
        if stage == 3:
            out["consolidated"] = (target._zero3_consolidated_16bit_state_dict(), _full(target))
    out["loaded"] = loaded
    out["other"] = other

    # was_step_applied and no_sync (stage 1): no_sync's summed micro-batches equal accumulation 2
    accumulate = _engine(1, accumulation=2)
    synced = _engine(1)
    manual = _engine(1, accumulation=2)  # accelerate's loop: the boundary set by hand, step() only there
    applied = []
    comm_before = None
    for batch in batches:
        for index in range(2):
            x, y = _micro(batch, index, rank)
            accumulate.backward(accumulate(x, y))
            accumulate.step()
            applied.append(accumulate.was_step_applied())
        x, y = _micro(batch, 0, rank)
        snapshot = json.dumps(synced.memory_report()["comm"], sort_keys=True)
        with synced.no_sync():
            synced.backward(synced(x, y) / 2)
            with pytest.raises(RuntimeError, match="inside engine.no_sync"):
                synced.step()
        comm_before = comm_before or (snapshot, json.dumps(synced.memory_report()["comm"], sort_keys=True))
        x, y = _micro(batch, 1, rank)
        synced.backward(synced(x, y) / 2)
        synced.step()
        for index in range(2):
            manual.set_gradient_accumulation_boundary(index == 1)
            x, y = _micro(batch, index, rank)
            manual.backward(manual(x, y))
        manual.step()
        applied.append(manual.was_step_applied())
    out["applied"] = applied
    out["manual"] = (_full(manual), manual.global_steps)
    out["no_sync_comm"] = comm_before
    out["no_sync"] = (_full(accumulate), _full(synced))
    for stage in (2, 3):
        with pytest.raises(RuntimeError, match=f"incompatible with ZeRO stage {stage}"):
            with _engine(stage).no_sync():
                pass

    # save_16bit_model: stage 3 consolidates only with the DeepSpeed key; bf16 weights in bf16
    plain3 = _engine(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["saved_without_key"] = plain3.save_16bit_model(save_dir, "none.bin")
    out["save_warning"] = [str(w.message) for w in caught if "save_16bit_model" in str(w.message)]
    for name, stage, extra in (("z3.safetensors", 3, {"zero_optimization": {
            "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}),
            ("bf16.bin", 2, {"bf16": {"enabled": True}})):
        saver = _engine(stage, **extra)
        x, y = _micro(batches[0], 0, rank)
        saver.backward(saver(x.to(saver.dtype), y.to(saver.dtype)))
        saver.step()
        out[name] = (saver.save_16bit_model(save_dir, name), _full(saver), os.path.exists(os.path.join(save_dir, name)))
    out["fp16_name"] = (saver.save_fp16_model(save_dir, "old_name.bin"),)  # DeepSpeed's older name

    # no gradient_clipping key: DeepSpeed 0.19.8's default, clipping at 1.0, on a batch whose gradient norm is far
    # above 1 (SGD, whose update is the gradient itself; stage 2, the partitioned norm)
    default_clip = _engine(2, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    x, y = _micro(_loud_batch(), 0, rank)
    default_clip.backward(default_clip(x, y))
    default_clip.step()
    out["default_clip"] = (_full(default_clip), default_clip.get_global_grad_norm())

    # fp16: an overflow with the scale already at min_loss_scale raises, on every rank
    fp16 = _engine(1, fp16={"enabled": True, "initial_scale_power": 1, "min_loss_scale": 2, "hysteresis": 1})
    x, y = _micro(batches[0], 0, rank)
    fp16.backward(fp16(x.half(), y.half()) * float("inf"))
    with pytest.raises(LossScaleError, match="min_loss_scale"):
        fp16.step()
    out["fp16_raised"] = True
    return out


class _TrainerView:
    """The engine as the Trainer drives it (engine(x, y) -> loss), its API otherwise unchanged."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __call__(self, x, y):
        return None, self._engine(x, y)


def test_engine_api_and_dist_at_world_two(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config(1)))
    results = run_distributed(engine_api_world2, 2, str(tmp_path), str(path), timeout=300)
    _check_initialize_from_args([out["from_args"] for out in results])
    for rank, out in enumerate(results):
        assert out["ranks"] == (rank, rank, 2, 2, "cpu", rank, 2, rank)
        assert out["queries"] == (1, False, False, False, None, True)
        assert out["more_queries"] == ([(0.9, 0.999)], 1, 1, 1.0, False, False, False, {})
        modes, forwarded, missing = out["modes"]
        assert modes == [(False, False), (True, True)] and forwarded and "no_such_attribute" in missing
        assert sorted(x for batch in results[0]["io"] + results[1]["io"] for x in batch) == list(range(8))
        assert len(out["io"]) == 2 and all(len(batch) == 2 for batch in out["io"])
        assert sorted(out["timers"]) == ["bwd", "bwd_allreduce", "bwd_inner", "fwd", "step"], out["timers"]
        assert all(value >= 0 for value in out["timers"].values()) and out["timers"]["fwd"] > 0
        assert out["module_state_keys"] == [key[len("module."):] for key in out["state_keys"]]
        assert out["stage3_queries"] == (True, True)
        assert out["fp16_name"] == (True,)
        assert out["dist"] == (3.0, 2.0, 3.0, 20.0, [[0.0, 0.5], [1.0, 1.5]], 5.0, 3.0)
        assert out["printing_restored"] is True
        if rank == 0:  # the whole weights (rank 1: {})
            _check_default_clipping(*out["default_clip"])
        assert out["printed_under_trainer"] == ""
        assert out["state_keys"] == ["module.fc1.bias", "module.fc1.weight", "module.fc2.bias", "module.fc2.weight"]
        assert out["applied"] == [False, True, True] * 3
        before, after = out["no_sync_comm"]
        assert before == after, "a backward inside no_sync() communicated"
        assert out["saved_without_key"] is False and out["save_warning"]
        assert out["fp16_raised"]
    lines = results[0]["printed"].splitlines()
    assert [line.split(",")[0] for line in lines] == ["[zerotrain] step=1", "[zerotrain] step=2"]
    assert "skipped=0" in lines[0] and "lr=[0.01]" in lines[0] and "mom=[(0.9, 0.999)]" in lines[0]
    assert results[1]["printed"] == ""
    consolidated, full = results[0]["consolidated"]
    assert set(consolidated) == set(full) and results[1]["consolidated"][0] == {}
    for name, value in full.items():
        torch.testing.assert_close(consolidated[name], value, rtol=0, atol=0)
    assert torch.equal(torch.load(tmp_path / "old_name.bin")["fc1.weight"], torch.load(tmp_path / "bf16.bin")["fc1.weight"])

    main = results[0]
    for stage, (before, after) in main["loaded"].items():
        for name, value in main["other"].items():
            torch.testing.assert_close(before[name], value, rtol=0, atol=0, msg=f"stage {stage} {name}")
            assert not torch.equal(after[name], value), f"stage {stage}: {name} did not train after the load"
            assert (after[name] - value).abs().max() < 0.05, f"stage {stage}: {name} stepped from other weights"
    accumulated, synced = main["no_sync"]
    manual, manual_steps = main["manual"]
    assert manual_steps == 3
    for name in accumulated:
        torch.testing.assert_close(synced[name], accumulated[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(manual[name], accumulated[name], rtol=1e-5, atol=1e-6)

    from safetensors.torch import load_file
    saved, full, exists = main["z3.safetensors"]
    assert saved and exists
    weights = load_file(str(tmp_path / "z3.safetensors"))
    assert set(weights) == set(full)
    for name, value in full.items():
        assert weights[name].dtype == torch.float32
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0)
    saved, full, exists = main["bf16.bin"]
    weights = torch.load(tmp_path / "bf16.bin")
    assert saved and set(weights) == set(full)
    for name, value in full.items():
        assert weights[name].dtype == torch.bfloat16
        torch.testing.assert_close(weights[name], value.to(torch.bfloat16), rtol=0, atol=0)
    model = OddMLP().to(torch.bfloat16)
    model.load_state_dict(weights)  # what a user's own model loads
    assert not (tmp_path / "none.bin").exists()
    assert results[1]["z3.safetensors"][0] is True  # every rank returns True


# --- initialize's keywords, add_config_arguments (no process group needed) -----------------------

def test_initialize_rejects_unknown_keywords_with_a_suggestion():
    import zerotrain

    with pytest.raises(TypeError, match=r"'traning_data'; did you mean 'training_data'\?"):
        zerotrain.initialize(model=OddMLP(), config=_config(0), traning_data=[])
    with pytest.raises(TypeError, match="'frobnicate'"):
        zerotrain.initialize(model=OddMLP(), config=_config(0), frobnicate=1)
    with pytest.raises(TypeError, match="needs model= a torch.nn.Module, got Namespace"):
        zerotrain.initialize(argparse.Namespace(), OddMLP())


def test_deepspeed_comm_names_point_to_zerotrain_dist():
    import zerotrain as deepspeed  # a ported script's `deepspeed.comm.get_rank()` reaches the internal package

    with pytest.raises(AttributeError, match=r"zerotrain.dist.get_rank"):
        deepspeed.comm.get_rank()
    with pytest.raises(AttributeError, match="no attribute 'frobnicate'"):
        deepspeed.comm.frobnicate
    from zerotrain.comm import compressed  # noqa: F401 - submodules still import


def test_add_config_arguments_feeds_initialize(tmp_path):
    import zerotrain

    parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--zerotrain_config", "zt.json"])
    assert (args.deepspeed, args.deepspeed_config, args.zerotrain_config) == (True, "ds.json", "zt.json")
    with pytest.raises(ValueError, match="different config files"):
        zerotrain.initialize(model=OddMLP(), args=args)
    with pytest.raises(ValueError, match="both config= and a config path in args"):
        zerotrain.initialize(model=OddMLP(), config=_config(0), args=parser.parse_args(["--deepspeed_config", "x"]))


def test_add_config_arguments_parses_as_deepspeeds_and_adds_zerotrain_config(capsys):
    """DeepSpeed's own `add_config_arguments` is the reference: every command line a DeepSpeed script takes parses
    to the same values (defaults included), the deprecated --deepscale* are hidden from the help, and the group
    is zerotrain's with --zerotrain_config beside them."""
    import deepspeed

    import zerotrain

    ours = zerotrain.add_config_arguments(argparse.ArgumentParser(prog="train.py"))
    theirs = deepspeed.add_config_arguments(argparse.ArgumentParser(prog="train.py"))
    for argv in ([], ["--deepspeed"], ["--deepspeed_config", "ds.json"],
                 ["--deepscale", "--deepscale_config", "o.json"],
                 ["--deepspeed", "--deepspeed_config", "ds.json", "--deepscale"]):
        got = vars(ours.parse_args(argv))
        assert got.pop("zerotrain_config") is None, argv
        assert got == vars(theirs.parse_args(argv)), argv
    assert ours.parse_args(["--zerotrain_config", "zt.json"]).zerotrain_config == "zt.json"
    help_text = ours.format_help()
    assert "--deepscale" not in help_text and "--deepspeed_config" in help_text and "--zerotrain_config" in help_text
    assert "\nzerotrain:\n  zerotrain (DeepSpeed-compatible) configuration\n" in help_text, help_text


def initialize_from_args(path: str) -> tuple:
    import zerotrain

    parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed_config", path])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, loader, _ = zerotrain.initialize(args=args, model=OddMLP(), training_data=list(range(8)),
                                                    collate_fn=lambda b: torch.tensor(b), distributed_port=1234,
                                                    dist_init_required=True, mpu=None)
    messages = [str(w.message) for w in caught]
    return (args.local_rank, engine.train_batch_size(), loader is engine.training_dataloader,
            [b.tolist() for b in loader], messages)


def _check_initialize_from_args(results: list) -> None:
    """initialize(args=...) at world 2: the config path from args, args.local_rank set, the training data
    split over the ranks, a warning naming distributed_port (and none for dist_init_required=True), once per
    job: rank 0 warns, rank 1 does not."""
    seen = []
    for rank, (local_rank, batch, same, batches, messages) in enumerate(results):
        assert (local_rank, batch, same) == (rank, 4, True)
        assert [m for m in messages if "initialize(" in m] == [
            "zerotrain.initialize(distributed_port=...) has no effect: the rendezvous port comes from the "
            "launcher (MASTER_PORT)"][:1 if rank == 0 else 0], (rank, messages)
        seen += [x for b in batches for x in b]
    assert sorted(seen) == list(range(8))


# --- zerotrain launch: a DeepSpeed script ported by its import ------------------------------------

DEEPSPEED_SCRIPT = '''
import argparse, json, os
import torch
import zerotrain as deepspeed


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 7)
        self.fc2 = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
parser.add_argument("--nproc", type=int, default=0)  # abbreviates torchrun's own option: must reach us
parser.add_argument("--out", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
passed_local_rank = args.local_rank

deepspeed.init_distributed()
torch.manual_seed(0)
net = Net()
generator = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator))
engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                    training_data=data)
losses = []
for x, y in loader:
    x, y = x.to(engine.device), y.to(engine.device)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    assert engine.was_step_applied()
engine.save_16bit_model(args.out)
with open(os.path.join(args.out, f"rank{engine.global_rank}.json"), "w") as f:
    json.dump({"passed_local_rank": passed_local_rank, "env_local_rank": int(os.environ["LOCAL_RANK"]),
               "engine_local_rank": engine.local_rank, "nproc": args.nproc, "losses": losses,
               "steps": engine.global_steps, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "world": engine.world_size}, f)
'''


def _reference_weights() -> dict:
    """Plain single-process training on the union of both ranks' DistributedSampler batches."""
    from torch.utils.data.distributed import DistributedSampler

    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator)
    torch.manual_seed(0)
    model = OddMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    orders = [list(DistributedSampler(range(16), num_replicas=2, rank=r, shuffle=True, seed=0)) for r in (0, 1)]
    for step in range(4):
        index = orders[0][step * MICRO:(step + 1) * MICRO] + orders[1][step * MICRO:(step + 1) * MICRO]
        loss = torch.nn.functional.mse_loss(model(x[index]), y[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


DEEPSPEED_SCRIPT_CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 2, "gradient_clipping": 0,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                           "zero_optimization": {"stage": 2}}


def _assert_trained_as_one_process(out) -> None:
    """The 2-rank run's saved weights equal plain single-process AdamW on the same batches (and moved)."""
    weights = torch.load(out / "pytorch_model.bin")
    reference = _reference_weights()
    assert set(weights) == set(reference)
    initial = (torch.manual_seed(0), OddMLP().state_dict())[1]
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)
        assert not torch.equal(weights[name], initial[name])


def test_launch_runs_a_deepspeed_script_ported_by_its_import(tmp_path):
    """`zerotrain launch --hostfile hosts` (DeepSpeed's `deepspeed --hostfile hosts train.py`) with one host that
    is this machine, by its hostname, `slots=2`: two ranks here, as `--nproc 2` (slot ids as CUDA_VISIBLE_DEVICES,
    as DeepSpeed's launch sets them), training as one process does."""
    import socket

    script = tmp_path / "train.py"
    script.write_text(DEEPSPEED_SCRIPT + "import threads_at_exit  # the test's probe, beside the script\n")
    (tmp_path / "threads_at_exit.py").write_text(_THREADS_AT_EXIT)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**DEEPSPEED_SCRIPT_CONFIG,
                                  # keys zerotrain ignores: one warning each for the job, not one per rank
                                  "cuda_visible_devices": 0, "flops_profiler": {"enabled": True}}, indent=1))
    hosts = tmp_path / "hostfile"
    hosts.write_text(f"# this machine only\n\n{socket.gethostname()} slots=2\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, THREADS_AT_EXIT=str(out))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = run_cli(["launch", "--hostfile", str(hosts), str(script), "--deepspeed_config", str(config), "--nproc", "3",
                    "--out", str(out)], cwd=tmp_path, env=env, timeout=300)  # the launcher forked, ranks fresh
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, info in enumerate(ranks):
        assert (info["passed_local_rank"], info["env_local_rank"], info["engine_local_rank"]) == (rank, rank, rank)
        assert info["nproc"] == 3 and info["steps"] == 4
        assert info["world"] == 2 and info["visible"] == "0,1"
    assert [line.split(",")[0] for line in proc.stdout.splitlines() if line.startswith("[zerotrain] step=")] == [
        "[zerotrain] step=2", "[zerotrain] step=4"]
    for said in ("unknown top-level key 'cuda_visible_devices' is ignored",
                 "flops_profiler is a DeepSpeed key that zerotrain does not implement"):
        warned = [line for line in proc.stderr.splitlines() if said in line]
        assert len(warned) == 1 and warned[0].startswith(f"{config}:"), proc.stderr  # at the file and its line
    _assert_trained_as_one_process(out)
    # No gloo worker thread is left when the interpreter starts to finalize: a worker that drops a finished
    # collective's tensors then cannot take the GIL and aborts the rank (SIGABRT after a complete run, ~1 in 30
    # under load). The script's namespace, its engine and the process groups are gone before `atexit` runs.
    for rank in (0, 1):
        left = json.loads((out / f"threads_at_exit{rank}.json").read_text())
        assert not [name for name in left if "gloo" in name], f"rank {rank}: threads at exit {left}"


# Imported at the end of the script: at exit, before the interpreter finalizes, records the threads still there.
_THREADS_AT_EXIT = """
import atexit, json, os


def _record():
    names = sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))
    with open(os.path.join(os.environ["THREADS_AT_EXIT"], f"threads_at_exit{os.environ['RANK']}.json"), "w") as f:
        json.dump(names, f)


atexit.register(_record)
"""

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "CUDA_VISIBLE_DEVICES")


def test_mpi_and_slurm_started_ranks_train_as_one_process(tmp_path):
    """Two jobs of 2 processes each, started as `mpirun -n 2` and `srun -n 2` start them: each process sees only
    its launcher's variables (Open MPI's OMPI_COMM_WORLD_*; Slurm's SLURM_PROCID/NTASKS/LOCALID and the compressed
    node list whose first host is the master), and MASTER_PORT (a free one, not the default 29500 other tests
    may hold). zerotrain maps them onto torchrun's names (`zerotrain.cluster`) and each job trains as one process
    does. The four processes run at once."""
    from concurrent.futures import ThreadPoolExecutor

    from distributed import free_port, run_python

    config = tmp_path / "ds.json"
    config.write_text(json.dumps(DEEPSPEED_SCRIPT_CONFIG))
    base = {k: v for k, v in os.environ.items()
            if k not in _LAUNCHER_VARS and not k.startswith(("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC"))}
    base["PYTHONPATH"] = REPO_ROOT
    mpi_port, slurm_port = free_port(), free_port()
    runs = []
    for rank in (0, 1):
        runs.append(("mpi", {**base, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                             "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                             "MASTER_PORT": str(mpi_port)}))
        runs.append(("slurm", {**base, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                               "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2",
                               "SLURM_JOB_NODELIST": "localhost,node[02-03]", "MASTER_PORT": str(slurm_port)}))
    for job in ("mpi", "slurm"):
        (tmp_path / job).mkdir()

    def start(run):
        job, env = run
        return run_python(["-c", DEEPSPEED_SCRIPT, "--deepspeed_config", str(config), "--out", str(tmp_path / job)],
                          cwd=tmp_path, env=env, timeout=300)

    with ThreadPoolExecutor(len(runs)) as pool:
        procs = list(pool.map(start, runs))
    for (job, _), proc in zip(runs, procs):
        assert proc.returncode == 0, (job, proc.stdout + proc.stderr)
    for job in ("mpi", "slurm"):
        for rank in (0, 1):
            info = json.loads((tmp_path / job / f"rank{rank}.json").read_text())
            assert (info["world"], info["env_local_rank"], info["engine_local_rank"], info["steps"]) == (
                2, rank, rank, 4), (job, info)
        _assert_trained_as_one_process(tmp_path / job)


STOPPABLE_SCRIPT = '''
import argparse, json, os, time
import torch
import zerotrain as deepspeed

parser = argparse.ArgumentParser()  # no --local_rank: torchrun's LOCAL_RANK is enough
parser.add_argument("--out", required=True)
parser.add_argument("--nproc", type=int, required=True)  # abbreviates torchrun's own option: must reach us
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
torch.manual_seed(0)
engine, *_ = deepspeed.initialize(args=args, model=torch.nn.Linear(4, 2))
engine.install_signal_handlers()
while True:
    engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
    engine.step()
    if engine.global_steps == 2 and engine.global_rank == 0:
        open(os.path.join(args.out, "running"), "w").close()
    if engine.should_stop():
        engine.save_checkpoint(os.path.join(args.out, "ckpt"))
        with open(os.path.join(args.out, f"stopped{engine.global_rank}.json"), "w") as f:
            json.dump({"step": engine.global_steps, "nproc": args.nproc}, f)
        break
    time.sleep(0.02)
'''


def test_launch_stops_a_script_on_sigterm_as_train_does(tmp_path):
    """SIGTERM to `zerotrain launch` reaches every rank of a script that opted in (install_signal_handlers,
    should_stop): all stop after the same step, save, and the launch exits 143 (128 + SIGTERM), as
    `zerotrain train` does. The script does not declare --local_rank (the launcher's other path)."""
    import signal
    import time

    script = tmp_path / "train.py"
    script.write_text(STOPPABLE_SCRIPT)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
                                  "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}))
    from distributed import free_port, served_python, start_python

    port = free_port()  # a static rendezvous (--master-addr/--master-port) rather than --standalone

    # the launcher forked from the test forkserver (a Popen stand-in), its agent and ranks too (served_python as
    # torch's PYTHON_EXEC)
    proc = start_python(["-m", "zerotrain.cli", "launch", "--nproc", "2", "--master-addr", "127.0.0.1",
                         "--master-port", str(port), str(script), "--deepspeed_config", str(config), "--out",
                         str(tmp_path), "--nproc", "3"], cwd=tmp_path,
                        env=dict(os.environ, PYTHONPATH=REPO_ROOT, PYTHON_EXEC=served_python()))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "running").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()  # its agent and ranks die with it (PR_SET_PDEATHSIG)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "stopped by SIGTERM" in err
    stopped = [json.loads((tmp_path / f"stopped{rank}.json").read_text()) for rank in (0, 1)]
    assert stopped[0] == stopped[1] and stopped[0]["step"] >= 2 and stopped[0]["nproc"] == 3, stopped
    assert (tmp_path / "ckpt" / f"global_step{stopped[0]['step']}").is_dir()


def _hf_trainer_checkpoint_calls(save_dir: str) -> dict:
    """The checkpoint calls HF transformers' Trainer makes on a DeepSpeed engine, with its keywords."""
    import inspect

    import zerotrain

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    out = {"accepts_exclude": "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(save_dir, exclude_frozen_parameters=True)  # Trainer._save_checkpoint, PEFT model
        path, _ = engine.load_checkpoint(save_dir, load_module_strict=False, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)  # deepspeed_load_checkpoint
    out["warnings"] = [str(w.message) for w in caught]
    out["loaded"] = path
    try:
        engine.load_checkpoint(save_dir, custom_load_fn=lambda *a: None)
    except NotImplementedError as error:
        out["custom_load_fn"] = str(error)
    engine.close()
    return out


def test_hf_trainer_checkpoint_keywords_are_accepted(tmp_path):
    out = run_distributed(_hf_trainer_checkpoint_calls, 1, str(tmp_path))[0]
    assert out["accepts_exclude"] and out["loaded"] == str(tmp_path / "global_step0")
    assert any("exclude_frozen_parameters=True" in w for w in out["warnings"])
    assert any("load_module_strict=False" in w for w in out["warnings"])
    assert "custom_load_fn" in out["custom_load_fn"]
