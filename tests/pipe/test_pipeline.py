"""Pipeline parallelism (zerotrain.pipe on torch.distributed.pipelining) trains exactly as one process does.

Every case trains the repository's GPT (its Blocks, a tied token embedding on the first stage used again as the
head on the last) split into pipeline pieces, with gradient accumulation (micro-batches of one batch) and active
gradient clipping, against plain single-process AdamW over the whole batches: losses, global gradient norms
(over every stage, the tied weight once) and weights within 1e-5; the tied copies equal on both stages.
One launch per world size: world 2 (PP2: 1F1B, interleaved 1F1B, interleaved zero-bubble with activation
checkpointing; the 1F1B case saves asynchronously before its last step, resumed at PP2 and PP1 x DP2 exactly; fp16
with dynamic loss scaling against single-process fp16 with the same scaler, an overflow in a stage-1 gradient only
skipping the step on both stages; tests/pipe/hf_llama.py's LoRA Llama against single-process peft) and world 4
(PP2 x DP2 with ZeRO-1: 1F1B, interleaved 1F1B, ZBV zero-bubble). The world-4 launch also checkpoints: its 1F1B
case saves before its last step, and the same launch loads that checkpoint at PP1 x DP4 and PP4 x DP1 (world 4
has no PP2 x DP1; PP4 x DP1 changes the stage count and the data-parallel size at once) and trains the last step:
equal to the uninterrupted run, the tied head's copy read from the embedding's entries (stored once). The same
world-4 launch runs tests/pipe/hf_llama.py's cases: a Hugging Face Llama split from "pipeline_parallel_size" alone
(padded and packed micro-batches, tied and untied head), its checkpoint under the Hugging Face names read by
`from_pretrained`, resumed by a plain ZeRO run and that run's checkpoint by a PP4 pipeline. `zerotrain estimate`'s
per-stage accounting is checked without a launch.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from distributed import run_distributed
from models_for_tests import accumulated_gradients, micro_slice

STEPS, MICRO, LR, CLIP, SEQ, BASE_SEED = 3, 2, 1e-2, 0.05, 8, 1234


def gpt_config(tied: bool = True):
    from zerotrain.models.gpt import GPTConfig
    # no biases: a key bias gets an exactly-zero gradient, whose rounding noise Adam would turn into lr-sized steps
    return GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=SEQ, n_inner=37, bias=False,
                     tie_weights=tied)


def batches(global_batch: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 64, (global_batch, SEQ), generator=generator),
             torch.randint(0, 64, (global_batch, SEQ), generator=generator)) for _ in range(steps)]


def config(schedule: str, stage: int, accumulation: int, **pipeline) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": CLIP, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},  # several buckets
            "pipeline": {"schedule": schedule, **pipeline}}


def train_cases(cases: list, save_dir: str = "", async_save: bool = False, resume_stages: tuple = (1, 4)) -> list:
    """On each rank: train every (schedule, ZeRO stage, accumulation) case; per case its losses, norms, this
    rank's named weights, which of them are replicas of a tied weight, and its grid place. With `save_dir`: the
    first case also saves a checkpoint after step STEPS - 1 (in the background with `async_save`: the next
    train_batch fences it), and `resume` loads it at each of `resume_stages` pipeline sizes."""
    import zerotrain
    from zerotrain.pipe import PipelineModule
    from zerotrain.pipe.gpt import gpt_layers, gpt_loss
    from zerotrain.sharding import is_pipeline_replica

    world = int(os.environ["WORLD_SIZE"])
    out = []
    for schedule, stage, accumulation, *pipeline in cases:
        module = PipelineModule(gpt_layers(gpt_config()), num_stages=2, loss_fn=gpt_loss,
                                partition_method="uniform", seed_layers=True, base_seed=BASE_SEED)
        engine, _, _, _ = zerotrain.initialize(model=module, config=config(schedule, stage, accumulation,
                                                                          **(pipeline[0] if pipeline else {})))
        dp, dp_rank = world // 2, engine.topology.dp_rank
        rank = engine.topology.rank  # the grid: pipeline outermost, stages of world / pp consecutive ranks
        assert (engine.stage_id, dp_rank, engine.topology.dp_size) == (rank // dp, rank % dp, dp), rank
        calls = []  # forwards of this rank's Blocks: activation checkpointing recomputes each in backward
        for layer in module.children():  # (counted in forward itself: module hooks do not fire in the recompute)
            if type(layer).__name__ == "Block":
                layer.forward = lambda *args, forward=layer.forward: (calls.append(1), forward(*args))[1]
        losses, norms, pending = [], [], None
        for step, batch in enumerate(batches(MICRO * accumulation * dp)):
            if save_dir and not out and step == STEPS - 1:  # saved before the last step
                engine.save_checkpoint(save_dir, tag="resume", client_state={"data_step": step},
                                       async_save=async_save)
                pending = engine.last_save()[0]  # still being written while the last step trains (async)
            reads = []

            def micro_batches():
                for index in range(accumulation):
                    reads.append(index)
                    yield micro_slice(batch, index, dp_rank, dp, MICRO)

            data = micro_batches() if engine.is_first_stage() or engine.is_last_stage() else None
            losses.append(float(engine.train_batch(data)))
            assert len(reads) == (accumulation if data is not None else 0)
            norms.append(engine.get_global_grad_norm())
        recomputed = len(calls) > 1.5 * STEPS * accumulation * sum(type(m).__name__ == "Block" for m in module.children())
        assert recomputed == bool(pipeline and pipeline[0].get("activation_checkpoint_interval")), len(calls)
        # eval_batch: the same loss on every rank, forward only (weights unchanged)
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        first = batches(MICRO * accumulation * dp)[0]
        data = iter([micro_slice(first, i, dp_rank, dp, MICRO) for i in range(accumulation)])
        if schedule == "zbv_zero_bubble":  # torch's ZBV has no forward-only run: refused by name
            with pytest.raises(NotImplementedError, match="zbv_zero_bubble"):
                engine.eval_batch(data)
            evaluation = None
        else:
            evaluation = float(engine.eval_batch(data))
        assert all(torch.equal(before[n], p) for n, p in module.named_parameters())
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
        replicas = sorted(n for n, p in module.named_parameters() if is_pipeline_replica(p))
        out.append(dict(case=(schedule, stage, accumulation, *pipeline), losses=losses, norms=norms, eval=evaluation,
                        weights=weights, replicas=replicas, stage_id=engine.stage_id, dp_rank=dp_rank,
                        global_steps=engine.global_steps, pending=pending))
        engine.close()  # the saving engine releases its save directory's lock (after a pending save commits)
    # the batch size: MICRO x accumulation x dp = MICRO x 2 x world / 2 samples at every shape (accumulation =
    # the stage count: world / stages data-parallel ranks)
    out += [resume(save_dir, stages, accumulation=stages) for stages in (resume_stages if save_dir else ())]
    return out


def resume(save_dir: str, stages: int, accumulation: int) -> dict:
    """Load the PP2 x DP2 checkpoint at `stages` x (world / stages) and train its last step."""
    import zerotrain
    from zerotrain.pipe import PipelineModule
    from zerotrain.pipe.gpt import gpt_layers, gpt_loss
    from zerotrain.sharding import is_pipeline_replica

    module = PipelineModule(gpt_layers(gpt_config()), num_stages=stages, loss_fn=gpt_loss,
                            partition_method="uniform", seed_layers=True, base_seed=BASE_SEED + 1)  # other weights
    engine, _, _, _ = zerotrain.initialize(model=module, config=config("1f1b", 1, accumulation))
    _, client_state = engine.load_checkpoint(save_dir, tag="resume")
    step, steps = client_state["data_step"], engine.global_steps
    dp, dp_rank = engine.topology.dp_size, engine.topology.dp_rank
    batch = batches(MICRO * accumulation * dp)[step]
    data = iter([micro_slice(batch, i, dp_rank, dp, MICRO) for i in range(accumulation)])
    loss = float(engine.train_batch(data if engine.is_first_stage() or engine.is_last_stage() else None))
    return dict(resume=stages, loaded_steps=steps, loss=loss, global_steps=engine.global_steps,
                weights={n: p.detach().clone() for n, p in module.named_parameters()},
                replicas=sorted(n for n, p in module.named_parameters() if is_pipeline_replica(p)))


class Reference(nn.Module):
    """The same layers in one process (each built under seed base + index, as seed_layers builds them), tied
    positions sharing one module: plain PyTorch."""

    def __init__(self, config=None) -> None:
        super().__init__()
        from zerotrain.pipe import TiedLayerSpec
        from zerotrain.pipe.gpt import gpt_layers
        self.layers = nn.ModuleDict()
        self.steps = []
        tied: dict = {}
        for index, spec in enumerate(gpt_layers(config or gpt_config())):
            if isinstance(spec, TiedLayerSpec) and spec.key in tied:
                module = tied[spec.key]
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(BASE_SEED + index)
                    module = spec.build()
                if isinstance(spec, TiedLayerSpec):
                    tied[spec.key] = module
            self.layers[str(index)] = module
            self.steps.append((module, getattr(spec, "forward_fn", None)))

    def forward(self, x):
        for module, forward_fn in self.steps:
            x = forward_fn(module, x) if forward_fn is not None else module(x)
        return x


def reference(accumulation: int, dp: int) -> tuple[list, list, list, dict]:
    """Plain AdamW over the whole batches, each the mean of its micro-batch losses, gradients summed in the
    engine's order (`accumulated_gradients`)."""
    from zerotrain.pipe.gpt import gpt_loss
    model = Reference()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    losses, norms = [], []
    count = accumulation * dp
    for batch in batches(MICRO * count):
        def micro_loss(index: int, rank: int) -> torch.Tensor:
            x, y = micro_slice(batch, index, rank, dp, MICRO)
            return gpt_loss(model(x), y)

        grads, total = accumulated_gradients(params, micro_loss, accumulation, dp)
        for param, grad in zip(params, grads):
            param.grad = grad
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    model.eval()
    x, y = batches(MICRO * count)[0]
    with torch.no_grad():
        evaluation = gpt_loss(model(x), y).item()
    return losses, norms, [evaluation], {n.removeprefix("layers."): p.detach() for n, p in model.named_parameters()}


def assert_weight_close(got: torch.Tensor, ref: torch.Tensor, where: str) -> None:
    """||got - ref|| / ||ref|| <= 1e-5 per tensor. Not element by element: this tiny GPT has elements whose
    gradient is a near-zero sum of large terms, chaotic under rounding (a 1e-6 relative perturbation of every
    gradient moves such an element's by 2e-4 one step later, measured), which Adam turns into lr-sized steps:
    one element of 1.attn.c_proj.weight differs by 4e-6 at PP2 x DP2, the tensor by 3e-6 relative. A real
    error (a lost micro-batch, an unsummed tie, a wrong norm) moves whole tensors by far more."""
    distance = float((got.float() - ref.float()).norm() / ref.float().norm())
    assert distance <= 1e-5, f"{where}: relative distance {distance:.2e}"


def check_against_reference(results: list, world: int) -> None:
    dp = world // 2
    ranks = len(results)
    for case_index in range(sum("case" in got for got in results[0])):
        per_rank = [results[rank][case_index] for rank in range(ranks)]
        schedule, stage, accumulation = per_rank[0]["case"][:3]
        where = f"world {world}, {schedule}, ZeRO-{stage}, accumulation {accumulation}"
        ref_losses, ref_norms, ref_eval, ref_weights = reference(accumulation, dp)
        for got in per_rank:  # the batch mean loss and the norm reach every rank
            assert got["global_steps"] == STEPS, where
            for what, ref in (("losses", ref_losses), ("norms", ref_norms), ("eval", ref_eval)):
                if got[what] is None:  # eval refused (ZBV)
                    continue
                values = got[what] if isinstance(got[what], list) else [got[what]]
                assert len(values) == len(ref), (where, what)
                for value, expected in zip(values, ref):
                    assert abs(value - expected) <= 1e-5 * abs(expected), (where, what, values, ref)
        assert ref_norms[0] > 2 * CLIP, "clipping must be active for the norm to matter"
        joined: dict = {}
        for got in per_rank:
            owned = {n: w for n, w in got["weights"].items() if n not in got["replicas"]}
            joined.update(owned)
        assert sorted(joined) == sorted(ref_weights), (where, sorted(joined), sorted(ref_weights))
        for name, ref in ref_weights.items():
            assert_weight_close(joined[name], ref, f"{where} {name}")
        # the tied head's copy on the last stage is the embedding's, and counted only there (ZBV: rank 0 holds
        # both ends, one module, no copy)
        for got in per_rank:
            assert bool(got["replicas"]) == (got["stage_id"] == 1 and schedule != "zbv_zero_bubble"), where
            for name in got["replicas"]:
                owner_name = "0." + name.split(".", 1)[1]
                assert_weight_close(got["weights"][name], ref_weights[owner_name], f"{where} replica {name}")


FP16_STEPS, OVERFLOW_STEP = 4, 2


def fp16_config() -> dict:
    # hysteresis 1: the overflow halves the scale at once (the scaler's own rules are tests/test_loss_scaler.py's)
    return dict(config("1f1b", 1, 2), fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})


def _overflow(grad: torch.Tensor) -> torch.Tensor:
    return torch.full_like(grad, float("inf"))


def fp16_case() -> dict:
    """World 2: the untied GPT at PP2 in fp16 (dynamic loss scale, 1F1B, accumulation 2, active clipping). At step
    OVERFLOW_STEP the gradient of the final LayerNorm's weight (layer 3, on stage 1 only) is made inf: every stage
    must skip that step (stage 0's gradients are finite) and halve the scale. Per step the loss, the norm and the
    loss scale; rank 0 also the whole fp32 masters of both stages (`full_state_dict`)."""
    import zerotrain
    from zerotrain.pipe import PipelineModule
    from zerotrain.pipe.gpt import gpt_layers, gpt_loss

    module = PipelineModule(gpt_layers(gpt_config(tied=False)), num_stages=2, loss_fn=gpt_loss,
                            partition_method="uniform", seed_layers=True, base_seed=BASE_SEED)
    engine, _, _, _ = zerotrain.initialize(model=module, config=fp16_config())
    assert all(p.dtype == torch.float16 for p in module.parameters())
    losses, norms, scales = [], [], []
    for step, batch in enumerate(batches(MICRO * 2, FP16_STEPS)):
        hook = None
        if step == OVERFLOW_STEP and engine.is_last_stage():
            hook = module.get_submodule("3").weight.register_hook(_overflow)
        losses.append(float(engine.train_batch(iter([micro_slice(batch, i, 0, 1, MICRO) for i in range(2)]))))
        norms.append(engine.get_global_grad_norm())
        scales.append(engine.loss_scale)
        if hook is not None:
            hook.remove()
    weights = engine.full_state_dict()  # rank 0: every stage's masters
    half = engine.consolidated_16bit_state_dict()  # rank 0: every stage's, in fp16
    engine.close()
    return dict(losses=losses, norms=norms, scales=scales, stage_id=engine.stage_id, weights=weights, half=half)


def fp16_reference() -> dict:
    """Single-process fp16 with fp32 masters and the same loss scaler (`zerotrain.precision.LossScaler` from the
    same config): gradients of the scaled loss in fp16, summed and divided in fp16 as the engine's buffer; an
    overflow skips the step; else unscaled in fp32, clipped, AdamW on the masters, copied back to fp16."""
    from zerotrain.config import load_config
    from zerotrain.pipe.gpt import gpt_loss
    from zerotrain.precision import LossScaler

    model = Reference(gpt_config(tied=False))
    names = [n.removeprefix("layers.") for n, _ in model.named_parameters()]
    # the fp32 masters start from the fp16 weights, as the engine makes them (and DeepSpeed's fp16 optimizer)
    masters = [p.detach().half().float() for p in model.parameters()]
    model.half()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(masters, lr=LR, weight_decay=0.01)
    scaler = LossScaler.from_config(load_config(fp16_config()).fp16)
    losses, norms, scales = [], [], []
    norm_weight = next(i for i, p in enumerate(params) if p is model.layers["3"].weight)
    for step, batch in enumerate(batches(MICRO * 2, FP16_STEPS)):
        def micro_loss(index: int, rank: int) -> torch.Tensor:
            x, y = micro_slice(batch, index, rank, 1, MICRO)
            return gpt_loss(model(x), y)

        grads, total = accumulated_gradients(params, micro_loss, 2, 1, scale=scaler.scale)
        if step == OVERFLOW_STEP:  # what the engine's hook does to that gradient
            grads[norm_weight] = _overflow(grads[norm_weight])
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        norm = None
        if not overflow:
            for master, grad in zip(masters, grads):
                master.grad = grad.float() / scaler.scale
            norm = float(torch.nn.utils.clip_grad_norm_(masters, CLIP))
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for param, master in zip(params, masters):
                    param.copy_(master)
        scaler.update(overflow)
        losses.append(total)
        norms.append(norm)
        scales.append(scaler.scale)
    return dict(losses=losses, norms=norms, scales=scales, weights=dict(zip(names, masters)))


def check_fp16(results: list) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fp16 kernels round by their blocking: one thread, as each rank runs
    try:
        ref = fp16_reference()
    finally:
        torch.set_num_threads(threads)
    where = "world 2, PP2 fp16"
    assert ref["norms"][0] > 2 * CLIP, "clipping must be active for the norm to matter"
    assert ref["norms"][OVERFLOW_STEP] is None and ref["scales"][OVERFLOW_STEP] == ref["scales"][0] / 2, ref
    for got in results:  # on every rank: the same losses, norms and scale, the overflow step skipped
        assert got["scales"] == ref["scales"], (where, got["stage_id"], got["scales"], ref["scales"])
        for what in ("losses", "norms"):
            for step, (value, expected) in enumerate(zip(got[what], ref[what], strict=True)):
                if expected is not None:
                    assert abs(value - expected) <= 1e-5 * abs(expected), (where, what, step, got[what], ref[what])
    weights = results[0]["weights"]  # stage 0's included: had it stepped on the overflow, they would differ
    assert sorted(weights) == sorted(ref["weights"]), (where, sorted(weights))
    for name, expected in ref["weights"].items():
        assert_weight_close(weights[name], expected, f"{where} {name}")
    # DeepSpeed's consolidated_16bit_state_dict: every stage's weights in the training dtype (the masters cast) on
    # global rank 0 only (stage 1 is rank 1: its own dp rank 0), none of them missing
    half = results[0]["half"]
    assert results[1]["half"] == {} and sorted(half) == sorted(ref["weights"]), (where, sorted(half))
    for name, expected in ref["weights"].items():
        assert half[name].dtype == torch.float16, (where, name, half[name].dtype)
        assert torch.equal(half[name], weights[name].half()), (where, name)


def world2_cases(cases: list, save_dir: str, lora_dir: str) -> dict:
    """The world-2 launch: the GPT cases (the first saves asynchronously before its last step, resumed at PP2 x
    DP1 and PP1 x DP2), the fp16 case and tests/pipe/hf_llama.py's LoRA case."""
    from hf_llama import lora_case
    return {"gpt": train_cases(cases, save_dir, async_save=True, resume_stages=(2, 1)), "fp16": fp16_case(),
            "lora": lora_case(lora_dir)}


@pytest.mark.timeout(600)  # one world-2 launch of 8 engines and their references
def test_pp2_schedules_fp16_lora_async_save_match_single_process(tmp_path):
    # zero-bubble with activation checkpointing: recomputation under its separate input / weight backward passes
    from hf_llama import check_lora_case
    cases = [("1f1b", 0, 2), ("interleaved_1f1b", 1, 4),
             ("interleaved_zero_bubble", 1, 2, {"activation_checkpoint_interval": 1})]
    (tmp_path / "gpt").mkdir()
    (tmp_path / "lora").mkdir()
    results = run_distributed(world2_cases, 2, cases, str(tmp_path / "gpt"), str(tmp_path / "lora"), timeout=300)
    gpt = [rank["gpt"] for rank in results]
    check_against_reference(gpt, 2)
    assert [rank[0]["pending"] for rank in gpt] == [True, True]  # async: still being written when the call returned
    check_resumes(gpt, tmp_path / "gpt", 2, (2, 1))
    check_fp16([rank["fp16"] for rank in results])
    check_lora_case([rank["lora"] for rank in results], tmp_path / "lora")


def check_resumes(results: list, save_dir, world: int, stages_list: tuple) -> None:
    """The checkpoint saved at PP2 x DP(world / 2) before the last step, loaded at each of `stages_list` pipeline
    sizes x (world / stages) data-parallel ranks: the last step continues exactly as the uninterrupted run (the
    reference), every weight and the tied copies."""
    from safetensors import safe_open
    keys = set()
    for path in (save_dir / "resume").glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            keys.update(handle.keys())
    last = len(gpt_layers_names()) - 1  # the tied head's position: stored once, under the embedding's name
    assert "0.wte.weight" in keys and "0.wte.weight/exp_avg_sq" in keys, sorted(keys)
    assert not any(key.startswith(f"{last}.") for key in keys), sorted(keys)
    ref_losses, _, _, ref_weights = reference(2, world // 2)
    for stages in stages_list:
        per_rank = [got for rank in results for got in rank if got.get("resume") == stages]
        where = f"resumed at PP{stages} x DP{world // stages}"
        assert len(per_rank) == world, where
        joined = {}
        for got in per_rank:
            assert (got["loaded_steps"], got["global_steps"]) == (STEPS - 1, STEPS), where
            assert abs(got["loss"] - ref_losses[-1]) <= 1e-5 * abs(ref_losses[-1]), (where, got["loss"], ref_losses)
            joined.update({n: w for n, w in got["weights"].items() if n not in got["replicas"]})
            for name in got["replicas"]:  # the head's copy on the last stage, loaded from the embedding's entries
                assert_weight_close(got["weights"][name], ref_weights["0." + name.split(".", 1)[1]], f"{where} {name}")
        assert sorted(joined) == sorted(ref_weights), where
        for name, ref in ref_weights.items():
            assert_weight_close(joined[name], ref, f"{where} {name}")
        assert any(got["replicas"] for got in per_rank) == (stages > 1), where


def gpt_layers_names() -> list:
    from zerotrain.pipe.gpt import gpt_layers
    return gpt_layers(gpt_config())


def world4_cases(cases: list, save_dir: str, hf_save_dir: str) -> dict:
    """The world-4 launch: the GPT cases and tests/pipe/hf_llama.py's Hugging Face Llama cases."""
    from hf_llama import hf_cases
    return {"gpt": train_cases(cases, save_dir), "hf": hf_cases(hf_save_dir)}


@pytest.mark.timeout(600)  # one world-4 launch of 9 engines (GPT and Llama cases) and their references
def test_pp2_dp2_zero1_gpt_and_hf_llama_match_single_process(tmp_path):
    # ZBV: pieces in a V, so rank 0 holds the embedding and the head, one tied module used twice on one rank.
    # The first case saves before its last step; the same launch resumes at PP1 x DP4 and PP4 x DP1.
    # The same launch splits a Hugging Face Llama from "pipeline_parallel_size" (tests/pipe/hf_llama.py).
    from hf_llama import check_hf_cases
    cases = [("1f1b", 1, 2), ("interleaved_1f1b", 1, 2), ("zbv_zero_bubble", 1, 4)]
    (tmp_path / "gpt").mkdir()
    (tmp_path / "hf").mkdir()
    results = run_distributed(world4_cases, 4, cases, str(tmp_path / "gpt"), str(tmp_path / "hf"), timeout=300)
    gpt = [rank["gpt"] for rank in results]
    check_against_reference(gpt, 4)
    assert [rank[0]["pending"] for rank in gpt] == [False] * 4  # a synchronous save: committed on return
    check_resumes(gpt, tmp_path / "gpt", 4, (1, 4))
    check_hf_cases([rank["hf"] for rank in results], tmp_path / "hf")


def test_refusals_name_the_key():
    import zerotrain
    from zerotrain.config import ConfigError
    from zerotrain.pipe import PipelineModule
    from zerotrain.pipe.gpt import gpt_layers, gpt_loss

    layers = gpt_layers(gpt_config())  # 5 layers
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage: 3 with pipeline parallelism is refused"):
        zerotrain.initialize(model=PipelineModule(layers, num_stages=2, loss_fn=gpt_loss),
                             config=config("1f1b", 3, 2))
    with pytest.raises(ValueError, match=r"5 layers cannot fill num_stages=6"):
        PipelineModule(layers, num_stages=6, loss_fn=gpt_loss)
    with pytest.raises(ValueError, match=r"5 layers cannot fill 6 pipeline pieces.*stages_per_rank=2"):
        zerotrain.initialize(model=PipelineModule(layers, num_stages=3, loss_fn=gpt_loss),
                             config=config("interleaved_1f1b", 1, 3))
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size: 2 needs a zerotrain\.pipe\.PipelineModule"):
        zerotrain.initialize(model=nn.Linear(2, 2), config=dict(config("1f1b", 1, 1), pipeline_parallel_size=2))
    with pytest.raises(ValueError, match=r"partition_method must be"):
        PipelineModule(layers, num_stages=2, partition_method="best")
    # tensor / sequence parallelism inside a stage: not yet, refused by the key
    with pytest.raises(ConfigError, match=r"pipeline parallelism with tensor_parallel\.autotp_size > 1"):
        zerotrain.initialize(model=PipelineModule(layers, num_stages=2, loss_fn=gpt_loss),
                             config=dict(config("1f1b", 1, 1), tensor_parallel={"autotp_size": 2}))
    with pytest.raises(ConfigError, match=r"sequence_parallel_size > 1 is not available"):
        zerotrain.initialize(model=PipelineModule(layers, num_stages=2, loss_fn=gpt_loss),
                             config=dict(config("1f1b", 1, 1), sequence_parallel_size=2))
    # a Hugging Face model the split does not know: refused naming its model_type (GPT-2's blocks differ)
    import transformers
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size: splitting a GPT2LMHeadModel \(model_type 'gpt2'\)"):
        zerotrain.initialize(model=gpt2, config=dict(config("1f1b", 1, 1), pipeline_parallel_size=2))


def test_partition_methods():
    from zerotrain.pipe import PipelineModule
    from zerotrain.pipe.gpt import gpt_layers
    from zerotrain.pipe.module import partition_balanced

    assert partition_balanced([1, 1, 1, 1, 1], 2) == [0, 3, 5]  # ties: the later cut (DeepSpeed's)
    assert partition_balanced([10, 1, 1, 1, 10], 3) == [0, 1, 4, 5]
    assert partition_balanced([0, 5, 5, 0], 2) == [0, 2, 4]
    layers = gpt_layers(gpt_config())
    # by type: the two Blocks are what counts, one per stage
    assert PipelineModule(layers, 2, partition_method="type:Block").partition(2) in ([0, 2, 5], [0, 3, 5])
    bounds = PipelineModule(layers, 2, partition_method="parameters").partition(2)
    assert bounds == [0, 2, 5]  # embedding + block | block + norm + head (the tied head counts again)


class _FrozenLinear(nn.Linear):
    """A layer that freezes itself when built (a LayerSpec's frozen layer, built on the meta device for the cut)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.requires_grad_(False)


def test_parameters_partition_counts_trainable_parameters_only():
    """"parameters" balances trainable parameters only, as DeepSpeed's `_count_layer_params` (requires_grad):
    frozen layers, built ones and LayerSpecs, weigh nothing in the cut (counting them cuts elsewhere)."""
    from zerotrain.pipe import LayerSpec, PipelineModule

    frozen = nn.Linear(100, 4).requires_grad_(False)  # 404 frozen
    layers = [LayerSpec(_FrozenLinear, 64, 64),  # 4160 frozen
              nn.Linear(4, 100), LayerSpec(nn.Linear, 4, 100),  # 500 + 500 trainable
              frozen, nn.Linear(4, 4)]  # 404 frozen, 20 trainable
    module = PipelineModule(layers, 2, partition_method="parameters")
    assert [[trainable for _, trainable in layer] for layer in module.layer_parameters()] == [
        [False, False], [True, True], [True, True], [False, False], [True, True]]
    # trainable [0, 500, 500, 0, 20]: 500 | 520 is the only best cut (every parameter counted: 4160 | 1424)
    assert module.partition(2) == [0, 2, 5]


def test_estimate_per_stage(tmp_path, capsys):
    """`zerotrain estimate` with `pipeline_parallel_size`: the engine's cut (embedding first, head last, every layer
    once), each stage's parameters, its share of one micro-batch's activations (they add up to the whole model's)
    and the micro-batches each schedule holds in flight there: GPipe m on every stage, 1F1B min(m, p - s), the
    multi-piece schedules read off torch's order of actions."""
    import json

    import transformers

    from zerotrain.cli import main
    from zerotrain.estimate import estimate
    from zerotrain.pipe.schedule import in_flight

    assert in_flight("gpipe", 2, 4) == [4, 4]
    assert in_flight("1f1b", 2, 4) == [2, 1] and in_flight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2) == [2, 2, 2, 1]  # fewer micro-batches than stages
    assert in_flight("looped_bfs", 2, 4, 2) == [4, 4]  # every forward of every piece before the first backward
    # interleaved 1F1B (p=2, m=4, 2 pieces per rank): rank 0 runs (2-1)*2 + 2*(2-1-0) = 4 piece-forwards, then
    # forward + backward in turn (5 held: 2.5 whole shares); rank 1 2 + 0, then 3 held
    assert in_flight("interleaved_1f1b", 2, 4, 2) == [2.5, 1.5]
    for name in ("interleaved_zero_bubble", "zbv_zero_bubble"):  # deferred weight passes: never above GPipe's
        flights = in_flight(name, 2, 4, 2)
        assert all(0 < f <= 4 for f in flights) and flights[0] >= flights[1], (name, flights)

    llama = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                     tie_word_embeddings=False)
    llama.save_pretrained(tmp_path / "llama")
    whole_model = transformers.LlamaForCausalLM(llama)
    whole = sum(p.numel() for p in whole_model.parameters())

    def run(schedule: str) -> dict:
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "pipeline_parallel_size": 2,
                  "zero_optimization": {"stage": 1}, "pipeline": {"schedule": schedule}}
        (tmp_path / f"{schedule}.json").write_text(json.dumps(config))
        return estimate(str(tmp_path / "llama"), str(tmp_path / f"{schedule}.json"), 4, device_type="cpu",
                        seq_len=16)

    result = run("1f1b")
    pipe = result["pipeline"]
    stages = pipe["per_stage"]
    assert (result["world_size"], result["dp_size"], pipe["ranks_per_stage"]) == (4, 2, 2)
    assert [s["layers"] for s in stages] == [[0, 1, 2], [3, 4, 5, 6]]  # by parameters: embedding + 2 | 2 + norm + head
    assert stages[0]["parameters"] + stages[1]["parameters"] == whole == result["parameters"]
    assert stages[0]["parameters"] == sum(p.numel() for n, p in whole_model.named_parameters()
                                          if n.startswith(("model.embed_tokens.", "model.layers.0.", "model.layers.1.")))
    assert [s["in_flight"] for s in stages] == [2, 1] and pipe["bubble_fraction"] == pytest.approx(1 / 5)
    acts = result["activations"]
    assert sum(s["activations_per_micro_batch"] for s in stages) == acts["without_checkpointing"] > 0
    assert stages[1]["activations_per_micro_batch"] > stages[0]["activations_per_micro_batch"]  # the head's logits
    for stage in stages:
        assert stage["activations_in_flight"] == stage["activations_per_micro_batch"] * stage["in_flight"]
        assert 0 < stage["activations_per_micro_batch_checkpointed"] < stage["activations_per_micro_batch"]
        assert stage["device_states"] > 0
    # the table is a rank of the fullest stage; ZeRO-2/3 (refused with a pipeline) are not offered
    assert {o["stage"] for o in result["options"]} == {0, 1}
    gpipe = run("gpipe")["pipeline"]["per_stage"]
    assert [s["in_flight"] for s in gpipe] == [4, 4]
    assert gpipe[0]["activations_in_flight"] == 2 * stages[0]["activations_in_flight"]
    assert main(["estimate", "--model", str(tmp_path / "llama"), "--config", str(tmp_path / "1f1b.json"),
                 "--world", "4", "--device", "cpu", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages x 2 data-parallel ranks, 1f1b" in out and "stage 1: layers 3-6" in out, out
    assert main(["estimate", "--model", str(tmp_path / "llama"), "--config", str(tmp_path / "1f1b.json"),
                 "--world", "3"]) == 2
    assert "pipeline_parallel_size: 2 does not divide the world size 3" in capsys.readouterr().err
