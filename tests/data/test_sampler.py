"""The resumable sampler: one global order regardless of world size, exact resume from the consumed count."""
import pytest

from zerotrain.data import ResumableSampler

N, G = 23, 6  # samples, global batch (a batch straddles the epoch boundary at 23)


def _global_batches(dp_size, steps, consumed=0, seed=3, num_epochs=None):
    """The samples of each global batch, assembled from every rank's share, in rank order."""
    samplers = [ResumableSampler(N, global_batch_size=G, dp_rank=r, dp_size=dp_size, seed=seed,
                                 consumed_samples=consumed, num_epochs=num_epochs) for r in range(dp_size)]
    iters = [iter(s) for s in samplers]
    share = G // dp_size
    out = []
    for _ in range(steps):
        out.append([next(it) for it in iters for _ in range(share)])
    return out, samplers


def test_same_global_order_at_any_world_size_and_exact_resume():
    reference, _ = _global_batches(1, 10)
    for dp in (2, 3, 6):
        assert _global_batches(dp, 10)[0] == reference
    # Every epoch is a permutation; epochs differ; the order depends on the seed.
    flat = [i for b in reference for i in b]
    assert sorted(flat[:N]) == list(range(N)) and flat[:N] != flat[N:2 * N]
    assert _global_batches(1, 10, seed=4)[0] != reference
    # Stop after 5 steps at dp 2, resume from the consumed count at dp 2 and at dp 3: the next samples.
    first, samplers = _global_batches(2, 5)
    consumed = samplers[0].state_dict()["consumed_samples"]
    assert consumed == 4 * G  # the 5th batch's share is handed out but not finished until the next request
    for dp in (2, 3):
        resumed = [ResumableSampler(N, global_batch_size=G, dp_rank=r, dp_size=dp, seed=3) for r in range(dp)]
        for s in resumed:
            s.load_state_dict({"consumed_samples": 5 * G, "seed": 3, "num_samples": N})
        rest, _ = _global_batches(dp, 5, consumed=5 * G)
        assert first + rest == reference


def test_epochs_bounded_and_bad_resume_rejected():
    s = ResumableSampler(N, global_batch_size=G, dp_rank=1, dp_size=2, num_epochs=2, shuffle=False)
    n = len(s)
    assert n == (2 * N // G) * G // 2 and len(list(s)) == n
    assert len(s) == 0 and list(s) == []  # one pass covers every epoch; the stream is used up
    with pytest.raises(ValueError, match="multiple of the global batch size"):
        ResumableSampler(N, global_batch_size=G, consumed_samples=G + 1)
    with pytest.raises(ValueError, match="seed=1 but this run has 0"):
        ResumableSampler(N, global_batch_size=G).load_state_dict({"consumed_samples": 0, "seed": 1})
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        ResumableSampler(N, global_batch_size=5, dp_size=2)


def test_one_sample_a_global_batch_of_one_and_one_rank_by_default():
    """The smallest valid stream (one sample, batches of one, the default single rank) runs; zero of either is
    refused, naming what is wrong."""
    sampler = ResumableSampler(1, global_batch_size=1, num_epochs=3, shuffle=False)
    assert list(sampler) == [0, 0, 0] and len(ResumableSampler(1, global_batch_size=1, num_epochs=3)) == 3
    with pytest.raises(ValueError, match="empty"):
        ResumableSampler(0, global_batch_size=1)
    with pytest.raises(ValueError, match="positive multiple"):
        ResumableSampler(4, global_batch_size=0)
