"""DeepSpeed checkpoint export and import in this process (issue #48): the fast covering test of
`checkpoint/deepspeed_export.py` and `checkpoint/deepspeed_dir.py`, whose end-to-end test (test_ckpt_deepspeed.py:
DeepSpeed's own engine resuming at world 2) takes minutes.

One zerotrain run at a world of one (this process; its process group torn down before the tests): a model with
two parameter groups, a tied weight, a buffer and a frozen parameter, AdamW + WarmupLR still warming up, 3 steps,
saved with a client state. Each export (stages 2 and 3, worlds 2 and 3: every partition padded, round-robin groups,
ZeRO-3's sub-groups) is read by DeepSpeed's own `zero_to_fp32` (the masters, against the engine's weights) and
its files by DeepSpeed's `torch.load`; the import (`convert_deepspeed`) of each export must give back the saved
checkpoint's every tensor bit for bit, its counters, scheduler and client state.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from models_for_tests import make_batches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

STEPS, MICRO, ACCUMULATION = 3, 2, 2


class RichMLP(torch.nn.Module):
    """Odd sizes (no partition divides evenly), a tied weight, a buffer and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 7)
        self.enc = torch.nn.Linear(7, 5)
        self.dec = torch.nn.Linear(5, 5, bias=False)
        self.dec.weight = torch.nn.Parameter(torch.randn(5, 5) * 0.3)
        self.back = torch.nn.Linear(5, 5, bias=False)
        self.back.weight = self.dec.weight  # tied
        self.fc2 = torch.nn.Linear(5, 3)
        self.offset = torch.nn.Parameter(torch.randn(3) * 0.1, requires_grad=False)  # frozen
        self.register_buffer("scale", torch.tensor([0.5, 1.5, 1.0]))

    def forward(self, x, y):
        h = torch.tanh(self.dec(torch.tanh(self.enc(torch.tanh(self.fc1(x))))))
        out = self.fc2(torch.tanh(self.back(h))) * self.scale + self.offset
        return torch.nn.functional.mse_loss(out, y)


def _config(stage: int) -> dict:
    return {"train_batch_size": MICRO * ACCUMULATION, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUMULATION, "steps_per_print": 10**6, "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_max_lr": 1e-2}}}


FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "min_loss_scale": 0.5, "hysteresis": 3,
        "consecutive_hysteresis": True}


def _train_and_save(directory: str, config: dict, dtype: torch.dtype) -> dict:
    import zerotrain

    torch.manual_seed(0)
    model = RichMLP()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    engine, *_ = zerotrain.initialize(model=model, config=config, model_parameters=[
        {"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}])
    for x, y in make_batches(STEPS, MICRO * ACCUMULATION):
        for a in range(ACCUMULATION):
            batch = slice(a * MICRO, (a + 1) * MICRO)
            engine.backward(engine(x[batch].to(dtype), y[batch].to(dtype)))
            engine.step()
    engine.save_checkpoint(directory, client_state={"epoch": 5, "note": "zt"})
    out = {"weights": {k: v.clone() for k, v in engine.full_state_dict().items()}, "lr": engine.get_lr(),
           "scale": engine.loss_scale}
    engine.close()
    with open(os.path.join(directory, "latest")) as handle:
        tag = handle.read().strip()
    return dict(out, path=os.path.join(directory, tag), tag=tag)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The zerotrain saves (fp32, and fp16 with a dynamic loss scale): tag directory and the engine's weights at
    it; the world of one torn down again."""
    from zerotrain import dist

    root = tmp_path_factory.mktemp("ds_units")
    started = not dist.is_initialized()
    try:
        fp32 = _train_and_save(str(root / "zt"), _config(2), torch.float32)
        fp16 = _train_and_save(str(root / "zt16"), dict(_config(2), fp16=FP16), torch.float16)
    finally:
        if started:
            dist.destroy_process_group()
    return dict(fp32, fp16=fp16)


def _tensors(path: str) -> dict:
    """Every tensor of a zerotrain checkpoint, by kind and name."""
    from zerotrain.checkpoint.reader import TensorReader
    from zerotrain.checkpoint.source import open_source

    source = open_source(path, load_module_only=False)
    out = {}
    for kind, weight_map in source.maps.items():
        with TensorReader(path, weight_map, kind) as reader:
            out[kind] = {name: reader.read(name) for name in weight_map}
    return out


def _trainer_state(path: str) -> dict:
    with open(os.path.join(path, "trainer_state.json")) as handle:
        return json.load(handle)


EXPORTS = [(2, 2, {}), (2, 3, {"round_robin_gradients": True}), (3, 2, {}), (3, 3, {"sub_group_size": 20})]


@pytest.mark.parametrize("stage,world,zero", EXPORTS, ids=[f"s{s}w{w}{'-' + next(iter(z)) if z else ''}"
                                                          for s, w, z in EXPORTS])
def test_export_is_read_by_deepspeed_and_imports_back_bit_for_bit(saved, tmp_path, stage, world, zero):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from zerotrain.checkpoint import verify_checkpoint
    from zerotrain.checkpoint.deepspeed_dir import convert_deepspeed, read_deepspeed
    from zerotrain.checkpoint.deepspeed_export import export_deepspeed

    config = dict(_config(stage), zero_optimization=dict({"stage": stage}, **zero))
    out = export_deepspeed(saved["path"], str(tmp_path / "ds"), world_size=world, config=config)
    where = f"stage {stage}, world {world}, {zero}"
    assert out == str(tmp_path / "ds" / saved["tag"]) and (tmp_path / "ds" / "latest").read_text() == saved["tag"]

    # DeepSpeed's own reader: every weight, the tied one under both names, the buffer and the frozen parameter
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
    expected = dict(saved["weights"], scale=RichMLP().scale)  # the engine's full_state_dict holds no buffers
    assert sorted(theirs) == sorted(expected), where
    for name, tensor in expected.items():
        assert torch.equal(theirs[name].float(), tensor.float()), (where, name)
    prefix = "zero_pp_rank_0_mp_rank_00" if stage == 3 else "mp_rank_00"
    model_states = torch.load(os.path.join(out, f"{prefix}_model_states.pt"), weights_only=False)
    assert (model_states["global_steps"], model_states["global_samples"], model_states["skipped_steps"]) == (
        STEPS, STEPS * MICRO * ACCUMULATION, 0), where
    assert (model_states["epoch"], model_states["note"]) == (5, "zt"), where  # the client state, top level
    assert model_states["dp_world_size"] == world and model_states["ds_config"]["zero_optimization"]["stage"] == stage
    # DeepSpeed's WarmupLR counts `last_batch_iteration` from 0 at the first step
    assert model_states["lr_scheduler"] == {"last_batch_iteration": STEPS - 1}, where
    assert model_states["shared_params"] == {"back.weight": "dec.weight"}, where
    assert model_states["buffer_names"] == ["scale"], where
    optim_files = sorted(f for f in os.listdir(out) if f.endswith("_optim_states.pt"))
    assert optim_files == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)], where
    optim = torch.load(os.path.join(out, optim_files[-1]), weights_only=False)["optimizer_state_dict"]
    assert optim["zero_stage"] == stage and optim.get("clip_grad") == (0.5 if stage < 3 else None), where
    groups = optim["optimizer_state_dict"]["param_groups"] if stage == 3 else optim["base_optimizer_state"][
        "param_groups"]
    assert [g["weight_decay"] for g in groups][:1] == [0.01] and groups[-1]["weight_decay"] == 0.0, where
    assert all(g["lr"] == pytest.approx(saved["lr"][0], rel=1e-12) for g in groups), where

    # read back as whole tensors: the masters and Adam states of the save, exactly
    ours = _tensors(saved["path"])
    read = read_deepspeed(out)
    assert (read.stage, read.world_size) == (stage, world), where
    assert read.groups == [["fc1.weight", "enc.weight", "dec.weight", "fc2.weight"],
                           ["fc1.bias", "enc.bias", "fc2.bias"]], where
    for name, master in read.masters.items():
        assert torch.equal(master, ours["model"][name]), (where, name)
        for key, value in read.states[name].items():
            assert torch.equal(value.reshape(-1), ours["optimizer"][f"{name}/{key}"].reshape(-1)), (where, name, key)
        assert read.scalars[name] == {"step": float(STEPS)}, (where, name)
    assert sorted(read.masters) == sorted(n for n in saved["weights"] if n not in ("back.weight", "scale", "offset"))
    assert {n: torch.equal(t, expected[n]) for n, t in read.extras.items()} == {"scale": True, "offset": True}, where

    # imported back: the saved checkpoint's tensors bit for bit, its counters, schedule and client state
    imported = convert_deepspeed(str(tmp_path / "ds"), str(tmp_path / "back"))
    assert imported == str(tmp_path / "back" / saved["tag"]) and verify_checkpoint(imported)["ok"], where
    back = _tensors(imported)
    ours["model"]["back.weight"] = ours["model"]["dec.weight"]  # the import writes a tied weight under both names
    for kind in ("model", "optimizer"):
        assert sorted(back[kind]) == sorted(ours[kind]), (where, kind)
        for name, tensor in ours[kind].items():
            assert back[kind][name].dtype == tensor.dtype and torch.equal(back[kind][name].view_as(tensor), tensor), (
                where, kind, name)
    before, after = _trainer_state(saved["path"]), _trainer_state(imported)
    for key in ("global_steps", "global_samples", "skipped_steps", "client_state", "buffer_names", "shared_params",
                "param_groups", "loss_scaler"):
        assert after[key] == before[key], (where, key, after[key], before[key])
    # DeepSpeed's WarmupLR keeps the step index only: torch's counters rebuilt from it
    assert after["lr_scheduler"] == {"last_batch_iteration": STEPS - 1, "last_epoch": STEPS, "_step_count": STEPS + 1}
    assert (before["lr_scheduler"]["last_epoch"], before["lr_scheduler"]["_step_count"]) == (STEPS, STEPS + 1)
    assert after["topology"]["world_size"] == world and after["topology"]["stage"] == stage, where


def test_fp16_export_carries_the_dynamic_loss_scale_and_imports_back_bit_for_bit(saved, tmp_path):
    """fp16 with a dynamic loss scale, every `fp16` key not at its default: DeepSpeed unpickles its own
    DynamicLossScaler from the export with the save's scale, counters and the config's rules; the import gives
    back the fp16 weights, the fp32 masters, the Adam states and the loss scaler's state."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from zerotrain.checkpoint.deepspeed_dir import convert_deepspeed
    from zerotrain.checkpoint.deepspeed_export import export_deepspeed

    fp16 = saved["fp16"]
    before = _trainer_state(fp16["path"])
    assert before["loss_scaler"]["scale"] == fp16["scale"] > 2 ** 8  # grown (window 2): the scale is the save's
    out = export_deepspeed(fp16["path"], str(tmp_path / "ds"), world_size=2, stage=3)  # the checkpoint's config
    optim = torch.load(os.path.join(out, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                       weights_only=False)["optimizer_state_dict"]
    scaler = optim["loss_scaler"]
    assert isinstance(scaler, DynamicLossScaler) and optim["dynamic_loss_scale"] is True
    state = before["loss_scaler"]
    assert (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis) == (
        state["scale"], state["iteration"], state["last_overflow_iteration"], state["hysteresis_left"])
    assert (scaler.scale_window, scaler.min_scale, scaler.delayed_shift, scaler.consecutive_hysteresis,
            scaler.scale_factor, scaler.dynamic, scaler.dtype) == (2, 0.5, 3, True, 2.0, True, torch.float16)
    ours = _tensors(fp16["path"])
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
    for name, master in ours["master_weights"].items():
        assert torch.equal(theirs[name], master), name

    imported = convert_deepspeed(str(tmp_path / "ds"), str(tmp_path / "back"))
    back = _tensors(imported)
    ours["model"]["back.weight"] = ours["model"]["dec.weight"]
    for kind in ("model", "master_weights", "optimizer"):
        assert sorted(back[kind]) == sorted(ours[kind]), kind
        for name, tensor in ours[kind].items():
            assert back[kind][name].dtype == tensor.dtype and torch.equal(back[kind][name].view_as(tensor), tensor), (
                kind, name)
    after = _trainer_state(imported)
    assert after["loss_scaler"] == state and after["topology"]["dtype"] == "float16"


@pytest.mark.parametrize("name,warmup,block", [
    ("linear", 4, {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                      "warmup_num_steps": 4, "warmup_type": "linear",
                                                      "total_num_steps": 10}}),
    ("cosine", 5, None)])  # saved inside the cosine's warmup: DeepSpeed's is one step apart there
def test_an_hf_schedule_is_written_as_deepspeeds_or_left_out_warning_at_the_caller(saved, tmp_path, name, warmup,
                                                                                  block):
    from zerotrain.checkpoint.deepspeed_export import ExportWarning, export_deepspeed

    config = dict(_config(2), scheduler={"type": "HFSchedule", "params": {
        "name": name, "num_warmup_steps": warmup, "num_training_steps": 10}})
    with pytest.warns(ExportWarning) as record:
        out = export_deepspeed(saved["path"], str(tmp_path / "ds"), world_size=2, config=config)
    assert len(record) == 1 and record[0].filename == __file__, [(w.filename, str(w.message)) for w in record]
    model_states = torch.load(os.path.join(out, "mp_rank_00_model_states.pt"), weights_only=False)
    assert model_states["ds_config"].get("scheduler") == block
    assert model_states["lr_scheduler"] == ({"last_batch_iteration": STEPS} if block else None)


def test_a_torch_scheduler_state_goes_out_and_back_as_it_was(saved, tmp_path):
    """A resumed config without a scheduler block (the run brings its own torch scheduler): the export writes the
    save's torch LRScheduler state as it is, and the import keeps it as it is (not DeepSpeed's step index)."""
    from zerotrain.checkpoint.deepspeed_dir import convert_deepspeed
    from zerotrain.checkpoint.deepspeed_export import export_deepspeed

    config = {k: v for k, v in _config(2).items() if k != "scheduler"}
    out = export_deepspeed(saved["path"], str(tmp_path / "ds"), world_size=2, config=config)
    before = _trainer_state(saved["path"])["lr_scheduler"]
    written = torch.load(os.path.join(out, "mp_rank_00_model_states.pt"), weights_only=False)["lr_scheduler"]
    assert written == before and written["last_epoch"] == STEPS and "warmup_num_steps" in written
    imported = convert_deepspeed(str(tmp_path / "ds"), str(tmp_path / "back"))
    assert _trainer_state(imported)["lr_scheduler"] == before


def test_an_older_writers_checkpoint_imports_with_defaults_and_numbers_only(saved, tmp_path):
    """Model states without `global_samples` / `skipped_steps` (DeepSpeed before 0.5 wrote neither) import as 0;
    per-parameter optimizer entries that are not numbers or tensors (a flag, a name) are not optimizer states."""
    from zerotrain.checkpoint.deepspeed_dir import convert_deepspeed, read_deepspeed
    from zerotrain.checkpoint.deepspeed_export import export_deepspeed

    out = export_deepspeed(saved["path"], str(tmp_path / "ds"), world_size=2)
    model_file = os.path.join(out, "mp_rank_00_model_states.pt")
    states = torch.load(model_file, weights_only=False)
    del states["global_samples"], states["skipped_steps"]
    torch.save(states, model_file)
    for rank in range(2):
        optim_file = os.path.join(out, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        optim = torch.load(optim_file, weights_only=False)
        for entry in optim["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            entry.update(amsgrad=False, kind="adamw", betas=None)
        torch.save(optim, optim_file)
    read = read_deepspeed(out)
    assert {name: scalars for name, scalars in read.scalars.items()} == {n: {"step": float(STEPS)} for n in read.masters}
    assert all(sorted(states) == ["exp_avg", "exp_avg_sq"] for states in read.states.values())
    after = _trainer_state(convert_deepspeed(str(tmp_path / "ds"), str(tmp_path / "back")))
    assert (after["global_steps"], after["global_samples"], after["skipped_steps"]) == (STEPS, 0, 0)
