"""Pipeline parallelism (zerotrain.pipe on torch.distributed.pipelining) trains exactly as one process does.

Every case trains the repository's GPT (its Blocks, a tied token embedding on the first stage used again as the
head on the last) split into pipeline pieces, with gradient accumulation (micro-batches of one batch) and active
gradient clipping, against plain single-process AdamW over the whole batches: losses, global gradient norms
(over every stage, the tied weight once) and weights within 1e-5; the tied copies equal on both stages.
One launch per world size: world 2 (PP2: 1F1B, interleaved 1F1B, interleaved zero-bubble with activation
checkpointing) and world 4
(PP2 x DP2 with ZeRO-1: 1F1B, interleaved 1F1B, ZBV zero-bubble). The world-4 launch also checkpoints: its 1F1B
case saves before its last step, and the same launch loads that checkpoint at PP1 x DP4 and PP4 x DP1 (world 4
has no PP2 x DP1; PP4 x DP1 changes the stage count and the data-parallel size at once) and trains the last step:
equal to the uninterrupted run, the tied head's copy read from the embedding's entries (stored once). The same
world-4 launch runs tests/pipe/hf_llama.py's cases: a Hugging Face Llama split from "pipeline_parallel_size" alone
(padded and packed micro-batches, tied and untied head), its checkpoint under the Hugging Face names read by
`from_pretrained`, resumed by a plain ZeRO run and that run's checkpoint by a PP4 pipeline.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from distributed import run_distributed
from models_for_tests import micro_slice

STEPS, MICRO, LR, CLIP, SEQ, BASE_SEED = 3, 2, 1e-2, 0.05, 8, 1234


def gpt_config():
    from zerotrain.models.gpt import GPTConfig
    # no biases: a key bias gets an exactly-zero gradient, whose rounding noise Adam would turn into lr-sized steps
    return GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=SEQ, n_inner=37, bias=False)


def batches(global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 64, (global_batch, SEQ), generator=generator),
             torch.randint(0, 64, (global_batch, SEQ), generator=generator)) for _ in range(STEPS)]


def config(schedule: str, stage: int, accumulation: int, **pipeline) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": CLIP, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},  # several buckets
            "pipeline": {"schedule": schedule, **pipeline}}


def train_cases(cases: list, save_dir: str = "") -> list:
    """On each rank: train every (schedule, ZeRO stage, accumulation) case; per case its losses, norms, this
    rank's named weights, which of them are replicas of a tied weight, and its grid place. With `save_dir`: the
    first case also saves a checkpoint after step STEPS - 1, and `resume` loads it at other shapes."""
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
        losses, norms = [], []
        for step, batch in enumerate(batches(MICRO * accumulation * dp)):
            if save_dir and not out and step == STEPS - 1:  # PP2 x DP2, ZeRO-1: saved before the last step
                engine.save_checkpoint(save_dir, tag="resume", client_state={"data_step": step})
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
                        global_steps=engine.global_steps))
        engine.close()  # the saving engine releases its save directory's lock
    if save_dir:  # the batch size: MICRO x accumulation x dp = 8 samples at every shape
        out += [resume(save_dir, 1, accumulation=1), resume(save_dir, 4, accumulation=4)]
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

    def __init__(self) -> None:
        super().__init__()
        from zerotrain.pipe import TiedLayerSpec
        from zerotrain.pipe.gpt import gpt_layers
        self.layers = nn.ModuleDict()
        self.steps = []
        tied: dict = {}
        for index, spec in enumerate(gpt_layers(gpt_config())):
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
    """Plain AdamW over the whole batches, each the mean of its micro-batch losses: per data-parallel rank the
    sum of its micro-batches' gradients over their count, then the mean over ranks, summed in that order as the
    engine sums (another order, e.g. one whole-batch backward, rounds differently: on a near-zero gradient element
    Adam turns that into weight differences of 5e-6, measured; any real error is orders of magnitude larger)."""
    from zerotrain.pipe.gpt import gpt_loss
    model = Reference()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    losses, norms = [], []
    count = accumulation * dp
    for batch in batches(MICRO * count):
        total, summed = 0.0, None
        for rank in range(dp):
            grads = None
            for index in range(accumulation):
                x, y = micro_slice(batch, index, rank, dp, MICRO)
                loss = gpt_loss(model(x), y)
                micro = torch.autograd.grad(loss, params)
                grads = micro if grads is None else [a + b for a, b in zip(grads, micro)]
                total += loss.item() / count
            grads = [g / accumulation for g in grads]
            summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
        for param, grad in zip(params, summed):
            param.grad = grad / dp
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


def test_pp2_schedules_match_single_process():
    # zero-bubble with activation checkpointing: recomputation under its separate input / weight backward passes
    cases = [("1f1b", 0, 2), ("interleaved_1f1b", 1, 4),
             ("interleaved_zero_bubble", 1, 2, {"activation_checkpoint_interval": 1})]
    check_against_reference(run_distributed(train_cases, 2, cases), 2)


def check_resumes(results: list, save_dir) -> None:
    """The checkpoint saved at PP2 x DP2 before the last step, loaded at PP1 x DP4 and PP4 x DP1: the last step
    continues exactly as the uninterrupted run (the reference), every weight and the tied copies."""
    from safetensors import safe_open
    keys = set()
    for path in (save_dir / "resume").glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            keys.update(handle.keys())
    last = len(gpt_layers_names()) - 1  # the tied head's position: stored once, under the embedding's name
    assert "0.wte.weight" in keys and "0.wte.weight/exp_avg_sq" in keys, sorted(keys)
    assert not any(key.startswith(f"{last}.") for key in keys), sorted(keys)
    ref_losses, _, _, ref_weights = reference(2, 2)
    for stages in (1, 4):
        per_rank = [got for rank in results for got in rank if got.get("resume") == stages]
        where = f"resumed at PP{stages} x DP{4 // stages}"
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
    check_resumes(gpt, tmp_path / "gpt")
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

    assert partition_balanced([1, 1, 1, 1, 1], 2) == [0, 2, 5]  # ties: the earlier cut
    assert partition_balanced([10, 1, 1, 1, 10], 3) == [0, 1, 4, 5]
    assert partition_balanced([0, 5, 5, 0], 2) == [0, 2, 4]
    layers = gpt_layers(gpt_config())
    # by type: the two Blocks are what counts, one per stage
    assert PipelineModule(layers, 2, partition_method="type:Block").partition(2) in ([0, 2, 5], [0, 3, 5])
    bounds = PipelineModule(layers, 2, partition_method="parameters").partition(2)
    assert bounds == [0, 2, 5]  # embedding + block | block + norm + head (the tied head counts again)
