"""The DeepSpeed-style engine API: optimizers passed in, parameter groups, schedules, counters, data, comm volume."""
from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

from distributed import run_distributed, run_python
from models_for_tests import OddMLP, make_batches, micro_slice, reference_training, train_global_step

MICRO, STEPS, LR = 2, 4, 1e-2
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


def _config(stage: int, accumulation: int = 1, clip: float = 1.0, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
        "steps_per_print": 0,
    }
    config.update(extra)
    return config


def _train(engine, accumulation: int, steps: int = STEPS, after_step=None) -> list[float]:
    """Feed this rank's slices of the shared global batches; return the global mean loss of each step."""
    world = int(os.environ["WORLD_SIZE"])
    return [train_global_step(engine, batch, MICRO, after_step) for batch in make_batches(steps, MICRO * accumulation * world)]


def _reference(make_optimizer, world: int, accumulation: int, clip: float = 1.0, steps: int = STEPS,
               make_scheduler=None, freeze=()) -> tuple[list[float], dict, list]:
    """Plain single-process training on the union of the same batches."""
    torch.manual_seed(0)
    model = OddMLP()
    for name in freeze:
        model.get_parameter(name).requires_grad_(False)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    losses, lrs = [], []
    for x, y in make_batches(steps, MICRO * accumulation * world):
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        lrs.append([g["lr"] for g in optimizer.param_groups])
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, lrs


def _assert_parity(losses, weights, ref_losses, ref_weights, what: str, rel_tol: float = 1e-5) -> None:
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert rel <= rel_tol, f"{what}: losses {losses} vs {ref_losses} (max rel {rel:.2e})"
    assert set(weights) == set(ref_weights), f"{what}: {sorted(weights)} vs {sorted(ref_weights)}"
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {name}: {m}")


# --- an optimizer passed in -------------------------------------------------------

def user_optimizer_vs_config(stage: int) -> dict:
    import zerotrain

    out = {}
    for how in ("config", "instance"):
        torch.manual_seed(0)
        model = OddMLP()
        config = _config(stage)
        optimizer = None
        if how == "instance":
            # No optimizer block: the user's optimizer is the only one.
            config.pop("optimizer")
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        engine, returned, _, _ = zerotrain.initialize(model=model, config=config, optimizer=optimizer)
        if optimizer is not None:
            assert returned is optimizer, "initialize returns the optimizer it was given"
        losses = _train(engine, 1)
        out[how] = (losses, engine.full_state_dict())
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_user_optimizer_instance_matches_config_optimizer(stage):
    out = run_distributed(user_optimizer_vs_config, 2, stage)[0]
    (cfg_losses, cfg_weights), (usr_losses, usr_weights) = out["config"], out["instance"]
    for a, b in zip(cfg_losses, usr_losses):
        assert abs(a - b) <= 1e-6, (cfg_losses, usr_losses)
    assert set(cfg_weights) == set(usr_weights) and cfg_weights
    for name in cfg_weights:
        torch.testing.assert_close(usr_weights[name], cfg_weights[name], rtol=0, atol=1e-6)


def sgd_from_callable(stage: int, accumulation: int) -> tuple:
    import zerotrain

    torch.manual_seed(0)
    config = _config(stage, accumulation)
    config.pop("optimizer")
    engine, optimizer, _, _ = zerotrain.initialize(
        model=OddMLP(), config=config, optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert isinstance(optimizer, torch.optim.SGD)
    return _train(engine, accumulation), engine.full_state_dict()


def test_callable_optimizer_sgd_momentum_matches_single_process():
    losses, weights = run_distributed(sgd_from_callable, 2, 2, 2)[0]
    ref_losses, ref_weights, _ = _reference(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 2, 2)
    _assert_parity(losses, weights, ref_losses, ref_weights, "stage 2, accumulation 2, SGD momentum")


# --- parameter groups -------------------------------------------------------------

LR_A, LR_B = 3e-2, 5e-3


def two_groups(stage: int) -> tuple:
    import zerotrain

    torch.manual_seed(0)
    model = OddMLP()
    groups = [{"params": list(model.fc1.parameters()), "lr": LR_A},
              {"params": list(model.fc2.parameters()), "lr": LR_B, "weight_decay": 0.0}]
    engine, optimizer, _, _ = zerotrain.initialize(model=model, config=_config(stage), model_parameters=groups)
    assert [g["lr"] for g in optimizer.param_groups] == [LR_A, LR_B]
    assert engine.get_lr() == [LR_A, LR_B]
    losses = _train(engine, 1)
    return losses, engine.full_state_dict(), [g["weight_decay"] for g in optimizer.param_groups]


@pytest.mark.parametrize("stage", [1, 2])
def test_two_param_groups_match_single_process(stage):
    losses, weights, decays = run_distributed(two_groups, 2, stage)[0]
    assert decays == [0.01, 0.0]

    def make(model):
        return torch.optim.AdamW([{"params": list(model.fc1.parameters()), "lr": LR_A},
                                  {"params": list(model.fc2.parameters()), "lr": LR_B, "weight_decay": 0.0}],
                                 lr=LR, weight_decay=0.01)

    ref_losses, ref_weights, _ = _reference(make, 2, 1)
    _assert_parity(losses, weights, ref_losses, ref_weights, f"stage {stage}, two groups")


# --- the config's scheduler -------------------------------------------------------

SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": LR, "warmup_num_steps": 3,
                                            "warmup_type": "linear"}}


def with_warmup(stage: int, accumulation: int) -> tuple:
    import zerotrain

    torch.manual_seed(0)
    engine, _, _, scheduler = zerotrain.initialize(model=OddMLP(), config=_config(stage, accumulation,
                                                                                  scheduler=SCHEDULER))
    assert scheduler is not None and scheduler is engine.lr_scheduler
    initial = engine.get_lr()
    after_each_micro_step = []
    losses = _train(engine, accumulation, steps=6, after_step=lambda e: after_each_micro_step.append(e.get_lr()))
    return initial, after_each_micro_step, losses, engine.full_state_dict()


def test_warmup_schedule_matches_single_process():
    from zerotrain.config import load_config
    from zerotrain.schedules import build_scheduler

    accumulation = 2
    initial, per_micro, losses, weights = run_distributed(with_warmup, 2, 2, accumulation)[0]
    sched_cfg = load_config(_config(2, accumulation, scheduler=SCHEDULER), dp_world_size=2).scheduler

    def make_optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    ref_losses, ref_weights, ref_lrs = _reference(make_optimizer, 2, accumulation, steps=6,
                                                  make_scheduler=lambda opt: build_scheduler(sched_cfg, opt))
    torch.manual_seed(0)
    ref_initial = [g["lr"] for g in build_scheduler(sched_cfg, make_optimizer(OddMLP())).optimizer.param_groups]
    assert initial == pytest.approx(ref_initial, rel=1e-12)
    # The lr moves only at accumulation boundaries, and then exactly as torch's scheduler moves it.
    expected = []
    for step_lrs in ref_lrs:
        expected += [expected[-1] if expected else ref_initial] * (accumulation - 1) + [step_lrs]
    assert len(per_micro) == len(expected)
    for got, want in zip(per_micro, expected):
        assert got == pytest.approx(want, rel=1e-12), (per_micro, expected)
    assert len({tuple(lr) for lr in expected}) > 2, "the schedule under test actually changes the lr"
    _assert_parity(losses, weights, ref_losses, ref_weights, "WarmupLR, stage 2")


# --- step counters ------------------------------------------------------------------

def counters_with_accumulation(accumulation: int) -> list:
    import zerotrain

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config(1, accumulation))
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    trace = [("sizes", engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
              engine.gradient_accumulation_steps())]
    for step, batch in enumerate(make_batches(2, MICRO * accumulation * world)):
        for a in range(accumulation):
            before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            boundary = engine.is_gradient_accumulation_boundary()
            x, y = micro_slice(batch, a, rank, world, MICRO)
            engine.backward(engine(x, y))
            engine.step()
            changed = any(not torch.equal(before[n], p) for n, p in engine.module.named_parameters())
            trace.append((boundary, engine.global_steps, engine.global_samples, changed))
    engine.close()
    # DeepSpeed's backward(loss, scale_wrt_gas=False): the micro-batch losses are not divided by the accumulation
    # steps (one step of plain SGD, no clipping: the weights show the gradient's size)
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config(
        1, accumulation, clip=0.0, optimizer={"type": "SGD", "params": {"lr": LR}}))
    batch = make_batches(1, MICRO * accumulation * world, seed=5)[0]
    for a in range(accumulation):
        x, y = micro_slice(batch, a, rank, world, MICRO)
        engine.backward(engine(x, y), scale_wrt_gas=False)
        engine.step()
    return trace, engine.full_state_dict()


def test_accumulation_counters_follow_deepspeed():
    """The step counters at each micro-step; and engine.backward(loss, scale_wrt_gas=False), as DeepSpeed's: the
    gradient of the losses as given (their sum over the accumulation steps, averaged over the ranks), not divided by
    gradient_accumulation_steps: plain PyTorch takes `accumulation` x the whole batch's gradient (the batch's loss
    is the mean of the equal micro-batches')."""
    accumulation, world = 3, 2
    results = run_distributed(counters_with_accumulation, world, accumulation)
    torch.manual_seed(0)
    model = OddMLP()
    x, y = make_batches(1, MICRO * accumulation * world, seed=5)[0]
    (model(x, y) * accumulation).backward()
    with torch.no_grad():
        expected = {n: p - LR * p.grad for n, p in model.named_parameters()}
    for name, ref in expected.items():
        torch.testing.assert_close(results[0][1][name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for rank, (trace, _) in enumerate(results):
        assert trace[0] == ("sizes", MICRO * accumulation * world, MICRO, accumulation), f"rank {rank}"
        expected, steps = [], 0
        for _ in range(2):
            for a in range(accumulation):
                boundary = a == accumulation - 1
                steps += boundary
                expected.append((boundary, steps, steps * MICRO * accumulation * world, boundary))
        assert trace[1:] == expected, f"rank {rank}: {trace[1:]}"


# --- training_data ------------------------------------------------------------------

def loader_samples(samples: int) -> dict:
    from torch.utils.data import TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import zerotrain

    def collate(items):
        return {"indices": torch.stack([index for index, _ in items]), "targets": torch.stack([t for _, t in items])}

    dataset = TensorDataset(torch.arange(samples), torch.randn(samples, 3))
    engine, _, loader, _ = zerotrain.initialize(model=OddMLP(), config=_config(0), training_data=dataset,
                                                collate_fn=collate)
    assert loader is not None and isinstance(loader.sampler, DistributedSampler)
    batches = [batch["indices"].tolist() for batch in loader]  # the collate_fn was used
    return {"batch_sizes": {len(b) for b in batches}, "indices": [i for b in batches for i in b],
            "len": len(loader)}


def test_training_data_gives_disjoint_shards():
    samples, world = 20, 2
    results = run_distributed(loader_samples, world, samples)
    seen = [set(r["indices"]) for r in results]
    for rank, result in enumerate(results):
        assert result["batch_sizes"] == {MICRO}, f"rank {rank}: {result['batch_sizes']}"
        assert len(result["indices"]) == len(seen[rank]) == samples // world, f"rank {rank}"
        assert result["len"] == samples // world // MICRO
    assert not seen[0] & seen[1], f"ranks share samples {seen[0] & seen[1]}"
    assert seen[0] | seen[1] == set(range(samples))


def no_data_no_loader(config_path: str) -> list:
    import zerotrain

    out = []
    for kwargs in ({"config": _config(0)}, {"config": config_path}, {"config_params": _config(0)}):
        result = zerotrain.initialize(model=OddMLP(), **kwargs)
        out.append((len(result), result[2], result[3], result[0].train_batch_size()))
    return out


def test_initialize_returns_four_and_reads_json_files(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text("// a DeepSpeed config file\n" + json.dumps(_config(0), indent=2))
    for rank, outcomes in enumerate(run_distributed(no_data_no_loader, 2, str(path))):
        assert outcomes == [(4, None, None, MICRO * 2)] * 3, f"rank {rank}: {outcomes}"


# --- frozen parameters ------------------------------------------------------------

FROZEN = "fc1.bias"


def train_with_frozen(stage: int, filtered: bool) -> tuple:
    import zerotrain

    torch.manual_seed(0)
    model = OddMLP()
    model.get_parameter(FROZEN).requires_grad_(False)
    initial = model.get_parameter(FROZEN).detach().clone()
    # DeepSpeed's idiom passes the trainable parameters as a generator; without it, initialize finds them.
    params = filter(lambda p: p.requires_grad, model.parameters()) if filtered else None
    engine, *_ = zerotrain.initialize(model=model, config=_config(stage), model_parameters=params)
    losses = _train(engine, 1)
    still = torch.equal(engine.module.get_parameter(FROZEN).detach(), initial)
    return losses, engine.full_state_dict(), still, initial


@pytest.mark.parametrize("stage, filtered", [(0, False), (2, True)])
def test_frozen_parameter_stays_and_is_saved(stage, filtered):
    results = run_distributed(train_with_frozen, 2, stage, filtered)
    losses, weights, _, initial = results[0]
    assert all(still for _, _, still, _ in results), "the frozen parameter moved on some rank"
    assert FROZEN in weights
    torch.testing.assert_close(weights[FROZEN], initial, rtol=0, atol=0)

    def make(model):
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)

    ref_losses, ref_weights, _ = _reference(make, 2, 1, freeze=(FROZEN,))
    _assert_parity(losses, weights, ref_losses, ref_weights, f"stage {stage}, {FROZEN} frozen")


# --- communication volume -----------------------------------------------------------

def comm_volume(stages: tuple, accumulation: int, steps: int) -> dict:
    import zerotrain

    reports = {}
    for stage in stages:
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config(stage, accumulation))
        before = engine.memory_report()["comm"]
        _train(engine, accumulation, steps=steps)
        reports[stage] = {"before": before, "after": engine.memory_report()["comm"],
                          "grad_bytes": sum(b.padded_numel * b.flat_param.element_size() for b in engine.buckets),
                          "buckets": len(engine.buckets)}
    return reports


def _delta(report: dict, kind: str, field: str = "bytes") -> int:
    return report["after"].get(kind, {}).get(field, 0) - report["before"].get(kind, {}).get(field, 0)


@pytest.mark.parametrize("world", [2, 4])
def test_comm_bytes_match_theory(world):
    """Bytes sent per collective kind (ring accounting) over 3 steps of 2 micro-steps, S = padded gradient bytes."""
    accumulation, steps = 2, 3
    micro_steps = steps * accumulation
    for rank, reports in enumerate(run_distributed(comm_volume, world, (0, 1, 2), accumulation, steps)):
        for stage, report in reports.items():
            what = f"stage {stage}, world {world}, rank {rank}: {report}"
            size, fraction = report["grad_bytes"], (world - 1) / world
            assert report["buckets"] > 1, "several buckets, so the sum over buckets is exercised"
            if stage == 0:
                # One all-reduce of the whole gradient per step; nothing on the other micro-steps.
                assert _delta(report, "all_reduce") == round(steps * 2 * size * fraction), what
                assert _delta(report, "all_reduce", "calls") == steps * report["buckets"], what
                assert _delta(report, "reduce_scatter") == _delta(report, "all_gather") == 0, what
                continue
            # Stage 1 reduce-scatters the accumulated gradient once per step, stage 2 on every micro-step.
            scatters = steps if stage == 1 else micro_steps
            assert _delta(report, "reduce_scatter") == round(scatters * size * fraction), what
            assert _delta(report, "all_gather") == round(steps * size * fraction), what
            # Only the global-norm scalar is all-reduced: a few bytes per step, never a gradient.
            assert 0 < _delta(report, "all_reduce") <= steps * 16, what


# --- a world of one, no launcher ----------------------------------------------------

SINGLE_PROCESS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests_dir!r})
    import torch
    import torch.distributed as dist
    import zerotrain
    from models_for_tests import OddMLP, make_batches, reference_training

    assert not dist.is_initialized()
    torch.manual_seed(0)
    engine, optimizer, _, _ = zerotrain.initialize(model=OddMLP(), config={{
        "train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2, "weight_decay": 0.01}}}},
        "zero_optimization": {{"stage": 2, "reduce_bucket_size": 40}}, "steps_per_print": 0}})
    losses = []
    for x, y in make_batches(3, 4):
        total = 0.0
        for a in range(2):
            loss = engine(x[2 * a:2 * a + 2], y[2 * a:2 * a + 2])
            engine.backward(loss)
            engine.step()
            total += loss.item() / 2
        losses.append(total)
    ref_losses, ref_weights = reference_training(OddMLP, make_batches(3, 4), lr=1e-2)
    weights = engine.full_state_dict()
    print(json.dumps({{
        "world": dist.get_world_size(), "initialized": dist.is_initialized(), "backend": dist.get_backend(),
        "micro": engine.train_micro_batch_size_per_gpu(), "steps": engine.global_steps,
        "max_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "weights_close": all(torch.allclose(weights[n], w, rtol=1e-5, atol=1e-6) for n, w in ref_weights.items()),
        "names_match": sorted(weights) == sorted(ref_weights), "comm": engine.memory_report()["comm"],
    }}))
""")


def test_world_of_one_without_launcher_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = run_python(["-c", SINGLE_PROCESS_SCRIPT.format(tests_dir=TESTS_DIR)], env=env, timeout=120,
                      cwd=TESTS_DIR)  # a process of its own, forked with torch imported
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["world"] == 1 and result["initialized"] and result["backend"] == "gloo", result
    assert result["micro"] == 2 and result["steps"] == 3, result
    assert result["names_match"], result
    assert result["max_rel"] <= 1e-5 and result["weights_close"], result  # the project's exact tolerance
    assert result["comm"] == {}, f"a world of one sends nothing: {result['comm']}"



# --- tied weights -------------------------------------------------------------------

class TiedMLP(torch.nn.Module):
    """Two layers share one weight (as a GPT's embedding and lm head do); 83 distinct elements."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)
        self.enc = torch.nn.Linear(4, 4)
        self.dec = torch.nn.Linear(4, 4, bias=False)
        self.dec.weight = self.enc.weight
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        h = torch.tanh(self.enc(torch.tanh(self.proj(x))))
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.dec(h))), y)


def train_tied(stage: int) -> tuple:
    import zerotrain

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=TiedMLP(), config=_config(stage))
    assert engine.module.dec.weight is engine.module.enc.weight
    losses = _train(engine, 1)
    return losses, engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 2])
def test_tied_weights_match_single_process(stage):
    losses, weights = run_distributed(train_tied, 2, stage)[0]
    torch.manual_seed(0)
    model = TiedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    ref_losses = []
    for x, y in make_batches(STEPS, MICRO * 2):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    ref_weights = {k: v.clone() for k, v in model.state_dict().items()}  # both names of the tied weight
    _assert_parity(losses, weights, ref_losses, ref_weights, f"stage {stage}, tied weights")


# --- every rank starts from rank 0's state --------------------------------------------

class WithBuffer(OddMLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.randn(3))

    def forward(self, x, y):
        return super().forward(x, y + self.offset)


def start_from_different_seeds(stage: int) -> tuple:
    import zerotrain

    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)  # every rank builds a different model
    model = WithBuffer()
    model.fc2.bias.requires_grad_(False)
    engine, *_ = zerotrain.initialize(model=model, config=_config(stage))
    start = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    losses = _train(engine, 1)
    return start, losses, engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 1])
def test_ranks_start_from_rank_zero_state(stage):
    results = run_distributed(start_from_different_seeds, 2, stage)
    torch.manual_seed(0)
    rank0_model = WithBuffer()
    for rank, (start, _, _) in enumerate(results):
        for name, value in rank0_model.state_dict().items():
            assert torch.equal(start[name], value), f"rank {rank} starts with its own {name}"

    def factory():
        torch.manual_seed(0)
        model = WithBuffer()
        model.fc2.bias.requires_grad_(False)
        return model

    _, losses, weights = results[0]
    model = factory()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    ref_losses = []
    for x, y in make_batches(STEPS, MICRO * 2):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    _assert_parity(losses, weights, ref_losses, dict(model.named_parameters()), f"stage {stage}, seeds differ")


def test_world_size_variable_without_rank_is_a_world_of_one():
    """WORLD_SIZE alone (no RANK) does not start a launcher world, so the batch triple must use 1 either."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(WORLD_SIZE="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS_DIR!r})
        import torch.distributed as dist
        import zerotrain
        from models_for_tests import OddMLP
        engine, *_ = zerotrain.initialize(model=OddMLP(), config={{
            "train_batch_size": 4, "gradient_accumulation_steps": 1,
            "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}}}})
        print(dist.get_world_size(), engine.train_micro_batch_size_per_gpu(), engine.train_batch_size())
    """)
    done = run_python(["-c", script], env=env, timeout=120, cwd=TESTS_DIR)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["1", "4", "4"], f"world, micro, train batch: {done.stdout}"


# --- zero_grad, a user lr_scheduler, clipping seen through SGD --------------------------

ZERO_GRAD_CASES = [(0, 2), (1, 2), (2, 2), (2, 1)]  # (stage, accumulation)


def zero_grad_everywhere(cases: list) -> list:
    """Per case: a junk backward dropped by zero_grad() at a cycle start, then training that calls
    zero_grad() before every micro-step (mid-accumulation too, as DeepSpeed loops do)."""
    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = []
    for stage, accumulation in cases:
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config(stage, accumulation))
        junk = torch.full((MICRO, 6), 50.0), torch.full((MICRO, 3), -50.0)
        engine.backward(engine(*junk))
        engine.zero_grad()  # at a cycle start: the junk gradient must be gone
        losses = _train(engine, accumulation, after_step=lambda e: e.zero_grad())
        # zero_grad() before each forward, mid-cycle included: gradients must accumulate regardless.
        for batch in make_batches(1, MICRO * accumulation * world, seed=7):
            for a in range(accumulation):
                engine.zero_grad()
                engine.backward(engine(*micro_slice(batch, a, rank, world, MICRO)))
                engine.step()
        out.append((losses, engine.full_state_dict()))
    return out


def test_zero_grad_drops_only_between_cycles():
    """Stages 0-2: zero_grad() drops a pending gradient at a cycle start but never mid-accumulation."""
    results = run_distributed(zero_grad_everywhere, 2, ZERO_GRAD_CASES)[0]
    for (stage, accumulation), (losses, weights) in zip(ZERO_GRAD_CASES, results):
        batches = make_batches(STEPS, MICRO * accumulation * 2) + make_batches(1, MICRO * accumulation * 2, seed=7)
        ref_losses, ref_weights = reference_training(OddMLP, batches, lr=LR, weight_decay=0.01, clip=1.0)
        _assert_parity(losses, weights, ref_losses[:STEPS], ref_weights,
                       f"stage {stage}, accumulation {accumulation}, zero_grad")


def user_lr_scheduler(stage: int, accumulation: int) -> dict:
    """An lr_scheduler passed to initialize: an instance on the user's optimizer, and a callable."""
    import zerotrain

    out = {}
    for how in ("instance", "callable"):
        torch.manual_seed(0)
        model = OddMLP()
        config = _config(stage, accumulation)
        if how == "instance":
            config.pop("optimizer")
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            engine, _, _, returned = zerotrain.initialize(model=model, config=config, optimizer=optimizer,
                                                          lr_scheduler=scheduler)
            assert returned is scheduler and engine.lr_scheduler is scheduler
        else:
            engine, optimizer, _, returned = zerotrain.initialize(
                model=model, config=config,
                lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
            assert isinstance(returned, torch.optim.lr_scheduler.StepLR) and returned.optimizer is optimizer
        lrs = []
        losses = _train(engine, accumulation, after_step=lambda e: lrs.append(e.get_lr()[0]))
        out[how] = (losses, engine.full_state_dict(), lrs)
    return out


def test_user_lr_scheduler_steps_at_boundaries():
    accumulation = 2
    out = run_distributed(user_lr_scheduler, 2, 1, accumulation)[0]
    ref_losses, ref_weights, ref_lrs = _reference(
        lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01), 2, accumulation,
        make_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    expected = []
    for step in range(STEPS):  # halved once per optimizer step, i.e. every `accumulation` micro-steps
        expected += [LR * 0.5 ** step] * (accumulation - 1) + [LR * 0.5 ** (step + 1)]
    assert [lrs[0] for lrs in ref_lrs] == pytest.approx(expected[accumulation - 1::accumulation], rel=1e-12)
    for how, (losses, weights, lrs) in out.items():
        assert lrs == pytest.approx(expected, rel=1e-12), (how, lrs)
        _assert_parity(losses, weights, ref_losses, ref_weights, f"stage 1, lr_scheduler {how}")


SGD_CASES = [(0, 1), (1, 2), (2, 1)]  # (stage, accumulation)
SGD_CLIP = 0.05


def sgd_with_clipping(cases: list) -> list:
    import zerotrain

    out = []
    for stage, accumulation in cases:
        torch.manual_seed(0)
        config = _config(stage, accumulation, clip=SGD_CLIP, optimizer={"type": "SGD", "params": {"lr": 0.1}})
        engine, optimizer, *_ = zerotrain.initialize(model=OddMLP(), config=config)
        assert isinstance(optimizer, torch.optim.SGD)
        norms = []
        losses = _train(engine, accumulation,
                        after_step=lambda e: norms.append(e.get_global_grad_norm())
                        if e.micro_steps % accumulation == 0 else None)
        out.append((losses, engine.full_state_dict(), norms))
    return out


def test_sgd_clipping_parity_and_global_grad_norm():
    """Plain SGD reacts linearly to clipping, so parity here checks the clip factor itself; the engine's
    global norm equals the return value of torch's clip_grad_norm_ on the single-process reference."""
    results = run_distributed(sgd_with_clipping, 2, SGD_CASES)[0]
    for (stage, accumulation), (losses, weights, norms) in zip(SGD_CASES, results):
        torch.manual_seed(0)
        model = OddMLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_losses, ref_norms = [], []
        for x, y in make_batches(STEPS, MICRO * accumulation * 2):
            loss = model(x, y)
            loss.backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), SGD_CLIP)))
            optimizer.step()
            optimizer.zero_grad()
            ref_losses.append(loss.item())
        what = f"SGD stage {stage}, accumulation {accumulation}"
        assert min(ref_norms) > SGD_CLIP, f"{what}: clipping must fire on every step ({ref_norms})"
        assert len(norms) == STEPS and all(n is not None for n in norms), (what, norms)
        assert norms == pytest.approx(ref_norms, rel=1e-5), (what, norms, ref_norms)
        _assert_parity(losses, weights, ref_losses, dict(model.named_parameters()), what)
