"""DeepSpeed checkpoints in and out, against DeepSpeed 0.19.8 itself (world 2, fp32, torch AdamW, WarmupLR still
warming up, so the scheduler state matters; ZeRO-2 with round_robin_gradients, so DeepSpeed's flat groups are
reordered).

In: DeepSpeed trains SAVE_AT steps at ZeRO-2 and ZeRO-3, saves (with a client state), trains MORE steps and
saves again for its final weights. zerotrain's `engine.load_checkpoint(DS_DIR)` loads each at the other stage
(resharded: DeepSpeed's flat ZeRO-2 partitions into zerotrain's per-parameter ZeRO-3 pieces and back), trains
the same MORE steps and must match DeepSpeed's losses and final fp32 weights (`zero_to_fp32`'s consolidation of
DeepSpeed's last save) within 1e-5, with DeepSpeed's step counter, lr and client state.
`zerotrain ckpt import` writes the same conversion to a directory: it verifies and holds DeepSpeed's Adam
states.

Out: zerotrain trains SAVE_AT steps at ZeRO-2 and ZeRO-3, saves, and goes on MORE steps (the uninterrupted
run). `zerotrain ckpt export --format deepspeed` writes each save for DeepSpeed at the other stage; DeepSpeed's
own `load_checkpoint` resumes it and its MORE steps must give the uninterrupted run's losses and final weights
within 1e-5, with the step, lr and client state.

Out in bf16 and fp16 (dynamic loss scale): zerotrain trains bf16 at ZeRO-3 and fp16 at ZeRO-2, saves, goes on; the
exports (DeepSpeed's bf16_ optimizer files, its loss scaler object) are resumed by DeepSpeed at the other stage and
judged by the lossy-mode rule against the uninterrupted run: losses and final fp32 weights near it, while the run
that does not train after the save (the saved weights, frozen) is outside the tolerance.

Two launches: zerotrain's runs, then one with DeepSpeed's runs, zerotrain resuming DeepSpeed's saves and
DeepSpeed resuming the exports (both engines in the same ranks, one after the other).
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os

import pytest
import torch

from distributed import run_distributed
from models_for_tests import OddMLP, assert_tolerance_discriminates, make_batches, micro_slice

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

DP, MICRO, ACCUMULATION, SAVE_AT, MORE = 2, 2, 2, 3, 3
STAGES = (2, 3)
# lossy exports: dtype -> (the stage zerotrain saves at, the stage DeepSpeed resumes at)
LOSSY = {"bf16": (3, 2), "fp16": (2, 3)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# lossy-mode tolerances (relative loss distance per step; weight distance ||w - w_ref|| / ||w_ref||)
LOSS_TOL, WEIGHT_TOL = 5e-3, 1e-2


def config(stage: int, dtype: str = "fp32") -> dict:
    precision = {"bf16": {"bf16": {"enabled": True}},
                 "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}}}
    return {"train_batch_size": MICRO * ACCUMULATION * DP, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUMULATION, "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage, **({"round_robin_gradients": True} if stage == 2 else {})},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_max_lr": 1e-2}},
            **precision.get(dtype, {})}


# zerotrain's HFSchedule (transformers' curves) -> its warmup: exported as DeepSpeed's equivalent block, which
# DeepSpeed resumes step for step (linear: saved inside the warmup; cosine: after it, where DeepSpeed's is exact)
HF_SCHEDULES, HF_TOTAL = {"linear": 4, "cosine": 2}, 10
HF_AS_DEEPSPEED = {
    "linear": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                                                   "warmup_type": "linear", "total_num_steps": HF_TOTAL}},
    "cosine": {"type": "WarmupCosineLR", "params": {"total_num_steps": HF_TOTAL, "warmup_num_steps": 2,
                                                    "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0,
                                                    "warmup_type": "linear"}}}


def hf_config(name: str, warmup: int) -> dict:
    return dict(config(2), scheduler={"type": "HFSchedule", "params": {"name": name, "num_warmup_steps": warmup,
                                                                       "num_training_steps": HF_TOTAL}})


def train_with_lrs(engine, steps: slice) -> dict:
    """Each optimizer step of `steps` one at a time: the lr it runs at and its global mean loss."""
    lrs, losses = [], []
    for index in range(*steps.indices(SAVE_AT + MORE)):
        lrs.append(engine.get_lr()[0])
        losses += train(engine, slice(index, index + 1))
    return {"lrs": lrs, "losses": losses}


def train(engine, steps: slice, dtype: torch.dtype = torch.float32, update: bool = True) -> list[float]:
    """Optimizer steps `steps` over the shared batches (inputs cast to `dtype`): each step's global mean loss.
    update=False: the losses of the current weights on those batches, nothing trained."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in make_batches(SAVE_AT + MORE, MICRO * ACCUMULATION * DP)[steps]:
        total = torch.zeros(1)
        for index in range(ACCUMULATION):
            x, y = (t.to(dtype) for t in micro_slice(batch, index, rank, world, MICRO))
            if update:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            else:
                with torch.no_grad():
                    loss = engine(x, y)
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (ACCUMULATION * world))
    return losses


def save_midway(engine, directory: str, client_state: dict, dtype: torch.dtype = torch.float32) -> dict:
    """SAVE_AT steps, a save to `directory`, MORE steps: the uninterrupted run's losses and lr."""
    train(engine, slice(None, SAVE_AT), dtype)
    engine.save_checkpoint(directory, client_state=client_state)
    return {"losses": train(engine, slice(SAVE_AT, None), dtype), "lr": engine.get_lr()}


def zerotrain_runs(root: str) -> dict:
    """zerotrain's side of "out": SAVE_AT steps, a save, MORE steps (the uninterrupted run)."""
    import zerotrain

    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=OddMLP(), config=config(stage))
        out[stage] = save_midway(engine, os.path.join(root, f"zt{stage}"), {"epoch": 5, "note": "zt"})
        out[stage]["weights"] = engine.full_state_dict()
        engine.close()
    for dtype, (stage, _) in LOSSY.items():
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=OddMLP(), config=config(stage, dtype))
        train(engine, slice(None, SAVE_AT), DTYPES[dtype])
        engine.save_checkpoint(os.path.join(root, f"zt_{dtype}"), client_state={"epoch": 5, "note": dtype})
        scale_at_save = engine.loss_scale
        # the do-nothing baseline: the saved weights, frozen, on the steps after the save
        frozen = {"losses": train(engine, slice(SAVE_AT, None), DTYPES[dtype], update=False),
                  "weights": engine.full_state_dict()}
        out[dtype] = {"losses": train(engine, slice(SAVE_AT, None), DTYPES[dtype]), "lr": engine.get_lr(),
                      "weights": engine.full_state_dict(), "frozen": frozen,
                      "scales": (scale_at_save, engine.loss_scale)}
        engine.close()
    for name, warmup in HF_SCHEDULES.items():  # HFSchedule: SAVE_AT steps, a save, MORE steps
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=OddMLP(), config=hf_config(name, warmup))
        train(engine, slice(None, SAVE_AT))
        engine.save_checkpoint(os.path.join(root, f"zt_hf_{name}"), client_state={"epoch": 5, "note": name})
        out[("hf", name)] = train_with_lrs(engine, slice(SAVE_AT, None))
        engine.close()
    return out


def deepspeed_runs(root: str) -> dict:
    """DeepSpeed's runs and saves; zerotrain resuming them ("in"); DeepSpeed resuming zerotrain's exports ("out")."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch.distributed as dist

    import zerotrain

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's CPU accelerator refuses fp16 unless the CPU has mkldnn fp16 (AVX512-FP16 / AMX); torch's own fp16
    # CPU kernels run this model, so its capability gate is lifted in these ranks for the fp16 export's resume
    type(get_accelerator()).is_fp16_supported = lambda self: True
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=OddMLP(), config=config(stage))
        out[stage] = save_midway(engine, os.path.join(root, f"ds{stage}"), {"epoch": 7, "note": "ds"})
        engine.save_checkpoint(os.path.join(root, f"ds{stage}_end"))
        dist.barrier()
        engine.destroy()
    for saved, stage in zip(STAGES, reversed(STAGES)):  # in: zerotrain resumes DeepSpeed's saves
        torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
        engine, *_ = zerotrain.initialize(model=OddMLP(), config=config(stage))
        path, client = engine.load_checkpoint(os.path.join(root, f"ds{saved}"))
        steps = engine.global_steps
        losses = train(engine, slice(SAVE_AT, None))
        out[("in", saved, stage)] = {"path": path, "client": client, "steps": steps, "losses": losses,
                                     "lr": engine.get_lr(), "weights": engine.full_state_dict()}
        engine.close()
    for saved, stage in zip(STAGES, reversed(STAGES)):  # out: DeepSpeed resumes zerotrain's exports
        torch.manual_seed(1)
        engine, *_ = deepspeed.initialize(model=OddMLP(), config=config(stage))
        path, client = engine.load_checkpoint(os.path.join(root, f"back{saved}"))
        steps = engine.global_steps
        losses = train(engine, slice(SAVE_AT, None))
        out[("out", saved, stage)] = {"path": path, "client": client, "steps": steps, "losses": losses,
                                      "lr": engine.get_lr()}
        engine.save_checkpoint(os.path.join(root, f"back{saved}_end"))
        dist.barrier()
        engine.destroy()
    for name in HF_SCHEDULES:  # out, HFSchedule: DeepSpeed resumes with the block the export converted it to
        torch.manual_seed(1)
        engine, *_ = deepspeed.initialize(model=OddMLP(), config=dict(config(2), scheduler=HF_AS_DEEPSPEED[name]))
        engine.load_checkpoint(os.path.join(root, f"back_hf_{name}"))
        out[("out", "hf", name)] = dict(train_with_lrs(engine, slice(SAVE_AT, None)), steps=engine.global_steps)
        dist.barrier()
        engine.destroy()
    for dtype, (_, stage) in LOSSY.items():  # out, bf16 / fp16: DeepSpeed resumes the lossy exports
        torch.manual_seed(1)
        engine, *_ = deepspeed.initialize(model=OddMLP(), config=config(stage, dtype))
        path, client = engine.load_checkpoint(os.path.join(root, f"back_{dtype}"))
        steps, scale_at_load = engine.global_steps, float(engine.optimizer.loss_scale)
        losses = train(engine, slice(SAVE_AT, None), DTYPES[dtype])
        out[("out", dtype)] = {"path": path, "client": client, "steps": steps, "losses": losses,
                               "lr": engine.get_lr(), "scales": (scale_at_load, float(engine.optimizer.loss_scale))}
        engine.save_checkpoint(os.path.join(root, f"back_{dtype}_end"))
        dist.barrier()
        engine.destroy()
    return out


def _config_file(root, stage: int, dtype: str = "fp32") -> str:
    path = os.path.join(str(root), f"ds_config{stage}_{dtype}.json")
    with open(path, "w") as handle:
        json.dump(config(stage, dtype), handle)
    return path


def _check_hf_schedule_left_out_or_handed_to_the_trainers_scheduler(parser, run_ckpt, root, capsys, lrs: list) -> None:
    """HFSchedule where DeepSpeed has no block with the same lrs (cosine resumed inside its warmup): left out, named
    on one line. A resumed config without a scheduler block (the HF Trainer under DeepSpeed brings its own,
    transformers' LambdaLR): the state is that scheduler's, which takes it on at the saved step."""
    from transformers import get_scheduler

    inside_warmup = root / "hf_cosine_warmup5.json"
    inside_warmup.write_text(json.dumps(dict(config(2), scheduler={"type": "HFSchedule", "params": {
        "name": "cosine", "num_warmup_steps": 5, "num_training_steps": HF_TOTAL}})))
    bare = root / "no_scheduler.json"
    bare.write_text(json.dumps({k: v for k, v in config(2).items() if k != "scheduler"}))
    states = {}
    for saved, given, out in (("zt_hf_cosine", inside_warmup, "left_out"), ("zt_hf_linear", bare, "lambda")):
        capsys.readouterr()
        args = parser.parse_args(["ckpt", "export", "--format", "deepspeed", "--world-size", str(DP),
                                  "--deepspeed-config", str(given), str(root / saved), str(root / out)])
        assert run_ckpt(args, io.StringIO()) == 0
        states[out] = (capsys.readouterr().err.splitlines(), torch.load(
            root / out / f"global_step{SAVE_AT}" / "mp_rank_00_model_states.pt", weights_only=False))
    said, written = states["left_out"]
    assert said == ["zerotrain ckpt export: warning: scheduler: HFSchedule 'cosine' is left out of the DeepSpeed "
                    "checkpoint: DeepSpeed's WarmupCosineLR follows transformers' cosine one step apart, the same lrs "
                    "only once the warmup is done (saved at step 3 of its 5); the resumed run starts its own "
                    "scheduler"], said
    assert written["lr_scheduler"] is None and "scheduler" not in written["ds_config"]
    said, written = states["lambda"]
    assert said == [] and "scheduler" not in written["ds_config"]
    model = OddMLP()
    schedule = get_scheduler("linear", torch.optim.AdamW(model.parameters(), lr=1e-2), num_warmup_steps=4,
                             num_training_steps=HF_TOTAL)
    schedule.load_state_dict(written["lr_scheduler"])
    # the lr of the step after the save (the saved state's), then the next one's: the uninterrupted run's `lrs`
    assert schedule.last_epoch == SAVE_AT and schedule.get_last_lr()[0] == pytest.approx(lrs[0], rel=1e-12)
    schedule.step()
    assert schedule.get_last_lr()[0] == pytest.approx(lrs[1], rel=1e-12)


def test_deepspeed_checkpoints_resume_exactly_in_zerotrain_and_back(tmp_path, capsys):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from zerotrain.checkpoint import verify_checkpoint
    from zerotrain.checkpoint.reader import TensorReader
    from zerotrain.checkpoint.source import open_source
    from zerotrain.checkpoint.command import add_ckpt_parser, run_ckpt

    parser = argparse.ArgumentParser()
    add_ckpt_parser(parser.add_subparsers(dest="command"), "zerotrain")
    uninterrupted = run_distributed(zerotrain_runs, DP, str(tmp_path), timeout=300)[0]
    for saved, stage in zip(STAGES, reversed(STAGES)):  # out: each save exported for DeepSpeed at the other stage
        args = parser.parse_args(["ckpt", "export", "--format", "deepspeed", "--world-size", str(DP),
                                  "--deepspeed-config", _config_file(tmp_path, stage),
                                  str(tmp_path / f"zt{saved}"), str(tmp_path / f"back{saved}")])
        assert run_ckpt(args, io.StringIO()) == 0
    for dtype, (saved, stage) in LOSSY.items():
        args = parser.parse_args(["ckpt", "export", "--format", "deepspeed", "--world-size", str(DP),
                                  "--deepspeed-config", _config_file(tmp_path, stage, dtype),
                                  str(tmp_path / f"zt_{dtype}"), str(tmp_path / f"back_{dtype}")])
        assert run_ckpt(args, io.StringIO()) == 0
    # HFSchedule (DeepSpeed has no such type): written as DeepSpeed's equivalent, named on one line
    for name in HF_SCHEDULES:
        capsys.readouterr()
        args = parser.parse_args(["ckpt", "export", "--format", "deepspeed", "--world-size", str(DP),
                                  str(tmp_path / f"zt_hf_{name}"), str(tmp_path / f"back_hf_{name}")])
        assert run_ckpt(args, io.StringIO()) == 0
        said = capsys.readouterr().err.splitlines()
        assert len(said) == 1 and said[0].startswith(f"zerotrain ckpt export: warning: scheduler: HFSchedule "
                                                     f"'{name}' is written as DeepSpeed's"), said
        assert json.loads(said[0].split("scheduler block ", 1)[1]) == HF_AS_DEEPSPEED[name]
    _check_hf_schedule_left_out_or_handed_to_the_trainers_scheduler(parser, run_ckpt, tmp_path, capsys,
                                                                    uninterrupted[("hf", "linear")]["lrs"])
    # without the world size DeepSpeed will resume at, the export is refused (usage error), nothing written
    args = parser.parse_args(["ckpt", "export", "--format", "deepspeed", str(tmp_path / "zt2"), str(tmp_path / "x")])
    assert run_ckpt(args, io.StringIO()) == 2 and not (tmp_path / "x").exists()
    theirs = run_distributed(deepspeed_runs, DP, str(tmp_path), timeout=300)[0]
    for saved, stage in zip(STAGES, reversed(STAGES)):  # out: DeepSpeed resumed zerotrain's exports
        final = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"back{saved}_end"))
        run, reference = theirs[("out", saved, stage)], uninterrupted[saved]
        where = f"zerotrain ZeRO-{saved} checkpoint exported to and resumed by DeepSpeed ZeRO-{stage}"
        # DeepSpeed's load_checkpoint returns the model-states file it read
        assert os.path.dirname(run["path"]) == str(tmp_path / f"back{saved}" / f"global_step{SAVE_AT}"), where
        # DeepSpeed hands back every top-level key it does not consume (buffer_names, ds_config, ...) besides ours
        assert {k: run["client"].get(k) for k in ("epoch", "note")} == {"epoch": 5, "note": "zt"}, where
        assert run["steps"] == SAVE_AT, where
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), where
        assert run["lr"] == pytest.approx(reference["lr"], rel=1e-12), where
        assert sorted(reference["weights"]) == sorted(final), where
        for name, tensor in final.items():
            torch.testing.assert_close(tensor.float(), reference["weights"][name], rtol=1e-5, atol=1e-7, msg=where)
        assert len(set(reference["losses"])) == MORE
    for name in HF_SCHEDULES:  # out, HFSchedule: DeepSpeed's block runs transformers' lrs on from the save
        run, reference = theirs[("out", "hf", name)], uninterrupted[("hf", name)]
        assert run["steps"] == SAVE_AT + MORE, name
        assert run["lrs"] == pytest.approx(reference["lrs"], rel=1e-12), name
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        assert len(set(reference["lrs"])) == MORE, reference  # the lr moves on every step: the check can fail
    for dtype, (saved, stage) in LOSSY.items():  # out, lossy: DeepSpeed resumed the bf16 / fp16 exports
        final = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"back_{dtype}_end"))
        run, reference = theirs[("out", dtype)], uninterrupted[dtype]
        where = f"zerotrain {dtype} ZeRO-{saved} checkpoint exported to and resumed by DeepSpeed {dtype} ZeRO-{stage}"
        assert {k: run["client"].get(k) for k in ("epoch", "note")} == {"epoch": 5, "note": dtype}, where
        assert run["steps"] == SAVE_AT, where
        assert run["lr"] == pytest.approx(reference["lr"], rel=1e-12), where
        # the loss scale resumes and grows on the same schedule (fp16: loss_scale_window 2, so it grows after the save)
        assert run["scales"] == reference["scales"], where
        if dtype == "fp16":
            assert reference["scales"][1] > reference["scales"][0], where
        assert sorted(reference["weights"]) == sorted(final), where
        assert_tolerance_discriminates(where, (reference["losses"], reference["weights"]),
                                       (run["losses"], {k: v.float() for k, v in final.items()}),
                                       (reference["frozen"]["losses"], reference["frozen"]["weights"]),
                                       loss_tol=LOSS_TOL, weight_tol=WEIGHT_TOL)
    for saved, stage in zip(STAGES, reversed(STAGES)):  # in: zerotrain resumed DeepSpeed's checkpoints
        final = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"ds{saved}_end"))
        run = theirs[("in", saved, stage)]
        where = f"DeepSpeed ZeRO-{saved} checkpoint resumed at zerotrain ZeRO-{stage}"
        assert run["path"] == str(tmp_path / f"ds{saved}" / f"global_step{SAVE_AT}"), where
        assert run["client"] == {"epoch": 7, "note": "ds"} and run["steps"] == SAVE_AT, where
        assert run["losses"] == pytest.approx(theirs[saved]["losses"], rel=1e-5), where
        assert run["lr"] == pytest.approx(theirs[saved]["lr"], rel=1e-12), where
        assert sorted(run["weights"]) == sorted(final), where
        for name, tensor in final.items():
            torch.testing.assert_close(run["weights"][name], tensor.float(), rtol=1e-5, atol=1e-7, msg=where)
        # the losses move: the comparison can fail
        assert len(set(theirs[saved]["losses"])) == MORE
    # `zerotrain ckpt import`: a verified checkpoint with DeepSpeed's masters and Adam states
    for saved in STAGES:
        args = parser.parse_args(["ckpt", "import", str(tmp_path / f"ds{saved}"), str(tmp_path / f"imported{saved}")])
        assert run_ckpt(args, io.StringIO()) == 0
        out = str(tmp_path / f"imported{saved}" / f"global_step{SAVE_AT}")
        assert verify_checkpoint(out)["ok"]
        source = open_source(out, load_module_only=False)
        with TensorReader(out, source.maps["optimizer"], "optimizer states") as optim:
            assert optim.read("fc1.weight/step").item() == SAVE_AT
            assert optim.read("fc1.weight/exp_avg_sq").shape == (7, 6)
