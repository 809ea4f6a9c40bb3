"""CUDA paths at world 1 (NCCL): each stage, the offload modes (NVMe for optimizer states and parameters) and a
checkpoint round trip reproduce plain PyTorch on the same GPU (fp32, 1e-5 relative); bf16 / fp16 (with
offload_param too) stay close to it while the untrained run does not.

Skipped without a GPU (the CPU suite covers the same code with gloo). A session with a GPU runs
`python -m pytest -q tests/gpu` for these, and the CPU suite with `CUDA_VISIBLE_DEVICES=` (with one
GPU, world-2 tests would put two NCCL ranks on one device, which NCCL refuses).
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS, MICRO, ACCUMULATION = 4, 4, 2


def _config(stage: int, zero_extra: dict, top: dict | None = None) -> dict:
    return {**(top or {}), "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, **zero_extra}, "steps_per_print": 0}


def _train(engine, batches) -> list[float]:
    device = engine.topology.device
    losses = []
    for x, y in batches:
        total = 0.0
        for index in range(ACCUMULATION):
            part = slice(index * MICRO, (index + 1) * MICRO)
            loss = engine(x[part].to(device, engine.dtype), y[part].to(device, engine.dtype))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        losses.append(total / ACCUMULATION)
    return losses


def cuda_run(stage: int, zero_extra: dict, save_dir: str = "", top: dict | None = None) -> dict:
    import zerotrain
    from models_for_tests import OddMLP, make_batches

    torch.manual_seed(0)
    engine, _, _, _ = zerotrain.initialize(model=OddMLP(), config=_config(stage, zero_extra, top))
    assert engine.topology.device.type == "cuda"
    batches = make_batches(STEPS, MICRO * ACCUMULATION)
    if not save_dir:
        losses = _train(engine, batches)
    else:  # half, save, a fresh stage-1 engine loads it and trains the other half
        losses = _train(engine, batches[:STEPS // 2])
        engine.save_checkpoint(save_dir, tag="half")
        engine.wait_checkpoint()
        engine.close()
        torch.manual_seed(1)  # different initial weights: the load must replace them
        engine, _, _, _ = zerotrain.initialize(model=OddMLP(), config=_config(1, {}))
        engine.load_checkpoint(save_dir, tag="half")
        losses += _train(engine, batches[STEPS // 2:])
    weights = {name: tensor.cpu() for name, tensor in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "weights": weights}


def cuda_reference(lr: float = 1e-2) -> tuple:
    """Plain fp32 PyTorch on the GPU (lr 0: the do-nothing baseline of the lossy modes)."""
    from models_for_tests import OddMLP, make_batches, reference_training

    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(STEPS, MICRO * ACCUMULATION)]
    losses, weights = reference_training(lambda: OddMLP().cuda(), batches, lr=lr)
    return losses, {name: tensor.cpu() for name, tensor in weights.items()}


MODES = {
    "stage 0": (0, {}),
    "stage 1": (1, {}),
    "stage 2": (2, {}),
    "stage 3": (3, {"stage3_param_persistence_threshold": 0}),
    "stage 2, cpu offload (pinned)": (2, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "stage 2, super_offload": (2, {"offload_optimizer": {"device": "cpu", "super_offload": True,
                                                         "super_offload_speculation": "always"}}),
    "stage 3, cpu offload + offload_param": (3, {"stage3_param_persistence_threshold": 0,
                                                 "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                                 "offload_param": {"device": "cpu", "pin_memory": True}}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_mode_matches_plain_pytorch_on_the_gpu(mode):
    from models_for_tests import assert_same_training

    stage, extra = MODES[mode]
    ref_losses, ref_weights = run_distributed(cuda_reference, 1)[0]
    result = run_distributed(cuda_run, 1, stage, extra)[0]
    assert_same_training(result["losses"], result["weights"], ref_losses, ref_weights)


def test_cuda_nvme_offload_matches(tmp_path):
    from models_for_tests import assert_same_training

    ref_losses, ref_weights = run_distributed(cuda_reference, 1)[0]
    extra = {"stage3_param_persistence_threshold": 0,
             "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}}
    result = run_distributed(cuda_run, 1, 3, extra)[0]
    assert_same_training(result["losses"], result["weights"], ref_losses, ref_weights)
    extra["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}
    result = run_distributed(cuda_run, 1, 3, extra)[0]  # parameters on NVMe too
    assert_same_training(result["losses"], result["weights"], ref_losses, ref_weights)


LOW_PRECISION = {"bf16 stage 2": (2, {}, {"bf16": {"enabled": True}}),
                 "bf16 stage 3, offload_param": (3, {"stage3_param_persistence_threshold": 0,
                                                      "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                                      "offload_param": {"device": "cpu", "pin_memory": True}},
                                                 {"bf16": {"enabled": True}}),
                 "fp16 stage 3": (3, {"stage3_param_persistence_threshold": 0},
                                  {"fp16": {"enabled": True, "initial_scale_power": 8}})}


@pytest.mark.parametrize("mode", list(LOW_PRECISION))
def test_cuda_bf16_fp16_close_to_fp32_and_not_to_the_untrained_run(mode):
    """CUDA bf16 / fp16 kernels with fp32 masters: within 0.7% (losses) / 1% (weights, relative L2) of fp32
    PyTorch on the GPU; the untrained run (measured on CPU: 2.1% / 11% after these steps, bf16 there 0.3% / 0.2%)
    falls outside by 2x. Dry-run on CPU only: no GPU session has run it yet."""
    from models_for_tests import assert_tolerance_discriminates

    stage, extra, top = LOW_PRECISION[mode]
    reference = run_distributed(cuda_reference, 1)[0]
    untrained = run_distributed(cuda_reference, 1, 0.0)[0]
    result = run_distributed(cuda_run, 1, stage, extra, "", top)[0]
    assert all(w.dtype == torch.float32 for w in result["weights"].values()), mode  # the fp32 masters
    assert_tolerance_discriminates(f"cuda {mode}", reference, (result["losses"], result["weights"]), untrained,
                                   loss_tol=7e-3, weight_tol=1e-2)


def test_cuda_checkpoint_stage3_resumes_at_stage1(tmp_path):
    from models_for_tests import assert_same_training

    ref_losses, ref_weights = run_distributed(cuda_reference, 1)[0]
    result = run_distributed(cuda_run, 1, 3, {"stage3_param_persistence_threshold": 0}, str(tmp_path))[0]
    assert_same_training(result["losses"], result["weights"], ref_losses, ref_weights)
