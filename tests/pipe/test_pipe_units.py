"""The pipeline's parts in the pytest process (issue #48: fast tests for the mutation runs of `zerotrain.pipe`).

Where each schedule's pieces sit against torch's own stage-to-rank mappings; `schedule_class` against torch's
classes; a one-stage pipeline engine at a world of one trained against plain PyTorch on the same batches (its
micro-batches read, joined and averaged, the batch loss, eval_batch, the DeepSpeed-named accessors, a checkpoint
saved and loaded back); the pipeline GPT's layers against `zerotrain.models.gpt.GPT` itself. The multi-rank
behaviour (tied copies over stages, PP x DP) is tests/pipe/test_pipeline.py's launches.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from test_pipeline import CLIP, LR, MICRO, Reference, assert_weight_close, batches, config, gpt_config, reference


def _one_stage_engine(schedule: str, accumulation: int, seed: int, **extra):
    import zerotrain
    from zerotrain.pipe import PipelineModule
    from zerotrain.pipe.gpt import gpt_layers, gpt_loss

    module = PipelineModule(gpt_layers(gpt_config()), num_stages=1, loss_fn=gpt_loss, partition_method="uniform",
                            seed_layers=True, base_seed=seed)
    engine, _, _, _ = zerotrain.initialize(model=module, config=dict(config(schedule, 1, accumulation), **extra))
    return engine, module


@pytest.mark.parametrize("schedule", ["interleaved_1f1b"])
def test_a_one_stage_pipeline_trains_evaluates_and_resumes_as_plain_pytorch(tmp_path, world_of_one, schedule):
    """A world of one, one pipeline stage (`interleaved_1f1b`: two pieces on the one rank, the tied embedding held by
    both: its gradient divided once), 3 micro-batches a batch with active clipping against plain AdamW over the
    same batches (test_pipeline.py's reference): the batch losses, the global norms, eval_batch's loss (weights
    unchanged), the weights; a checkpoint saved before the last step and loaded into an engine built from other
    weights trains the last step as the uninterrupted run; the DeepSpeed-named accessors."""
    from test_pipeline import BASE_SEED, STEPS

    from models_for_tests import micro_slice

    accumulation = 3
    engine, module = _one_stage_engine(schedule, accumulation, BASE_SEED)
    ref_losses, ref_norms, ref_eval, ref_weights = reference(accumulation, 1)
    assert ref_norms[0] > 2 * CLIP  # clipping active
    assert (engine.stage_id, engine.num_stages, engine.is_first_stage(), engine.is_last_stage()) == (0, 1, True, True)
    assert engine.schedule_name == schedule
    assert (engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu(),
            engine.train_batch_size(), engine.dp_world_size) == (accumulation, MICRO, MICRO * accumulation, 1)
    losses, norms, reads = [], [], []
    for step, batch in enumerate(batches(MICRO * accumulation)):
        if step == STEPS - 1:
            engine.save_checkpoint(str(tmp_path), tag="resume", client_state={"data_step": step})

        def micro_batches(batch=batch):
            for index in range(accumulation + 1):  # one more than a batch: train_batch reads exactly its three
                reads.append(index)
                yield micro_slice(batch, index, 0, 1, MICRO)

        losses.append(float(engine.train_batch(micro_batches())))
        norms.append(engine.get_global_grad_norm())
    assert len(reads) == STEPS * accumulation
    assert (engine.global_steps, engine.global_samples) == (STEPS, STEPS * MICRO * accumulation)
    assert losses == pytest.approx(ref_losses, rel=1e-5) and norms == pytest.approx(ref_norms, rel=1e-5)
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    for name, ref in ref_weights.items():
        assert_weight_close(weights[name], ref, f"{schedule} {name}")
    first = batches(MICRO * accumulation)[0]
    evaluation = engine.eval_batch(iter([micro_slice(first, i, 0, 1, MICRO) for i in range(accumulation)]))
    assert float(evaluation) == pytest.approx(ref_eval[0], rel=1e-5)
    assert module.training  # eval_batch gives training mode back
    assert all(torch.equal(weights[n], p) for n, p in module.named_parameters())
    whole = engine.full_state_dict()  # every weight, the tied head's under its own position's name too
    assert sorted(set(whole) - set(ref_weights)) == ["4.wpe.weight", "4.wte.weight"], sorted(whole)
    assert all(torch.equal(whole[n], weights[n.replace("4.", "0.", 1)]) for n in whole)
    engine.close()

    resumed, module = _one_stage_engine(schedule, accumulation, BASE_SEED + 1)
    _, client_state = resumed.load_checkpoint(str(tmp_path), tag="resume")
    step = client_state["data_step"]
    assert (step, resumed.global_steps) == (STEPS - 1, STEPS - 1)
    batch = batches(MICRO * accumulation)[step]
    loss = float(resumed.train_batch(iter([micro_slice(batch, i, 0, 1, MICRO) for i in range(accumulation)])))
    assert loss == pytest.approx(ref_losses[-1], rel=1e-5)
    for name, parameter in module.named_parameters():
        assert_weight_close(parameter.detach(), ref_weights[name], f"{schedule} resumed {name}")
    resumed.close()
