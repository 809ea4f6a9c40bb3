"""The gradient reducers' parts that need no other rank, in process: the staging pool's reuse and accounting."""
import pytest
import torch

from zerotrain.zero.grads import StagingPool


def test_staging_pool_reuses_a_spare_that_fits_and_counts_bytes():
    stats = {"staging_bytes": 0, "peak_staging_bytes": 0, "staging_reused": 0}
    pool = StagingPool(stats)
    cpu = torch.device("cpu")
    first = pool.take(10, torch.float32, cpu)
    assert first.numel() == 10 and stats["staging_bytes"] == stats["peak_staging_bytes"] == 40
    pool.release(first, reuse=True)
    assert stats["staging_bytes"] == 0 and stats["peak_staging_bytes"] == 40

    smaller = pool.take(6, torch.float32, cpu)  # the head of the spare, counted whole
    assert smaller.numel() == 6 and smaller.data_ptr() == first.data_ptr() and stats["staging_reused"] == 1
    assert stats["staging_bytes"] == 40 and pool.spares == []
    pool.release(smaller, reuse=True)  # the whole spare comes back
    assert stats["staging_bytes"] == 0 and [s.numel() for s in pool.spares] == [10]

    # a larger buffer does not take the spare, and replaces it: a spare too small for a bucket would mostly wait,
    # unused, to the end of backward (buckets come in like sizes)
    larger = pool.take(11, torch.float32, cpu)
    assert larger.numel() == 11 and stats["staging_reused"] == 1 and pool.spares == []
    pool.release(larger, reuse=True)
    other = pool.take(4, torch.bfloat16, cpu)  # another dtype neither
    assert (other.numel(), other.dtype) == (4, torch.bfloat16) and pool.spares == []
    assert stats["staging_bytes"] == 8 and stats["peak_staging_bytes"] == 44
    pool.release(other, reuse=False)  # not ours to reuse: not kept
    assert pool.spares == []
    pool.release(pool.take(3, torch.float32, cpu), reuse=True)
    assert [s.numel() for s in pool.spares] == [3]
    pool.clear()
    assert pool.spares == []


def _buckets(dp, expert_comm):
    """Two buckets as a reducer binds them (anything with `group`, `shard_numel`, `device`): one over the
    data-parallel ranks, one of split experts over an expert-data-parallel group."""
    from types import SimpleNamespace

    dense = SimpleNamespace(group=SimpleNamespace(comm=dp, partitions=dp.size, expert=False), shard_numel=12,
                            device=torch.device("cpu"))
    experts = SimpleNamespace(group=SimpleNamespace(comm=expert_comm, partitions=expert_comm.size, expert=True),
                              shard_numel=6, device=torch.device("cpu"))
    return [dense, experts]


def test_quantized_reduce_binds_hops_and_keeps_loco_bookkeeping():
    """qgZ's per-bucket reducers (none for a group of one rank, two hops only over the data-parallel ranks),
    LoCo's reset every reset_T steps, drop on overflow, rescale on a loss-scale change, its checkpoint state and
    layout check, and no LoCo at all in a data-parallel world of one. No collective runs here."""
    import warnings

    from zerotrain.comm import Comm
    from zerotrain.zero.reduce import GradQuantization, QuantizedReduce

    quantization = GradQuantization(loco_beta=0.5, reset_T=3)
    alone = QuantizedReduce(quantization, Comm(None, 0, 1))
    alone.bind(_buckets(Comm(None, 0, 1), Comm(None, 0, 1)))
    assert not alone.loco_enabled and alone.loco_bytes() == 0 and alone.loco_state()["layout"]["loco"] is False

    dp = Comm(None, 1, 4)
    hierarchy = (Comm(None, 1, 2), Comm(None, 0, 2))
    reduce = QuantizedReduce(GradQuantization(loco_beta=0.5, reset_T=3, hierarchy=hierarchy), dp)
    reduce.bind(_buckets(dp, Comm(None, 0, 2)))
    dense, experts = reduce.per_bucket
    assert dense.two_hop and not experts.two_hop and reduce.loco_enabled
    solo = QuantizedReduce(GradQuantization(loco_beta=None), dp)  # qgZ without LoCo
    solo.bind(_buckets(dp, Comm(None, 0, 1)))
    assert solo.per_bucket[1] is None and not solo.loco_enabled  # no other rank holds those experts

    def fill() -> list:
        torch.manual_seed(0)
        for feedback in reduce._reducers()[0].feedbacks + experts.feedbacks:
            feedback.update(torch.randn(feedback.shape), torch.zeros(feedback.shape), None)
        return [f.error() for r in reduce._reducers() for f in r.feedbacks]

    errors = lambda: [f.error() for r in reduce._reducers() for f in r.feedbacks]  # noqa: E731
    saved_errors = fill()
    assert len(saved_errors) == 3 and reduce.loco_bytes() > 0
    saved = reduce.loco_state()
    assert saved["layout"] == {"world": 4, "rank": 1, "shards": [12, 6], "hops": [[2, 24], [2, 12]], "loco": True,
                               "expert_partitions": [2]}
    reduce.loco_after_step(False, 8.0, 8.0, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(errors(), saved_errors))
    reduce.loco_after_step(False, 8.0, 4.0, steps=2)  # the loss scale halved: so is the error
    assert all(torch.equal(a, b * 0.5) for a, b in zip(errors(), saved_errors))
    reduce.loco_after_step(False, 4.0, 4.0, steps=3)  # every reset_T = 3 steps
    assert reduce.loco_bytes() == 0
    fill()
    reduce.loco_after_step(True, 4.0, 4.0, steps=4)  # an overflow drops it
    assert reduce.loco_bytes() == 0

    assert reduce.load_loco_state(saved) is True
    assert all(torch.equal(a, b) for a, b in zip(errors(), saved_errors))
    reduce.reset_loco_state()
    assert reduce.loco_bytes() == 0
    old = dict(saved, layout={k: v for k, v in saved["layout"].items() if k != "expert_partitions"})
    with pytest.warns(UserWarning, match="another layout"):  # saved before expert_partitions: experts differ now
        assert reduce.load_loco_state(old) is False
    reduce.load_loco_state(saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert reduce.load_loco_state(dict(saved, layout=dict(saved["layout"], world=2))) is False
    assert any("another layout" in str(w.message) for w in caught) and reduce.loco_bytes() == 0
