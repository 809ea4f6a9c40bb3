"""ZeRO-Inference (#15): a forward-only engine of a Hugging Face model directory at ZeRO-3 with parameters on
NVMe generates the same tokens as plain single-process transformers, every rank running the same number of
forwards while their sequences finish at different times; training it is an error naming the cause; it holds no
gradients, masters or optimizer states."""
from __future__ import annotations

import json
import os

import pytest
import torch

from distributed import run_distributed

MAX_NEW = 8


def _greedy(model, ids, **kwargs):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=MAX_NEW, use_cache=True, **kwargs)[0, ids.shape[1]:].tolist()


def _generate_on_rank(model_dir: str, nvme: str) -> dict:
    import transformers

    import zerotrain
    from zerotrain.config import ConfigError
    from zerotrain.run.generate import load_for_inference
    from zerotrain.zero.forward_only import NoOptimizerError

    rank = int(os.environ["RANK"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(text, return_tensors="pt")["input_ids"] for text in
               ("def add(a, b):\n    return", "import os\nfrom typing import")]
    assert prompts[0].shape[1] != prompts[1].shape[1], "prompts of different lengths"
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    free = [_greedy(reference, ids, eos_token_id=None) for ids in prompts]
    # An end token that rank 0's prompt produces at its 3rd new token and rank 1's never: rank 0 finishes after 3
    # tokens, rank 1 runs all MAX_NEW; a rank stepping alone would wait in its gathers until the comm timeout.
    eos = free[0][2]
    assert eos not in free[0][:2] and eos not in free[1], (free, "pick other prompts")
    want = _greedy(reference, prompts[rank], eos_token_id=eos)

    config = {"comm_timeout_seconds": 60, "optimizer": {"type": "AdamW"},  # ignored by load_for_inference
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4,
                                                      "buffer_size": 100_000, "max_in_cpu": 1000}}}
    # Under a memory budget nothing fits (zerotrain.budget), a forward-only engine is refused for its parameters
    # and buffers, the same model trained also for its gradients and optimizer states
    refused = []
    for build in (lambda tight: load_for_inference(model_dir, tight)[0].close(),
                  lambda tight: zerotrain.initialize(model=reference, config=dict(tight, train_micro_batch_size_per_gpu=1))):
        tight = dict(config, zero_optimization=dict(config["zero_optimization"], memory_budget_bytes=10_000))
        with pytest.raises(ConfigError, match="there are \\(zero_optimization.memory_budget_bytes\\)") as caught:
            build(tight)
        refused.append(str(caught.value))
    engine, _ = load_for_inference(model_dir, config)
    assert not engine.module.training  # loaded for inference: eval mode (no dropout in generate)
    from zerotrain.monitor import MemoryTimeline
    timeline = MemoryTimeline(os.path.join(nvme, "timeline"), rank=rank)
    engine.watch_memory(timeline)  # its forwards, and stage 3's blocking gathers inside them
    assert engine.optimizer is None and engine.zero_optimizer.masters == [] and engine.reducer.grad_shards == []
    with torch.no_grad():
        want_logits = reference(input_ids=prompts[rank]).logits
    logits = engine(input_ids=prompts[rank]).logits
    got = engine.module.generate(input_ids=prompts[rank], attention_mask=torch.ones_like(prompts[rank]),
                                 do_sample=False, max_new_tokens=MAX_NEW, use_cache=True, eos_token_id=eos)
    got = got[0, prompts[rank].shape[1]:].tolist()
    report = engine.memory_report()
    engine.watch_memory(None)
    timeline.close()
    with open(timeline.path) as handle:
        boundaries = {json.loads(line).get("boundary") for line in handle}
    errors = []
    loss = engine(input_ids=prompts[rank]).logits.sum()
    for call in (lambda: engine.backward(loss), engine.step):
        with pytest.raises(NoOptimizerError, match="no optimizer") as caught:
            call()
        errors.append(str(caught.value))
    # A plain initialize without an optimizer is forward-only too (no scheduler allowed with it).
    with pytest.raises(ConfigError, match="scheduler"):
        zerotrain.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "scheduler": {"type": "WarmupLR"}})
    result = {"refused": refused, "want": want, "got": got, "logits_diff": float((logits - want_logits).abs().max()),
              "forwards": engine.forward_passes.count, "report": report, "errors": errors,
              "store": engine.work_stats()["param_store"], "phases": {"gather", "forward"} <= boundaries, "mismatches": engine.work_stats()["gather"]["order_mismatches"]}
    engine.close()
    return result


def test_zero3_nvme_generate_matches_transformers_on_every_rank(tiny_llama_dir, tmp_path):
    results = run_distributed(_generate_on_rank, 2, str(tiny_llama_dir), str(tmp_path / "nvme"))
    lengths = [len(r["want"]) for r in results]
    assert lengths[0] < MAX_NEW == lengths[1], f"rank 0 finishes early, rank 1 does not: {lengths}"
    for rank, result in enumerate(results):
        forward_only, trained = result["refused"]  # both name what they need, what there is and the largest
        assert "optimizer_states" not in forward_only and "gradient staging" not in forward_only, forward_only
        assert "optimizer_states" in trained and "more than the 9.77 KiB there are" in trained, trained
        assert result["got"] == result["want"], f"rank {rank}: greedy tokens differ from transformers'"
        assert result["logits_diff"] < 1e-5, f"rank {rank}: engine(...) logits differ by {result['logits_diff']}"
        # every rank ran the same forwards: 1 engine(...) + MAX_NEW in generate (rank 0 kept stepping) + 1 for the loss
        assert result["forwards"] == 2 + MAX_NEW, f"rank {rank}: {result['forwards']} forwards"
        assert result["mismatches"] == 0, "every forward followed the recorded order"
        assert result["phases"], f"rank {rank}: no forward or gather phase in its memory timeline"
        store = result["store"]
        assert store["read_ahead"] > 0 and store["read_ahead_hits"] > 0, f"rank {rank}: no reads ahead: {store}"
        report = result["report"]
        assert report["gradients"] == 0 and report["optimizer_states"] == 0 and "offload" not in report, report
        assert report["parameters"] == 0, "nothing left gathered on the device after generate"
        assert report["offload_param"]["nvme"] > 0, report
        assert all("engine.backward()" in e or "engine.step()" in e for e in result["errors"]), result["errors"]


def test_generate_command_prints_the_greedy_continuation(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """`zerotrain generate` prints transformers' greedy continuation, on the run layer's path (issue 42): its config
    parsed once and that parsed object handed to `zerotrain.initialize` (it was parsed twice, by the command and by
    initialize), the model and weights as `zerotrain train` builds and reads them."""
    import json as json_module

    import transformers

    import zerotrain
    import zerotrain.config.loader as loader
    from zerotrain.cli import main
    from zerotrain.config import ZeroTrainConfig

    parses, handed = [], []
    build, initialize = loader._build, zerotrain.initialize
    monkeypatch.setattr(loader, "_build", lambda *a, **k: parses.append(a[0]) or build(*a, **k))
    monkeypatch.setattr(zerotrain, "initialize", lambda **k: handed.append(k["config"]) or initialize(**k))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    config = tmp_path / "ds.json"  # a training config: its optimizer block is dropped, the batch size is ignored
    config.write_text(json_module.dumps({"train_batch_size": 8, "optimizer": {"type": "AdamW"},
                                         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompt = "def add(a, b):"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    want = tokenizer.decode(_greedy(reference, ids, pad_token_id=tokenizer.pad_token_id)[:4], skip_special_tokens=True)
    assert main(["generate", "--model", str(tiny_llama_dir), "--config", str(config), "--prompt", prompt,
                 "--max-new-tokens", "4"]) == 0
    assert f"### prompt 0: {prompt}\n{prompt}{want}\n" in capsys.readouterr().out
    assert len(parses) == 1 and len(handed) == 1 and isinstance(handed[0], ZeroTrainConfig), (parses, handed)
    # the training config's optimizer dropped, its batch resolved for the one rank
    assert handed[0].optimizer is None and handed[0].train_batch_size == 8


def test_forward_only_config_drops_the_training_blocks_and_keeps_or_makes_a_batch(tmp_path):
    """`forward_only_config` (no engine): a training config's optimizer and scheduler dropped; a batch the config gives
    kept as it is (a train_batch_size alone stays alone, resolved later for the ranks), "auto" batch keys dropped, and
    without any batch size a micro-batch of 1; a file read the same; a bad file is a ConfigError naming it."""
    from zerotrain.config import ConfigError
    from zerotrain.run.generate import forward_only_config

    training = {"train_batch_size": 8, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"},
                "zero_optimization": {"stage": 3}}
    assert forward_only_config(training) == {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    assert "optimizer" in training  # the caller's dict is not changed
    assert forward_only_config({"train_micro_batch_size_per_gpu": 4}) == {"train_micro_batch_size_per_gpu": 4}
    assert forward_only_config({}) == {"train_micro_batch_size_per_gpu": 1}
    assert forward_only_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto"}) == {"train_micro_batch_size_per_gpu": 1}
    file = tmp_path / "ds.json"
    file.write_text(json.dumps(training))
    assert forward_only_config(str(file)) == {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    file.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="a JSON object is expected"):
        forward_only_config(str(file))
    with pytest.raises(ConfigError, match="cannot read config"):
        forward_only_config(str(tmp_path / "missing.json"))
