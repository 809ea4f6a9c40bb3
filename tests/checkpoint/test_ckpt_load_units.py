"""The pieces of a checkpoint load in-process (`checkpoint/load.py`): the names a weight is looked up under
(Hugging Face's base-model prefix, a PEFT-wrapped model's base names), the one error for a model that does
not fit, the optimizer states planned for a shard (scalars shared by its parameters, a shard of padding only),
and the reads into masters, states and whole tensors (in place, strided, split)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from zerotrain.checkpoint import load
from zerotrain.checkpoint.format import CheckpointError
from zerotrain.checkpoint.reader import TensorReader
from zerotrain.sharding import ShardRecord


def _reader(tmp_path, tensors: dict, what: str = "model weights", file: str = "t.safetensors") -> TensorReader:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / file))
    return TensorReader(str(tmp_path), {k: file for k in tensors}, what)


def test_names_are_looked_up_with_and_without_the_base_model_prefix():
    model = torch.nn.Module()
    model.base_model_prefix = "transformer"
    assert load._name_candidates(model, "transformer.h.0.w", False) == ["transformer.h.0.w"]
    assert load._name_candidates(model, "transformer.h.0.w", True) == ["transformer.h.0.w", "h.0.w"]
    assert load._name_candidates(model, "lm_head.weight", True) == ["lm_head.weight", "transformer.lm_head.weight"]
    assert load._name_candidates(torch.nn.Linear(1, 1), "weight", True) == ["weight"]  # no prefix
    wrapped = torch.nn.Module()  # a PEFT wrapper: its base model has the prefix
    wrapped.get_base_model = lambda: model
    name = "base_model.model.transformer.h.0.attn.base_layer.weight"
    assert load._name_candidates(wrapped, name, False) == [name, "transformer.h.0.attn.weight"]
    assert load._name_candidates(wrapped, name, True) == [name, "transformer.h.0.attn.weight", "h.0.attn.weight"]


def _slot(records, master=None):
    return SimpleNamespace(records=records, master=master)


def test_a_model_that_does_not_fit_is_one_error_naming_the_first_weight_and_the_count(tmp_path):
    reader = _reader(tmp_path, {"a": torch.zeros(2, 3), "b": torch.zeros(4), "n": torch.zeros(2, dtype=torch.int64)})
    module, path = torch.nn.Module(), str(tmp_path)
    a, b = ShardRecord("a", (2, 3), 0, 6, 0), ShardRecord("b", (5,), 0, 5, 6)
    c, n = ShardRecord("c", (1,), 0, 1, 11), ShardRecord("n", (2,), 0, 2, 0)
    load._check_model_fits(reader, module, [_slot([a]), _slot([n, a])], {}, False, path)  # integers, repeats: fine
    with pytest.raises(CheckpointError, match=r"^tensor 'b' in \S+ has shape \[4\], the model expects \[5\] "
                                              r"\(2 of 3 model weights this rank loads do not match\): is this a "
                                              r"checkpoint of another model\?$"):
        load._check_model_fits(reader, module, [_slot([a, b]), _slot([c, a])], {}, False, path)
    with pytest.raises(CheckpointError, match=r"^tensor 'c' is missing from the model weights of \S+: is this"):
        load._check_model_fits(reader, module, [_slot([a, c])], {}, False, path)
    # a trained weight found in the master files, and a LoRA adapter on a base model's weights, are not missing
    masters = _reader(tmp_path, {"c": torch.zeros(1)}, "master weights", "m.safetensors")
    load._check_model_fits(reader, module, [_slot([a, c], master=torch.zeros(12))], {}, False, path, masters=masters)
    with pytest.raises(CheckpointError, match="'c' is missing"):  # a frozen slot reads the model weights
        load._check_model_fits(reader, module, [_slot([a, c])], {}, False, path, masters=masters)
    adapter = ShardRecord("x.lora_A.weight", (1,), 0, 1, 0)
    load._check_model_fits(reader, module, [_slot([a, adapter])], {}, False, path, base_only=True)
    with pytest.raises(CheckpointError, match="lora_A"):
        load._check_model_fits(reader, module, [_slot([a, adapter])], {}, False, path)


def test_optimizer_states_of_a_shard_are_planned_and_read_into_place(tmp_path):
    master = torch.zeros(10)
    optimizer = torch.optim.AdamW([master], foreach=False)
    w, v = torch.arange(6.0).reshape(2, 3), -torch.arange(1.0, 5.0)
    tensors = {"w/exp_avg": w, "w/exp_avg_sq": w * 2, "w/step": torch.tensor(3.0),
               "v/exp_avg": v, "v/exp_avg_sq": v * 2, "v/step": torch.tensor(3.0)}
    reader = _reader(tmp_path, tensors, "optimizer states")
    records = [ShardRecord("w", (2, 3), 1, 5, 0), ShardRecord("v", (4,), 0, 4, 6)]  # w from its 2nd element
    templates = load._Templates(optimizer)
    plan = load._plan_states(_slot(records, master), reader, templates, {})
    assert plan.scalars == {"step": 3.0} and set(plan.states) == {"exp_avg", "exp_avg_sq"}
    for key, factor in (("exp_avg", 1), ("exp_avg_sq", 2)):
        target = torch.full((10,), 9.0)
        for read in plan.states[key]:
            read.into(target)
        expected = torch.cat([w.reshape(-1)[1:] * factor, torch.tensor([9.0]), v * factor])
        assert torch.equal(target, expected), key
    # a shard of padding only takes any parameter's scalar; parameters of one shard must agree on it
    assert load._plan_states(_slot([], master), reader, templates, {}).scalars == {"step": 3.0}
    tensors["v/step"] = torch.tensor(4.0)
    other = _reader(tmp_path, tensors, "optimizer states", "o.safetensors")
    with pytest.raises(CheckpointError, match=r"'v/step' is 4.0 but other parameters of the same shard have 3.0"):
        load._plan_states(_slot(records, master), other, templates, {})
    # a scalar state that is not one (another optimizer's layout) is one line naming it, not torch's .item() error
    tensors["v/step"] = torch.tensor([3.0, 3.0])
    vector = _reader(tmp_path, tensors, "optimizer states", "s.safetensors")
    with pytest.raises(CheckpointError, match=r"^tensor 'v/step' in \S+s.safetensors has shape \[2\], the model "
                                              r"expects \[\]$"):
        load._plan_states(_slot(records, master), vector, templates, {})
    no_step = _reader(tmp_path, {"w/exp_avg": w}, "optimizer states", "n.safetensors")
    with pytest.raises(CheckpointError, match=r"optimizer state 'step' is missing from"):
        load._plan_states(_slot([], master), no_step, templates, {})
    with pytest.raises(CheckpointError, match="in no optimizer group"):
        templates(torch.zeros(10))


def test_templates_are_probed_once_per_group_and_read_off_an_existing_state(monkeypatch):
    first, second, third = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    optimizer = torch.optim.SGD([{"params": [first, second]}, {"params": [third], "momentum": 0.9}], lr=0.1)
    probes = []
    real = load.probe_template
    monkeypatch.setattr(load, "probe_template", lambda *args: probes.append(args[1]) or real(*args))
    templates = load._Templates(optimizer)
    assert templates(first) is templates(second) and probes == [0]
    assert set(templates(third).elementwise) == {"momentum_buffer"} and probes == [0, 1]
    optimizer.state[third]["momentum_buffer"] = torch.ones(4)
    optimizer.state[third]["extra"] = torch.ones(4)  # an existing state is read, not the cached probe
    assert set(templates(third).elementwise) == {"momentum_buffer", "extra"} and probes == [0, 1, 1]


def test_state_tensors_are_reused_only_when_they_fit():
    master = torch.zeros(6)
    fits = torch.ones(6)
    assert load._state_tensor(fits, master, torch.float32) is fits
    for current in (None, torch.ones(6, dtype=torch.float64), torch.ones(5), 3.0):
        made = load._state_tensor(current, master, torch.float32)
        assert made is not current and made.dtype == torch.float32 and torch.equal(made, torch.zeros(6))


def test_whole_tensors_are_read_into_parameters_buffers_strided_targets_and_split_slices(tmp_path):
    from zerotrain.checkpoint.split import RunsRead
    from zerotrain.parallel.slices import split_slice

    whole = torch.arange(24.0).reshape(4, 6)
    reader = _reader(tmp_path, {"w": whole})
    param = torch.nn.Parameter(torch.zeros(4, 6))
    strided = torch.zeros(6, 4).t()  # a non-contiguous buffer
    tensor_slice = split_slice((4, 6), 1, 1, 2)  # columns 3-5: strided in the file
    local = torch.nn.Parameter(torch.zeros(4, 3))
    with torch.no_grad():  # as `apply` runs every read (`_no_grad`)
        load._extra_read(load.Read(reader, "w", 0, 24, 0), param)
        load._extra_read(load.Read(reader, "w", 0, 24, 0), strided)
        load._extra_read(RunsRead(reader, "w", tensor_slice, 0, 12, 0), local)
    assert torch.equal(param.detach(), whole) and torch.equal(strided, whole)
    assert torch.equal(local.detach(), whole[:, 3:])
    target = torch.zeros(8)
    load.Read(reader, "w", 5, 3, 2).into(target)
    assert torch.equal(target, torch.tensor([0, 0, 5, 6, 7, 0, 0, 0.0]))
    record = ShardRecord("w", (4, 3), 4, 6, 1)  # a split parameter's record: its slice, mapped to the file
    read = load._record_read(reader, "w", record, {"w": tensor_slice})
    target = torch.zeros(8)
    read.into(target)
    assert torch.equal(target[1:7], whole[:, 3:].reshape(-1)[4:10]) and target[0] == 0 and target[7] == 0
    with pytest.raises(CheckpointError, match=r"the model expects \[4, 3\]"):  # unsplit: the record's own shape
        load._record_read(reader, "w", record, {})


def test_new_state_tensors_take_reads_straight_in_and_only_their_padding_is_zeroed(tmp_path):
    """A resume before the first step: the optimizer has no state, so the load makes the tensors (torch.empty)
    and reads straight into them; the element no read covers (padding) is zeroed; a state the optimizer has
    and that fits is left for after the verdict, and a stored dtype that needs converting gets zeros."""
    master = torch.zeros(10)
    optimizer = torch.optim.AdamW([master], foreach=False)
    w, v = torch.arange(6.0).reshape(2, 3), -torch.arange(1.0, 5.0)
    tensors = {"w/exp_avg": w, "w/exp_avg_sq": w * 2, "w/step": torch.tensor(3.0),
               "v/exp_avg": v, "v/exp_avg_sq": (v * 2).half(), "v/step": torch.tensor(3.0)}
    reader = _reader(tmp_path, tensors, "optimizer states")
    records = [ShardRecord("w", (2, 3), 1, 5, 0), ShardRecord("v", (4,), 0, 4, 6)]  # element 5: padding
    slot = _slot(records, master)
    plan = load._plan_states(slot, reader, load._Templates(optimizer), {})
    for _ in range(50):  # freed memory of this size, full of NaN: what torch.empty may hand back
        torch.full((10,), float("nan"))
    direct = load._direct_reads(plan, slot, optimizer, replace=False)
    assert sorted((read.name, id(target)) for read, target in direct) == sorted(
        [("w/exp_avg", id(plan.fresh["exp_avg"])), ("v/exp_avg", id(plan.fresh["exp_avg"])),
         ("w/exp_avg_sq", id(plan.fresh["exp_avg_sq"]))])
    assert plan.states["exp_avg"] == [] and [read.name for read in plan.states["exp_avg_sq"]] == ["v/exp_avg_sq"]
    assert torch.equal(plan.fresh["exp_avg_sq"], torch.zeros(10))  # a converted read left: all zeros first
    for read, target in direct:
        read.reader.read_checked(read.name, read.start, read.count, target[read.offset:read.offset + read.count], [])
    assert torch.equal(plan.fresh["exp_avg"], torch.cat([w.reshape(-1)[1:], torch.tensor([0.0]), v]))
    # the optimizer's own state that fits is written after the verdict, in place: no new tensor, no direct read
    optimizer.state[master] = {"exp_avg": torch.ones(10), "exp_avg_sq": torch.ones(10), "step": torch.tensor(1.0)}
    again = load._plan_states(slot, reader, load._Templates(optimizer), {})
    assert load._direct_reads(again, slot, optimizer, replace=False) == [] and again.fresh == {}
    assert [len(reads) for reads in again.states.values()] == [2, 2]
    # with room for a second copy (`replace`), new tensors for those too: read straight in, the old ones untouched
    held = dict(optimizer.state[master])
    swapped = load._plan_states(slot, reader, load._Templates(optimizer), {})
    direct = load._direct_reads(swapped, slot, optimizer, replace=True)
    assert sorted(read.name for read, _ in direct) == ["v/exp_avg", "w/exp_avg", "w/exp_avg_sq"]
    assert all(swapped.fresh[key] is not held[key] for key in ("exp_avg", "exp_avg_sq"))
    assert [read.name for read in swapped.states["exp_avg_sq"]] == ["v/exp_avg_sq"] and swapped.states["exp_avg"] == []
    assert torch.equal(held["exp_avg"], torch.ones(10)) and optimizer.state[master]["exp_avg"] is held["exp_avg"]
    reader.close()


def test_the_second_copy_counts_the_per_element_states_of_host_masters_only():
    """What reading into new tensors would copy: each host master's states of its own length (10 + 10 floats
    here), not its scalar `step`, a per-row state of another length, a number, a frozen slot (no master) or a
    master in another device's memory (its states are written in place)."""
    host, single, other = torch.zeros(10), torch.zeros(1), torch.zeros(6, device="meta")
    optimizer = SimpleNamespace(state={
        host: {"exp_avg": torch.ones(10), "exp_avg_sq": torch.ones(10, dtype=torch.float64), "step": torch.tensor(3.0),
               "row": torch.ones(4), "lr": 0.1},
        single: {"exp_avg": torch.ones(1), "step": torch.tensor(3.0)},  # one element: its step is no state of it
        other: {"exp_avg": torch.ones(6, device="meta")}})
    slots = [_slot([], None), _slot([], host), _slot([], single), _slot([], other), _slot([], torch.zeros(3))]
    assert load._copy_bytes(slots, optimizer) == 10 * 4 + 10 * 8 + 4  # the last slot: a master without state


def test_a_load_replaces_the_states_only_when_their_second_copy_fits_what_the_host_can_spare(world_of_one, tmp_path):
    """`CheckpointState.load_copy_bytes` against the bytes of the per-element states in host memory (the second
    copy a read into new tensors makes): equal fits (every state read straight into a new tensor), one byte less
    does not (the states left for after the verdict)."""
    import dataclasses

    from ckpt_common import make_engine, train

    engine = make_engine(stage=1)
    train(engine, 0, 1)
    path = engine.save_checkpoint(str(tmp_path), tag="t")
    state = engine.checkpoint_state()
    held = sum(value.numel() * value.element_size() for states in state.optimizer.state.values()
               for value in states.values() if torch.is_tensor(value) and value.dim() > 0)
    assert held > 0 and load._copy_bytes(state.slots(), state.optimizer) == held
    assert state.load_copy_bytes() > held  # the engine's allowance (budget.load_copy_allowance): this host has room

    def planned(room: int) -> tuple[int, int]:
        source, _ = load.open_checked(path, True, False)
        plan = load.prepare(dataclasses.replace(state, load_copy_bytes=lambda: room), source, set(), True, False)
        plan.files.close()
        return len(plan.direct), sum(len(reads) for slot in plan.slots for reads in (slot.states or {}).values())

    straight, left = planned(held)
    assert straight > 0 and left == 0
    assert planned(held - 1) == (0, straight)
