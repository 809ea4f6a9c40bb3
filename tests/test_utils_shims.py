"""zerotrain.utils' DeepSpeed helpers in-process (issue #48, round 4): `log_dist` logs where DeepSpeed 0.19's
`get_dist_msg` does (deepspeed/utils/logging.py: every call before the process group is up, as rank -1; afterwards
only on listed ranks, `[-1]` first meaning all, none for None), and `recursive_getattr`/`recursive_setattr` reach a
submodule by its dotted name as DeepSpeed-Chat's LoRA conversion uses them."""
from __future__ import annotations

import logging

import pytest
import torch

from zerotrain.utils import log_dist, recursive_getattr, recursive_setattr


def _logged(caplog, **kwargs) -> list[tuple[int, str]]:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="zerotrain"):
        log_dist("hello", **kwargs)
    return [(record.levelno, record.getMessage()) for record in caplog.records if record.name == "zerotrain"]


def test_log_dist_before_the_process_group_logs_every_call_as_rank_minus_one(caplog):
    for ranks in (None, [], [0], [1], [-1]):
        assert _logged(caplog, ranks=ranks) == [(logging.INFO, "[Rank -1] hello")], ranks
    assert _logged(caplog, ranks=[3], level=logging.WARNING) == [(logging.WARNING, "[Rank -1] hello")]


def test_log_dist_in_a_process_group_logs_on_the_listed_ranks_only(caplog, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert _logged(caplog) == []  # None: no rank (DeepSpeed's `ranks or []`)
        assert _logged(caplog, ranks=[]) == []
        assert _logged(caplog, ranks=[1]) == []
        assert _logged(caplog, ranks=[1, -1]) == []  # -1 means every rank only first, as DeepSpeed reads it
        assert _logged(caplog, ranks=[0]) == [(logging.INFO, "[Rank 0] hello")]
        assert _logged(caplog, ranks=[2, 0]) == [(logging.INFO, "[Rank 0] hello")]
        assert _logged(caplog, ranks=[-1], level=logging.DEBUG) == [(logging.DEBUG, "[Rank 0] hello")]
    finally:
        dist.destroy_process_group()


def test_recursive_getattr_and_setattr_follow_dotted_names():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    assert recursive_getattr(model, "1.1") is model[1][1]
    assert recursive_getattr(model, "0.weight") is model[0].weight
    replacement = torch.nn.Linear(3, 1, bias=False)
    recursive_setattr(model, "1.1", replacement)
    assert model[1][1] is replacement and isinstance(model[1][0], torch.nn.ReLU)
    top = torch.nn.Identity()
    recursive_setattr(model, "0", top)  # a top-level name: set on the model itself
    assert model[0] is top
    with pytest.raises(AttributeError):
        recursive_getattr(model, "1.missing")
