"""Every path that behaves differently on CUDA, written device-agnostic: each test runs on this machine's device
(its GPU when there is one, else the CPU), so the CPU suite runs every body before a GPU ever does.

Four launches:
- world 1 (`world1_paths`): ZeRO-1/2/3 against plain PyTorch on the same device (fp32, exact); CPU offload with
  pinned buffers and its copy streams, SuperOffload (speculation "always": overlap, and the clipping redos and the
  fp16 overflow rollbacks it must undo) equal to plain offload bit for bit and to PyTorch at the project
  tolerance; param offload; NVMe offload of states and parameters (O_DIRECT from pinned buffers where the
  directory takes it: no buffered-I/O warning then); bf16 close to fp32; fp16 with dynamic loss scaling and an
  injected overflow: the step is skipped, the scale halves, and the run equals PyTorch that skipped that batch
  (within fp16's tolerance, the do-nothing run outside it); activation checkpointing with `cpu_checkpointing`
  (inputs kept in pinned host memory on CUDA) equal to PyTorch without checkpointing.
- quantization (`quantization_on_device`, no launch): qgZ/qwZ's blockwise int8/int4 kernels and LoCo's error
  feedback on this device equal the CPU kernels bit for bit (IEEE division and rounding on both).
- world 2 on ONE device over gloo (`gloo_world2`): NCCL refuses two ranks on one GPU, gloo takes CUDA tensors
  for all-reduce, broadcast, all-gather and all-to-all; each Comm collective on device tensors gives the
  exact sums, and ZeRO-2, ZeRO-3 and ZeRO-3 with qgZ + LoCo + qwZ train as single-process PyTorch does.
- a Hugging Face Llama (`hf_lora_and_generate`): LoRA (peft) fine-tuned at ZeRO-3 equals peft's own training on
  the same device; ZeRO-Inference (`load_for_inference`, parameters on NVMe) generates transformers' tokens.

GPU sessions run these through benchmarks/gpu_check.sh, whose pytest `--basetemp` is a folder on a disk that
takes O_DIRECT (/tmp may be tmpfs), so the NVMe paths really read and write with it.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from distributed import run_distributed

STEPS, MICRO, ACCUMULATION = 4, 4, 2
EXPECTED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _config(stage: int, zero: dict | None = None, top: dict | None = None, clip: float = 1.0) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": clip, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0,
                                  **(zero or {})}, **(top or {})}


def _steps(engine, batches, world: int = 1, rank: int = 0, poison: tuple = ()) -> list[float]:
    """Global steps over `batches` (this rank's micro-batches, moved to the engine's device); `poison`: (step,
    micro) pairs whose loss is multiplied by inf (an fp16 overflow). Returns the mean loss of every step."""
    from models_for_tests import micro_slice

    device, losses = engine.topology.device, []
    for step, batch in enumerate(batches):
        total = 0.0
        for index in range(ACCUMULATION):
            x, y = (t.to(device, engine.dtype) for t in micro_slice(batch, index, rank, world, MICRO))
            loss = engine(x, y)
            engine.backward(loss * float("inf") if (step, index) in poison else loss)
            engine.step()
            total += float(loss.detach())
        losses.append(total / ACCUMULATION)
    if world > 1:
        import torch.distributed as dist
        mean = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(mean)  # a CPU tensor: every backend's all-reduce takes it
        losses = (mean / world).tolist()
    return losses


def _reference(device: torch.device, batches, lr: float = 1e-2) -> tuple:
    from models_for_tests import OddMLP, reference_training

    on_device = [(x.to(device), y.to(device)) for x, y in batches]
    losses, weights = reference_training(lambda: OddMLP().to(device), on_device, lr=lr)
    return losses, {name: tensor.cpu() for name, tensor in weights.items()}


def _engine_run(stage: int, zero: dict | None = None, top: dict | None = None, batches=None,
                poison: tuple = ()) -> dict:
    import zerotrain
    from models_for_tests import OddMLP

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config(stage, zero, top))
        world, rank = engine.topology.dp_size, engine.topology.dp_rank
        losses = _steps(engine, batches, world, rank, poison)
    out = {"losses": losses, "weights": {n: t.cpu() for n, t in engine.full_state_dict().items()},
           "skipped": engine.skipped_steps, "loss_scale": float(engine.loss_scale),
           "offload": engine.offload_stats() if engine.zero_optimizer is not None else {},
           "warnings": [str(w.message) for w in caught], "device": engine.topology.device.type}
    engine.close()
    return out


# --- world 1 -----------------------------------------------------------------------------------------------
PINNED = {"device": "cpu", "pin_memory": True}
SUPER = {"device": "cpu", "pin_memory": True, "super_offload": True, "super_offload_speculation": "always"}
EXACT = {  # name -> (stage, zero_optimization extras): each equals plain fp32 PyTorch on the device
    "zero1": (1, {}),
    "zero2": (2, {}),
    "zero3": (3, {}),
    "zero2 cpu offload (pinned)": (2, {"offload_optimizer": PINNED}),
    "zero2 super_offload": (2, {"offload_optimizer": SUPER}),
    "zero3 super_offload + offload_param": (3, {"offload_optimizer": SUPER, "offload_param": PINNED}),
    "zero3 offload_param only": (3, {"offload_param": PINNED}),
    "zero3 nvme states + params": (3, {"offload_optimizer": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True},
                                       "offload_param": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True}}),
}
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
POISONED = (1, 1)  # the overflow: step 1's second micro-batch
CKPT_SEQ = 16


def _gpt():
    from zerotrain.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=4, n_embd=32, block_size=CKPT_SEQ, n_inner=64))


def _checkpointing_runs(device: torch.device) -> dict:
    """GPT at ZeRO-3 with `cpu_checkpointing` against plain PyTorch without checkpointing (math attention in both:
    the fused CUDA kernels may pick another backward per call)."""
    import zerotrain
    from zerotrain import checkpointing as ckpt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens = [torch.randint(0, 96, (MICRO, CKPT_SEQ + 1), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    with sdpa_kernel(SDPBackend.MATH):
        model = _gpt().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
        ref_losses = []
        for t in tokens:
            t = t.to(device)
            _, loss = model(t[:, :-1], t[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            ref_losses.append(loss.item())
        ref_weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, "steps_per_print": 0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "activation_checkpointing": {"cpu_checkpointing": True}}
        engine, *_ = zerotrain.initialize(model=_gpt(), config=config)
        ckpt.reset()
        losses = []
        for t in tokens:
            t = t.to(device)
            _, loss = engine(t[:, :-1], t[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out = {"losses": losses, "weights": {n: t.cpu() for n, t in engine.full_state_dict().items()},
               "ref_losses": ref_losses, "ref_weights": ref_weights, "stats": ckpt.stats()}
        engine.close()
    return out


def world1_paths(nvme_dir: str) -> dict:
    """Every world-1 run on this rank's device (see the module docstring), in one process."""
    from models_for_tests import make_batches
    from zerotrain.offload.aio import direct_io_supported
    from zerotrain.topology import default_device

    device = default_device()
    batches = make_batches(STEPS, MICRO * ACCUMULATION)
    skipping = [b for step, b in enumerate(batches) if step != POISONED[0]]  # PyTorch that skipped the poisoned step
    out = {"device": device.type, "direct_io": direct_io_supported(nvme_dir),
           "reference": _reference(device, batches), "untrained": _reference(device, batches, 0.0),
           "skipping": _reference(device, skipping), "skipping_untrained": _reference(device, skipping, 0.0)}
    for name, (stage, zero) in EXACT.items():
        zero = {k: ({**v, "nvme_path": nvme_dir} if v.get("nvme_path") == "NVME" else v) for k, v in zero.items()}
        out[name] = _engine_run(stage, zero, batches=batches)
    out["zero2 bf16"] = _engine_run(2, {}, {"bf16": {"enabled": True}}, batches)
    for name, offload in (("plain offload", PINNED), ("super_offload", SUPER)):
        out[f"zero2 {name}, fp16 overflow"] = _engine_run(2, {"offload_optimizer": offload}, FP16, batches, (POISONED,))
    out["zero3 fp16 overflow"] = _engine_run(3, {}, FP16, batches, (POISONED,))
    out["checkpointing"] = _checkpointing_runs(device)
    return out


def test_world1_paths_match_plain_pytorch_on_this_device(tmp_path):
    from models_for_tests import assert_same_training, assert_tolerance_discriminates

    run = run_distributed(world1_paths, 1, str(tmp_path), timeout=300)[0]
    assert run["device"] == EXPECTED_DEVICE
    reference, untrained = run["reference"], run["untrained"]
    for name in EXACT:
        assert run[name]["device"] == EXPECTED_DEVICE, name
        assert_same_training(run[name]["losses"], run[name]["weights"], *reference, where=name)
        assert run[name]["skipped"] == 0, name
    # SuperOffload speculated every step; clipping (1.0) fired on some, whose speculative updates were redone.
    for name in ("zero2 super_offload", "zero3 super_offload + offload_param"):
        stats = run[name]["offload"]
        assert stats["speculative_steps"] == STEPS and stats["committed"] + stats["clip_redos"] == STEPS, (name, stats)
        assert stats["clip_redos"] >= 1 and stats["committed"] >= 1, (name, stats)
    # SuperOffload equals plain CPU offload bit for bit (the same CPU Adam on the same gradients; on the CPU this
    # holds, tests/offload/test_offload_speculation.py; a GPU difference would name the first tensor that differs).
    for got, want in (("zero2 super_offload", "zero2 cpu offload (pinned)"),
                      ("zero2 super_offload, fp16 overflow", "zero2 plain offload, fp16 overflow")):
        assert run[got]["losses"] == run[want]["losses"], (got, want)
        for tensor_name, tensor in run[want]["weights"].items():
            assert torch.equal(run[got]["weights"][tensor_name], tensor), (got, tensor_name)
    # NVMe: O_DIRECT where the directory takes it, and then no fallback warning.
    nvme_warnings = [w for w in run["zero3 nvme states + params"]["warnings"] if "O_DIRECT" in w]
    if run["direct_io"]:
        assert not nvme_warnings, nvme_warnings
    else:  # a folder without O_DIRECT (tmpfs): the buffered fallback is announced
        assert nvme_warnings
    # bf16 (fp32 masters) close to fp32, the do-nothing run outside (tolerances as test_cuda_world1's).
    assert_tolerance_discriminates("bf16 zero2", reference, (run["zero2 bf16"]["losses"], run["zero2 bf16"]["weights"]),
                                   untrained, loss_tol=7e-3, weight_tol=1e-2)
    # fp16, dynamic loss scale 2^8, one micro-batch's loss times inf: that step is skipped, the scale halves once
    # (hysteresis 1), and the run is PyTorch's that skipped the batch, within fp16's tolerance.
    for name in ("zero2 plain offload, fp16 overflow", "zero2 super_offload, fp16 overflow", "zero3 fp16 overflow"):
        result = run[name]
        assert result["skipped"] == 1 and result["loss_scale"] == 2.0 ** 7, (name, result["skipped"],
                                                                              result["loss_scale"])
        losses = [loss for step, loss in enumerate(result["losses"]) if step != POISONED[0]]
        # (measured on CPU: 4.2e-4 / 2.1e-4 off, the do-nothing run 5.3e-3 / 9.0e-2)
        assert_tolerance_discriminates(name, run["skipping"], (losses, result["weights"]), run["skipping_untrained"],
                                       loss_tol=2e-3, weight_tol=1e-2)
    stats = run["zero2 super_offload, fp16 overflow"]["offload"]
    assert stats["overflow_rollbacks"] == 1, stats
    # Activation checkpointing with cpu_checkpointing: PyTorch's numbers; on CUDA every kept input in host memory.
    ckpt = run["checkpointing"]
    assert_same_training(ckpt["losses"], ckpt["weights"], ckpt["ref_losses"], ckpt["ref_weights"],
                         where="cpu_checkpointing")
    stats = ckpt["stats"]
    assert stats["forwards"] == stats["recomputes"] == 2 * 3, stats  # two blocks, three steps
    if EXPECTED_DEVICE == "cuda":  # every block input went to pinned host memory and came back for the recompute
        assert stats["kept_host_bytes"] == stats["input_bytes"] == 2 * 3 * MICRO * CKPT_SEQ * 32 * 4, stats
        assert stats["kept_device_bytes"] == 0, stats
    else:  # on the CPU there is no host copy to make: torch's checkpoint keeps the inputs as they are
        assert stats["kept_host_bytes"] == stats["input_bytes"] == 0, stats


# --- quantization kernels on the device against the CPU ones ---------------------------------------------------
def test_quantization_kernels_on_this_device_equal_the_cpu_kernels():
    from zerotrain.comm.compressed import ErrorFeedback
    from zerotrain.comm.quant import quantize_rows
    from zerotrain.topology import default_device

    device = default_device()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=generator) * torch.logspace(-6, 6, 6).unsqueeze(1)
    x[2, 100:400] = 0.0  # whole zero blocks
    x[3, 7] = 1e4  # an outlier
    # The check can fail: for these inputs CUDA's `tensor / number` (tensor times the rounded reciprocal) gives
    # other scales than a correctly rounded division, which quantize_rows therefore does not use.
    amax = x.abs().reshape(-1, 8).amax(dim=1)
    for qmax in (127.0, 7.0):
        reciprocal = torch.tensor(1.0) / torch.tensor(qmax)
        assert not torch.equal(amax * reciprocal, amax / torch.tensor(qmax)), qmax
    for bits in (8, 4):
        for scale_dtype in (torch.float32, torch.float16):
            x_in = x[:2] if scale_dtype == torch.float16 else x  # fp16 scales hold the small rows only
            want = quantize_rows(x_in, bits, 256, scale_dtype)
            got = quantize_rows(x_in.to(device), bits, 256, scale_dtype)
            where = f"{bits} bits, {scale_dtype} scales on {device}"
            assert torch.equal(got.data.cpu(), want.data), where
            assert torch.equal(got.scales.cpu(), want.scales), where
            assert torch.equal(got.wire().cpu(), want.wire()), where
            assert torch.equal(got.dequantize().cpu(), want.dequantize()), where
            assert (got.dequantize().cpu() - x_in).abs().max() > 0, where  # lossy: not a copy
    # LoCo's error feedback (c = g + e; e <- b*e + (1-b)*(c - deQ(Q(c))) in 8 bits), three steps. Step 0 (e = 0)
    # is bit for bit; later ones may differ where the device fuses b*e + ... into one FMA and the CPU rounds twice:
    # then by at most one int4 step of the block (an 8-bit error element flipped, then its int4 rounding).
    runs = {}
    for where in ("cpu", str(device)):
        feedback, values, steps = ErrorFeedback(4, 512, beta=0.8), [], []
        for step in range(3):
            grad = torch.randn(4, 512, generator=torch.Generator().manual_seed(10 + step)).to(where)
            compensated, error = feedback.compensate(grad)
            q = quantize_rows(compensated, 4)
            feedback.update(compensated, q.dequantize(), error)
            values.append(q.dequantize().cpu())
            steps.append(q.scales.cpu())
        runs[where] = (values, steps, feedback.error().cpu())
    (cpu_values, cpu_scales, cpu_error), (dev_values, _, dev_error) = runs["cpu"], runs[str(device)]
    assert torch.equal(cpu_values[0], dev_values[0]), f"LoCo step 0 on {device}"
    for step in (1, 2):
        step_size = cpu_scales[step].repeat_interleave(256, dim=1)[:, :512]
        assert bool(((cpu_values[step] - dev_values[step]).abs() <= step_size * 1.001).all()), f"LoCo step {step}"
    assert cpu_error.abs().max() > 0 and (cpu_error - dev_error).abs().max() <= 0.05 * cpu_error.abs().max()


# --- world 2 on one device over gloo ----------------------------------------------------------------------------
QUANTIZED_STEPS = 10
ZEROPP = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
          "zero_quantized_weights": True}


def _collectives(device: torch.device) -> dict:
    """Each Comm collective on device tensors: 'ok', or the error it raised (first line)."""
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    topology = Topology.build()
    comm = Comm.data_parallel(topology)
    rank, world = topology.dp_rank, topology.dp_size
    base = torch.arange(12, dtype=torch.float32, device=device)  # every rank: base * (rank + 1)
    mine = base * (rank + 1)
    total = base * sum(r + 1 for r in range(world))
    checks = {
        "all_reduce": lambda: (lambda t: (comm.all_reduce(t), t)[1])(mine.clone()).equal(total),
        "broadcast": lambda: (lambda t: (comm.broadcast(t, src=1), t)[1])(mine.clone()).equal(base * 2),
        "all_gather": lambda: (lambda out: (comm.all_gather(out, mine), out)[1])(
            torch.empty(world * 12, device=device)).equal(torch.cat([base * (r + 1) for r in range(world)])),
        "reduce_scatter": lambda: (lambda out: (comm.reduce_scatter(out, mine), out)[1])(
            torch.empty(12 // world, device=device)).equal(total.chunk(world)[rank]),
        "all_to_all": lambda: (lambda out: (comm.all_to_all(out, mine.view(world, -1)), out)[1])(
            torch.empty(world, 12 // world, device=device)).equal(
            torch.stack([(base * (r + 1)).view(world, -1)[rank] for r in range(world)])),
    }
    results = {}
    for name, check in checks.items():
        try:
            results[name] = "ok" if check() else "wrong values"
        except Exception as error:  # noqa: BLE001 - reported to the test, which decides
            results[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        comm.barrier()
    return results


def gloo_world2() -> dict:
    """Two ranks on this machine's one device over gloo: the collectives, then ZeRO-2/3 (+ ZeRO++) training."""
    import torch.distributed as dist

    from models_for_tests import make_batches
    from zerotrain.topology import default_device

    device = default_device()
    dist.init_process_group("gloo")  # before zerotrain: on CUDA it would pick NCCL, which refuses 2 ranks on 1 GPU
    out = {"device": device.type, "backend": str(dist.get_backend()), "collectives": _collectives(device)}
    batches = make_batches(STEPS, MICRO * ACCUMULATION * 2)
    quantized_batches = make_batches(QUANTIZED_STEPS, MICRO * ACCUMULATION * 2, seed=3)
    if dist.get_rank() == 0:
        out["reference"] = _reference(device, batches)
        out["quantized_reference"] = _reference(device, quantized_batches)
        out["quantized_untrained"] = _reference(device, quantized_batches, 0.0)
    out["zero2"] = _engine_run(2, batches=batches)
    out["zero3"] = _engine_run(3, batches=batches)
    out["zero3 qgZ+LoCo+qwZ"] = _engine_run(3, ZEROPP, batches=quantized_batches)
    return out


def test_two_ranks_on_one_device_over_gloo_train_as_pytorch():
    from models_for_tests import assert_same_training, assert_tolerance_discriminates

    runs = run_distributed(gloo_world2, 2, timeout=300)
    first = runs[0]
    assert first["device"] == EXPECTED_DEVICE and first["backend"] == "gloo"
    for rank, run in enumerate(runs):
        assert run["collectives"] == {name: "ok" for name in run["collectives"]}, (rank, run["collectives"])
    for name in ("zero2", "zero3"):  # full weights are gathered on rank 0; every rank reports the mean losses
        assert_same_training(first[name]["losses"], first[name]["weights"], *first["reference"], where=name)
        assert runs[1][name]["losses"] == first[name]["losses"], name
    # int4 gradients (one quantization per contribution, LoCo) and int8 weights (measured on CPU: 1.5e-3 / 1.9e-2
    # off, the do-nothing run 0.18 / 0.28).
    result = first["zero3 qgZ+LoCo+qwZ"]
    assert_tolerance_discriminates("gloo world 2 qgZ+LoCo+qwZ", first["quantized_reference"],
                                   (result["losses"], result["weights"]), first["quantized_untrained"],
                                   loss_tol=0.02, weight_tol=0.08)


# --- a Hugging Face Llama: LoRA fine-tune, ZeRO-Inference generate -----------------------------------------------
LORA_STEPS, LORA_SEQ, MAX_NEW = 4, 16, 8


def _lora_model(model_dir: str, device: torch.device):
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(7)  # the adapters' initialisation
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config).to(device)


def hf_lora_and_generate(model_dir: str, nvme_dir: str) -> dict:
    """peft LoRA at ZeRO-3 and plain peft on this device; load_for_inference's generate and transformers'."""
    import transformers

    import zerotrain
    from zerotrain.run.generate import load_for_inference
    from zerotrain.topology import default_device

    device = default_device()
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    tokens = torch.randint(0, vocab, (LORA_STEPS, 2, LORA_SEQ), generator=torch.Generator().manual_seed(3))
    out = {"device": device.type}
    for lr, key in ((1e-2, "reference"), (0.0, "untrained")):
        model = _lora_model(model_dir, device)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=lr, eps=1e-6, weight_decay=0.0)
        losses = []
        for ids in tokens.to(device):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[key] = (losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad})
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerotrain.initialize(model=_lora_model(model_dir, device), config=config)
    losses = []
    for ids in tokens.to(device):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["lora"] = (losses, {n: t.cpu() for n, t in engine.full_state_dict(trainable_only=True).items()})
    engine.close()

    prompt = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(5)).to(device)
    greedy = {"do_sample": False, "max_new_tokens": MAX_NEW, "use_cache": True, "eos_token_id": None, "pad_token_id": 0}
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out["want"] = reference.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **greedy)[0].tolist()
    inference = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                       "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 4,
                                                         "buffer_size": 100_000, "max_in_cpu": 1000}}}
    engine, _ = load_for_inference(model_dir, inference)
    out["got"] = engine.module.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **greedy)[0].tolist()
    out["generate_device"] = engine.topology.device.type
    engine.close()
    return out


def test_hf_llama_lora_and_zero_inference_generate_on_this_device(tiny_llama_dir, tmp_path):
    from models_for_tests import assert_same_training

    run = run_distributed(hf_lora_and_generate, 1, str(tiny_llama_dir), str(tmp_path), timeout=300)[0]
    assert run["device"] == run["generate_device"] == EXPECTED_DEVICE
    losses, weights = run["lora"]
    assert weights and all(".lora_" in name for name in weights), sorted(weights)[:4]  # only the adapters train
    assert_same_training(losses, weights, *run["reference"], where="LoRA ZeRO-3")
    untrained = run["untrained"][1]  # the adapters moved: lora_B starts at zero, so any training changes it
    assert any(not torch.equal(weights[n], untrained[n]) for n in untrained if "lora_B" in n)
    assert len(run["got"]) == len(run["want"]) == 6 + MAX_NEW
    assert run["got"] == run["want"], "ZeRO-Inference's greedy tokens differ from transformers'"
