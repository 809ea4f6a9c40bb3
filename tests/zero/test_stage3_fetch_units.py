"""Stage-3 gathering in process: a world of one (a Comm without a process group, whose gathers are copies)
driven through whole micro-steps by the engine's own parts (`partition_module`, `Stage3Hooks`,
`PartitionedWeights`). What the fetcher keeps, releases and counts does not depend on the world size; the
spawned tests (test_stage3*.py) check the same at worlds 2 and 4 against single-process training."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from zerotrain.comm import Comm
from zerotrain.engine.weights import PartitionedWeights
from zerotrain.zero.forward_only import generate_between_steps
from zerotrain.zero.stage3.hooks import Stage3Hooks
from models_for_tests import saved_activation_bytes
from zerotrain.zero.stage3.setup import partition_module


class Net(torch.nn.Module):
    """emb -> mid twice in a row -> out. `access`: out's weight is also used directly in the root's forward,
    outside out's own forward (gathered on access and held by no module, as a tied head used in user code)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(6, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, access: bool = False) -> torch.Tensor:
        hidden = torch.tanh(self.mid(torch.tanh(self.mid(torch.tanh(self.emb(x))))))
        y = self.out(hidden)
        return y + F.linear(hidden, self.out.weight) if access else y

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self(x, access=True)


REQUESTS = {"emb": 6 * 8 + 8, "mid": 8 * 8 + 8, "out": 8 * 3 + 3}  # elements one module's forward gathers
LARGEST = max(REQUESTS.values())


def stage3(sequential: bool = False, prefetch: int = 10**6, reuse: int = 0) -> tuple[Net, PartitionedWeights]:
    """A Net partitioned at a world of one, hooked as the engine hooks it."""
    model = Net()
    group_of = {id(p): 0 for p in model.parameters()}
    parts = partition_module(model, Comm(None, 0, 1), group_of, 0, sequential, prefetch,
                             max_reuse_distance=reuse)
    weights = PartitionedWeights(model, parts)
    parts.hooks = Stage3Hooks(model, weights.fetcher)
    return model, weights


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(count)]


def micro_step(model: Net, weights: PartitionedWeights, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One forward and backward, then the micro-step's end; the gradients (full: a world of one)."""
    F.mse_loss(weights.forward((x,), {}), y).backward()
    weights.end_micro_step()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    for param in model.parameters():
        param.grad = None
    return grads


def reference_grads(x: torch.Tensor, y: torch.Tensor) -> dict:
    model = Net()
    F.mse_loss(model(x), y).backward()
    return {name: param.grad for name, param in model.named_parameters()}


def gathered(model: Net) -> list[str]:
    return [name for name, param in model.named_parameters() if param._zero.gathered]


@pytest.mark.parametrize("sequential", [False, True])
def test_micro_steps_gather_exact_values_release_everything_and_count_peaks_from_below(sequential):
    """Recorded first micro-step, then followed ones with prefetch: the gradients are one process's, nothing is
    gathered between micro-steps, every blocking gather is one "gather" phase of the memory timeline, and each
    peak counter is at least what one request holds (a peak taken with `min` stays 0)."""
    model, weights = stage3(sequential)
    fetcher = weights.fetcher
    phases = []

    @contextlib.contextmanager
    def phase(name: str):
        phases.append(name)
        yield

    weights.watch(phase)
    for step, (x, y) in enumerate(batches(3)):
        gathers_before = fetcher.stats["gathers"]
        grads = micro_step(model, weights, x, y)
        for name, want in reference_grads(x, y).items():
            torch.testing.assert_close(grads[name], want, msg=lambda m: f"step {step} {name}: {m}")
        assert gathered(model) == [], f"step {step}: still gathered after the micro-step"
        stats = fetcher.stats
        assert stats["live_bytes"] == stats["live_numel"] == stats["inflight_numel"] == stats["inflight_bytes"] == 0
        if step == 0:  # recording: no prefetch, every gather blocks, each inside its own "gather" phase
            assert stats["prefetched"] == 0
            assert phases == ["gather"] * (stats["gathers"] - gathers_before) and phases, phases
    stats = fetcher.stats
    assert stats["prefetched"] > 0 and stats["prefetch_hits"] > 0, stats
    assert stats["order_mismatches"] == 0, stats
    largest_param = 8 * 8
    assert stats["peak_live_bytes"] >= 4 * LARGEST, stats  # a module's weight and bias live at once
    assert stats["peak_held_bytes"] >= stats["peak_live_bytes"], stats
    # gathered and in flight at once: every element counted in bytes (fp32: 4 each), the two peaks taken together
    assert stats["peak_held_bytes"] == 4 * stats["peak_live_inflight_numel"], stats
    assert stats["peak_live_inflight_numel"] >= LARGEST, stats
    assert stats["peak_inflight_numel"] >= (largest_param if sequential else LARGEST), stats
    # one gather's transient memory at its largest: sequential, the largest parameter's buffer; bucketed, the largest
    # request's gathered output, its staged input (the output / ranks: one rank here) and the full buffers copied out
    assert stats["peak_gather_bytes"] == 4 * (largest_param if sequential else 3 * LARGEST), stats
    assert stats["peak_prefetch_inflight_numel"] >= (largest_param if sequential else REQUESTS["out"]), stats
    if sequential:  # one parameter ahead at most
        assert stats["peak_prefetch_inflight_params"] == 1, stats
    else:  # a request (weight and bias) in one collective
        assert stats["peak_prefetch_inflight_params"] >= 2, stats


def test_forward_without_grad_releases_what_reuse_would_have_kept():
    """With reuse on, a training forward keeps its last modules' parameters for backward; an evaluation forward
    (no grad: no backward follows) releases every one of them when it returns, and training goes on following
    the record."""
    model, weights = stage3(reuse=10**9)
    data = batches(4)
    for x, y in data[:2]:
        micro_step(model, weights, x, y)
    x, y = data[2]
    output = weights.forward((x,), {})
    assert gathered(model), "the premise: reuse keeps parameters from forward to backward"
    output.sum().backward()
    weights.end_micro_step()
    for param in model.parameters():
        param.grad = None
    with torch.no_grad():
        output = weights.forward((x,), {})
    torch.testing.assert_close(output, Net()(x))
    assert gathered(model) == [], "no backward follows a no-grad forward: nothing may stay gathered"
    stats = weights.fetcher.stats
    assert stats["live_bytes"] == 0 and stats["inflight_bytes"] == 0, stats
    hits = stats["prefetch_hits"]
    grads = micro_step(model, weights, *data[3])
    for name, want in reference_grads(*data[3]).items():
        torch.testing.assert_close(grads[name], want)
    assert stats["prefetch_hits"] > hits and stats["order_mismatches"] == 0, stats


def test_generate_between_steps_releases_even_a_parameter_used_outside_its_module():
    """A training engine's generate (untraced forwards) gathers on access a weight no module holds; it is
    released when the forward returns, and the record is untouched: training goes on following it."""
    model, weights = stage3(reuse=0)
    model.generate = generate_between_steps(model.generate, model, weights.fetcher)
    data = batches(3)
    for x, y in data[:2]:
        micro_step(model, weights, x, y)
    stats = weights.fetcher.stats
    hits, gathers = stats["prefetch_hits"], stats["gathers"]
    output = model.generate(data[2][0])
    torch.testing.assert_close(output, Net().generate(data[2][0]))
    assert stats["gathers"] > gathers, "generate gathered its parameters"
    assert gathered(model) == [], "gathered after generate returned"
    assert stats["live_bytes"] == 0 and stats["inflight_bytes"] == 0, stats
    micro_step(model, weights, *data[2])
    assert stats["prefetch_hits"] > hits and stats["order_mismatches"] == 0, "the record was left as it was"


def test_prefetch_passing_over_a_gathered_parameter_keeps_it_for_its_next_use():
    """mid runs twice in a row: with prefetch on, the walk ahead sees mid's second use while mid is gathered
    and keeps it (even with reuse off), so each followed micro-step gathers it once less than without prefetch."""
    counts = {}
    for prefetch in (0, 10**6):
        model, weights = stage3(prefetch=prefetch, reuse=0)
        data = batches(3)
        micro_step(model, weights, *data[0])  # recorded
        stats = weights.fetcher.stats
        releases = stats["releases"]
        for x, y in data[1:]:
            micro_step(model, weights, x, y)
        counts[prefetch] = stats["releases"] - releases
    # two followed micro-steps, mid's weight and bias: released (and gathered) 2 x 2 times less
    assert counts[0] - counts[10**6] == 4, counts


def test_parameters_are_released_after_their_module_forward_and_once_their_gradient_is_taken():
    """Reuse off: emb's parameters are released when emb's forward returns (not held until the micro-step ends:
    they are gathered no more when out's forward starts), and a parameter whose gradient has been accumulated is
    released during backward: when emb's weight (the last gradient of backward) arrives, none is gathered any
    more (mid's and out's were gathered again in backward for their saved weights)."""
    model, weights = stage3(reuse=0)
    at_out, at_last_grad = [], []
    model.out.register_forward_pre_hook(lambda module, args: at_out.append(gathered(model)))
    model.emb.weight.register_post_accumulate_grad_hook(lambda param: at_last_grad.append(gathered(model)))
    for x, y in batches(2):  # recorded, then followed (with prefetch)
        micro_step(model, weights, x, y)
    assert len(at_out) == 2 and all("out.weight" in names and "emb.weight" not in names and "emb.bias" not in names
                                    for names in at_out), at_out
    assert at_last_grad == [[], []], at_last_grad


class Matmul(torch.nn.Module):
    """`x @ weight` (autograd saves the parameter itself) or `x @ weight.t()` (it saves a view of it, the transpose)."""

    def __init__(self, features_in: int, features_out: int, transposed: bool) -> None:
        super().__init__()
        shape = (features_out, features_in) if transposed else (features_in, features_out)
        self.weight = torch.nn.Parameter(torch.randn(shape) / features_in ** 0.5)
        self.transposed = transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.t() if self.transposed else self.weight)


def test_a_saved_parameter_or_view_of_one_is_released_after_forward_and_gathered_again_in_backward():
    """A layer whose backward needs its weight and one that needs a transposed view of it (saved as a reference,
    with the view's size, stride and offset): nothing is gathered after forward, and the gradients are one
    process's."""
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(Matmul(6, 5, True), torch.nn.Tanh(), Matmul(5, 4, False), torch.nn.Tanh(),
                                   Matmul(4, 3, True))

    model = build()
    parts = partition_module(model, Comm(None, 0, 1), {id(p): 0 for p in model.parameters()}, 0, False, 10**6,
                             max_reuse_distance=0)
    weights = PartitionedWeights(model, parts)
    parts.hooks = Stage3Hooks(model, weights.fetcher)
    for x, y in batches(2):
        y = y[:, :3]
        output = weights.forward((x,), {})
        assert gathered(model) == [], "a saved parameter or view must not keep it gathered"
        F.mse_loss(output, y).backward()
        weights.end_micro_step()
        reference = build()
        F.mse_loss(reference(x), y).backward()
        for (name, param), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, want.grad, msg=lambda m: f"{name}: {m}")
            param.grad = None


class _Wrapped(torch.Tensor):
    """A wrapper tensor subclass (as torchao's float8 tensors are): no storage of its own to count."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, _Wrapped) else x  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class _SavesWrapped(torch.autograd.Function):
    """Identity whose backward keeps a wrapper tensor of its input's shape."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(_Wrapped(x.detach().clone()))
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _SavesWrappedLayer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SavesWrapped.apply(x)


def test_the_saved_activations_are_counted_once_per_storage_without_parameters():
    """`saved_activation_bytes` (what the first pass's reserve holds back, issue #43): the bytes autograd saves in
    the micro-step's forwards, equal to plain PyTorch's count (parameters, persistent ones and views of them left
    out; each storage once), two forwards before one backward adding up, back to 0 after the micro-step; a saved
    wrapper tensor (no storage of its own) counted at its elements' size."""
    def build(wrapped: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [Matmul(6, 5, True), torch.nn.Tanh(), Matmul(5, 4, False), torch.nn.Tanh(), Matmul(4, 3, True)]
        return torch.nn.Sequential(*([_SavesWrappedLayer()] if wrapped else []), *layers)

    def hooked(model: torch.nn.Module) -> PartitionedWeights:
        # threshold 20: the 6 x 5 weight is partitioned, the 5 x 4 one (saved itself) and the 4 x 3 one (saved as
        # a transposed view) are persistent
        parts = partition_module(model, Comm(None, 0, 1), {id(p): 0 for p in model.parameters()}, 20, False,
                                 10**6, max_reuse_distance=0)
        assert sorted(p.persistent for p in parts.trainable) == [False, True, True]
        weights = PartitionedWeights(model, parts)
        parts.hooks = Stage3Hooks(model, weights.fetcher)
        return weights

    x, y = batches(1)[0]
    reference = build(False)
    want = saved_activation_bytes(lambda: reference(x))
    weights = hooked(build(False))
    assert want > 0 and weights.saved_activation_bytes() == 0
    first = weights.forward((x,), {})
    assert weights.saved_activation_bytes() == want
    second = weights.forward((2 * x,), {})  # a second forward before the backward: its tensors are kept too
    assert weights.saved_activation_bytes() == 2 * want
    F.mse_loss(first + second, y).backward()
    weights.end_micro_step()
    assert weights.saved_activation_bytes() == 0
    wrapping = hooked(build(True))  # the first layer keeps a wrapper of x; the next one its output, not x
    output = wrapping.forward((x.clone().requires_grad_(),), {})  # (an input that needs grad: a graph to save in)
    assert wrapping.saved_activation_bytes() == want + x.numel() * 4
    F.mse_loss(output, y).backward()
    wrapping.end_micro_step()


@pytest.mark.parametrize("compressed", ["qwZ", "float8"])
def test_compressed_weight_gathers_asked_for_at_one_rank_gather_the_plain_values(compressed):
    """`zero_quantized_weights` (qwZ, int8) or `fp8.float8_all_gather` at a world of one: there is nothing to send,
    so the weights are not quantized and dequantized (a lossy round trip that would train another model): the
    micro-steps' gradients are one process's exactly and no quantized or float8 gather is counted."""
    model, weights = stage3()
    fetcher = weights.fetcher
    if compressed == "qwZ":
        fetcher.configure_zeropp(quantize_weights=True)
    else:
        fetcher.configure_fp8_gathers([model.mid.weight, model.out.weight])
    for x, y in batches(2):
        grads = micro_step(model, weights, x, y)
        for name, want in reference_grads(x, y).items():
            assert torch.equal(grads[name], want), name
    stats = fetcher.stats
    assert stats["gathers"] > 0 and stats["quantized_gathers"] == stats["fp8_gathers"] == 0, stats
    assert stats["fp8_scale_updates"] == 0, stats



@pytest.mark.parametrize("sequential", [False, True])
def test_every_micro_step_gathers_into_buffers_it_released(sequential):
    """The fetcher keeps released gather buffers (unreferenced, up to 4x the largest parameter's bytes) for the next
    gathers: in every micro-step some gather takes a buffer an earlier release gave back instead of a new one
    (backward's gathers the forward's), and the gradients stay one process's."""
    model, weights = stage3(sequential)
    pool = weights.fetcher.pool
    for step, (x, y) in enumerate(batches(3)):
        before = dict(pool.stats)
        grads = micro_step(model, weights, x, y)
        for name, want in reference_grads(x, y).items():
            torch.testing.assert_close(grads[name], want, msg=lambda m: f"step {step} {name}: {m}")
        assert pool.stats["reused"] > before["reused"], (step, before, pool.stats)
