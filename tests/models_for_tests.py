"""Small deterministic models and data shared by the engine tests."""
from __future__ import annotations

import torch


class OddMLP(torch.nn.Module):
    """73 parameters (6·7+7 + 7·3+3): divisible by neither 2 nor 4, so shards need padding."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 7)
        self.fc2 = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        if y is None:
            return out
        return torch.nn.functional.mse_loss(out, y)


MOE_D_IN, MOE_D_OUT, MOE_EXPERTS = 6, 3, 4


class MoENet(torch.nn.Module):
    """Linear -> expert-parallel MoE (4 experts, top 2) -> Linear; forward(x, y) returns MSE + 0.01 * aux."""

    def __init__(self, comm) -> None:
        from zerotrain.parallel.moe import ExpertParallelMoE

        super().__init__()
        self.inp = torch.nn.Linear(MOE_D_IN, 8)
        self.moe = ExpertParallelMoE(8, 16, MOE_EXPERTS, comm, top_k=2)
        self.out = torch.nn.Linear(8, MOE_D_OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden, aux = self.moe(torch.tanh(self.inp(x)))
        return torch.nn.functional.mse_loss(self.out(hidden), y) + 0.01 * aux


def make_moe_model(comm) -> MoENet:
    """The MoE net with fixed initial weights (experts are seeded per expert index, so every split agrees)."""
    torch.manual_seed(0)
    return MoENet(comm)


def make_batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, 6, generator=generator), torch.randn(global_batch, 3, generator=generator))
            for _ in range(steps)]


def micro_slice(step_batch, accumulation_index: int, rank: int, world: int, micro: int):
    """The samples rank `rank` sees at micro-step `accumulation_index` of a step."""
    start = (accumulation_index * world + rank) * micro
    return tuple(t[start:start + micro] for t in step_batch)


def train_global_step(engine, step_batch, micro: int, after_micro_step=None) -> float:
    """One global step of `engine` over `step_batch` (this rank's micro-batches of every accumulation step,
    cast to the engine's dtype); returns the global mean loss. `after_micro_step(engine)` runs after each."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    accumulation = engine.gradient_accumulation_steps()
    total = torch.zeros(1)
    for index in range(accumulation):
        x, y = micro_slice(step_batch, index, rank, world, micro)
        loss = engine(x.to(engine.dtype), y.to(engine.dtype))
        engine.backward(loss)
        engine.step()
        if after_micro_step is not None:
            after_micro_step(engine)
        total += loss.detach().float()
    dist.all_reduce(total)
    return total.item() / (accumulation * world)


def accumulated_gradients(params: list, micro_loss, accumulation: int, dp: int,
                          scale: float = 1.0) -> tuple[list[torch.Tensor], float]:
    """One step's gradients of `params` as a data-parallel engine with gradient accumulation makes them, in its
    order: per data-parallel rank the sum of its micro-batches' gradients over their count, then the mean over the
    ranks (another order, e.g. one whole-batch backward, rounds differently: on a near-zero gradient element Adam
    turns that into weight differences of 5e-6; any real error is orders of magnitude larger). `micro_loss(index,
    rank)` is the loss of micro-batch `index` of data-parallel rank `rank`; gradients are of `loss * scale` (fp16's
    loss scale; summed and divided in the parameters' dtype, as the engine's gradient buffer). Returns (the
    gradients, the mean unscaled loss)."""
    total, summed = 0.0, None
    for rank in range(dp):
        grads = None
        for index in range(accumulation):
            loss = micro_loss(index, rank)
            micro = torch.autograd.grad(loss * scale if scale != 1.0 else loss, params)
            grads = list(micro) if grads is None else [a + b for a, b in zip(grads, micro)]
            total += loss.item() / (accumulation * dp)
        grads = [g / accumulation for g in grads]
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
    return [g / dp for g in summed], total


def assert_same_training(losses, weights, ref_losses, ref_weights, where: str = "") -> None:
    """As many losses as the reference, each within 1e-5 relative of its, and every reference weight close to the
    engine's (rtol 1e-5, atol 1e-6); failures name `where` and the tensor."""
    assert len(losses) == len(ref_losses), (where, losses, ref_losses)
    for got, ref in zip(losses, ref_losses):
        assert abs(got - ref) <= 1e-5 * abs(ref), (where, losses, ref_losses)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")


def reference_training(model_factory, batches, lr=1e-2, weight_decay=0.01, clip=1.0, norms=None, make_optimizer=None):
    """Plain single-process AdamW (or `make_optimizer(parameters)`'s optimizer) over whole global batches: the
    ground truth.

    With a list as `norms`, each step's global gradient norm (before clipping) is appended to it:
    AdamW is nearly blind to the scale of its gradients, so clipping is checked through the norm."""
    torch.manual_seed(0)
    model = model_factory()
    optimizer = (make_optimizer(model.parameters()) if make_optimizer is not None
                 else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay))
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        if norms is not None:
            norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def adamw_reference_steps(model, batches, loss_of, lr: float, eps: float = 1e-8, clip: float = 1.0,
                          weight_decay: float = 0.0):
    """Plain single-process AdamW (weight_decay DeepSpeed's 0, what a config without the key trains with), one step
    per batch: the losses and a snapshot of the named parameters after every step. `loss_of(model, batch)` is the
    model's loss on one batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=weight_decay)
    losses, weights = [], []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        weights.append({name: param.detach().clone() for name, param in model.named_parameters()})
    return losses, weights


def assert_tensors_close(got: dict, want: dict, where: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same names, same shapes, values within rtol/atol (compared in fp32); messages name `where` and the tensor."""
    assert sorted(got) == sorted(want), where
    for name, expected in want.items():
        assert got[name].shape == expected.shape, (where, name)
        torch.testing.assert_close(got[name].float(), expected, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{where}, {name}: {m}")



def _loss_distance(losses, ref_losses) -> float:
    """The largest relative distance between two loss curves of the same length."""
    assert len(losses) == len(ref_losses), (losses, ref_losses)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))


def _weight_distance(weights: dict, ref_weights: dict) -> float:
    """||w - w_ref|| / ||w_ref|| over every reference tensor together (compared in fp32)."""
    assert sorted(weights) == sorted(ref_weights), (sorted(weights), sorted(ref_weights))
    diff = sum(float((weights[n].detach().float() - r.detach().float()).pow(2).sum()) for n, r in ref_weights.items())
    norm = sum(float(r.detach().float().pow(2).sum()) for r in ref_weights.values())
    return (diff / norm) ** 0.5


def assert_tolerance_discriminates(where: str, reference: tuple, candidate: tuple, baseline: tuple, *,
                                   loss_tol: float | None, weight_tol: float | None = None,
                                   margin: float = 2.0) -> None:
    """The rule for every lossy mode (quantized gradients or weights, bf16/fp16, LoCo): `candidate` is within
    tolerance of `reference` AND the do-nothing `baseline` (no update, or the parameters in question frozen, on
    the same batches) is outside it by `margin`, so a run that does not train cannot pass. Pass only some
    tensors in the weight dicts to judge the parameters in question (e.g. the experts, against frozen experts).

    Each of the three is (losses, weights dict or None). Losses: the largest relative distance per step must be
    <= loss_tol for the candidate and >= margin * loss_tol for the baseline. Weights (when `weight_tol` is given):
    the same with ||w - w_ref|| / ||w_ref|| over every tensor together (elementwise bounds do not fit a lossy
    mode: Adam turns quantization noise on tiny gradients into whole lr-sized steps on single elements)."""
    checks = [] if loss_tol is None else [("losses", _loss_distance, 0, loss_tol)]
    if weight_tol is not None:
        checks.append(("weights", _weight_distance, 1, weight_tol))
    assert checks, "nothing to check"
    measured = [(what, distance(candidate[i], reference[i]), distance(baseline[i], reference[i]), tol)
                for what, distance, i, tol in checks]
    report = "; ".join(f"{what}: candidate {got:.2e}, baseline {base:.2e}, tolerance {tol:.1e}"
                       for what, got, base, tol in measured)
    for what, got, base, tol in measured:
        assert got <= tol, f"{where}: {what} out of tolerance ({report})"
        assert base >= margin * tol, (f"{where}: the do-nothing baseline's {what} are within {margin}x the tolerance, "
                                      f"so this check could not fail: train longer or tighten it ({report})")


def tied_llama_copy(src, out):
    """The tiny-Llama fixture's model (`src`) with tied embeddings, random weights, one model.safetensors
    (lm_head.weight not stored), its tokenizer files copied: a `Path` to `out`."""
    import os
    import shutil
    from pathlib import Path

    import transformers

    src, out = Path(src), Path(out)
    config = transformers.AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(src / name, out / name)
    return out


def saved_activation_bytes(forward) -> int:
    """What plain PyTorch's autograd saves for backward while `forward()` runs, parameters and views of them left
    out, each storage once: the reference for what stage 3's pack hook counts (`Stage3Hooks.saved_activation_bytes`,
    the first pass's reserve)."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(tensor, torch.nn.Parameter) and not isinstance(base, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())
