"""`zerotrain train --pipeline-parallel-size`'s step and evaluator (`zerotrain.train.pipeline`) in the pytest
process (issue #48): a tiny Llama split by `causal_lm_pipeline` into one stage (two pieces on this rank, the
interleaved schedule) at a world of one, fed the run loader's unpadded batches (shorter than --seq-len, some
packed with position ids), against the plain model's own loss on those batches and one plain AdamW step.
The multi-rank runs (a middle stage reading nothing, data-parallel ranks' means) are test_pipeline_cli.py's and
test_pipeline.py's launches."""
from __future__ import annotations

import pytest
import torch

from hf_llama import MICRO, SEQ, VOCAB, llama

ACCUMULATION, LENGTH, LR = 2, 5, 1e-2


def _data() -> list[dict]:
    """Six micro-batches of LENGTH < SEQ tokens: odd ones packed (two documents by their position ids), even ones
    with an all-ones attention mask; the last token of each sample not learned (label -100)."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for index in range(6):
        ids = torch.randint(0, VOCAB, (MICRO, LENGTH), generator=generator)
        labels = ids.clone()
        labels[:, -1] = -100
        batch = {"input_ids": ids, "labels": labels}
        if index % 2:
            batch["position_ids"] = torch.tensor([0, 1, 2, 0, 1]).repeat(MICRO, 1)
        else:
            batch["attention_mask"] = torch.ones_like(ids)
        out.append(batch)
    return out


def _engine():
    import zerotrain
    from zerotrain.pipe.hf import causal_lm_pipeline

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
              "steps_per_print": 0, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "pipeline": {"schedule": "interleaved_1f1b"}}
    engine, _, _, _ = zerotrain.initialize(model=causal_lm_pipeline(llama(False), 1), config=config)
    return engine


def _losses(model, data) -> list[float]:
    with torch.no_grad():
        return [float(model(**batch).loss) for batch in data]


def test_pad_batch_pads_on_the_right_unlearned_and_continues_the_positions():
    from zerotrain.train.pipeline import pad_batch

    packed = _data()[1]
    out = pad_batch(packed, SEQ)
    extra = SEQ - LENGTH
    assert torch.equal(out["input_ids"][:, :LENGTH], packed["input_ids"])
    assert torch.equal(out["input_ids"][:, LENGTH:], torch.zeros(MICRO, extra, dtype=torch.long))
    assert torch.equal(out["labels"][:, LENGTH:], torch.full((MICRO, extra), -100))
    assert torch.equal(out["attention_mask"], torch.tensor([[1] * LENGTH + [0] * extra] * MICRO))
    assert torch.equal(out["position_ids"][0], torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]))
    assert pad_batch(packed, LENGTH) is packed
    with pytest.raises(ValueError, match="5 tokens is longer than the sequence length 4"):
        pad_batch(packed, LENGTH - 1)


def test_the_pipeline_step_and_evaluator_give_the_plain_models_loss_and_adamw_step(world_of_one):
    from zerotrain.train.pipeline import PipelineEvaluator, PipelineLMStep, eval_micro_batches
    from zerotrain.trainer import reduce_step

    data = _data()
    reference = llama(False)
    losses = _losses(reference, data)
    engine = _engine()
    try:
        evaluator = PipelineEvaluator(engine, data, 5, SEQ)  # 5 micro-batches: whole batches of 2, so 4
        assert evaluator.batches == 4 and evaluator("before") is None
        assert evaluator("after")["eval_loss"] == pytest.approx(sum(losses[:4]) / 4, rel=1e-5)
        assert eval_micro_batches(4, 4) == 4
        with pytest.raises(ValueError, match="1 evaluation micro-batch"):
            eval_micro_batches(1, ACCUMULATION)

        step = PipelineLMStep(engine, data, SEQ)
        result = step.run()  # micro-batches 0 and 1
        totals = reduce_step(result)
        assert totals.loss == pytest.approx((losses[0] + losses[1]) / 2, rel=1e-5)
        assert totals.tokens == MICRO * ACCUMULATION * SEQ and result.lr == LR

        optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
        loss = sum(reference(**batch).loss for batch in data[:2]) / ACCUMULATION
        loss.backward()
        optimizer.step()
        after = _losses(reference, data)
        resumed = PipelineLMStep(engine, data, SEQ)  # a resumed run's: one batch consumed, read from micro-batch 2
        resumed.seek(ACCUMULATION * MICRO)
        totals = reduce_step(resumed.run())
        assert totals.loss == pytest.approx((after[2] + after[3]) / 2, rel=1e-5)

        # a step given no loader reads on from the engine's own iterator (DeepSpeed's train_batch() without one
        # goes on with the last one it read): micro-batches 4 and 5, one more plain step later
        optimizer.zero_grad()
        (sum(reference(**batch).loss for batch in data[2:4]) / ACCUMULATION).backward()
        optimizer.step()
        later = _losses(reference, data)
        totals = reduce_step(PipelineLMStep(engine, None, SEQ).run())
        assert totals.loss == pytest.approx((later[4] + later[5]) / 2, rel=1e-5)
        assert totals.tokens == MICRO * ACCUMULATION * SEQ  # this rank is the first stage
    finally:
        engine.close()
