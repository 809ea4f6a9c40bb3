"""checkpoint/loco.py and checkpoint/slots.py in-process (issue #48, round 4): LoCo's per-rank state file written
and read back as it was (nested dicts, lists, tensors, plain values), a file that is not one refused naming it, the
warning when a LoCo run resumes without buffers; a tied layer's aliased records renamed to their owner's.
(test_loco_resume.py resumes real LoCo runs at worlds 2 and 4.)"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from safetensors.torch import save_file

from zerotrain.checkpoint.format import CheckpointError
from zerotrain.checkpoint.loco import capture_loco, loco_file, read_loco, restore_loco, write_loco
from zerotrain.checkpoint.slots import aliased_slots, sharded_names
from zerotrain.sharding import ShardedSlot, ShardRecord


def _state() -> dict:
    return {"steps": 7, "beta": 0.8, "name": "loco", "none": None,
            "buckets": [{"error": torch.arange(6, dtype=torch.int8), "scale": torch.tensor([0.5, 0.25])},
                        {"error": torch.zeros(0, dtype=torch.int8), "scale": torch.ones(1)}],
            "hops": {"0": torch.tensor([[1.0, 2.0]]), "1": {"inner": torch.tensor([3], dtype=torch.int64)}}}


def _assert_equal(got, want, where="state") -> None:
    if torch.is_tensor(want):
        assert torch.is_tensor(got) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_equal(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want)):
            _assert_equal(a, b, f"{where}/{index}")
    else:
        assert got == want and type(got) is type(want), where


def test_loco_state_is_written_and_read_back_as_it_was(tmp_path):
    path = str(tmp_path / loco_file(3))
    assert path.endswith("loco_state_3.safetensors")
    entry = write_loco(path, _state())
    assert entry["size"] == (tmp_path / "loco_state_3.safetensors").stat().st_size
    _assert_equal(read_loco(path), _state())


def test_a_file_that_is_not_a_loco_state_is_refused_naming_it(tmp_path):
    plain = str(tmp_path / "plain.safetensors")
    save_file({"x": torch.zeros(2)}, plain, metadata={"state": "{}"})
    with pytest.raises(CheckpointError, match=f"^{plain} is not a LoCo state file$"):
        read_loco(plain)
    labelled = str(tmp_path / "no_state.safetensors")
    save_file({"x": torch.zeros(2)}, labelled, metadata={"zerotrain": "loco"})
    with pytest.raises(CheckpointError, match="is not a LoCo state file"):
        read_loco(labelled)
    missing = str(tmp_path / "missing.safetensors")
    save_file({"loco/a": torch.zeros(2)}, missing,
              metadata={"zerotrain": "loco", "state": '{"a": {"__tensor__": "loco/b"}}'})
    with pytest.raises(CheckpointError, match="LoCo tensor 'loco/b' is missing"):
        read_loco(missing)
    cut = tmp_path / "cut.safetensors"
    write_loco(str(cut), _state())
    cut.write_bytes(cut.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=f"^cannot read LoCo state {cut}: "):
        read_loco(str(cut))


@dataclass
class _LoCo:
    enabled: bool
    held: Optional[dict] = None
    loaded: object = "never"

    def state_dict(self) -> Optional[dict]:
        return self.held

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.loaded = state


def test_capture_and_restore_follow_whether_loco_is_on():
    assert capture_loco(_LoCo(enabled=False, held={"x": 1})) is None
    assert capture_loco(_LoCo(enabled=True, held={"x": 1})) == {"x": 1}
    on = _LoCo(enabled=True)
    with pytest.warns(UserWarning, match="checkpoint ck holds no LoCo error buffers for rank 2; they restart from zero"):
        restore_loco(on, None, "ck", 2)
    assert on.loaded is None
    off = _LoCo(enabled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_loco(off, None, "ck", 2)  # LoCo off: nothing to restart, no warning
        restore_loco(on, {"x": 1}, "ck", 2)
    assert off.loaded is None and on.loaded == {"x": 1}


def test_aliased_records_are_renamed_to_their_owner_and_names_listed():
    def slot(*names):
        return ShardedSlot(records=[ShardRecord(name, (2,), 0, 2, 2 * i) for i, name in enumerate(names)],
                           master=torch.zeros(2 * len(names)), model_shard=torch.zeros(2 * len(names)),
                           replicated=False)

    slots = [slot("head.weight", "ln.bias"), slot("fc.weight")]
    assert sharded_names(slots) == {"head.weight", "ln.bias", "fc.weight"}
    assert aliased_slots(slots, {}) is slots
    renamed = aliased_slots(slots, {"head.weight": "embed.weight"})
    assert [[r.name for r in s.records] for s in renamed] == [["embed.weight", "ln.bias"], ["fc.weight"]]
    assert renamed[0].records[0] == ShardRecord("embed.weight", (2,), 0, 2, 0)  # only the name changes
    assert renamed[0].master is slots[0].master and slots[0].records[0].name == "head.weight"
