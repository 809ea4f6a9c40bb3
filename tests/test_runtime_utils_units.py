"""`zerotrain.runtime.utils` against `deepspeed.runtime.utils` itself (issue #48): the generators each seed
leaves, `see_memory_usage`'s lines (nothing without `force`), `move_to_device` over nested containers and in place
where `criterion_func` says so."""
from __future__ import annotations

import random
import re

import numpy
import pytest
import torch

from zerotrain.runtime.utils import move_to_device, see_memory_usage, set_random_seed


def _draws() -> tuple:
    """What each generator gives next, and torch's seed as it reports it (its CPU engine draws from the low bits)."""
    return torch.initial_seed(), random.random(), float(numpy.random.rand()), torch.rand(3).tolist()


@pytest.fixture
def kept_generators():
    state = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(state[0])
    numpy.random.set_state(state[1])
    torch.set_rng_state(state[2])


@pytest.mark.parametrize("seed", [1234, 3 * 2 ** 32 + 7, 2 ** 62 + 9, 2 ** 64 + 3])  # numpy's mod 2**32, torch's mod 2**63
def test_set_random_seed_seeds_the_three_generators_as_deepspeed(seed, kept_generators):
    ds_utils = pytest.importorskip("deepspeed.runtime.utils")
    ds_utils.set_random_seed(seed)
    theirs = _draws()
    set_random_seed(seed)
    assert _draws() == theirs


def test_see_memory_usage_prints_deepspeeds_lines_only_when_forced(capsys):
    import psutil

    see_memory_usage("not shown")
    assert capsys.readouterr().out == ""
    see_memory_usage("after step 3", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after step 3" and len(lines) == 3, lines
    assert re.fullmatch(r"MA [\d.]+ GB Max_MA [\d.]+ GB CA [\d.]+ GB Max_CA \d+ GB ", lines[1]), lines[1]
    used = float(re.fullmatch(r"CPU Virtual Memory:  used = ([\d.]+) GB, percent = [\d.]+%", lines[2]).group(1))
    stats = psutil.virtual_memory()
    assert used == pytest.approx((stats.total - stats.available) / 1024 ** 3, abs=0.25)


def test_move_to_device_moves_nested_tensors_and_in_place_where_the_criterion_says():
    ds_utils = pytest.importorskip("deepspeed.runtime.utils")
    a, b, c = torch.ones(2), torch.zeros(3, dtype=torch.float64), torch.arange(4)
    item = [a, (b, {"c": c, "d": [a]})]
    for move in (move_to_device, ds_utils.move_to_device):
        moved = move(item, torch.float16)  # `.to(dtype)`: any argument of Tensor.to, as DeepSpeed passes it on
        assert isinstance(moved, list) and isinstance(moved[1], tuple) and isinstance(moved[1][1], dict)
        assert [moved[0].dtype, moved[1][0].dtype, moved[1][1]["c"].dtype, moved[1][1]["d"][0].dtype] == [
            torch.float16] * 4
        assert a.dtype == torch.float32  # a copy: the item's own tensors unchanged
    kept = torch.ones(2)
    out = move_to_device({"x": kept, "y": torch.ones(1)}, torch.float64, criterion_func=lambda t: t is kept)
    assert out["x"] is kept and kept.dtype == torch.float64 and out["y"].dtype == torch.float64


def test_see_memory_usage_prints_on_rank_0_of_a_process_group(tmp_path, world_of_one, capsys):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    see_memory_usage("rank 0", force=True)
    assert capsys.readouterr().out.splitlines()[0] == "rank 0"
