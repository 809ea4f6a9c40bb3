"""The engine in the pytest process (a world of one): the step machine's counters and boundaries, overflow rules,
checkpoint round trips, whole-weight exports and loads, the DeepSpeed accessors, the data loader and the monitors,
each against plain single-process PyTorch on the same batches. Seconds, so the engine's modules (`engine/*`) can be
put under mutation (`tools/mutate.py`'s `COVERING`); the multi-rank cases of the same behaviours are the spawned
tests (test_engine_api.py, zero/test_parity.py, checkpoint/...)."""
from __future__ import annotations

import csv
import gc
import warnings
import weakref

import pytest
import torch

from models_for_tests import OddMLP, assert_same_training, make_batches, reference_training

import zerotrain

MICRO, LR = 2, 1e-2


def _config(stage: int, accumulation: int = 1, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": 1.0, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage}}
    config.update(extra)
    return config


def _engine(config: dict, model: torch.nn.Module | None = None):
    torch.manual_seed(0)
    return zerotrain.initialize(model=model if model is not None else OddMLP(), config=config)[0]


def _micro_steps(engine, batch) -> list[float]:
    """One global step over `batch` (a world of one: every micro-batch is this rank's); the micro losses."""
    accumulation = engine.gradient_accumulation_steps()
    losses = []
    for index in range(accumulation):
        x, y = (t[index * MICRO:(index + 1) * MICRO] for t in batch)
        assert engine.is_gradient_accumulation_boundary() == (index == accumulation - 1)
        loss = engine(x.to(engine.dtype), y.to(engine.dtype))
        engine.backward(loss)
        engine.step()
        assert engine.was_step_applied() == (index == accumulation - 1)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_finished_engine_is_collected_with_its_communicator(stage, world_of_one):
    """Once nothing holds the engine, the collector frees it with its parts: its communicator (and so its process
    groups and their gloo threads) does not outlive it. The parameters hold their gradient hooks in C++, where the
    collector cannot see; a hook holding the reducer or the stage-3 fetcher strongly kept them, and the Comm,
    alive until the interpreter exited (`zero.param_hooks`)."""
    engine = _engine(_config(stage))
    _micro_steps(engine, make_batches(1, MICRO)[0])
    engine_ref, comm_ref = weakref.ref(engine), weakref.ref(engine.comm)
    del engine
    gc.collect()
    assert engine_ref() is None and comm_ref() is None, f"stage {stage}: a finished engine's communicator is alive"


def test_a_kept_model_does_not_keep_its_process_group_past_teardown(world_of_one):
    """A script keeps its model after training (an HF script's `trainer` global): stage 3's hooks on it hold the
    fetcher and so the Comm. torch.distributed's teardown still frees the group (a Comm holds it weakly), and with
    it gloo's worker threads, before the interpreter exits; the kept Comm then says what happened in one line."""
    import torch.distributed as dist

    engine = _engine(_config(3))
    _micro_steps(engine, make_batches(1, MICRO)[0])
    model, comm = engine.module, engine.comm
    del engine
    group = weakref.ref(dist.group.WORLD)
    zerotrain.dist.destroy_process_group()
    assert group() is None, "the world group outlived destroy_process_group while the model was kept"
    with pytest.raises(RuntimeError, match=r"rank 0's process group of 1 was destroyed"):
        comm.group
    assert any(module._forward_pre_hooks for module in model.modules())  # stage 3's hooks, alive to the end


class _SharedInside(torch.nn.Module):
    """A parameter registered in a module and in the child it calls: the child's forward ends (and lets go of its
    parameters) before the parent uses the same parameter again."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(6, 6)
        self.weight = self.inner.weight
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inner(x)) @ self.weight.t()
        return torch.nn.functional.mse_loss(self.head(hidden), y)


def test_stage3_keeps_a_parameter_its_module_still_uses_when_a_child_sharing_it_ends(world_of_one):
    """ZeRO-3 gathers a module's parameters before its forward and holds them until it ends: a child holding the same
    parameter lets go of it at its own end, but the parent still uses it, so it stays gathered (the first forward,
    before any record of the order could keep it: one gather per module, 3, not a fourth for the shared weight);
    the steps equal plain AdamW's."""
    batches = make_batches(2, MICRO)
    ref_losses, ref_weights = reference_training(_SharedInside, batches, lr=LR)
    torch.manual_seed(0)
    config = _config(3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter gathered and released
    engine = zerotrain.initialize(model=_SharedInside(), config=config)[0]
    x, y = batches[0]
    loss = engine(x, y)  # the first forward, before any record of the order: one gather per module, none again
    assert engine.work_stats()["gather"]["gathers"] == 3, engine.work_stats()["gather"]
    engine.backward(loss)
    engine.step()
    losses = [loss.item()] + [_micro_steps(engine, batch)[0] for batch in batches[1:]]
    assert_same_training(losses, engine.full_state_dict(), ref_losses, ref_weights, "stage 3, a parameter shared with a child")


# --- the step machine ----------------------------------------------------------------------

@pytest.mark.parametrize("stage, zero", [(1, {}), (3, {}), (2, {"offload_optimizer": {"device": "cpu"}}),
                                         (3, {"zero_hpz_partition_size": 2})])
def test_accumulated_steps_and_their_counters_match_plain_torch(stage, zero, world_of_one):
    """Accumulation 2 over 3 steps: boundaries every second micro-step, each step's weights plain AdamW's on the
    whole batch (clipped at DeepSpeed's 1.0), and the counters DeepSpeed's (global steps, samples, micro-steps);
    the same with the optimizer offloaded to the CPU, and with an hpZ group size where there is one data-parallel
    rank (nothing to split: it trains as without)."""
    batches = make_batches(3, 2 * MICRO)
    config = _config(stage, accumulation=2)
    config["zero_optimization"].update(zero)
    engine = _engine(config)
    losses = [sum(_micro_steps(engine, batch)) / 2 for batch in batches]
    ref_losses, ref_weights = reference_training(OddMLP, batches, lr=LR)
    assert_same_training(losses, engine.full_state_dict(), ref_losses, ref_weights, f"stage {stage}")
    assert (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps) == (3, 12, 6, 0)
    assert engine.train_batch_size() == 4 and engine.train_micro_batch_size_per_gpu() == MICRO
    # DeepSpeed's engine.tput_timer, driven by the forwards and step()s as DeepSpeed's engine drives it: 6 timed
    # micro-steps, 3 global steps, the one after its 2 warm-up steps timed (a program reading it got 0 before)
    timer = engine.tput_timer
    assert (timer.micro_step_count, timer.global_step_count, timer.started) == (6, 3, False)
    assert timer.total_elapsed_time > 0 and timer.avg_samples_per_sec() == 4 / timer.total_elapsed_time


def test_a_manual_boundary_steps_every_micro_batch_and_no_sync_adds_gradients(world_of_one):
    """`set_gradient_accumulation_boundary(True)` (accelerate's loop) steps at every micro-step of an accumulation-2
    config, each backward still scaled by 1/2; a backward inside `no_sync()` adds its gradient to the next one's;
    `external_backward()` reduces the gradients made inside it once (a pipeline schedule's)."""
    batches = make_batches(3, MICRO)
    engine = _engine(_config(1, accumulation=2))
    engine.set_gradient_accumulation_boundary(True)
    for x, y in batches:
        assert engine.is_gradient_accumulation_boundary()
        engine.backward(engine(x, y))
        engine.step()
        assert engine.was_step_applied()
    assert engine.global_steps == 3
    # the reference: each step's loss halved (clipping at 1.0 sees the halved gradient)
    torch.manual_seed(0)
    model = OddMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for x, y in batches:
        (model(x, y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert_same_training([], engine.full_state_dict(), [], dict(model.named_parameters()), "manual boundary")

    (xa, ya), (xb, yb), (xc, yc) = make_batches(3, MICRO, seed=2)
    engine = _engine(_config(1))
    with engine.no_sync():
        engine.backward(engine(xa, ya))
    engine.backward(engine(xb, yb))
    engine.step()
    with engine.external_backward():
        engine(xc, yc).backward()
    engine.step()
    torch.manual_seed(0)
    model = OddMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for loss_of in (lambda: model(xa, ya) + model(xb, yb), lambda: model(xc, yc)):
        loss_of().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert_same_training([], engine.full_state_dict(), [], dict(model.named_parameters()), "no_sync, external")
    assert engine.global_steps == 2 and engine.micro_steps == 2


def test_a_non_finite_gradient_skips_the_step_only_where_checked(world_of_one):
    """fp32 checks nothing: an inf batch is stepped (a warning names the norm), nothing skipped; bf16 with
    `check_grad_overflow` skips it (the weights and the scheduler's lr unchanged, one skipped step counted); fp16's
    dynamic scale skips it and halves the scale."""
    (x, y), = make_batches(1, MICRO)
    inf = torch.full_like(x, float("inf"))
    engine = _engine(_config(1))
    with pytest.warns(RuntimeWarning, match="gradient norm is"):
        engine.backward(engine(inf, y))
        engine.step()
    assert engine.was_step_applied() and engine.skipped_steps == 0 and engine.global_steps == 1

    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4}}
    engine = _engine(_config(1, bf16={"enabled": True, "check_grad_overflow": True}, scheduler=scheduler))
    before, lr = engine.full_state_dict(), engine.get_lr()
    engine.backward(engine(inf.bfloat16(), y.bfloat16()))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1 and engine.global_steps == 1
    assert engine.get_lr() == lr
    for name, value in engine.full_state_dict().items():
        assert torch.equal(value, before[name]), name
    clean = _engine(_config(1, bf16={"enabled": True, "check_grad_overflow": True}, scheduler=scheduler))
    for step in range(2):  # after the skipped step, the same lrs and weights as an engine that never saw it
        for each in (engine, clean):
            each.backward(each(x.bfloat16(), y.bfloat16()))
            each.step()
        assert engine.was_step_applied() and engine.get_lr() == clean.get_lr()
    assert engine.skipped_steps == 1 and engine.global_steps == 3 and engine.get_lr() != lr
    assert_same_training([], engine.full_state_dict(), [], clean.full_state_dict(), "after a skipped step")

    engine = _engine(_config(1, fp16={"enabled": True, "initial_scale_power": 8}))
    for skipped, scale in ((1, 2.0 ** 8), (2, 2.0 ** 7)):  # DeepSpeed's hysteresis 2: the second overflow halves
        engine.backward(engine(inf.half(), y.half()))
        engine.step()
        assert not engine.was_step_applied() and engine.skipped_steps == skipped and engine.loss_scale == scale


def test_parameter_groups_given_as_params_or_dicts_and_a_parameter_in_none(world_of_one):
    """`model_parameters` as a list of parameters trains them (the rest stay, warned by name), as group dicts each
    group at its own lr: both equal torch's AdamW over the same groups."""
    batches = make_batches(2, MICRO)

    def run(groups_of, frozen_warning: bool):
        torch.manual_seed(0)
        model = OddMLP()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            engine = zerotrain.initialize(model=model, model_parameters=groups_of(model), config=_config(1))[0]
        orphans = [str(w.message) for w in seen if "in no optimizer group" in str(w.message)]
        assert orphans == (["parameters ['fc2.bias'] require grad but are in no optimizer group; they stay frozen"]
                           if frozen_warning else []), orphans
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
        torch.manual_seed(0)
        reference = OddMLP()
        optimizer = torch.optim.AdamW(groups_of(reference), lr=LR, weight_decay=0.01)
        for x, y in batches:
            reference(x, y).backward()
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
            optimizer.step()
            optimizer.zero_grad()
        assert_same_training([], engine.full_state_dict(), [], dict(reference.named_parameters()), "groups")

    run(lambda m: [m.fc1.weight, m.fc1.bias, m.fc2.weight], True)
    run(lambda m: [{"params": [m.fc1.weight, m.fc1.bias]}, {"params": [m.fc2.weight, m.fc2.bias], "lr": LR / 4}], False)


def test_generate_between_training_steps_runs_in_eval_mode_without_grad(world_of_one):
    """A training engine's `engine.module.generate(...)` (the Trainer's evaluation) runs under no_grad in eval mode
    and leaves the module training, with the caller's arguments."""
    modes = []
    original = Recorder.generate

    def generate(self, *args, **kwargs):
        self(torch.zeros(1, 6))
        return original(self, *args, **kwargs)

    engine = _engine(_config(1), type("Generating", (Recorder,), {"generate": generate})())
    engine.module.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    assert engine.module.generate(3, top_k=1) == "generated"
    assert engine.module.seen == ((3,), {"top_k": 1}, False) and modes == [False] and engine.module.training


# --- checkpoints ------------------------------------------------------------------------------

def test_a_checkpoint_resumes_weights_optimizer_scheduler_and_counters(tmp_path, world_of_one):
    """Two steps, a save (with files added to it), a fresh engine loads it: the same weights, lr, counters and client
    state; the next two steps equal the uninterrupted run's (the optimizer's moments came back). `load_module_only` restores the
    weights alone (fresh moments: another third step)."""
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 5}}
    config = _config(2, accumulation=2, scheduler=scheduler)
    batches = make_batches(4, 2 * MICRO)
    engine = _engine(config)
    for batch in batches[:2]:
        _micro_steps(engine, batch)
    assert engine.last_save() == (False, None)
    engine.add_checkpoint_files({"notes.txt": b"kept"})
    engine.add_checkpoint_files(lambda: {"made.txt": str(engine.global_steps).encode()})
    engine.save_checkpoint(str(tmp_path), tag="two")
    assert (tmp_path / "two" / "notes.txt").read_bytes() == b"kept" and (tmp_path / "two" / "made.txt").read_bytes() == b"2"
    assert not list((tmp_path / "two").glob("loco_state_*")), "LoCo state saved without qgZ's LoCo"
    pending, stall = engine.last_save()
    assert pending is False and stall is not None and stall >= 0
    saved, saved_lr = engine.full_state_dict(), engine.get_lr()
    for batch in batches[2:]:
        _micro_steps(engine, batch)
    uninterrupted = engine.full_state_dict()

    resumed = _engine(config)
    path, client_state = resumed.load_checkpoint(str(tmp_path), tag="two")
    assert client_state == {} and path.endswith("two")
    assert (resumed.global_steps, resumed.global_samples, resumed.micro_steps, resumed.skipped_steps) == (2, 8, 4, 0)
    assert resumed.get_lr() == saved_lr and saved_lr != [0.0]
    for name, value in saved.items():
        torch.testing.assert_close(dict(resumed.module.named_parameters())[name].detach(), value, rtol=0, atol=0)
    for batch in batches[2:]:
        _micro_steps(resumed, batch)
    assert_same_training([], resumed.full_state_dict(), [], uninterrupted, "resumed")

    module_only = _engine(config)
    module_only.load_checkpoint(str(tmp_path), tag="two", load_module_only=True)
    assert module_only.global_steps == 0
    for name, value in saved.items():
        torch.testing.assert_close(module_only.full_state_dict()[name], value, rtol=0, atol=0)


def test_a_stage3_checkpoint_brings_back_its_frozen_weights(tmp_path, world_of_one):
    """Stage 3 with a frozen parameter: an engine built from other weights loads a checkpoint and computes what the
    saved engine computes (its frozen bias too, whole again after its shard was written)."""
    def frozen_model(seed: int) -> OddMLP:
        torch.manual_seed(seed)
        model = OddMLP()
        model.fc2.bias.requires_grad_(False)
        return model

    (x, y), = make_batches(1, MICRO)
    engine = zerotrain.initialize(model=frozen_model(0), config=_config(3))[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(str(tmp_path))
    other = zerotrain.initialize(model=frozen_model(3), config=_config(3))[0]
    other.load_checkpoint(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(other(x), engine(x), rtol=0, atol=0)
    assert torch.equal(other.full_state_dict()["fc2.bias"], frozen_model(0).fc2.bias.detach())


# --- whole weights ------------------------------------------------------------------------------

class BufferedTied(torch.nn.Module):
    """A tied weight (safetensors refuses shared storage), a persistent and a non-persistent buffer, one frozen
    parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(6, 6)
        self.dec = torch.nn.Linear(6, 6, bias=False)
        self.dec.weight = self.enc.weight
        self.head = torch.nn.Linear(6, 3)
        self.head.bias.requires_grad_(False)
        self.register_buffer("shift", torch.arange(6.0))
        self.register_buffer("scratch", torch.ones(6), persistent=False)

    def forward(self, x, y):
        h = torch.tanh(self.dec(torch.tanh(self.enc(x + self.shift * self.scratch))))
        return torch.nn.functional.mse_loss(self.head(h), y)


def test_whole_weights_out_and_in(tmp_path, world_of_one):
    """`state_dict()` is `module_state_dict()` under `module.`; `exclude_frozen_parameters` drops the frozen bias;
    the 16-bit dict is bf16 with the persistent buffer (not the scratch one); `save_16bit_model` writes it as
    torch.save and as safetensors (tied weight cloned) and both load into a plain model; `load_state_dict` takes
    either spelling into the weights and the masters (the next step trains from them); strict refuses a missing
    key, non-strict returns it."""
    engine = _engine(_config(1, bf16={"enabled": True}), BufferedTied())
    own = engine.module_state_dict()
    assert list(engine.state_dict()) == [f"module.{k}" for k in own]
    assert all(torch.equal(engine.state_dict()[f"module.{k}"], v) for k, v in own.items())
    assert "head.bias" in own and "head.bias" not in engine.module_state_dict(exclude_frozen_parameters=True)
    report = engine.memory_report()  # no LoCo buffers, nothing offloaded
    assert report["loco_errors"] == 0 and "offload" not in report and "offload_param" not in report, report
    unique = {id(p): p for p in engine.module.parameters()}.values()  # the tied weight once, the frozen bias too
    assert engine.memory_report()["parameters"] == sum(p.numel() * 2 for p in unique) == (36 + 6 + 18 + 3) * 2
    sixteen = engine.consolidated_16bit_state_dict()
    assert "shift" in sixteen and "scratch" not in sixteen and sixteen["enc.weight"].dtype == torch.bfloat16
    assert "head.bias" in sixteen
    assert "head.bias" not in engine.consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert engine.save_16bit_model(str(tmp_path / "bin")) is True
    assert engine.save_16bit_model(str(tmp_path / "bf16"), "model.safetensors") is True
    # fp32: the tied names are one tensor in the dict (bf16's casts are two), which safetensors alone refuses
    fp32 = _engine(_config(1), BufferedTied())
    sixteen = fp32.consolidated_16bit_state_dict()
    assert sixteen["enc.weight"] is sixteen["dec.weight"]
    assert fp32.save_16bit_model(str(tmp_path / "st"), "model.safetensors") is True
    from safetensors.torch import load_file
    assert sorted(load_file(tmp_path / "bf16" / "model.safetensors")) == sorted(engine.consolidated_16bit_state_dict())
    for loaded, want in ((torch.load(tmp_path / "bin" / "pytorch_model.bin"), engine.consolidated_16bit_state_dict()),
                         (load_file(tmp_path / "st" / "model.safetensors"), sixteen)):
        assert sorted(loaded) == sorted(want)
        for name, value in want.items():
            assert torch.equal(loaded[name], value), name
        BufferedTied().to(want["enc.weight"].dtype).load_state_dict(loaded)  # strict: every name, buffers too

    torch.manual_seed(5)
    new = {n: torch.randn_like(p, dtype=torch.float32) for n, p in OddMLP().named_parameters()}
    for prefixed in (True, False):
        engine = _engine(_config(2))
        engine.load_state_dict({(f"module.{k}" if prefixed else k): v for k, v in new.items()})
        (x, y), = make_batches(1, MICRO)
        engine.backward(engine(x, y))
        engine.step()
        model = OddMLP()
        model.load_state_dict(new)
        _, ref = reference_training(lambda: model, [(x, y)], lr=LR)
        assert_same_training([], engine.full_state_dict(), [], ref, f"loaded (prefixed {prefixed})")
    bf16 = _engine(_config(1, bf16={"enabled": True}))
    bf16.load_state_dict(new)  # the fp32 masters take the values themselves, the weights their bf16 cast
    for name, value in bf16.full_state_dict().items():
        assert torch.equal(value, new[name]), name
        assert torch.equal(dict(bf16.module.named_parameters())[name].detach(), value.bfloat16()), name
    partial = {k: v for k, v in new.items() if k != "fc2.bias"}
    with pytest.raises(RuntimeError, match=r"missing keys \['fc2.bias'\]"):
        engine.load_state_dict(partial)
    assert engine.load_state_dict(dict(partial, extra=torch.ones(1)), strict=False) == (["fc2.bias"], ["extra"])
    assert torch.equal(dict(engine.module.named_parameters())["fc1.weight"].detach(), new["fc1.weight"])


def test_stage3_whole_weights_need_the_gather_flag(tmp_path, world_of_one):
    """At stage 3 `save_16bit_model` writes only with `stage3_gather_16bit_weights_on_model_save` (DeepSpeed's rule,
    a warning and False otherwise); `module_state_dict` is refused; `load_state_dict` writes every shard."""
    engine = _engine(_config(3))
    assert engine.zero_gather_16bit_weights_on_model_save() is False
    with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save"):
        assert engine.save_16bit_model(str(tmp_path / "no")) is False
    assert not (tmp_path / "no").exists()
    with pytest.raises(RuntimeError, match="partitioned"):
        engine.module_state_dict()
    config = _config(3)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine = _engine(config)
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    assert engine.save_16bit_model(str(tmp_path / "yes")) is True
    saved = torch.load(tmp_path / "yes" / "pytorch_model.bin")
    torch.manual_seed(0)
    for name, value in OddMLP().named_parameters():
        assert torch.equal(saved[name], value.detach()), name
    new = {k: v + 1 for k, v in saved.items()}
    engine.load_state_dict(new)
    for name, value in engine.full_state_dict().items():
        assert torch.equal(value, new[name]), name


# --- the DeepSpeed accessors, the data loader, the monitors -----------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_questions_answer_as_deepspeed(stage, world_of_one):
    engine = _engine(_config(stage))
    assert engine.zero_optimization_stage() == stage
    assert engine.zero_optimization() == (stage > 0)
    assert engine.zero_optimization_partition_gradients() == (stage >= 2)
    assert engine.zero_optimization_partition_weights() == (stage >= 3)
    assert (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.gradient_clipping()) == (False, False, 1.0)
    assert engine.get_mom() == [(0.9, 0.999)] and engine.get_lr() == [LR]
    assert (engine.world_size, engine.dp_world_size, engine.mp_world_size, engine.global_rank) == (1, 1, 1, 0)


def test_a_forward_only_engine_holds_no_gradients_and_computes_the_model(world_of_one):
    """Built without an optimizer (DeepSpeed's ZeRO-Inference): no gradient, LoCo or optimizer bytes, not a LoCo
    checkpoint user, and its forward is the plain model's."""
    engine = _engine({"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3}})
    report = engine.memory_report()
    assert (report["gradients"], report["loco_errors"], report["optimizer_states"]) == (0, 0, 0), report
    assert engine.checkpoint_state().loco.enabled is False
    (x, _), = make_batches(1, MICRO)
    torch.manual_seed(0)
    assert torch.equal(engine(x), OddMLP()(x).detach())


class Recorder(OddMLP):
    """An OddMLP with a `generate` that records its arguments, and the GPT's activation-checkpointing switch."""

    activation_checkpointing = False

    def generate(self, *args, **kwargs):
        self.seen = (args, kwargs, torch.is_grad_enabled())
        return "generated"


def test_forwarded_attributes_generate_and_activation_checkpointing(world_of_one):
    """`engine.generate` calls the model's under no_grad with the caller's arguments as they are at a world of one
    (no `synced_gpus` added: nothing to keep in step); a model attribute is reached through the engine; a config with
    an `activation_checkpointing` block switches the built-in GPT's flag on, one without leaves it."""
    engine = _engine(_config(1), Recorder())
    assert engine.generate(1, max_new_tokens=2) == "generated"
    assert engine.module.seen == ((1,), {"max_new_tokens": 2}, False)
    assert engine.activation_checkpointing is False
    engine = _engine(_config(1, activation_checkpointing={"partition_activations": False}), Recorder())
    assert engine.module.activation_checkpointing is True
    with pytest.raises(AttributeError, match="nor has its module"):
        engine.not_an_attribute


def test_the_data_loader_and_the_monitor_rows(tmp_path, world_of_one):
    """`deepspeed_io` batches this rank's samples at the micro-batch size through the given collate_fn (extra
    DeepSpeed arguments warned by name, none: no warning); a `csv_monitor` block gets one lr row per optimizer step
    at the samples seen, the rate after the scheduler's step; nothing inside `progress_printing(False)`."""
    dataset = [(torch.full((6,), float(i)), torch.zeros(3)) for i in range(9)]
    engine = _engine(_config(1, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
                             scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                                       "warmup_num_steps": 4}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = engine.deepspeed_io(dataset, collate_fn=lambda items: ("collated", len(items)))
    assert list(loader) == [("collated", MICRO)] * 4  # 9 samples, the incomplete last batch dropped
    with pytest.warns(UserWarning, match="route"):
        engine.deepspeed_io(dataset, route="train")
    rows = []
    for step, (x, y) in enumerate(make_batches(3, MICRO)):
        with engine.progress_printing(step != 1):
            engine.backward(engine(x, y))
            engine.step()
        if step != 1:
            rows.append([str(engine.global_samples), str(engine.get_lr()[0])])
    with open(tmp_path / "run" / "Train_Samples_lr.csv", newline="") as handle:
        written = list(csv.reader(handle))
    assert written[0] == ["step", "lr"] and written[1:] == rows


def test_a_save_warns_of_unapplied_gradients_only_inside_a_cycle(tmp_path, world_of_one, caplog):
    """A checkpoint saved while gradients are held that no step applied warns that they are not saved; one saved
    after a step does not, a step at a forced boundary (an epoch's short last cycle, the HF Trainer's) included:
    the warning used to follow `micro_steps % gradient_accumulation_steps`, false after such a step."""
    import logging

    engine = _engine(_config(1, accumulation=2))
    (xa, ya), (xb, yb), (xc, yc) = make_batches(3, MICRO)
    warned = []
    for x, y, boundary in ((xa, ya, None), (xb, yb, None), (xc, yc, True)):
        if boundary:
            engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(x, y))
        engine.step()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zerotrain"):
            engine.save_checkpoint(str(tmp_path), tag=f"micro{engine.micro_steps}")
        warned.append(any("middle of a gradient accumulation cycle" in r.getMessage() for r in caplog.records))
    assert warned == [True, False, False] and engine.micro_steps == 3 and engine.global_steps == 2
