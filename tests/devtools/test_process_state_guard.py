"""The conftest's guard (`tests/conftest.py::_process_state_guard`, issue #48): the test that leaves process-global
state behind fails, named in one line, and the state is put back so the tests after it run as if it had not.

The leak that broke CI in round 1 was an in-process test running benchmarks/fp8_memory.py's engine, which started a
world of one and kept it: test_hostfile's bad-SLURM-variables run, later in the same process, found torch.distributed
up, skipped its rank discovery and trained. The inner session below has that shape: a test starts a world of one
(as `zerotrain.topology.init_distributed` does without a launcher) and keeps it; the next asserts it is down."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch  # before pytester's in-process run: it drops the modules it saw imported, and torch imports once
import torch.distributed as dist

from conftest import process_state, restore, state_leaks

pytest_plugins = ("pytester",)

LEAKS = '''
import os

import torch
import torch.distributed as dist


def test_starts_a_world_of_one_and_keeps_it():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_later_finds_no_world():
    assert not dist.is_initialized()


def test_starts_and_ends_its_own_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()


def test_sets_a_launcher_variable(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    os.environ["MASTER_PORT"] = "29533"


def test_later_finds_no_launcher_variable():
    assert "MASTER_PORT" not in os.environ


def test_monkeypatched_variables_and_directory_are_given_back(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("ZEROTRAIN_RANKS_PER_NODE", "2")
    monkeypatch.chdir(tmp_path)


def test_changes_the_default_dtype():
    torch.set_default_dtype(torch.float64)


def test_later_finds_float32():
    assert torch.get_default_dtype() == torch.float32
'''


def test_the_leaking_test_fails_named_once_and_the_next_ones_run_clean(pytester, monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the installed plugins' imports: seconds, unneeded
    pytester.makeconftest((Path(__file__).resolve().parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_leaks=LEAKS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=8, errors=3)
    # one line per leaking test, naming it and what it left; the tests after it found the state put back
    named = [line for line in result.outlines if "left process-global state behind" in line
             and not line.startswith("ERROR ")]
    assert named == [
        "test_leaks.py::test_starts_a_world_of_one_and_keeps_it left process-global state behind: "
        "torch.distributed initialized (destroy the process group it started)",
        "test_leaks.py::test_sets_a_launcher_variable left process-global state behind: $MASTER_PORT None -> '29533'",
        "test_leaks.py::test_changes_the_default_dtype left process-global state behind: torch default dtype "
        "'torch.float32' -> 'torch.float64'",
    ], result.outlines


def test_state_leaks_names_each_difference_and_restore_puts_it_back(tmp_path, monkeypatch):
    """The guard's two functions directly: every kind of state it watches, changed and given back."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    before = process_state()
    assert not before["torch.distributed initialized"] and before["environment"]["WORLD_SIZE"] == "1"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    os.environ["SLURM_PROCID"] = "1"
    del os.environ["WORLD_SIZE"]
    os.environ["UNRELATED_TO_RANKS"] = "x"  # not a launcher variable: not watched
    os.chdir(tmp_path)
    torch.set_default_dtype(torch.float16)
    torch.set_grad_enabled(False)
    try:
        after = process_state()
        assert state_leaks(before, after) == [
            "torch.distributed initialized (destroy the process group it started)",
            f"working directory {before['working directory']!r} -> {str(tmp_path)!r}",
            "torch default dtype 'torch.float32' -> 'torch.float16'",
            "torch grad mode True -> False",
            "$SLURM_PROCID None -> '1'",
            "$WORLD_SIZE '1' -> None",
        ]
    finally:
        restore(before, after)
        del os.environ["UNRELATED_TO_RANKS"]
    assert process_state() == before and not dist.is_initialized() and torch.is_grad_enabled()
    assert state_leaks(before, process_state()) == []
