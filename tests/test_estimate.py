"""`zerotrain estimate`: the per-rank bytes it predicts are what the engine holds, option by option."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from zerotrain.cli import main
from zerotrain.estimate import (Option, estimate, estimate_option, load_meta_model, measure_activations,
                                model_shape, parse_bytes, probe_optimizer, split_tensor_parallel)

# Small buckets and a low persistence threshold, so the tiny GPT has several buckets, padding at
# world 2 (its MLP width is odd) and a mix of partitioned and persistent stage-3 parameters.
# An explicit budget far above what these tiny engines need: every budget-sized key takes its cap (DeepSpeed's
# default), as the estimate of the plain config does. (Under the default budget, half the memory available at
# the time, a loaded machine made the engine choose 3 NVMe optimizer buffers against the estimate's 4.)
_ZERO = {"reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 1000, "memory_budget_bytes": 8 << 30}

# (stage, offload_optimizer (device, ratio), offload_param, precision); "bf16 records": bf16 training with the
# NVMe records (or CPU offload's host masters) in bf16 (bf16_master_weights_and_grads + bf16_optimizer_states:
# 6 bytes per Adam parameter)
CASES = [
    (0, None, None, "fp32"), (1, None, None, "fp32"), (2, None, None, "fp32"), (3, None, None, "fp32"),
    (2, ("cpu", 0.5), None, "fp32"), (3, ("cpu", 1.0), "cpu", "fp32"), (2, None, None, "bf16"),
    (3, None, "cpu", "bf16"), (2, ("nvme", 1.0), None, "bf16 records"), (3, ("cpu", 1.0), None, "bf16 records"),
    (3, None, "nvme", "bf16"),
    # stages 0-1 in bf16 (CPU offload at stage 1): a bf16 buffer plus the reduced fp32 gradient held to the step
    (0, None, None, "bf16"), (1, ("cpu", 1.0), None, "bf16"),
    (3, ("nvme", 1.0), "nvme", "fp32"),  # without clipping the NVMe step streams each gradient shard: none held
    # clipping on (the default 1.0) with the parameters on NVMe: the norm from a first backward, then the step
    # streamed in a second; no gradient held or spilled (#43)
    (3, ("nvme", 1.0), "nvme", "bf16"),
    # clipping on, the parameters in host memory: each bf16 gradient shard spilled to the swap directory (#43)
    (3, ("nvme", 1.0), "cpu", "bf16"),
]
STREAMED, FIRST_PASS, SPILLED = CASES[-3], CASES[-2], CASES[-1]


def _config(stage: int, offload, offload_param, precision: str, nvme_path: str = "") -> dict:
    zero = dict(_ZERO, stage=stage)
    if offload is not None:
        zero["offload_optimizer"] = {"device": offload[0], "ratio": offload[1]}
        if offload[0] == "nvme":
            zero["offload_optimizer"]["nvme_path"] = os.path.join(nvme_path, "optimizer")
    if offload_param is not None:
        zero["offload_param"] = {"device": offload_param}
        if offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = os.path.join(nvme_path, "param")
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "bf16 records":
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    return config


def _swap_file_bytes(nvme_path: str) -> int:
    """Sizes of this rank's open NVMe swap files (the optimizer's and the parameter store's)."""
    rank, total = int(os.environ.get("RANK", "0")), 0  # (a world of one in the pytest process: rank 0)
    for folder, _, files in os.walk(nvme_path):
        if f"-r{rank}-" in os.path.basename(folder):
            total += sum(os.path.getsize(os.path.join(folder, name)) for name in files)
    return total


def _step_then_backward(config: dict, after_step=None, at_end=None):
    """The tiny GPT's engine under `config` after one step and one more backward (what the estimate's peak
    counts: a step's states and a backward's gradients at once), with `after_step(engine)` taken right after the
    step and `at_end(engine)` after the backward, both in this frame (its last batch alive, as in a training
    loop): (engine, after_step's value, at_end's value)."""
    import zerotrain
    from zerotrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)
    measured = None
    for step in range(2):
        idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        _, loss = engine(idx, idx)
        del _
        engine.backward(loss)
        del loss
        if step == 0:
            engine.step()
            measured = after_step(engine) if after_step is not None else None
    return engine, measured, (at_end(engine) if at_end is not None else None)


# weak references to the tensors `gc.freeze()` hides from `gc.get_objects()`, listed by `_every_object_seen`
_FROZEN_TENSORS: list = []


@contextlib.contextmanager
def _every_object_seen():
    """Every live tensor in `_live_tensor_bytes`'s view for the block. The objects the suite froze
    (tests/conftest.py: the session's; tests/distributed.py: a rank's inherited ones) are not in
    `gc.get_objects()`: they are listed here once, weakly (one freed later is not counted), and everything alive at
    the block's start is frozen with them, so each reading walks only what the block made: 1-5 ms, where
    unfreezing the heap for the block made each reading walk every object (0.35 s in a rank, more in the suite's
    process: 23 s of the suite for the 14 readings at a world of one)."""
    import gc
    import weakref

    if gc.get_freeze_count() == 0:  # nothing hidden: every reading sees every object
        yield
        return
    gc.unfreeze()
    gc.collect()  # (a frozen garbage cycle is never collected: its tensors would read as live)
    _FROZEN_TENSORS[:] = [weakref.ref(tensor) for tensor in _tensors(gc.get_objects())]
    gc.freeze()
    try:
        yield
    finally:
        _FROZEN_TENSORS.clear()


def _tensors(objects: list) -> list:
    """The tensors among `objects`."""
    import warnings

    with warnings.catch_warnings():  # isinstance() on every object touches torch's deprecated module aliases
        warnings.simplefilter("ignore", FutureWarning)
        return [obj for obj in objects if isinstance(obj, torch.Tensor)]


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor alive in this process (the garbage collector's view and
    `_every_object_seen`'s frozen tensors), once two readings 50 ms or more apart agree: gloo's worker thread
    drops a finished all-reduce's tensor (the clip's fp64 sum of squares, 8 bytes) a moment after waking the
    caller, so one reading right after a step counts it or not by the race (8 bytes off, one run in two)."""
    import time

    readings = [_tensor_bytes_now()]
    for pause in (0.05, 0.1, 0.2, 0.4, 0.8, 1.6):
        time.sleep(pause)
        readings.append(_tensor_bytes_now())
        if readings[-1] == readings[-2]:
            return readings[-1]
    raise AssertionError(f"the live tensor bytes did not settle: {readings}")


def _tensor_bytes_now() -> int:
    """One reading of `_live_tensor_bytes`."""
    import gc

    gc.collect()  # garbage in reference cycles is still listed until the collector runs (when, varies): not live
    frozen = [tensor for tensor in (ref() for ref in _FROZEN_TENSORS) if tensor is not None]
    storages = {}
    for tensor in _tensors(gc.get_objects()) + frozen:
        if tensor.device.type == "cpu" and not tensor.is_meta:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def engine_memory_per_case(nvme_path: str) -> list[dict]:
    """Each case's engine on this rank: one step, then one more backward (the gradients are held, the
    optimizer states exist), and its memory report next to the estimate for the same config."""
    with _every_object_seen():
        return _engine_memory_per_case(nvme_path)


def _engine_memory_per_case(nvme_path: str) -> list[dict]:
    """engine_memory_per_case's work."""
    from zerotrain.config import load_config

    out = []
    for case in CASES:
        config = _config(*case, nvme_path=nvme_path)
        if case == STREAMED:  # (clipping needs every gradient before the update: it turns streaming off)
            config["gradient_clipping"] = 0.0
        engine, after_step, (report, live_at_end) = _step_then_backward(
            config, after_step=lambda engine: (_live_tensor_bytes(), engine.memory_report()["gradients"]),
            at_end=lambda engine: (engine.memory_report(), _live_tensor_bytes()))
        if case[0] < 3:  # what backward made and still holds, measured on the live tensors, next to what the
            # report added (stage 3 also gathers and frees parameters in backward: not only gradients grow)
            report["grown in backward"] = (live_at_end - after_step[0], report["gradients"] - after_step[1])
        report["buffers"] = sum(b.numel() * b.element_size() for b in engine.module.buffers())
        report["nvme_files"] = _swap_file_bytes(nvme_path)
        report["first_pass"] = engine.zero_optimizer.takes_norm_first_pass()
        report["spill_bytes"] = engine.offload_stats().get("nvme_spill_bytes", 0)
        report.pop("comm")
        engine.close()
        parsed = load_config(config, dp_world_size=2)
        meta, _ = load_meta_model("tiny")
        predicted = estimate_option(model_shape(meta), parsed, 2, Option(case[0], case[1][0] if case[1] else "none",
                                                                           case[2] or "none"),
                                    probe_optimizer(parsed.optimizer), device_type="cpu")
        out.append({"case": case, "report": report, "estimate": predicted.rows, "nvme_files": predicted.nvme_files,
                    "notes": predicted.notes})
    out.append(sequence_parallel_case())
    out += parallel_and_zeropp_cases()
    return out


LOCO = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}
EVEN_GPT = dict(n_layer=2, n_head=4, n_embd=48, block_size=32)  # an MLP width (192) that splits over 2 ranks


def _two_steps(engine, loss_of) -> dict:
    """One step, one more backward (gradients held, optimizer states and LoCo errors exist); the report."""
    for step in range(2):
        engine.backward(loss_of(engine, step))
        if step == 0:
            engine.step()
    report = engine.memory_report()
    report["buffers"] = sum(b.numel() * b.element_size() for b in engine.module.buffers())
    report.pop("comm")
    return report


def parallel_and_zeropp_cases() -> list[dict]:
    """TP=2 (ZeRO-2: the model split by its plan, the ZeRO group one rank), an MoE model with EP=2 under qgZ with
    LoCo (ZeRO-2: dense buckets quantized over both ranks, the experts' expert-data-parallel group is one rank),
    and ZeRO-3 with qgZ + LoCo + qwZ (LoCo per parameter): the engine's report next to the estimate's rows."""
    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.config import load_config
    from zerotrain.estimate import shape_comm
    from zerotrain.models import GPT, GPTConfig
    from zerotrain.topology import Topology
    from models_for_tests import make_moe_model

    def gpt_batch(engine, step):
        idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        return engine(idx, idx)[1]

    def moe_batch(engine, step):
        generator = torch.Generator().manual_seed(step)
        return engine(torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator))

    out = []
    # TP=2
    config = dict(_config(2, None, None, "fp32"), tensor_parallel={"autotp_size": 2}, train_batch_size=2)
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=GPT(GPTConfig(**EVEN_GPT)), config=config)
    report = _two_steps(engine, gpt_batch)
    real = measure_activations(engine.module, "gpt", 2, 16, tensor_parallel=2).as_dict()  # the fused kernel's
    engine.close()
    with torch.device("meta"):
        meta = GPT(GPTConfig(**EVEN_GPT))
    whole = estimate(meta, config, 2, device_type="cpu", seq_len=16, options=[Option(2)])
    out.append({"case": ("tp2 ZeRO-2", None, None, "fp32"), "report": report,
                "estimate": whole["options"][0]["rows"], "whole": whole,
                "real_activations": real, "numel": sum(p.numel() for p in GPT(GPTConfig(**EVEN_GPT)).parameters())})
    # EP=2, qgZ + LoCo
    config = _config(2, None, None, "fp32")
    config["zero_optimization"].update(LOCO)
    topology = Topology.build(timeout_seconds=60)
    ep_comm = Comm.data_parallel(topology).subgroup(*topology.expert_parallel_group(2))
    engine, *_ = zerotrain.initialize(model=make_moe_model(ep_comm), config=config)
    report = _two_steps(engine, moe_batch)
    engine.close()
    whole = estimate(make_moe_model(shape_comm(2)), config, 2, device_type="cpu", options=[Option(2)])
    out.append({"case": ("ep2 ZeRO-2 qgZ+LoCo", None, None, "fp32"), "report": report,
                "estimate": whole["options"][0]["rows"],
                "whole": whole})
    # ZeRO-3, qgZ + LoCo + qwZ
    config = _config(3, None, None, "fp32")
    config["zero_optimization"].update(LOCO, zero_quantized_weights=True)
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)
    report = _two_steps(engine, gpt_batch)
    engine.close()
    parsed = load_config(config, dp_world_size=2)
    predicted = estimate_option(model_shape(load_meta_model("tiny")[0]), parsed, 2, Option(3),
                                probe_optimizer(parsed.optimizer), device_type="cpu")
    out.append({"case": ("ZeRO-3 qgZ+LoCo+qwZ", None, None, "fp32"), "report": report, "estimate": predicted.rows,
                "transient": predicted.transient})
    # EP=2 at ZeRO-1 in fp32: the experts' group is this rank alone, so their reduced gradient is their buffer itself
    config = _config(1, None, None, "fp32")
    engine, *_ = zerotrain.initialize(model=make_moe_model(ep_comm), config=config)
    report = _two_steps(engine, moe_batch)  # (not live: the MoE forward keeps tensors of its own until the next)
    engine.close()
    whole = estimate(make_moe_model(shape_comm(2)), config, 2, device_type="cpu", options=[Option(1)])
    out.append({"case": ("ep2 ZeRO-1", None, None, "fp32"), "report": report, "estimate": whole["options"][0]["rows"]})
    return out


SP_CASE = (2, None, None, "fp32")  # and sequence_parallel_size 2: the two ranks are one sequence-parallel pair


def sequence_parallel_case() -> dict:
    """ZeRO-2 at sequence_parallel_size 2 (no data parallelism): the states partitioned over the pair, and the
    activations of the real sequence-parallel forward (the fused attention kernel, as the estimate's meta forward counts it) next to the
    estimate's, whose meta forward runs one rank's part of the exchange."""
    import zerotrain
    from zerotrain.config import load_config
    from zerotrain.models import GPT, GPTConfig

    config = dict(_config(*SP_CASE), sequence_parallel_size=2, train_batch_size=2)
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)
    for step in range(2):
        idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        batch = engine.sequence_parallel.shard({"input_ids": idx, "labels": idx}, shift_labels=False)
        _, loss = engine(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])
        engine.backward(loss)
        if step == 0:
            engine.step()
    report = engine.memory_report()
    report["buffers"] = sum(b.numel() * b.element_size() for b in engine.module.buffers())
    report.pop("comm")
    real = measure_activations(engine.module, "gpt", 2, 8).as_dict()  # this rank's 8 of 16 tokens
    engine.close()
    parsed = load_config(config, dp_world_size=1)
    meta, _ = load_meta_model("tiny")
    predicted = estimate_option(model_shape(meta), parsed, 2, Option(2, "none", "none"),
                                probe_optimizer(parsed.optimizer), device_type="cpu")
    whole = estimate("tiny", config, 2, device_type="cpu", seq_len=16)
    return {"case": SP_CASE + ("sp2",), "report": report, "estimate": predicted.rows, "real_activations": real,
            "whole": whole}


def test_estimate_equals_the_engines_memory_report_at_world_2(tmp_path):
    results = run_distributed(engine_memory_per_case, 2, str(tmp_path), timeout=240)
    assert [len(per_rank) for per_rank in results] == [len(CASES) + 5] * 2
    for rank, per_rank in enumerate(results):
        sp, tp, ep, loco3, _ = per_rank[-5:]
        # TP=2: ZeRO over world / tp = 1 rank; each rank holds its slices (the whole model counted once)
        assert (tp["whole"]["tensor_parallel_size"], tp["whole"]["zero_ranks"]) == (2, 1)
        assert tp["whole"]["parameters"] == tp["numel"]
        assert tp["report"]["parameters"] < 0.6 * 4 * tp["numel"]  # fp32: about half of the model on each rank
        # what one tensor-parallel rank keeps for backward is what the estimate's split meta forward keeps
        assert tp["whole"]["activations"]["without_checkpointing"] == tp["real_activations"]["without_checkpointing"]
        # EP=2: 4 experts, 2 on each rank; the whole model counts all 4
        moe_numel = 6 * 8 + 8 + 8 * 4 + 4 * (16 * 8 + 16 + 8 * 16 + 8) + 8 * 3 + 3  # inp, gate, 4 experts, out
        assert (ep["whole"]["expert_parallel_size"], ep["whole"]["parameters"]) == (2, moe_numel)
        assert ep["report"]["loco_errors"] > 0 and loco3["report"]["loco_errors"] > 0
        assert loco3["transient"]["qwZ gather buffers"] > 0 and loco3["transient"]["qgZ scratch (largest reduce)"] > 0
        whole, real = sp["whole"], sp["real_activations"]
        assert (whole["dp_size"], whole["zero_ranks"], whole["sequence_parallel_size"]) == (1, 2, 2)
        by_label = {o["option"]: o for o in whole["options"]}
        assert by_label["ZeRO-2"]["rows"] == sp["estimate"]  # the states: partitioned over the pair
        acts = whole["activations"]
        assert acts["seq_len"] == 16 and acts["without_checkpointing"] == real["without_checkpointing"] > 0, \
            (rank, acts, real)
        # the largest exchange (q, k, v or the output): this rank's 2 x 8 tokens x 48 features, sent and received
        assert acts["all_to_all_buffers"] == 2 * (2 * 8 * 48 * 4)
        # not a plain forward on the shard: attention sees the whole sequence (of half the heads)
        assert measure_activations(load_meta_model("tiny")[0], "gpt", 2, 8).full < real["without_checkpointing"]
        for entry in per_rank:
            case, report, rows = entry["case"], entry["report"], entry["estimate"]
            where = f"rank {rank}, case {case}"
            assert report["parameters"] == rows["parameters"]["device"], where
            assert report["gradients"] == rows["gradients"]["device"] + rows["loco_errors"]["device"], where
            if "grown in backward" in report:  # the report's gradients are what the run holds
                live, reported = report["grown in backward"]
                assert live == reported, (where, live, reported)
            streamed = case in (STREAMED, FIRST_PASS, SPILLED)
            assert report.get("first_pass", False) == (case == FIRST_PASS), where  # the engine's choice, the estimate's
            assert any("norm from a first backward" in note for note in entry.get("notes", ())) == \
                (case == FIRST_PASS), where
            assert (report.get("spill_bytes", 0) > 0) == (case == SPILLED), where  # no spill file then
            assert report["loco_errors"] == rows["loco_errors"]["device"], where
            assert (rows["gradients"]["device"] == 0) if streamed else (rows["gradients"]["device"] > 0), where
            assert report["optimizer_states"] == rows["master_weights"]["device"] + \
                rows["optimizer_states"]["device"], where
            assert report["buffers"] == rows["buffers"]["device"], where
            offload = report.get("offload", {"host": 0, "nvme": 0, "host_buffers": 0})
            assert offload["host"] == rows["master_weights"]["host"] + rows["optimizer_states"]["host"], where
            assert offload["nvme"] == rows["master_weights"]["nvme"] + rows["optimizer_states"]["nvme"], where
            split = report.get("offload_param", {"host": 0, "nvme": 0})
            assert split["host"] == rows["parameters"]["host"] and split["nvme"] == rows["parameters"]["nvme"], where
            assert offload["host_buffers"] + report.get("offload_param", {}).get("host_buffers", 0) == \
                rows["host_io_buffers"]["host"], where
            if case[1] is not None:  # something really moved off the device
                assert offload["host" if case[1][0] == "cpu" else "nvme"] > 0, where
            if "nvme" in (case[1] or ("",))[0] + (case[2] or ""):  # with its pool of I/O buffers
                assert rows["host_io_buffers"]["host"] > 0 and rows["parameters"]["nvme"] + \
                    rows["master_weights"]["nvme"] > 0, where
                # and its swap files: records (optimizer: plus spares) at aligned offsets, byte for byte
                assert report["nvme_files"] == entry["nvme_files"] > 0, where


@pytest.mark.parametrize("masked,grouped", [(False, False), (True, False), (False, True)])
def test_meta_attention_keeps_what_the_real_kernel_keeps(masked, grouped):
    """The estimate's stand-in for `scaled_dot_product_attention` on the meta device (#49) keeps for backward the
    bytes torch's own kernel keeps on the CPU: query, key, value, output, log-sum-exp, and the mask when one is
    given; grouped keys (fewer key heads, enable_gqa) keep their own size."""
    from zerotrain.estimate import _fused_attention

    def kept(device: str, attention) -> int:
        generator = torch.Generator().manual_seed(0)
        heads_kv = 2 if grouped else 4
        q = torch.randn(2, 8, 4, 16, generator=generator).to(device).transpose(1, 2).requires_grad_()
        k = torch.randn(2, heads_kv, 8, 16, generator=generator).to(device).requires_grad_()
        v = torch.randn(2, heads_kv, 8, 16, generator=generator).to(device).requires_grad_()
        mask = torch.zeros(2, 1, 8, 8, device=device) if masked else None
        bases = {}

        def pack(tensor):
            base = tensor._base if tensor._base is not None else tensor
            bases[id(base)] = base.untyped_storage().nbytes()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
        assert out.shape == (2, 4, 8, 16)
        return sum(bases.values())
    real = kept("cpu", torch.nn.functional.scaled_dot_product_attention)
    assert kept("meta", _fused_attention) == real > 0


def test_a_model_of_unknown_inputs_has_no_measured_activations():
    """A model that is neither zerotrain's GPT nor a transformers causal LM: its forward's inputs are unknown, so the
    estimate measures no activations (its states are still counted)."""
    from zerotrain.estimate import estimate

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    result = estimate(model, {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}}, 1,
                      device_type="cpu", seq_len=8)
    acts = result["activations"]
    assert acts["without_checkpointing"] == acts["with_checkpointing"] == acts["blocks"] == 0, acts
    assert result["parameters"] == 16 * 32 + 32 + 32 * 16 + 16 and result["options"][0]["totals"]["device"] > 0


def test_estimate_of_a_hugging_face_config_builds_nothing(tmp_path):
    """A config.json (or its directory) is built on the meta device: the parameter count is the real
    model's, tied embeddings counted once; the activations shrink with checkpointing."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    hf_config.save_pretrained(tmp_path)
    real = AutoModelForCausalLM.from_config(hf_config)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
                              "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3}}))
    result = estimate(str(tmp_path), str(ds), 4, seq_len=16)
    assert result["parameters"] == sum(p.numel() for p in real.parameters())
    assert result["dp_size"] == 4 and result["dtype"] == "bfloat16"
    acts = result["activations"]
    assert acts["micro_batch"] == 3 and acts["blocks"] == 3
    assert 0 < acts["with_checkpointing"] < acts["without_checkpointing"]
    meta, kind = load_meta_model(str(tmp_path / "config.json"))  # the file itself, too
    assert kind == "hf" and all(p.device.type == "meta" for p in meta.parameters())
    assert model_shape(meta).numel == result["parameters"]
    # The meta forward saves what a real one saves with the fused attention kernel it picks (the meta device's
    # own dispatch, the math path, keeps the probabilities too: a real run forced onto it keeps more; #49)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    predicted = measure_activations(meta, "hf", 2, 16)
    assert predicted.full == measure_activations(real, "hf", 2, 16).full
    with sdpa_kernel(SDPBackend.MATH):
        assert measure_activations(real, "hf", 2, 16).full > predicted.full
    # Ulysses over 2 of the 4 ranks: ZeRO still partitions over all 4, the batch counts 2 data-parallel ranks,
    # each rank's activations are those of its half of the sequence (plus whole-sequence attention of half the
    # heads, and the exchange buffers)
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True}, "train_batch_size": 6,
                              "sequence_parallel_size": 2, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3}}))
    split = estimate(str(tmp_path), str(ds), 4, seq_len=16)
    assert (split["dp_size"], split["zero_ranks"]) == (2, 4) and split["options"] == result["options"]
    halves = split["activations"]
    # (about half: the mask transformers builds for a plain run is dropped, the attention is causal by itself)
    assert 0.4 * acts["without_checkpointing"] < halves["without_checkpointing"] < 0.6 * acts["without_checkpointing"]
    assert halves["all_to_all_buffers"] == 2 * 3 * 8 * 32 * 2  # q: 3 x 8 tokens x 32 features in bf16, both ways
    with pytest.raises(ValueError, match="sequence_parallel_size: 2 does not divide the world size 3"):
        estimate(str(tmp_path), str(ds), 3, seq_len=16)
    # TP=2 over the 4 ranks (the model's own base_model_tp_plan): ZeRO partitions over 2; each rank holds its
    # slices and keeps for backward what a real split model keeps (split here with the same shapes-only group)
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
                              "tensor_parallel": {"autotp_size": 2}, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3}}))
    tp = estimate(str(tmp_path), str(ds), 4, seq_len=16, options=[Option(3)])
    assert (tp["zero_ranks"], tp["dp_size"], tp["parameters"]) == (2, 2, result["parameters"])
    split_real = split_tensor_parallel(AutoModelForCausalLM.from_config(hf_config), 2)
    assert 0.5 * result["parameters"] < model_shape(split_real).numel < 0.6 * result["parameters"]
    assert tp["activations"]["without_checkpointing"] == \
        measure_activations(split_real.to(torch.bfloat16), "hf", 3, 16, tensor_parallel=2).full
    assert tp["activations"]["without_checkpointing"] < acts["without_checkpointing"]
    with pytest.raises(ValueError, match="autotp_size: 2 does not divide the world size 3"):
        estimate(str(tmp_path), str(ds), 3, seq_len=16)


def test_estimate_command_table_json_and_errors(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                    "stage3_param_persistence_threshold": 0}}))
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--nodes", "2", "--gpus-per-node", "4",
                 "--memory", "4MiB"]) == 0
    out = capsys.readouterr().out
    assert "world 8 (data-parallel 8)" in out and "ZeRO-2 optimizer->cpu *" in out and "ZeRO-3" in out
    assert "largest depth at the model's width 48 that fits 4.00 MiB per rank under ZeRO-2 optimizer->cpu: " in out
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--world", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    by_label = {o["option"]: o for o in result["options"]}
    # stage 0 -> 3 holds less and less on the device; offload moves the optimizer to the host
    totals = [by_label[f"ZeRO-{s}"]["totals"]["device"] for s in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    moved = by_label["ZeRO-2 optimizer->cpu"]
    assert moved["rows"]["optimizer_states"]["device"] == 0 and moved["rows"]["optimizer_states"]["host"] > 0
    assert main(["estimate", "--model", "nope", "--config", str(ds), "--world", "2"]) == 2
    assert "'nope': not a GPT preset" in capsys.readouterr().err
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stgae": 2}}))
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--world", "2"]) == 2
    assert "stgae" in capsys.readouterr().err
    # the README's example, with the example config (train_batch_size 16: it fits 4 ranks, not 16): estimated with
    # its micro-batch and a note, not refused
    import re
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    command = re.search(r"`zerotrain (estimate [^`]*)`", readme).group(1).split()
    assert command[command.index("--config") + 1] == "ds.json" and "--nodes" in command
    command[command.index("--config") + 1] = str(Path(__file__).resolve().parents[1] / "examples" / "zero2.json")
    assert main([*command, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["world_size"] == 16 and result["activations"]["micro_batch"] == 4
    assert result["note"].startswith("the config's train_batch_size=16 does not fit 16 data-parallel ranks")
    # optimizer states are read from the optimizer zerotrain builds (none in the config: AdamW)
    from zerotrain.config import load_config
    sgd = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}).optimizer
    assert (probe_optimizer(sgd).per_element, probe_optimizer(sgd).per_tensor) == (4, 0)
    assert (probe_optimizer(None).per_element, probe_optimizer(None).per_tensor) == (8, 4)
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("80GB") == 80 * 10**9


def test_largest_model_that_fits_a_memory(tmp_path):
    """--memory: the depth found fits and one layer more does not; likewise the width, in its steps."""
    from zerotrain.config import load_config
    from zerotrain.estimate import config_option, device_peak

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    config = load_config(str(ds), dp_world_size=2)
    optimizer = probe_optimizer(config.optimizer)

    def peak(layers=None, width=None) -> int:
        model, kind = load_meta_model("tiny", torch.float32, layers, width)
        states = estimate_option(model_shape(model), config, 2, config_option(config), optimizer, "cpu")
        return device_peak(states.as_dict(), measure_activations(model, kind, 2, 32).as_dict())

    memory = 2 * peak()
    result = estimate("tiny", str(ds), 2, device_type="cpu", memory=memory)["largest"]
    depth, wide = result["layers"], result["width"]
    assert depth["width"] == 48 and depth["layers"] > 3 and not depth["at_cap"]
    assert peak(layers=depth["layers"]) <= memory < peak(layers=depth["layers"] + 1)
    step = 4  # the head count
    assert wide["layers"] == 3 and wide["width"] > 48 and wide["width"] % step == 0
    assert peak(width=wide["width"]) <= memory < peak(width=wide["width"] + step)
    assert estimate("tiny", str(ds), 2, device_type="cpu", memory=1000)["largest"] == {"layers": None,
                                                                                       "width": None}
    # with tensor parallelism (TP=2 of 4 ranks): each candidate is split by its plan before it is estimated
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 2}}))
    config = load_config(str(ds), dp_world_size=2)

    def split_peak(layers: int, width: int) -> int:
        model, kind = load_meta_model("small", torch.float32, layers, width, multiple=2)
        states = estimate_option(model_shape(split_tensor_parallel(model, 2)), config, 2, config_option(config),
                                 optimizer, "cpu")
        return device_peak(states.as_dict(), measure_activations(model, kind, 2, 32, tensor_parallel=2).as_dict())

    memory = 3 * split_peak(6, 288) // 2
    result = estimate("small", str(ds), 4, device_type="cpu", seq_len=32, memory=memory)["largest"]
    depth, wide = result["layers"], result["width"]
    assert depth["layers"] > 6 and split_peak(depth["layers"], 288) <= memory < split_peak(depth["layers"] + 1, 288)
    assert wide["width"] > 288 and split_peak(6, wide["width"]) <= memory < split_peak(6, wide["width"] + 6)


def test_stage3_peak_counts_its_gradient_shards_or_the_activations_not_both():
    """Stage 3 at one micro-step per step makes its gradient shards during backward while the activations are freed,
    and frees them after the step (zero.stage3.grads): `device_peak` counts the larger of the two. With gradient
    accumulation the shards outlive the next backward, and both count (issue #27: the sum overestimated the in-step
    peak that benchmarks/zero_speed_memory.py --matrix measures by 15%)."""
    from zerotrain.config import load_config
    from zerotrain.estimate import config_option, device_peak

    model, kind = load_meta_model("tiny", torch.float32)
    acts = measure_activations(model, kind, 4, 32).as_dict()
    peaks, grads = {}, {}
    for gas in (1, 2):
        config = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
                              "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3}}, dp_world_size=2)
        states = estimate_option(model_shape(model), config, 2, config_option(config),
                                 probe_optimizer(config.optimizer), "cpu").as_dict()
        peaks[gas], grads[gas] = device_peak(states, acts), states["rows"]["gradients"]["device"]
    assert grads[1] == grads[2] > 0 and acts["with_checkpointing"] > 0
    assert peaks[2] - peaks[1] == min(grads[1], acts["with_checkpointing"]) > 0


def test_a_cpu_first_pass_peak_takes_its_activations_out_of_the_parameter_cache():
    """Issue #43: on a CPU run whose clip takes the norm from a first backward, the activations stay through it
    and the parameter cache gives up as many bytes (`budget.FirstPassReserve`): `device_peak` takes off the
    smaller of the cache and the activations. Not where the user set `max_in_cpu` (the engine keeps it), nor on
    a GPU (activations in device memory, the cache in host memory), nor for the spill."""
    from zerotrain.config import load_config
    from zerotrain.estimate import config_option, device_peak

    model, kind = load_meta_model("tiny", torch.float32)
    acts = measure_activations(model, kind, 1, 8).as_dict()

    def states(device_type: str = "cpu", optimizer: dict | None = None, **param) -> dict:
        nvme = {"device": "nvme", "nvme_path": "/unused"}
        config = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                              "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                    "offload_optimizer": {**nvme, **(optimizer or {})},
                                                    "offload_param": {**nvme, **param}}}, dp_world_size=2)
        return estimate_option(model_shape(model), config, 2, config_option(config),
                               probe_optimizer(config.optimizer), device_type).as_dict()

    cached = states()
    cache = cached["rows"]["parameters"]["host"]
    assert cached["first_pass_cache"] == cache > acts["with_checkpointing"] > 0
    assert any("parameter cache gives them up" in note for note in cached["notes"]), cached["notes"]
    kept = states(max_in_cpu=cache // 4)  # the same bound, set by the user
    assert kept["first_pass_cache"] == 0 and kept["rows"] == cached["rows"]
    assert device_peak(kept, acts) - device_peak(cached, acts) == acts["with_checkpointing"]
    larger = dict(acts, with_checkpointing=2 * cache)  # activations larger than the cache: all of the cache
    assert device_peak(kept, larger) - device_peak(cached, larger) == cache
    assert states("cuda")["first_pass_cache"] == 0
    assert states(optimizer={"norm_first_pass": False})["first_pass_cache"] == 0  # the spill
    in_host = states(optimizer={"norm_first_pass": True}, device="cpu")  # a first pass, parameters in host memory
    assert any("norm from a first backward" in note for note in in_host["notes"]) and in_host["first_pass_cache"] == 0


class _MoEStack(torch.nn.Module):
    """`layers` expert-parallel MoE layers (4 experts) of `width` features between two linear layers."""

    def __init__(self, layers: int, width: int, comm) -> None:
        from zerotrain.parallel.moe import ExpertParallelMoE

        super().__init__()
        self.inp, self.out = torch.nn.Linear(6, width), torch.nn.Linear(width, 3)
        self.moes = torch.nn.ModuleList(ExpertParallelMoE(width, 2 * width, 4, comm) for _ in range(layers))


def test_expert_parallel_states_and_the_largest_moe_that_fits():
    """Split experts (a model family built over a shapes-only expert-parallel group of 2, world 4): their
    states are partitioned over the expert-data-parallel group of 2, the dense ones over all 4; --memory's
    search resizes the family."""
    from zerotrain.estimate import ModelFamily, config_option, device_peak, shape_comm

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 10**9}}
    family = ModelFamily(lambda layers, width: _MoEStack(layers, width, shape_comm(2)), layers=2, width=16,
                         width_step=8, name="moe-stack")
    result = estimate(family, config, 4, device_type="cpu")
    assert (result["expert_parallel_size"], result["model"]) == (2, "moe-stack")
    local = _MoEStack(2, 16, shape_comm(2))
    experts = sum(p.numel() for n, p in local.named_parameters() if ".w_" in n or ".b_" in n)  # this rank's 2 of 4
    dense = sum(p.numel() for p in local.parameters()) - experts
    assert result["parameters"] == dense + 2 * experts
    by_label = {o["option"]: o for o in result["options"]}
    states = by_label["ZeRO-2"]["rows"]["optimizer_states"]["device"]  # AdamW: 8 bytes per element
    assert states == 8 * (-(-dense // 4) + -(-experts // 2)) + 4 * 2  # (+ one `step` per bucket's master)
    # fp32 stage 1 (zero.grads.FullBufferReducer): the whole fp32 buffer (each group's bucket padded to its ranks)
    # and, at the boundary, the reduced shard as a tensor of its own; experts alone in their group (world 2, expert
    # group of 1) are not reduced: their shard is the buffer itself. Stage 0 reduces in place.
    pad = lambda n, r: -(-n // r) * r  # noqa: E731
    grads = {o: by_label[o]["rows"]["gradients"]["device"] for o in ("ZeRO-0", "ZeRO-1")}
    assert grads == {"ZeRO-0": 4 * (dense + experts),
                     "ZeRO-1": 4 * (pad(dense, 4) + pad(experts, 2)) + 4 * (pad(dense, 4) // 4 + pad(experts, 2) // 2)}
    by_label_2 = {o["option"]: o for o in estimate(family, config, 2, device_type="cpu")["options"]}
    assert by_label_2["ZeRO-1"]["rows"]["gradients"]["device"] == 4 * (pad(dense, 2) + experts) + 4 * pad(dense, 2) // 2
    from zerotrain.config import load_config
    parsed = load_config(config, dp_world_size=4)
    optimizer = probe_optimizer(parsed.optimizer)

    def peak(layers: int, width: int) -> int:
        states = estimate_option(model_shape(family.meta(torch.float32, layers, width)), parsed, 4,
                                 config_option(parsed), optimizer, "cpu")
        return device_peak(states.as_dict(), {"with_checkpointing": 0})

    memory = 3 * peak(2, 16)
    largest = estimate(family, config, 4, device_type="cpu", memory=memory)["largest"]
    depth, wide = largest["layers"]["layers"], largest["width"]["width"]
    assert depth > 2 and peak(depth, 16) <= memory < peak(depth + 1, 16)
    assert wide > 16 and wide % 8 == 0 and peak(2, wide) <= memory < peak(2, wide + 8)


def test_estimate_default_device_labelled_searches_and_no_local_budget_for_a_cluster(tmp_path, capsys):
    """Issue 47: the device follows the machine; the two largest-model lines say which search each is; this machine's
    MemAvailable is no budget line of a cluster's estimate (several nodes, or more ranks than this machine has)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3}}))
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--world", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--world", "1"]) == 0
    assert "of this machine's MemAvailable" in capsys.readouterr().out  # this machine: its budget, said so
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--nodes", "2", "--gpus-per-node", "8",
                 "--memory", "4MiB"]) == 0
    out = capsys.readouterr().out
    assert "MemAvailable" not in out and "memory budget: none of this machine's memory (the estimate is for 2 " \
                                         "nodes)" in out
    largest = [line for line in out.splitlines() if line.startswith("largest")]
    assert [line.split(" that fits")[0] for line in largest] == ["largest depth at the model's width 48",
                                                                "largest width at the model's depth 3 layers"]
    assert largest[0].endswith("parameters)") and " layers (" in largest[0] and ": width " in largest[1]
    # nothing fits: each line says which search found none
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--world", "1", "--memory", "1000"]) == 0
    largest = [line for line in capsys.readouterr().out.splitlines() if line.startswith("largest")]
    assert largest[0].endswith(": none (even 1 layer does not fit)")
    assert largest[1].endswith(": none (even the narrowest width does not fit)")
    # more ranks on the node than this machine has: not this machine's either; a budget the config sets is used
    many = str((torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count()) + 1)
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--world", many]) == 0
    assert "MemAvailable" not in capsys.readouterr().out
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3, "memory_budget_bytes": 2**30}}))
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--nodes", "2", "--gpus-per-node", "8"]) == 0
    assert "zero_optimization.memory_budget_bytes" in capsys.readouterr().out


@pytest.mark.parametrize("optimizer_device", ["cpu", "nvme"])
def test_the_nvme_peak_counts_the_tied_weights_zero_init_wrote(tmp_path, optimizer_device, world_of_one):
    """Built under zero.Init with offload_param on NVMe, the tied GPT's head weight is partitioned and written
    before the tie replaces it by the embedding's; initialize drops it. The estimate's `nvme_files_peak` is the
    parameter file right after zero.Init, byte for byte, and `nvme_files` the files after initialize (#43: the
    CPU-offload rows of benchmarks/scale.py measured a peak 1.27x the estimate, which counted the steady files
    only; with the optimizer on NVMe its records come later and are the peak)."""
    import zerotrain
    from zerotrain.config import load_config
    from zerotrain.estimate import config_option
    from zerotrain.models import GPT, GPTConfig

    offload = {"device": optimizer_device}
    if optimizer_device == "nvme":
        offload["nvme_path"] = str(tmp_path / "optimizer")
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {**_ZERO, "stage": 3, "offload_optimizer": offload,
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "param")}}}

    def on_disk() -> int:
        return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(tmp_path)
                   for name in names)

    with zerotrain.zero.Init(dtype=torch.bfloat16, config=config):
        model = GPT(GPTConfig.preset("tiny"))
    after_init = on_disk()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    steady = on_disk()
    engine.close()
    parsed = load_config(config, dp_world_size=1)
    shape = model_shape(load_meta_model("tiny")[0])
    assert [name for name, _ in shape.tied_copies] == ["transformer.wte.weight"], shape.tied_copies
    predicted = estimate_option(shape, parsed, 1, config_option(parsed), probe_optimizer(parsed.optimizer), "cpu")
    peak = predicted.as_dict()["nvme_files_peak"]
    assert predicted.nvme_files == steady, (predicted.nvme_files, steady)
    if optimizer_device == "cpu":  # the parameter file alone: zero.Init's is the peak, by the head's shard
        assert peak == after_init > steady, (peak, after_init, steady)
    else:  # the records come after initialize dropped the head's shard: the steady files are the peak
        assert peak == steady > after_init, (peak, after_init, steady)


# In-process cases at a world of one: the stage 0-1 gradients in fp32 and bf16 (the reduced fp32 gradient is the
# buffer itself, or a tensor of its own held until the step), CPU offload at stages 1-3 (stage 3 narrow: bf16 shards
# and one fp32 scratch), and gradient accumulation at stage 3 (fp32 shards, no scratch).
WORLD_OF_ONE_CASES = [
    (0, None, None, "fp32", 1), (0, None, None, "bf16", 1), (1, None, None, "fp32", 1),
    (1, ("cpu", 1.0), None, "bf16", 1), (2, ("cpu", 0.5), None, "bf16", 1), (3, ("cpu", 1.0), "cpu", "bf16", 1),
    (3, ("cpu", 1.0), None, "bf16", 2),
]


def test_estimate_matches_the_engine_at_a_world_of_one(tmp_path, world_of_one):
    """Each case's engine in the pytest process (one step, then one more backward: the gradients are held):
    `memory_report()` row for row equals the estimate, and the gradient bytes the report adds from the step's end
    to after that backward are the bytes of the tensors that became alive (the garbage collector's view), so the
    gradients row is what the run holds, not only what the engine says it holds."""
    with _every_object_seen():
        _world_of_one_cases(tmp_path)


def _world_of_one_cases(tmp_path) -> None:
    """test_estimate_matches_the_engine_at_a_world_of_one's cases and checks."""
    import zerotrain
    from zerotrain.config import load_config
    from zerotrain.models import GPT, GPTConfig

    for *case, accumulation in WORLD_OF_ONE_CASES:
        config = dict(_config(*case, nvme_path=str(tmp_path)), gradient_accumulation_steps=accumulation)
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny"))
        if case[3] == "fp32":  # buffers of the model's own: an int64 one (8 bytes each) and an fp32 one
            model.register_buffer("counts", torch.zeros(5, dtype=torch.int64))
            model.register_buffer("scale", torch.ones(3))
        shape = model_shape(model)
        engine, *_ = zerotrain.initialize(model=model, config=config)
        for micro in range(2 * accumulation):
            idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(micro))
            _, loss = engine(idx, idx)
            del _
            engine.backward(loss)
            del loss
            if micro < accumulation:
                engine.step()
            if micro == accumulation - 1:
                after_step = (_live_tensor_bytes(), engine.memory_report()["gradients"])
        report = engine.memory_report()
        grown = (_live_tensor_bytes() - after_step[0], report["gradients"] - after_step[1])
        buffers = sum(b.numel() * b.element_size() for b in engine.module.buffers())
        engine.close()
        parsed = load_config(config, dp_world_size=1)
        rows = estimate_option(shape, parsed, 1, Option(case[0], case[1][0] if case[1] else "none", case[2] or "none"),
                               probe_optimizer(parsed.optimizer), device_type="cpu").rows
        where = f"case {case}, accumulation {accumulation}"
        label = " ".join(["ZeRO-%d" % case[0]] + (["optimizer->cpu"] if case[1] else []) +
                         (["params->cpu"] if case[2] else []))
        assert Option(case[0], case[1][0] if case[1] else "none", case[2] or "none").label == label, where
        assert report["gradients"] == rows["gradients"]["device"] > 0, (where, report["gradients"], rows["gradients"])
        if case[0] < 3:  # (stage 3 also gathers and frees parameters in backward: not only gradients grow)
            assert grown[0] == grown[1], (where, grown)
        assert report["parameters"] == rows["parameters"]["device"], where
        assert buffers == rows["buffers"]["device"] == (5 * 8 + 3 * 4 if case[3] == "fp32" else 0), where
        assert report["optimizer_states"] == rows["master_weights"]["device"] + rows["optimizer_states"]["device"], \
            where
        offload = report.get("offload", {"host": 0, "host_buffers": 0})
        assert offload["host"] == rows["master_weights"]["host"] + rows["optimizer_states"]["host"], where
        assert offload["host_buffers"] == rows["host_io_buffers"]["host"], where
        split = report.get("offload_param", {"host": 0})
        assert split["host"] == rows["parameters"]["host"], where


# The NVMe cases of CASES at a world of one (in the pytest process: what tools/mutate.py runs per mutant):
# streamed (no clipping), the norm's first pass (parameters on NVMe), spilled gradients (parameters in host memory),
# and stage 2's bf16 records.
# fp32 spilled: the spill's host buffers hold no fp32 working copy of a chunk (bf16's do)
SPILLED_FP32 = (3, ("nvme", 1.0), "cpu", "fp32")
NVME_WORLD_OF_ONE_CASES = [STREAMED, FIRST_PASS, SPILLED, SPILLED_FP32, (2, ("nvme", 1.0), None, "bf16 records")]


def test_estimate_matches_the_engine_on_nvme_at_a_world_of_one(tmp_path, world_of_one):
    """Each NVMe case's engine in the pytest process (one step, one more backward): the memory report's rows,
    the host I/O buffers of the optimizer's and the parameter store's pools, the swap files on disk byte for byte,
    the first pass and the spill as the engine chose them, equal to the estimate at a world of one."""
    from zerotrain.config import load_config

    for number, case in enumerate(NVME_WORLD_OF_ONE_CASES):
        nvme_path = str(tmp_path / str(number))
        config = _config(*case, nvme_path=nvme_path)
        if case == STREAMED:
            config["gradient_clipping"] = 0.0
        engine, _, _ = _step_then_backward(config)
        report = engine.memory_report()
        files = _swap_file_bytes(nvme_path)
        first_pass = engine.zero_optimizer.takes_norm_first_pass()
        reserve = engine.first_pass_reserve is not None
        spilled = engine.offload_stats().get("nvme_spill_bytes", 0)
        engine.close()
        parsed = load_config(config, dp_world_size=1)
        predicted = estimate_option(model_shape(load_meta_model("tiny")[0]), parsed, 1,
                                    Option(case[0], case[1][0], case[2] or "none"), probe_optimizer(parsed.optimizer),
                                    device_type="cpu")
        rows, where = predicted.rows, f"case {case}"
        assert report["parameters"] == rows["parameters"]["device"], where
        assert report["gradients"] == rows["gradients"]["device"], where
        assert (rows["gradients"]["device"] == 0) == (case in (STREAMED, FIRST_PASS, SPILLED, SPILLED_FP32)), where
        assert report["optimizer_states"] == rows["master_weights"]["device"] + rows["optimizer_states"]["device"], \
            where
        offload = report["offload"]
        assert offload["host"] == rows["master_weights"]["host"] + rows["optimizer_states"]["host"], where
        assert offload["nvme"] == rows["master_weights"]["nvme"] + rows["optimizer_states"]["nvme"] > 0, where
        split = report.get("offload_param", {"host": 0, "nvme": 0})
        assert split["host"] == rows["parameters"]["host"] and split["nvme"] == rows["parameters"]["nvme"], where
        assert offload["host_buffers"] + report.get("offload_param", {}).get("host_buffers", 0) == \
            rows["host_io_buffers"]["host"], where
        assert files == predicted.nvme_files > 0, (where, files, predicted.nvme_files)
        assert first_pass == (case == FIRST_PASS) == reserve, where
        # the first pass's activations come out of the parameter cache (the budget chose max_in_cpu)
        assert predicted.first_pass_cache == (rows["parameters"]["host"] if case == FIRST_PASS else 0), where
        assert any("norm from a first backward" in note for note in predicted.notes) == (case == FIRST_PASS), where
        assert (spilled > 0) == (case in (SPILLED, SPILLED_FP32)), where


def test_qgz_loco_buffers_of_one_and_two_hops_are_the_reducers():
    """qgZ with LoCo at 4 ZeRO ranks (stage 3: one reduce per parameter): on one node and on two nodes of 2 ranks
    (`ranks_per_node`), the estimate's LoCo error bytes are those of the engine's own reducer for that shard
    (`comm.compressed.QuantizedReduceScatter`, one hop or the two-hop hierarchy: L x M·S then M x S), each of its
    error buffers stored once. In-process: no process group, the reducers' Comms only name their sizes."""
    from zerotrain.comm import Comm
    from zerotrain.comm.compressed import QuantizedReduceScatter
    from zerotrain.config import load_config

    with torch.device("meta"):
        model = torch.nn.Linear(1024, 512, bias=False)
    loco = {"err_beta": 0.8, "reset_T": 1024}
    parsed = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                          "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                "zeropp_loco_param": loco}}, dp_world_size=4)
    shard = 1024 * 512 // 4
    for per_node, hierarchy in ((None, None), (2, (Comm(None, 0, 2), Comm(None, 0, 2)))):
        reducer = QuantizedReduceScatter(Comm(None, 0, 4), shard, loco_beta=0.8, hierarchy=hierarchy)
        for feedback in reducer.feedbacks:
            zeros = torch.zeros(feedback.shape)
            feedback.update(zeros, zeros, None)
        want = sum(feedback.nbytes for feedback in reducer.feedbacks)
        rows = estimate_option(model_shape(model), parsed, 4, Option(3, "none", "none"),
                               probe_optimizer(parsed.optimizer), device_type="cpu", ranks_per_node=per_node).rows
        assert rows["loco_errors"]["device"] == want > 0, (per_node, rows["loco_errors"], want)


def test_the_estimates_options_are_estimate_option_on_the_device_asked():
    """`estimate(...)` of a CPU run (the optimizer offloaded to the CPU: no host copy of what is already in host
    memory) gives, per option, `estimate_option`'s bytes for that device, not a CUDA device's (which differ)."""
    from zerotrain.config import load_config

    with torch.device("meta"):
        model = torch.nn.Linear(256, 128)
    ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    option = Option(2, "cpu", "none")
    parsed = load_config(ds, dp_world_size=1)
    report = estimate(model, ds, world_size=1, options=[option], device_type="cpu", seq_len=8)
    rows = {device: estimate_option(model_shape(model), parsed, 1, option, probe_optimizer(parsed.optimizer),
                                    device_type=device).as_dict() for device in ("cpu", "cuda")}
    assert rows["cpu"] != rows["cuda"]
    assert report["options"] == [rows["cpu"]]


@pytest.mark.parametrize("width,memory", [(64, 40_000_000), (64, 3_000_000)])
def test_the_largest_fit_search_builds_only_the_models_its_prediction_and_check_need(width, memory):
    """`largest_fitting`'s contract (each `peak` is a meta model built and estimated: seconds on a real family):
    the depth is predicted from the line through the model's depth and the next, each width from its 1- and
    2-layer models, and only the prediction and the next step are checked at the full depth when the bytes are
    exactly linear in the depth. The widths probed grow by doubling from the model's own: none beyond twice
    the answer or the model's own width. The answers equal a scan of every depth and width."""
    from zerotrain.estimate import largest_fitting

    layers, step = 4, 4
    probes = []

    def peak(layers: int, width: int) -> tuple[int, int]:  # bytes linear in the depth, quadratic in the width
        probes.append((layers, width))
        per_layer = 12 * width * width + 13 * width
        return 5000 * width + layers * per_layer * 4, 5000 * width + layers * per_layer

    result = largest_fitting(peak, memory, layers, width, step)
    built = list(probes)
    fits = lambda n, w: peak(n, w)[0] <= memory  # noqa: E731
    depth = max(n for n in range(1, 300) if fits(n, width))
    wide = max(w for w in range(step, 4096, step) if fits(layers, w))
    assert result["layers"] == {"layers": depth, "width": width, "parameters": peak(depth, width)[1],
                                "at_cap": False}
    assert result["width"] == {"layers": layers, "width": wide, "parameters": peak(layers, wide)[1],
                               "at_cap": False}
    assert len(built) == len(set(built))  # each model built once
    full = {probe for probe in built if probe[0] > 2}
    assert full == {(layers, width), (layers + 1, width), (depth, width), (depth + 1, width),
                    (layers, wide), (layers, wide + step)}, (depth, wide, sorted(full))
    assert {n for n, _ in built if n <= 2} == {1, 2}
    assert max(w for n, w in built if n <= 2) <= max(width, 2 * wide), (wide, sorted(built))


def test_the_command_passes_and_prints_what_it_was_asked(tmp_path, capsys):
    """`zerotrain estimate`'s flags reach the estimate and its output says what was estimated: tensor parallelism
    in the JSON and the table's title; --gpus-per-node's nodes in the bytes (qgZ + LoCo's two hops: those of
    `estimate(ranks_per_node=)`, not of one node); the fp8 line names a float8 gather only where the config makes
    one; every size unit --memory takes."""
    import transformers

    from zerotrain.estimate import format_bytes

    ds = tmp_path / "tp.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 2}}))
    command = ["estimate", "--model", "small", "--config", str(ds), "--world", "4", "--device", "cpu", "--seq-len", "8"]
    assert main([*command, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["tensor_parallel_size"], result["expert_parallel_size"], result["dp_size"]) == (2, 1, 2)
    assert main(command) == 0
    assert "world 4 (data-parallel 2 x tensor-parallel 2; ZeRO over 2 ranks)" in capsys.readouterr().out

    ds = tmp_path / "qgz.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                    "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}}))
    assert main(["estimate", "--model", "tiny", "--config", str(ds), "--nodes", "2", "--gpus-per-node", "2",
                 "--device", "cpu", "--seq-len", "8", "--json"]) == 0
    options = json.loads(capsys.readouterr().out)["options"]
    two_nodes = estimate("tiny", str(ds), 4, device_type="cpu", seq_len=8, ranks_per_node=2)["options"]
    one_node = estimate("tiny", str(ds), 4, device_type="cpu", seq_len=8)["options"]
    assert options == two_nodes != one_node

    llama = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    llama.save_pretrained(tmp_path / "llama")
    for gathers in (False, True):
        ds = tmp_path / "fp8.json"
        ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": 3},
                                  "fp8": {"enabled": True, "float8_all_gather": gathers}}))
        command = ["estimate", "--model", str(tmp_path / "llama"), "--config", str(ds), "--world", "2",
                   "--device", "cpu", "--seq-len", "16"]
        assert main([*command, "--json"]) == 0
        fp8 = json.loads(capsys.readouterr().out)["fp8"]
        assert main(command) == 0
        line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fp8 (")]
        assert len(line) == 1 and f" add {format_bytes(fp8['transient_bytes'])} to '+ act.'" in line[0], line
        assert (" and float8 gather (" in line[0]) == gathers, line
        if gathers:
            assert f"float8 gather ({format_bytes(fp8['gather_bytes'])})" in line[0]

    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
             "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    for unit, factor in units.items():
        assert parse_bytes(f"3{unit}") == parse_bytes(f"3 {unit.upper()}") == 3 * factor, unit
    assert parse_bytes("1.5KiB") == 1536
    # and the table's sizes: bytes below 1 KiB as bytes, each unit from exactly 1024 of the one below
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 2**20 - 1, 2**20, 3 * 2**30, 2**40, 2**50)] == \
        ["0", "1023 B", "1.00 KiB", "1.50 KiB", "1024.00 KiB", "1.00 MiB", "3.00 GiB", "1.00 TiB", "1024.00 TiB"]

