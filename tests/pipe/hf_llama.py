"""A Hugging Face causal LM split into pipeline stages from the config alone trains as one process does.

`hf_cases` runs inside tests/pipe/test_pipeline.py's world-4 launch (one launch for the GPT and the Llama cases),
`check_hf_cases` checks them: a tiny Llama, 4 decoder layers, given to `zerotrain.initialize` as it is with
`"pipeline_parallel_size": 2` (PP2 x DP2, ZeRO-1, 1F1B, accumulation 2, active clipping, left-padded micro-batches
whose attention_mask travels between the stages), and the same Llama with `tie_word_embeddings` under the
interleaved 1F1B schedule (4 pieces over 2 ranks, the tied head on the last piece) on packed micro-batches (the
position ids travel between the stages): losses, global gradient norms
and every weight equal plain single-process AdamW on `model(input_ids, attention_mask, labels).loss` within 1e-5.
The untied run saves before its last step; its checkpoint holds the Hugging Face names (read back by
`from_pretrained` in the test process), a plain ZeRO-1 run at DP4 (no pipeline) resumes it and trains the last step
exactly, saves it again at once, and a PP4 x DP1 pipeline resumes that plain checkpoint and trains the last step
exactly too (the reverse direction; 4 stages: embedding + layer, 2 layers, layer + norm + head). Before it trains,
the untied run evaluates (`train.pipeline.PipelineEvaluator`: `eval_batch(aggregate=False)` and the Trainer's
`reduce_step`) with each data-parallel rank holding other batches: every rank's eval loss is the mean of the 8
micro-batch losses of the initial model in one process.
`lora_case` runs in the world-2 launch: the tied Llama with peft's LoRA at PP2, checked by `check_lora_case`.
"""
from __future__ import annotations

import os

import pytest
import torch

from models_for_tests import accumulated_gradients, micro_slice

pytest.importorskip("transformers")

STEPS, MICRO, LR, CLIP, SEQ, VOCAB = 3, 2, 1e-2, 0.05, 8, 64


def llama(tied: bool):
    import transformers
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=tied, attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def batches(global_batch: int, packed: bool) -> list[tuple[torch.Tensor, ...]]:
    """(input_ids, attention_mask, position_ids, labels). Padded: every other sample left-padded for 3 tokens
    (mask 0, label -100), so later tokens would attend to the padding without the mask. Packed: every other
    sample two documents (positions 0-4, 0-2), which transformers keeps apart by the position ids alone."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=generator)
        mask = torch.ones_like(ids)
        positions = torch.arange(SEQ).repeat(global_batch, 1)
        if packed:
            positions[1::2, 5:] = torch.arange(SEQ - 5)
        else:
            mask[1::2, :3] = 0
        out.append((ids, mask, positions, ids.masked_fill(mask == 0, -100)))
    return out


def model_inputs(ids, mask, positions, packed: bool) -> dict:
    """What the plain model is given: the mask (padded) or the position ids (packed), as zerotrain.data's batches."""
    return {"input_ids": ids, "position_ids": positions} if packed else {"input_ids": ids, "attention_mask": mask}


def config(schedule: str, accumulation: int, pp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": CLIP, "steps_per_print": 0, "pipeline_parallel_size": pp,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 1}, "pipeline": {"schedule": schedule}}


def pipeline_micro_batches(batch, accumulation: int, dp_rank: int, dp: int, packed: bool):
    from zerotrain.pipe.hf import pipeline_inputs
    for index in range(accumulation):
        ids, mask, positions, labels = micro_slice(batch, index, dp_rank, dp, MICRO)
        yield pipeline_inputs({**model_inputs(ids, mask, positions, packed), "labels": labels})


def hf_cases(save_dir: str) -> list:
    import zerotrain
    from zerotrain.sharding import is_pipeline_replica

    out = []
    for tied, schedule in ((False, "1f1b"), (True, "interleaved_1f1b")):
        engine, _, _, _ = zerotrain.initialize(model=llama(tied), config=config(schedule, 2, 2))
        dp, dp_rank = engine.topology.dp_size, engine.topology.dp_rank
        assert dp == 2
        evaluated = None
        if not tied:  # the evaluation first (the initial weights): each data-parallel rank holds other batches
            from zerotrain.train.pipeline import PipelineEvaluator
            ids, mask, positions, labels = batches(MICRO * 4 * dp, packed=False)[0]
            mine = [dict(zip(("input_ids", "attention_mask", "labels"), (ids, mask, labels)))
                    for ids, mask, _, labels in (micro_slice((ids, mask, positions, labels), i, dp_rank, dp, MICRO)
                                                 for i in range(4))]
            evaluated = PipelineEvaluator(engine, mine, 4, SEQ)("end")["eval_loss"]
        losses, norms = [], []
        for step, batch in enumerate(batches(MICRO * 2 * dp, packed=tied)):
            if not tied and step == STEPS - 1:
                engine.save_checkpoint(save_dir, tag="resume", client_state={"data_step": step})
            data = pipeline_micro_batches(batch, 2, dp_rank, dp, packed=tied)
            losses.append(float(engine.train_batch(data if engine.is_first_stage() or engine.is_last_stage()
                                                   else None)))
            norms.append(engine.get_global_grad_norm())
        replicas = sorted(n for n, p in engine.module.named_parameters() if is_pipeline_replica(p))
        out.append(dict(tied=tied, losses=losses, norms=norms, replicas=replicas, eval_loss=evaluated,
                        weights={n: p.detach().clone() for n, p in engine.module.named_parameters()}))
        engine.close()
    # a plain ZeRO-1 run at DP4 resumes the pipeline's checkpoint, saves it again before training the last step
    engine, _, _, _ = zerotrain.initialize(model=llama(False), config=config("1f1b", 1, 1))
    _, client_state = engine.load_checkpoint(save_dir, tag="resume")
    step = client_state["data_step"]
    engine.save_checkpoint(save_dir, tag="plain", client_state=client_state)
    batch = batches(MICRO * 4, packed=False)[step]
    ids, mask, positions, labels = micro_slice(batch, 0, engine.topology.dp_rank, 4, MICRO)
    loss = engine(**model_inputs(ids, mask, positions, False), labels=labels).loss
    engine.backward(loss)
    engine.step()
    out.append(dict(resume="plain", global_steps=engine.global_steps,
                    weights={n: p.detach().clone() for n, p in engine.module.named_parameters()}))
    engine.close()
    # and a PP4 x DP1 pipeline resumes the plain run's checkpoint
    engine, _, _, _ = zerotrain.initialize(model=llama(False), config=config("1f1b", 4, 4))
    _, client_state = engine.load_checkpoint(save_dir, tag="plain")
    batch = batches(MICRO * 4, packed=False)[client_state["data_step"]]
    loss = float(engine.train_batch(pipeline_micro_batches(batch, 4, 0, 1, packed=False)
                                    if engine.is_first_stage() or engine.is_last_stage() else None))
    out.append(dict(resume="pipeline", global_steps=engine.global_steps, loss=loss,
                    weights={n: p.detach().clone() for n, p in engine.module.named_parameters()}))
    engine.close()
    return out


def lora_llama(tied: bool):
    """`llama(tied)` with peft's LoRA on q_proj, v_proj and up_proj, A and B both random (peft's zero B would
    give A no gradient at the first step)."""
    from peft import LoraConfig, get_peft_model
    model = llama(tied)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "up_proj"]))


def reference(tied: bool, dp: int = 2, accumulation: int = 2, lora: bool = False) -> dict:  # tied: packed batches
    """Plain AdamW on the whole model's trainable parameters (with `lora`: peft's adapters), each micro-batch's
    `.loss` (HF's own), gradients summed in the engine's order (`accumulated_gradients`). With `lora` also the
    trained model merged by peft (`merge_and_unload`)."""
    model = lora_llama(tied) if lora else llama(tied)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    losses, norms, before_last = [], [], None
    for step, batch in enumerate(batches(MICRO * accumulation * dp, packed=tied)):
        if step == STEPS - 1:
            before_last = {n: p.detach().clone() for n, p in model.named_parameters()}

        def micro_loss(index: int, rank: int) -> torch.Tensor:
            ids, mask, positions, labels = micro_slice(batch, index, rank, dp, MICRO)
            return model(**model_inputs(ids, mask, positions, tied), labels=labels).loss

        grads, total = accumulated_gradients(params, micro_loss, accumulation, dp)
        for param, grad in zip(params, grads):
            param.grad = grad
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = {n: p.detach() for n, p in model.merge_and_unload().named_parameters()} if lora else None
    return dict(losses=losses, norms=norms, before_last=before_last, weights=weights, merged=merged)


def lora_case(save_dir: str) -> dict:
    """World 2: the tied Llama with LoRA (`lora_llama`) at PP2 (1F1B, accumulation 2, packed micro-batches), built
    as `zerotrain train --lora-r` builds its engine (the adapter's PEFT files in every checkpoint); saves at the
    end."""
    from zerotrain.sharding import is_pipeline_replica
    from zerotrain.run.model import train_engine

    model = lora_llama(True)
    engine = train_engine(model, config("1f1b", 2, 2), lora=True)
    assert (engine.topology.pp_size, engine.topology.dp_size) == (2, 1)
    losses, norms = [], []
    for batch in batches(MICRO * 2, packed=True):
        data = pipeline_micro_batches(batch, 2, 0, 1, packed=True)
        losses.append(float(engine.train_batch(data)))
        norms.append(engine.get_global_grad_norm())
    engine.save_checkpoint(save_dir, tag="lora")
    out = dict(losses=losses, norms=norms,
               replicas=sorted(n for n, p in engine.module.named_parameters() if is_pipeline_replica(p)),
               trainable=sorted(n for n, p in engine.module.named_parameters() if p.requires_grad),
               weights={n: p.detach().clone() for n, p in engine.module.named_parameters()})
    engine.close()
    return out


def check_lora_case(results: list, save_dir) -> None:
    """`results`: both ranks' `lora_case`; `save_dir`: where it saved. Losses, norms and every weight (adapters
    trained, the base unchanged) equal single-process peft LoRA training; the checkpoint's adapter files load
    with peft's `PeftModel.from_pretrained` and its merged export (`zerotrain ckpt export --merge-lora`) equals
    peft's `merge_and_unload`, as without a pipeline."""
    import transformers
    from peft import PeftModel

    from zerotrain.checkpoint.tools import export_model

    ref = reference(True, dp=1, accumulation=2, lora=True)
    where = "Llama LoRA PP2"
    assert ref["norms"][0] > 2 * CLIP, "clipping must be active for the norm to matter"
    joined: dict = {}
    for got in results:
        for what in ("losses", "norms"):
            for value, expected in zip(got[what], ref[what], strict=True):
                assert abs(value - expected) <= 1e-5 * abs(expected), (where, what, got[what], ref[what])
        assert all(".lora_" in name for name in got["trainable"]) and got["trainable"], (where, got["trainable"])
        joined.update({n: w for n, w in got["weights"].items() if n not in got["replicas"]})
    assert [r["replicas"] for r in results] == [[], ["base_model.model.lm_head.weight"]], where
    assert_weights(joined, ref["weights"], where)  # the adapters trained as peft's, the base unchanged
    initial = dict(lora_llama(True).named_parameters())
    moved = {n for n, w in joined.items() if not torch.equal(w, initial[n])}
    assert moved and all(".lora_" in n for n in moved), (where, sorted(moved))
    adapter = PeftModel.from_pretrained(llama(True), str(save_dir / "lora"))
    assert_weights({n: p.detach() for n, p in adapter.named_parameters() if ".lora_" in n},
                   {n: w for n, w in ref["weights"].items() if ".lora_" in n}, f"{where} adapter files")
    export_model(str(save_dir / "lora"), str(save_dir / "merged"), merge_lora="")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(save_dir / "merged"))
    assert_weights({n: p.detach() for n, p in merged.named_parameters()}, ref["merged"], f"{where} merged export")


def assert_weights(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), (where, sorted(set(got) ^ set(want)))
    for name, ref in want.items():  # per tensor, as tests/pipe/test_pipeline.py argues
        distance = float((got[name] - ref).norm() / ref.norm())
        assert distance <= 1e-5, f"{where} {name}: relative distance {distance:.2e}"


def check_hf_cases(results: list, tmp_path) -> None:
    """`results`: every rank's `hf_cases` list; `tmp_path`: the save directory they used."""
    import transformers

    references = {tied: reference(tied) for tied in (False, True)}
    for tied in (False, True):
        ref = references[tied]
        where = f"Llama {'tied' if tied else 'untied'} PP2 x DP2"
        assert ref["norms"][0] > 2 * CLIP, "clipping must be active for the norm to matter"
        joined: dict = {}
        for rank in results:
            got = next(case for case in rank if case.get("tied") is tied)
            for what in ("losses", "norms"):
                for value, expected in zip(got[what], ref[what], strict=True):
                    assert abs(value - expected) <= 1e-5 * abs(expected), (where, what, got[what], ref[what])
            assert got["replicas"] in ([], ["lm_head.weight"]), (where, got["replicas"])  # the tied head's copy
            joined.update({n: w for n, w in got["weights"].items() if n not in got["replicas"]})
        assert any(case["replicas"] for rank in results for case in rank if case.get("tied") is tied) == tied, where
        assert_weights(joined, ref["weights"], where)
        if tied:
            replica = next(case["weights"]["lm_head.weight"] for rank in results for case in rank
                           if case.get("tied") and case["replicas"])
            assert_weights({"w": replica}, {"w": ref["weights"]["model.embed_tokens.weight"]}, f"{where} tied head")
    # the pipeline's evaluation (`PipelineEvaluator`: eval_batch's local losses through the Trainer's reduce_step)
    # over both data-parallel ranks' different batches: the mean of the 8 micro-batch losses of the initial model in
    # one process, on every rank
    model = llama(False).eval()
    ids, mask, positions, labels = batches(MICRO * 4 * 2, packed=False)[0]
    with torch.no_grad():
        micro_losses = [float(model(input_ids=ids[i:i + MICRO], attention_mask=mask[i:i + MICRO],
                                    labels=labels[i:i + MICRO]).loss) for i in range(0, MICRO * 8, MICRO)]
    want = sum(micro_losses) / len(micro_losses)
    assert len(set(micro_losses)) == 8  # the batches differ: a rank's own mean, or one rank's, would show
    for rank in results:
        got = next(case for case in rank if case.get("tied") is False)["eval_loss"]
        assert abs(got - want) <= 1e-5 * want, (got, want, micro_losses)
    ref = references[False]
    # the pipeline checkpoint is a Hugging Face directory of the plain model's names
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "resume"))
    assert_weights({n: p.detach() for n, p in loaded.named_parameters()}, ref["before_last"], "from_pretrained")
    # the last step at DP4 x 1 micro-batch (or DP1 x 4) averages the same 4 micro-batches of 2 samples
    for rank in results:
        plain = next(case for case in rank if case.get("resume") == "plain")
        assert plain["global_steps"] == STEPS
        assert_weights(plain["weights"], ref["weights"], "plain ZeRO-1 DP4 resumed from PP2 x DP2")
    joined = {}
    for rank in results:
        got = next(case for case in rank if case.get("resume") == "pipeline")
        assert got["global_steps"] == STEPS
        joined.update(got["weights"])
        assert abs(got["loss"] - ref["losses"][-1]) <= 1e-5 * ref["losses"][-1], (got["loss"], ref["losses"])
    assert_weights(joined, ref["weights"], "PP4 resumed from the plain run")
