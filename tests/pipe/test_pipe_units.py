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

from models_for_tests import micro_slice
from test_pipeline import CLIP, MICRO, assert_weight_close, batches, config, gpt_config, reference


def test_each_schedules_pieces_sit_where_torch_places_its_stages():
    """Placement against torch.distributed.pipelining's own mapping (loop for the multi-piece schedules, V for ZBV):
    the pieces of each rank, the rank of each piece, the first stage's and the last stage's rank."""
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping, generate_stage_to_rank_mapping

    from zerotrain.pipe.schedule import Placement

    for pp in (1, 2, 3, 4):
        for per_rank, v_shape in ((1, False), (2, False), (3, False), (2, True)):
            placement = Placement(pp, per_rank, v_shape=v_shape)
            where = (pp, per_rank, v_shape)
            pieces = pp * per_rank
            style = "v" if v_shape else "loop"
            assert placement.pieces == pieces, where
            stage_to_rank = generate_stage_to_rank_mapping(pp, pieces, style=style)
            assert [placement.rank_of(p) for p in range(pieces)] == [stage_to_rank[p] for p in range(pieces)], where
            rank_to_stages = generate_rank_to_stage_mapping(pp, pieces, style=style)
            assert [placement.pieces_of(r) for r in range(pp)] == [rank_to_stages[r] for r in range(pp)], where
            assert (placement.first_rank, placement.last_rank) == (stage_to_rank[0], stage_to_rank[pieces - 1]), where
    assert Placement(3, 2, v_shape=True).last_rank == 0  # the V: the first and the last piece share rank 0
    assert Placement(3, 2).last_rank == 2


def test_each_schedule_name_is_torchs_class_of_that_schedule():
    from torch.distributed import pipelining

    from zerotrain.config.schema import PIPELINE_SCHEDULES
    from zerotrain.pipe.schedule import schedule_class

    expected = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
                "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B, "looped_bfs": pipelining.ScheduleLoopedBFS,
                "interleaved_zero_bubble": pipelining.ScheduleInterleavedZeroBubble,
                "zbv_zero_bubble": pipelining.ScheduleZBVZeroBubble}
    assert sorted(PIPELINE_SCHEDULES) == sorted(expected)
    for name, cls in expected.items():
        assert schedule_class(name) is cls, name


def test_in_flight_of_the_one_piece_schedules_at_every_rank():
    """GPipe holds every micro-batch on every rank; 1F1B min(m, pp - r) (its warm-up of pp - 1 - r forwards)."""
    from zerotrain.pipe.schedule import in_flight

    assert in_flight("gpipe", 3, 5) == [5.0, 5.0, 5.0]
    assert in_flight("1f1b", 3, 5) == [3.0, 2.0, 1.0]
    assert in_flight("1f1b", 3, 2) == [2.0, 2.0, 1.0]
    # a multi-piece schedule counts a piece as 1 / per_rank of the rank's share: looped BFS holds every forward
    assert in_flight("looped_bfs", 2, 4, 2) == [4.0, 4.0]
    assert in_flight("looped_bfs", 2, 2, 2) == [2.0, 2.0]
    assert in_flight("looped_bfs", 4, 2, 2) == [2.0] * 4  # fewer micro-batches than ranks: one round of them
    # interleaved 1F1B (Megatron's): rank r's warm-up is 2 (pp - 1 - r) + (per_rank - 1) pp piece-forwards, one more
    # before the first backward frees one, capped by the m x per_rank forwards of the batch
    for pp, m in ((2, 2), (2, 4), (3, 6), (4, 4), (4, 8)):
        expected = [min(2 * (pp - 1 - r) + pp + 1, 2 * m) / 2 for r in range(pp)]
        assert in_flight("interleaved_1f1b", pp, m, 2) == expected, (pp, m)


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


def test_the_pipeline_gpts_layers_compute_what_the_gpt_computes():
    """`pipe.gpt`'s layers (built from their specs, a tied head using the embedding's module) given the weights of a
    `zerotrain.models.gpt.GPT`: the same logits and the same loss (targets with -100 ignored), in training mode with
    dropout under the same seed too; its embeddings and head drawn N(0, 0.02) as the GPT's."""
    from zerotrain.models.gpt import GPT, GPTConfig
    from zerotrain.pipe import TiedLayerSpec
    from zerotrain.pipe.gpt import gpt_layers, gpt_loss

    for tied, bias, dropout in ((True, False, 0.0), (False, True, 0.2)):
        cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=8, n_inner=37, bias=bias,
                        tie_weights=tied, dropout=dropout)
        torch.manual_seed(0)
        specs = gpt_layers(cfg)
        assert len(specs) == cfg.n_layer + 3
        assert isinstance(specs[0], TiedLayerSpec) == isinstance(specs[-1], TiedLayerSpec) == tied
        built: dict = {}
        steps = []
        for spec in specs:
            key = spec.key if isinstance(spec, TiedLayerSpec) else None
            module = built[key] if key in built else spec.build()
            if key is not None:
                built[key] = module
            steps.append((module, getattr(spec, "forward_fn", None)))
        embedding, blocks, norm, head = steps[0][0], [m for m, _ in steps[1:-2]], steps[-2][0], steps[-1][0]
        assert (head is embedding) == tied
        for name, weight in (("wte", embedding.wte.weight.detach()), ("wpe", embedding.wpe.weight.detach()),
                             ("head", None if tied else head.weight.detach())):
            if weight is not None:  # GPT-2's N(0, 0.02)
                assert abs(float(weight.mean())) < 0.005 and 0.016 < float(weight.std()) < 0.024, (name, tied)
        gpt = GPT(cfg)
        with torch.no_grad():
            gpt.transformer.wte.weight.copy_(embedding.wte.weight)
            gpt.transformer.wpe.weight.copy_(embedding.wpe.weight)
            for mine, theirs in zip(blocks, gpt.transformer.h, strict=True):
                theirs.load_state_dict(mine.state_dict())
            gpt.transformer.ln_f.load_state_dict(norm.state_dict())
            if not tied:
                gpt.lm_head.weight.copy_(head.weight)
        idx = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
        targets = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(2))
        targets[0, :5] = -100
        for training in (False, True) if dropout else (False,):
            gpt.train(training)
            for module, _ in steps:
                module.train(training)
            torch.manual_seed(3)
            x = idx
            for module, forward_fn in steps:
                x = forward_fn(module, x) if forward_fn is not None else module(x)
            torch.manual_seed(3)
            ref_logits, ref_loss = gpt(idx, targets)
            where = (tied, training)
            torch.testing.assert_close(x, ref_logits, rtol=1e-5, atol=1e-6, msg=str(where))
            torch.testing.assert_close(gpt_loss(x, targets), ref_loss, rtol=1e-5, atol=0, msg=str(where))


def test_a_split_llama_on_one_rank_computes_the_models_loss_under_its_names():
    """`pipe.hf`: a tiny Llama (untied on left-padded micro-batches, tied on packed ones, a tied one with peft's LoRA)
    split into 2 pieces both built on this rank: the pieces in order give the model's own loss (its
    `loss_function`, the mask or the position ids carried between the layers), every parameter under the model's
    name, the cut DeepSpeed's `partition_balanced` (zerotrain's copy) over every layer's parameter count (frozen
    ones too), the checkpoint's config the model's; `pipeline_inputs`' defaults; what `pipeline_model` splits and
    what it refuses."""
    from hf_llama import MICRO as HF_MICRO
    from hf_llama import batches as hf_batches
    from hf_llama import llama, lora_llama, model_inputs

    from zerotrain.config import ConfigError
    from zerotrain.pipe.hf import CausalLMPipeline, causal_lm_pipeline, pipeline_inputs, pipeline_model, splittable
    from zerotrain.runtime.utils import partition_balanced  # DeepSpeed's cut (test_deepspeed_pipeline.py compares)

    for tied, packed, lora in ((False, False, False), (True, True, False), (True, False, True)):
        model = lora_llama(tied) if lora else llama(tied)
        where = (tied, packed, lora)
        names = sorted(n for n, _ in model.named_parameters())
        inner = model.get_base_model() if lora else model
        layers = [inner.model.embed_tokens, *inner.model.layers, inner.model.norm, inner.lm_head]
        counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        assert splittable(model) and (pipeline_model(model, 1) is model), where
        pipe = causal_lm_pipeline(model, 2)
        assert pipe.config is inner.config and pipe.config.architectures == ["LlamaForCausalLM"], where
        assert pipe.generation_config is inner.generation_config, where
        assert pipe.partition(2) == partition_balanced(counts, 2), where
        assert pipe.partition(3) == partition_balanced(counts, 3), where
        pipe.build([0, 1], lambda piece: 0, 2)
        assert sorted(n for n, _ in pipe.named_parameters()) == names, where
        ids, mask, positions, labels = micro_slice(hf_batches(HF_MICRO * 2, packed)[0], 1, 0, 1, HF_MICRO)
        given = model_inputs(ids, mask, positions, packed)
        inputs, targets = pipeline_inputs({**given, "labels": labels})
        assert torch.equal(targets, labels) and torch.equal(inputs[0], ids), where
        # what the batch leaves out: an all-ones mask (packed) or 0..seq-1 (padded)
        assert torch.equal(inputs[1], mask if not packed else torch.ones_like(ids)), where
        assert torch.equal(inputs[2], positions if packed else torch.arange(ids.shape[1]).repeat(ids.shape[0], 1))
        expected = model(**given, labels=labels).loss
        torch.testing.assert_close(pipe.loss_fn(pipe(*inputs), targets), expected, rtol=1e-5, atol=0, msg=str(where))
        # the first stage takes (input_ids[, attention_mask[, position_ids]]): the defaults the model's forward takes
        if packed:
            expected = model(input_ids=ids, labels=labels).loss
            for given_inputs in ((ids,), (ids, torch.ones_like(ids))):
                torch.testing.assert_close(pipe.loss_fn(pipe(*given_inputs), targets), expected, rtol=1e-5, atol=0)
    assert isinstance(pipeline_model(llama(False), 2), CausalLMPipeline)
    plain = nn.Linear(2, 2)
    assert pipeline_model(plain, 2) is plain and not splittable(plain)
    import transformers
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2,
                                                                n_positions=8))
    assert not splittable(gpt2)
    with pytest.raises(ConfigError, match="model_type 'gpt2'") as error:
        pipeline_model(gpt2, 2)
    assert error.value.key == "pipeline_parallel_size"
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=1))
    assert splittable(qwen)
    with pytest.raises(ConfigError, match="sliding-window layers") as error:
        pipeline_model(qwen, 2)
    assert error.value.key == "pipeline_parallel_size"
