"""`zerotrain.topology` (issue #48): which ranks each group of the grid holds, against the layout its docstring
states (global rank = ((p × dp + d) × sp + s) × tp + t), at world 8 in one launch of real gloo ranks; the
environment's ranks per node, the node layout and the refusals in-process."""
from __future__ import annotations

import itertools
import os

import pytest

from distributed import run_distributed

WORLD = 8


def _ranks(group) -> list:
    import torch.distributed as dist

    return None if group is None else dist.get_process_group_ranks(group)


def grid_groups() -> dict:
    """In each rank: the groups of a pp2 x dp1 x sp2 x tp2 grid, of a tp2 grid's ZeRO++ subgroups and expert groups,
    of a flat world's, and the refusals."""
    from zerotrain.topology import Topology

    # two pretend nodes of four ranks, set in the rank itself: the ranks fork from the test forkserver, which does
    # not see a variable the test process sets after it started
    os.environ["ZEROTRAIN_RANKS_PER_NODE"] = "4"
    out = {}
    grid = Topology.build(timeout_seconds=60, pp_size=2, tp_size=2, sp_size=2)
    out["grid"] = {"pp": (_ranks(grid.pp_group), grid.pp_rank, grid.pp_size),
                   "tp": (_ranks(grid.tp_group), grid.tp_rank, grid.tp_size),
                   "sp": (_ranks(grid.sp_group), grid.sp_rank, grid.sp_size),
                   "dp": (_ranks(grid.dp_group), grid.dp_rank, grid.dp_size),
                   "data": (grid.data_parallel_size, grid.data_parallel_rank), "stage_world": grid.stage_world_size,
                   "describe": grid.describe(), "pipe01": _ranks(grid.pipeline_subgroup([1, 0])[0]),
                   "pipe01_rank": grid.pipeline_subgroup([0, 1])[1:], "pipe1": grid.pipeline_subgroup([1]),
                   "own": _ranks(grid.own_group()), "per_node": grid.ranks_per_node}
    tp = Topology.build(timeout_seconds=60, tp_size=2)
    out["tp"] = {"dp": (_ranks(tp.dp_group), tp.dp_rank, tp.dp_size), "per_node": tp.ranks_per_node,
                 "block": (lambda g: (_ranks(g[0]), g[1], g[2]))(tp.partition_group(2)),
                 "stride": (lambda g: (_ranks(g[0]), g[1], g[2]))(tp.strided_group(2)),
                 "ep": (lambda g: (_ranks(g[0]), g[1], g[2]))(tp.expert_parallel_group(4)),
                 "edp": (lambda g: (_ranks(g[0]), g[1], g[2]))(tp.expert_data_parallel_group(2)),
                 "ep_size": tp.ep_size, "layout": tp.node_layout()}
    flat = Topology.build(timeout_seconds=60)
    out["flat"] = {"dp": (_ranks(flat.dp_group), flat.dp_rank, flat.dp_size),
                   "block": (lambda g: (_ranks(g[0]), g[1], g[2]))(flat.partition_group(4)),
                   "stride": (lambda g: (_ranks(g[0]), g[1], g[2]))(flat.strided_group(4)),
                   "one": flat.partition_group(1), "layout": flat.node_layout(), "per_node": flat.ranks_per_node,
                   "pp": (_ranks(flat.pp_group), flat.pp_rank, flat.pp_size),
                   "sp": (_ranks(flat.sp_group), flat.sp_rank, flat.sp_size), "data": (flat.data_parallel_size,
                                                                                    flat.data_parallel_rank)}
    refusals = []
    for kwargs in ({"pp_size": 3}, {"tp_size": 3}, {"tp_size": 2, "sp_size": 3}, {"pp_size": 2, "tp_size": 8}):
        try:
            Topology.build(timeout_seconds=60, **kwargs)
            refusals.append(None)
        except ValueError as error:
            refusals.append(str(error))
    for call in (lambda: flat.partition_group(3), lambda: flat.strided_group(0), lambda: flat.expert_parallel_group(3),
                 lambda: flat.expert_data_parallel_group(0)):
        try:
            call()
            refusals.append(None)
        except ValueError as error:
            refusals.append(str(error))
    out["refusals"] = refusals
    return out


def test_every_group_of_the_grid_holds_the_ranks_the_layout_says():
    results = run_distributed(grid_groups, WORLD, timeout=240)
    pp, sp, tp = 2, 2, 2
    dp = WORLD // (pp * sp * tp)
    coords = {((p * dp + d) * sp + s) * tp + t: (p, d, s, t)
              for p, d, s, t in itertools.product(range(pp), range(dp), range(sp), range(tp))}
    for rank, out in enumerate(results):
        p, d, s, t = coords[rank]
        grid = out["grid"]
        at = lambda **c: ((c.get("p", p) * dp + c.get("d", d)) * sp + c.get("s", s)) * tp + c.get("t", t)
        assert grid["pp"] == ([at(p=q) for q in range(pp)], p, pp), (rank, grid)
        assert grid["tp"] == ([at(t=q) for q in range(tp)], t, tp), (rank, grid)
        assert grid["sp"] == ([at(s=q) for q in range(sp)], s, sp), (rank, grid)
        # ZeRO's group: the data x sequence ranks of this stage and tensor index
        zero = sorted(at(d=a, s=b) for a in range(dp) for b in range(sp))
        assert grid["dp"] == (zero, zero.index(rank), dp * sp), (rank, grid)
        assert grid["data"] == (dp, d) and grid["stage_world"] == WORLD // pp, (rank, grid)
        assert grid["describe"] == {"world_size": WORLD, "dp_size": dp * sp, "tp_size": tp, "ep_size": 1,
                                    "sp_size": sp, "pp_size": pp}
        assert grid["pipe01"] == [at(p=0), at(p=1)] and grid["pipe01_rank"] == (p, 2), (rank, grid)
        assert grid["pipe1"] == (None, 0 if p == 1 else -1, 1), (rank, grid)
        assert grid["own"] == [rank] and grid["per_node"] == 2, (rank, grid)  # 4 per node (<= a stage) / tp 2

        tp_out = out["tp"]  # tp 2 x dp 4: ZeRO ranks are the same tensor index, 2 pretend nodes of 2 of them
        zero = list(range(rank % 2, WORLD, 2))
        index = zero.index(rank)
        assert tp_out["dp"] == (zero, index, 4) and tp_out["per_node"] == 2, (rank, tp_out)
        assert tp_out["block"] == (zero[index // 2 * 2:index // 2 * 2 + 2], index % 2, 2), (rank, tp_out)
        assert tp_out["stride"] == (zero[index % 2::2], index // 2, 2), (rank, tp_out)
        assert tp_out["ep"] == (zero, index, 4) and tp_out["ep_size"] == 2, (rank, tp_out)  # ep 4 == dp: dp's
        assert tp_out["edp"] == (zero[index % 2::2], index // 2, 2), (rank, tp_out)
        assert tp_out["layout"] == (2, 2), (rank, tp_out)

        flat = out["flat"]
        assert flat["dp"] == (list(range(WORLD)), rank, WORLD) and flat["per_node"] == 4, (rank, flat)
        assert flat["block"] == ([q for q in range(WORLD) if q // 4 == rank // 4], rank % 4, 4), (rank, flat)
        assert flat["stride"] == ([q for q in range(WORLD) if q % 4 == rank % 4], rank // 4, 2), (rank, flat)
        assert flat["one"] == (None, 0, 1) and flat["layout"] == (4, 2), (rank, flat)
        # no pipeline, no sequence parallelism: no groups, this rank the only one of each
        assert (flat["pp"], flat["sp"], flat["data"]) == ((None, 0, 1), (None, 0, 1), (WORLD, rank)), (rank, flat)
        assert out["refusals"] == [
            "pipeline_parallel_size: 3 does not divide the world size 8",
            "tensor_parallel.autotp_size: 3 does not divide the world size 8",
            "sequence_parallel_size: 3 x tensor_parallel.autotp_size: 2 does not divide the world size 8",
            "tensor_parallel.autotp_size: 8 does not divide the world size 8 / 2 pipeline stages",
            "a group of 3 ranks does not divide the 8 data-parallel ranks",
            "a group of 0 ranks does not divide the 8 data-parallel ranks",
            "ep_size=3 does not divide the 8 data-parallel ranks: expert-parallel groups are blocks of ep_size "
            "consecutive data-parallel ranks",
            "ep_size=0 does not divide the 8 data-parallel ranks: expert-parallel groups are blocks of ep_size "
            "consecutive data-parallel ranks"], (rank, out["refusals"])


def test_without_a_launcher_this_process_is_rank_0_of_a_world_of_one(monkeypatch):
    """No RANK / WORLD_SIZE (nor MPI's or Slurm's): a world of one on a private store, every group its own."""
    import torch.distributed as dist

    from zerotrain.topology import Topology

    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or \
                name.startswith(("OMPI_COMM_WORLD_", "PMI_", "SLURM_", "ZEROTRAIN_RANKS_PER_NODE")):
            monkeypatch.delenv(name)
    assert not dist.is_initialized()
    try:
        topology = Topology.build(timeout_seconds=60)
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
        assert (topology.rank, topology.world_size, topology.dp_rank, topology.dp_size, topology.ranks_per_node) == (
            0, 1, 0, 1, 1)
        assert topology.own_group() is None and topology.node_layout() == (1, 1)
        assert "RANK" not in os.environ  # nothing set for later runs in this process
    finally:
        dist.destroy_process_group()


def test_ranks_per_node_comes_from_the_environment_bounded_by_the_world(monkeypatch):
    from zerotrain.topology import _ranks_per_node

    monkeypatch.delenv("ZEROTRAIN_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _ranks_per_node(6) == 6
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert (_ranks_per_node(6), _ranks_per_node(3)) == (4, 3)
    monkeypatch.setenv("ZEROTRAIN_RANKS_PER_NODE", "2")  # zerotrain's own wins over torchrun's
    assert _ranks_per_node(6) == 2
    monkeypatch.setenv("ZEROTRAIN_RANKS_PER_NODE", "0")
    assert _ranks_per_node(6) == 1
    monkeypatch.setenv("ZEROTRAIN_RANKS_PER_NODE", "two")
    with pytest.raises(ValueError) as error:
        _ranks_per_node(6)
    assert str(error.value) == "environment variable ZEROTRAIN_RANKS_PER_NODE must be an integer, got 'two'"


@pytest.mark.parametrize("per_node,layout", [(0, (6, 1)), (2, (2, 3)), (3, (3, 2)), (4, (6, 1)), (6, (6, 1)),
                                             (12, (6, 1))])
def test_node_layout_splits_the_data_parallel_ranks_only_evenly(per_node, layout):
    import torch

    from zerotrain.topology import Topology

    topology = Topology(rank=0, world_size=6, dp_group=None, dp_rank=0, dp_size=6, device=torch.device("cpu"),
                        ranks_per_node=per_node)
    assert topology.node_layout() == layout
