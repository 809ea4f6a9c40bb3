"""ZeRO++ through the engine: qgZ (+LoCo) at stages 1-3, qwZ and hpZ at stage 3, byte counters.

Stated tolerances against plain single-process AdamW on the same batches (10 steps of OddMLP, lr 2e-2):
- hpZ alone moves exact values: the project's exact tolerance (assert_same_training);
- qwZ and hpZ+qwZ also save halfway; a fresh engine loading it repeats the second half bit for bit;
- qwZ (int8 weights): losses within 2% relative, weights within 8% (relative L2 distance);
- qgZ int4 gradients (with or without LoCo, alone or with qwZ/hpZ): losses within 4%, weights within 15%.
Every lossy check also runs the do-nothing baseline (lr 0 on the same batches) and asserts it falls outside
its tolerance by 2x (assert_tolerance_discriminates): the baseline is off by ~17% / ~44%.
World 4 runs as 2 pretend nodes of 2 ranks (ZEROTRAIN_RANKS_PER_NODE=2), so qgZ takes its two
hops and hpZ groups pairs of ranks.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

from distributed import run_distributed
from models_for_tests import (OddMLP, assert_same_training, assert_tolerance_discriminates, make_batches, micro_slice,
                              reference_training, train_global_step)

STEPS, MICRO, LR = 10, 2, 2e-2
QG = {"zero_quantized_gradients": True}
LOCO = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}
QW = {"zero_quantized_weights": True}
HPZ = {"zero_hpz_partition_size": 2}


class WideMLP(torch.nn.Module):
    """~33k parameters: large enough that block scales and padding barely count."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 256)
        self.fc2 = torch.nn.Linear(256, 120)
        self.fc3 = torch.nn.Linear(120, 3)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), y)


def config(stage: int, accumulation: int = 1, bucket: int = 40, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                  "stage3_param_persistence_threshold": 0, **zero},
            "steps_per_print": 0}


def train(engine, world: int, rank: int, accumulation: int, steps: int = STEPS) -> list[float]:
    return [train_global_step(engine, batch, MICRO) for batch in make_batches(steps, MICRO * accumulation * world)]


# Combos that also save halfway, and a fresh engine (other initial weights) loads that checkpoint and trains
# the second half: it must repeat the uninterrupted run exactly (qwZ is lossy but deterministic).
RESUMED = {"stage3 qwZ", "stage3 hpZ+qwZ"}


def run_combos(combos: list, save_root: str) -> list:
    import zerotrain

    os.environ["ZEROTRAIN_RANKS_PER_NODE"] = "2"
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = []
    for name, model_class, stage, accumulation, zero in combos:
        torch.manual_seed(0)
        bucket = 10**9 if model_class is WideMLP else 40
        build = lambda: zerotrain.initialize(  # noqa: E731
            model=model_class(), config=config(stage, accumulation, bucket, **zero))[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing is "accepted but not implemented" any more
            engine = build()
        steps = STEPS if model_class is OddMLP else 1
        before = engine.memory_report()["comm"]
        resumed = {}
        if name in RESUMED:
            batches = make_batches(steps, MICRO * accumulation * world)
            half, save_dir = steps // 2, os.path.join(save_root, name.replace(" ", "_").replace("+", "_"))
            losses = [train_global_step(engine, batch, MICRO) for batch in batches[:half]]
            engine.save_checkpoint(save_dir)
            losses += [train_global_step(engine, batch, MICRO) for batch in batches[half:]]
            torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
            fresh = build()
            fresh.load_checkpoint(save_dir)
            resumed = {"half": half, "losses": [train_global_step(fresh, batch, MICRO) for batch in batches[half:]],
                       "weights": fresh.full_state_dict(), "steps": fresh.global_steps}
        else:
            losses = train(engine, world, rank, accumulation, steps)
        after = engine.memory_report()["comm"]
        delta = {kind: {field: value - before.get(kind, {}).get(field, 0) for field, value in entry.items()}
                 for kind, entry in after.items()}
        stats = engine.work_stats()["gather"]
        grad_numel = sum(b.padded_numel for b in engine.buckets)
        results.append({"name": name, "accumulation": accumulation, "losses": losses, "stage": stage, "zero": zero,
                        "weights": engine.full_state_dict(), "comm": delta, "stats": stats,
                        "grad_numel": grad_numel, "loco_bytes": engine.memory_report()["loco_errors"],
                        "gradient_report": engine.memory_report()["gradients"], "resumed": resumed})
    return results


WORLD2 = [
    ("stage1 qgZ", OddMLP, 1, 2, QG),
    ("stage2 qgZ+LoCo", OddMLP, 2, 2, LOCO),
    ("stage3 qgZ+LoCo+qwZ", OddMLP, 3, 1, {**LOCO, **QW}),
    ("stage3 qwZ", OddMLP, 3, 2, QW),
    ("wide stage2 qgZ+LoCo", WideMLP, 2, 1, LOCO),
    ("wide stage3 qwZ", WideMLP, 3, 1, QW),
]
WORLD4 = [
    ("stage3 hpZ", OddMLP, 3, 1, HPZ),
    ("stage3 hpZ+qwZ", OddMLP, 3, 2, {**HPZ, **QW}),
    ("stage3 ZeRO++ (qgZ+LoCo+qwZ+hpZ)", OddMLP, 3, 1, {**LOCO, **QW, **HPZ}),
    ("stage2 qgZ two hops", OddMLP, 2, 1, LOCO),
]


def _tolerance(name: str) -> tuple[float, float] | None:
    """(loss, weight) tolerances of a lossy mode for assert_tolerance_discriminates; None for an exact one."""
    if "qgZ" in name or "ZeRO++" in name:
        return 0.04, 0.15
    if "qwZ" in name:
        return 0.02, 0.08
    return None


@pytest.mark.parametrize("world,combos", [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_zeropp_training_close_to_exact(world, combos, tmp_path):
    results = run_distributed(run_combos, world, combos, str(tmp_path))[0]
    assert any(result["name"] in RESUMED for result in results), "each launch checks one resume"
    for result in results:
        name, accumulation = result["name"], result["accumulation"]
        what = f"world {world}, {name}"
        comm = result["comm"]
        if name in RESUMED:  # save + resume repeats the uninterrupted run exactly
            resumed, half = result["resumed"], result["resumed"]["half"]
            assert resumed["steps"] == STEPS and resumed["losses"] == result["losses"][half:], (what, resumed)
            assert resumed["weights"].keys() == result["weights"].keys()
            for key, value in result["weights"].items():
                assert torch.equal(resumed["weights"][key], value), (what, key)
        if name.startswith("wide"):
            if "qgZ" in name:  # int4 gradients: 1/8 of fp32 plus one fp32 scale per 256 values
                entry = comm["reduce_scatter_q4"]
                ratio = entry["bytes"] / entry["logical_bytes"]
                assert ratio <= 1 / 7 and abs(ratio - (1 / 8 + 1 / 256)) < 2e-3, (what, entry)
                assert "reduce_scatter" not in comm, what
                assert result["loco_bytes"] > 0 and result["gradient_report"] >= result["loco_bytes"]
            if "qwZ" in name:  # int8 weights: 1/4 plus scales
                entry = comm["all_gather_q8"]
                ratio = entry["bytes"] / entry["logical_bytes"]
                assert abs(ratio - (1 / 4 + 1 / 256)) < 5e-3, (what, entry)
            continue
        batches = make_batches(STEPS, MICRO * accumulation * world)
        reference = reference_training(OddMLP, batches, lr=LR)
        tolerance = _tolerance(name)
        if tolerance is None:
            assert_same_training(result["losses"], result["weights"], *reference)
        else:  # the do-nothing baseline: no update on the same batches
            assert_tolerance_discriminates(what, reference, (result["losses"], result["weights"]),
                                           reference_training(OddMLP, batches, lr=0.0),
                                           loss_tol=tolerance[0], weight_tol=tolerance[1])
        if "qgZ" in name or "ZeRO++" in name:
            kinds = {k for k in comm if k.startswith("reduce_scatter")}
            expected = {"reduce_scatter_q4_intra", "reduce_scatter_q4_inter"} if world == 4 else {"reduce_scatter_q4"}
            assert kinds == expected, (what, comm)
        if "qwZ" in name:
            assert "all_gather_q8" in comm and result["stats"]["quantized_gathers"] > 0, (what, comm)
        predicted = _estimate(world, result["stage"], result["zero"])  # zerotrain estimate, same layout
        if "LoCo" in name or "ZeRO++" in name:  # LoCo's error buffers, per bucket (stage 3: parameter) and hop
            assert result["loco_bytes"] == predicted.rows["loco_errors"]["device"] > 0, (what, predicted.rows)
        if "hpZ" in name or "ZeRO++" in name:
            assert comm["all_gather_hpz"]["calls"] > 0 and result["stats"]["hpz_gathers"] > 0, (what, comm)
            assert result["stats"]["peak_secondary_bytes"] > 0 and result["stats"]["secondary_bytes"] == 0
            assert result["stats"]["peak_secondary_bytes"] == predicted.transient["hpZ secondary shards"], what
            if "qwZ" not in name and "ZeRO++" not in name:
                assert result["stats"]["quantized_gathers"] == 0


def _estimate(world: int, stage: int, zero: dict):
    """`zerotrain estimate`'s rows for OddMLP at this world (2 ranks per node, as run_combos pretends)."""
    from zerotrain.config import load_config
    from zerotrain.estimate import Option, estimate_option, model_shape, probe_optimizer

    parsed = load_config(config(stage, 1, 40, **zero), dp_world_size=world)
    return estimate_option(model_shape(OddMLP()), parsed, world, Option(stage), probe_optimizer(parsed.optimizer),
                           device_type="cpu", ranks_per_node=2)


# --- LoCo bookkeeping through the engine ------------------------------------------------------

def loco_bookkeeping() -> dict:
    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = {}
    # reset_T = 3: the error is zeroed after every third optimizer step (steps, not tensors:
    # 2 micro-steps per step and several buckets).
    torch.manual_seed(0)
    zero = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 3}}
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=config(2, 2, **zero))
    pattern = []
    for batch in make_batches(5, MICRO * 2 * world):
        for a in range(2):
            x, y = micro_slice(batch, a, rank, world, MICRO)
            engine.backward(engine(x, y))
            engine.step()
        pattern.append((engine.reducer.optimizer_steps, engine.global_steps, engine.memory_report()["loco_errors"] > 0))
    out["pattern"] = pattern

    # Save / load, rescale and drop, on an engine that does not reset.
    torch.manual_seed(0)
    zero["zeropp_loco_param"]["reset_T"] = 1000
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=config(2, 1, **zero))
    train(engine, world, rank, 1, steps=2)
    reducer = engine.reducer
    errors = lambda: [f.error().clone() for r in reducer.reduce.per_bucket for f in r.feedbacks]  # noqa: E731
    saved = copy.deepcopy(reducer.loco_state())
    saved_errors = errors()
    train(engine, world, rank, 1, steps=1)
    out["changed"] = any(not torch.equal(a, b) for a, b in zip(errors(), saved_errors))
    out["loaded"] = reducer.load_loco_state(saved)
    out["restored"] = all(torch.equal(a, b) for a, b in zip(errors(), saved_errors)) and reducer.optimizer_steps == 2
    reducer.after_optimizer_step(False, 1024.0, 512.0)  # the loss scale halved
    out["rescaled"] = all(torch.equal(a, b * 0.5) for a, b in zip(errors(), saved_errors))
    other = copy.deepcopy(saved)
    other["layout"]["shards"] = [1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["other_layout_loaded"] = reducer.load_loco_state(other)
    out["other_layout_warned"] = any("another layout" in str(w.message) for w in caught)
    out["after_other_layout"] = reducer.loco_bytes()
    reducer.load_loco_state(saved)
    reducer.after_optimizer_step(True, 1024.0, 512.0)  # an overflow: dropped
    out["after_overflow"] = reducer.loco_bytes()

    # fp16 end to end: an inf on rank 1 only; qgZ sends it as nan scales, every rank skips the
    # step and drops its error buffer. Around it, the scale doubles after each clean step (loss_scale_window 1):
    # the engine's step rescales the error buffers backward left by new / old = 2.
    torch.manual_seed(0)
    zero["zeropp_loco_param"]["reset_T"] = 1000
    fp16 = dict(config(2, 1, **zero),
                fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1})
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=fp16)
    reducer = engine.reducer
    trace = []
    for step, batch in enumerate(make_batches(4, MICRO * world)):
        x, y = micro_slice(batch, 0, rank, world, MICRO)
        if step == 2 and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        engine.backward(engine(x.half(), y.half()))
        held, scale = errors(), engine.loss_scale
        engine.step()
        if engine.loss_scale == 2 * scale:  # grown (not at the overflow): the buffers follow it
            out.setdefault("fp16_grown", []).append(any(bool(e.any()) for e in held) and
                                                    all(torch.equal(a, b * 2) for a, b in zip(errors(), held)))
        trace.append((engine.skipped_steps, engine.loss_scale, engine.memory_report()["loco_errors"]))
    out["fp16"] = trace
    out["fp16_finite"] = all(torch.isfinite(slot.master).all().item() for slot in engine.sharded_slots())
    return out


def test_loco_reset_save_load_rescale_and_overflow():
    for rank, out in enumerate(run_distributed(loco_bookkeeping, 2)):
        what = f"rank {rank}: {out}"
        assert [p[0] for p in out["pattern"]] == [p[1] for p in out["pattern"]] == [1, 2, 3, 4, 5], what
        assert [p[2] for p in out["pattern"]] == [True, True, False, True, True], what
        assert out["changed"] and out["loaded"] and out["restored"] and out["rescaled"], what
        assert not out["other_layout_loaded"] and out["other_layout_warned"] and out["after_other_layout"] == 0, what
        assert out["after_overflow"] == 0, what
        fp16 = out["fp16"]
        assert [t[0] for t in fp16] == [0, 0, 1, 1], what  # step 3 skipped on every rank
        assert fp16[2][1] == fp16[1][1] / 2, what  # scale halved
        assert fp16[1][2] > 0 and fp16[2][2] == 0 and fp16[3][2] > 0, what  # e dropped, then rebuilt
        assert out["fp16_finite"] and out.get("fp16_grown") and all(out["fp16_grown"]), what


def test_zeropp_misconfigurations_and_exact_user_gathers():
    changed = run_distributed(_misc, 4)
    assert sum(changed) == 2, changed  # exactly the two written elements, nothing else


def _misc() -> int:
    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    # qwZ never leaks into the fp32 masters: GatheredParameters (which may write back) sees
    # exact values, even for a parameter already gathered through int8 (the access below).
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=config(3, **QW))
    train(engine, world, rank, 1, steps=1)
    masters = [slot.master.clone() for slot in engine.sharded_slots()]
    weight = engine.module.fc1.weight
    float(weight.sum())  # gathered for access, through int8
    assert id(weight._zero) in engine.stage3.fetcher._lossy
    for param in (weight, engine.module.fc2.weight):
        with zerotrain.zero.GatheredParameters([param], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    param[0, 0] += 1.0
    changed = sum((before != slot.master).sum().item() for before, slot in zip(masters, engine.sharded_slots()))

    # Misconfigurations are named, a warning once for the job: by rank 0 (once), not by the other ranks.
    with pytest.raises(ValueError, match="zero_hpz_partition_size"):
        zerotrain.initialize(model=OddMLP(), config=config(3, zero_hpz_partition_size=3))
    for odd, said in (({"zero_quantized_weights": True}, "zero_quantized_weights has no effect"),
                      ({"zeropp_loco_param": {"err_beta": 0.5}}, "zeropp_loco_param has no effect")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # as a user sees them: each once per place
            zerotrain.initialize(model=OddMLP(), config=config(2, **odd))
        shown = [str(w.message) for w in caught if said in str(w.message)]
        assert len(shown) == (1 if rank == 0 else 0), (rank, shown)
    return changed
