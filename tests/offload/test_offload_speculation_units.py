"""super_offload's speculative step and its rollback in-process (`offload/speculative.py`), against plain CPU
offload bit for bit after every step: an overflow on a fresh state, a committed step, a clipped step (redone),
a loss scale that moved, a model used again before the step, a second boundary backward, and a failing update
(`SpeculationError`, every change undone), with zerotrain's CPU Adam kernel (out of place into spare buffers)
and with torch's own step (a saved copy); the adaptive policy's skips; the counters and the host bytes.

World 1 without a process group (a one-rank `Comm`); the reducer is a stand-in that hands the gradient shards
in and calls the shard-ready callbacks, as the engine's does during backward."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

SIZES, GROUP_OF, CLIP = (300, 200, 100), (0, 1, 0), 1.0  # three buckets, two optimizer groups
ORDER = (2, 1, 0)  # the order backward makes the buckets' gradients final
KEYS = ("speculative_steps", "bucket_updates", "committed", "rollbacks", "overflow_rollbacks", "clip_redos",
        "other_rollbacks", "not_speculated")


def _build(speculative: bool, fused: bool, speculation: str = "always"):
    from zerotrain.comm.core import Comm
    from zerotrain.offload import OffloadOptimizer, SuperOffloadOptimizer
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.flat import FlatBucket

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    buckets = [FlatBucket(i, [(f"p{i}", p)], GROUP_OF[i], ShardGroup.local()) for i, p in enumerate(params)]
    groups = [[p for p, g in zip(params, GROUP_OF) if g == k] for k in range(2)]
    optimizer = torch.optim.AdamW([{"params": groups[0], "lr": 1e-2, "weight_decay": 0.01},
                                   {"params": groups[1], "lr": 5e-3, "weight_decay": 0.1}], fused=fused)
    reducer = SimpleNamespace(grad_shards=[None] * len(SIZES), shard_ready_callbacks=[])
    scale = {"value": 4.0}  # the loss scale the engine reports during backward
    args = (buckets, Comm(None, 0, 1), optimizer, groups, CLIP)
    if speculative:
        opt = SuperOffloadOptimizer(*args, reducer=reducer, loss_scale=lambda: scale["value"], speculation=speculation)
    else:
        opt = OffloadOptimizer(*args, reducer=reducer)
    assert all(opt.cpu_adam.supports(m, b.group_index) == fused for m, b in zip(opt.masters, buckets))
    return SimpleNamespace(opt=opt, reducer=reducer, buckets=buckets, scale=scale)


def _backward(run, grads) -> None:
    run.reducer.grad_shards = grads
    for index in ORDER:
        for callback in run.reducer.shard_ready_callbacks:
            callback(index)


def _snapshot(run) -> dict:
    opt = run.opt
    return {"masters": [m.detach().clone() for m in opt.masters],
            "states": [{k: v.detach().clone() if torch.is_tensor(v) else v
                        for k, v in opt.optimizer.state.get(m, {}).items()} for m in opt.masters],
            "model": [b.local_shard().detach().clone() for b in run.buckets]}


def _assert_same(got: dict, want: dict, what: str) -> None:
    for kind in ("masters", "model"):
        for i, (a, b) in enumerate(zip(got[kind], want[kind])):
            assert torch.equal(a, b), f"{what}: {kind}[{i}] differs"
    for i, (a, b) in enumerate(zip(got["states"], want["states"])):
        assert set(a) == set(b), f"{what}: state keys of master {i}: {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), f"{what}: {key} of master {i}"


def _grads(scale: float, size: float, inf: bool = False) -> list[torch.Tensor]:
    """Loss-scaled gradient shards whose unscaled norm is about 24 * `size` (0.01: under the clip; 1: over it)."""
    grads = [torch.randn(n) * size * scale for n in SIZES]
    if inf:
        grads[1][7] = float("inf")
    return grads


def _step(run, grads, loss_scale: float, overflow_check: bool = True, between=None) -> bool:
    """One boundary: backward hands the shards in, (fp16) the overflow check, the step. True: skipped."""
    _backward(run, [g.clone() for g in grads])
    if between is not None:
        between(run)
    shards = run.reducer.grad_shards
    if overflow_check and run.opt.has_overflow(shards):
        return True
    run.opt.step(shards, loss_scale)
    return False


def _counts(opt) -> tuple:
    return tuple(opt.stats[k] for k in KEYS)


@pytest.mark.parametrize("native", [True, False], ids=["cpu_adam kernel", "torch step"])
def test_speculative_steps_equal_plain_offload_after_every_rollback(native):
    from zerotrain.offload.speculative import SpeculationError

    plain, spec = _build(False, native), _build(True, native)
    torch.manual_seed(1)

    def both(grads, loss_scale, overflow_check=True, between=None, expect=None, what=""):
        skipped = _step(plain, grads, loss_scale, overflow_check)
        assert _step(spec, grads, loss_scale, overflow_check, between) == skipped, what
        _assert_same(_snapshot(spec), _snapshot(plain), what)
        if expect is not None:
            assert _counts(spec.opt) == expect, (what, dict(zip(KEYS, _counts(spec.opt))))
        return skipped

    # an overflow on the first step: the fresh states the speculative updates created are dropped again
    assert both(_grads(4.0, 0.01, inf=True), 4.0, expect=(1, 3, 0, 1, 1, 0, 0, 0), what="overflow")
    assert all(not spec.opt.optimizer.state.get(m) for m in spec.opt.masters)
    assert spec.opt.stats["overflow_buckets_ahead"] == 2  # buckets 0 and 2 proven finite by their norm terms
    # not clipped: committed
    assert not both(_grads(4.0, 0.01), 4.0, expect=(2, 6, 1, 1, 1, 0, 0, 0), what="commit")
    assert not both(_grads(4.0, 1.0), 4.0, expect=(3, 9, 1, 2, 1, 1, 0, 0), what="clipped: redone")
    spec.scale["value"] = 2.0  # the scale seen during backward is not the one the step unscales by
    norms_ahead = spec.opt.stats["norm_buckets_ahead"]
    assert not both(_grads(4.0, 0.01), 4.0, expect=(4, 12, 1, 3, 1, 1, 1, 0), what="the loss scale moved")
    assert (spec.opt.stats["norm_buckets_ahead"], spec.opt.stats["overflow_buckets_ahead"]) == (norms_ahead + 3, 11)
    assert spec.opt.stats["steps"] == plain.opt.stats["steps"] == 3
    spec.scale["value"] = 4.0

    # a forward before the step sees the last step's weights (the kernel wrote the model shards: undone); fp32
    # (no overflow check, as the engine runs it without a dynamic loss scale): step() waits for the updates itself
    seen, last = {}, _snapshot(plain)["model"]
    expect = (5, 15, 1, 4, 1, 1, 2, 0) if native else (5, 15, 2, 3, 1, 1, 1, 0)

    def forward(run):
        run.opt.before_model_use()
        seen.update(model=_snapshot(run)["model"])

    assert not both(_grads(4.0, 0.01), 4.0, overflow_check=False, between=forward, expect=expect,
                    what="model used before the step")
    assert all(torch.equal(a, b) for a, b in zip(seen["model"], last)), "the speculative weights were seen"

    # a second boundary backward before the step: the first one's updates are undone, the second's kept
    first = _grads(4.0, 0.01)
    _backward(spec, [g.clone() for g in first])
    expect = (7, 21, 2, 5, 1, 1, 3, 0) if native else (7, 21, 3, 4, 1, 1, 2, 0)
    assert not both(_grads(4.0, 0.01), 4.0, expect=expect, what="a second backward")

    # an update that fails: every rank (this one) rolls back and raises; the retried step continues the run
    before = _snapshot(spec)
    if native:
        real, name, target = spec.opt.cpu_adam.step_to, "step_to", spec.opt.cpu_adam
    else:
        real, name, target = spec.opt._stepper.step, "step", spec.opt._stepper

    def failing(master, *args, **kwargs):
        if (master[0] if isinstance(master, list) else master) is spec.opt.masters[1]:
            raise RuntimeError("disk on fire")
        return real(master, *args, **kwargs)

    setattr(target, name, failing)
    grads = _grads(4.0, 0.01)
    _backward(spec, [g.clone() for g in grads])
    with pytest.raises(SpeculationError, match=r"failed on rank\(s\) \[0\]; here \(rank 0\): RuntimeError"):
        spec.opt.has_overflow(spec.reducer.grad_shards)
    delattr(target, name)
    _assert_same(_snapshot(spec), before, "after a failed speculative update")
    assert (spec.opt.stats["rollbacks"], spec.opt.stats["other_rollbacks"]) == \
        ((6, 4) if native else (5, 3))
    # the retry in fp32 (no overflow check): step() waits for the updates again (slow ones here)
    def slow(*args, **kwargs):
        time.sleep(0.2)
        return real(*args, **kwargs)

    setattr(target, name, slow)
    assert not both(grads, 4.0, overflow_check=False, what="the retried step")
    # the interface's contract: has_overflow() leaves nothing a later step() relies on. A skipped step, then
    # one without the check (slow updates): step() waits for the new speculative updates itself
    assert both(_grads(4.0, 0.01, inf=True), 4.0, what="an overflow before a step without the check")
    assert not both(_grads(4.0, 0.01), 4.0, overflow_check=False, what="a step without the check after a skip")
    delattr(target, name)
    # host bytes: the spare masters and states of the kernel's out-of-place steps, or the saved copies
    split = spec.opt.memory_split()
    if native:
        assert split["host_buffers"] == 12 * sum(SIZES)
    else:  # a copy of every master and state, and the unscaled host copies of the gradients
        assert split["host_buffers"] == split["host"] + 4 * sum(SIZES)
    spec.opt.close()


def test_adaptive_speculation_skips_the_step_after_a_clipped_or_overflowed_one():
    plain, spec = _build(False, True), _build(True, True, speculation="adaptive")
    torch.manual_seed(2)
    steps = [("commit", 0.01, False, (1, 3, 1, 0, 0, 0, 0, 0)),
             ("clipped", 1.0, False, (2, 6, 1, 1, 0, 1, 0, 0)),
             ("not speculated after a clip", 0.01, False, (2, 6, 1, 1, 0, 1, 0, 1)),
             ("speculated again", 0.01, False, (3, 9, 2, 1, 0, 1, 0, 1)),
             ("overflow", 0.01, True, (4, 12, 2, 2, 1, 1, 0, 1)),
             ("not speculated after an overflow", 0.01, False, (4, 12, 2, 2, 1, 1, 0, 2))]
    for what, size, inf, expect in steps:
        grads = _grads(4.0, size, inf)
        skipped = _step(plain, grads, 4.0)
        assert _step(spec, grads, 4.0) == skipped == inf, what
        _assert_same(_snapshot(spec), _snapshot(plain), what)
        assert _counts(spec.opt) == expect, (what, dict(zip(KEYS, _counts(spec.opt))))
    # speculating or not, every final gradient's share of the norm was summed during backward
    assert spec.opt.stats["norm_buckets_ahead"] == 3 * 5 and spec.opt.stats["steps"] == 5
    spec.opt.close()
