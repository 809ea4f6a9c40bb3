"""The engine's checkpointer in the pytest process at a world of one (issue #48, round 4): the fast covering test of
`checkpoint/checkpointer.py` and `checkpoint/snapshot.py`, whose other tests launch world-2 jobs. A synchronous save
under the default tag resumes into a fresh engine exactly (weights, optimizer state, counters, schedule, groups);
an asynchronous save written while training moves on holds the state at the save call, reuses its host buffers on
the next save, and is reported by `engine.last_save()`; a failed write surfaces with its own message (or as a
warning under `on_save_error: warn`); the save directory's lock is held while the job writes and given back by
`close`."""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time

import pytest
import torch

from ckpt_common import assert_weights_equal, make_engine, snapshot, train

LOCK = ".zerotrain-lock.json"


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert_weights_equal(got["weights"], want["weights"], rtol=0, atol=0, what=what)
    for mine, theirs in zip(got["optimizer"], want["optimizer"], strict=True):
        assert mine.keys() == theirs.keys(), what
        for key in theirs:
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(theirs[key])), (what, key)
    assert got["counters"] == want["counters"] and got["lr"] == want["lr"], what
    assert got["scheduler"] == want["scheduler"], what


def _join_writers() -> None:
    """Let a background save finish without asking the engine (so that the next step() is what collects it)."""
    for thread in threading.enumerate():
        if thread.name.startswith("zerotrain-checkpoint-"):
            thread.join()


def test_a_sync_save_under_the_default_tag_resumes_exactly_and_holds_the_save_dir(tmp_path, world_of_one):
    save_dir = str(tmp_path / "ckpt")
    engine = make_engine(stage=2, groups=True)
    train(engine, 0, 2)
    assert engine.last_save() == (False, None)
    before = time.perf_counter()
    path = engine.save_checkpoint(save_dir, client_state={"epoch": 3})
    took = time.perf_counter() - before
    assert path == os.path.join(os.path.abspath(save_dir), "global_step2")
    pending, stall = engine.last_save()
    assert not pending and 0 <= stall <= took
    assert engine.checkpointer.buffers.nbytes() == 0  # a synchronous save on the CPU reads the live tensors
    assert sorted(os.listdir(save_dir)) == [LOCK, "global_step2", "latest"]  # the job holds the directory
    with open(os.path.join(path, "manifest.json")) as handle:  # what a person or another tool reads of the save
        manifest = json.load(handle)
    assert (manifest["tag"], manifest["global_steps"], manifest["world_size"]) == ("global_step2", 2, 1)
    at_save = snapshot(engine)
    fresh = make_engine(stage=1, seed=9, groups=True)
    loaded, client = fresh.load_checkpoint(save_dir)
    assert loaded == path and client["epoch"] == 3
    _assert_same(snapshot(fresh), at_save, "resumed")
    assert [group["weight_decay"] for group in fresh.optimizer.param_groups] == [0.05, 0.0]
    # both go on alike from there
    assert train(fresh, 2, 2) == train(engine, 2, 2)
    _assert_same(snapshot(fresh), snapshot(engine), "trained on")
    engine.close()
    fresh.close()
    assert LOCK not in os.listdir(save_dir)  # close gave the directory back
    # ... and a save after close takes it again
    engine.save_checkpoint(save_dir, tag="again")
    assert LOCK in os.listdir(save_dir)
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_an_async_save_holds_the_state_of_the_save_call_and_reuses_its_buffers(tmp_path, world_of_one, stage):
    save_dir = str(tmp_path / "ckpt")
    engine = make_engine(stage=stage, async_save=True)
    train(engine, 0, 2)
    at_save = snapshot(engine)
    before = time.perf_counter()
    path = engine.save_checkpoint(save_dir, tag="first")
    took = time.perf_counter() - before
    pending, stall = engine.last_save()
    assert pending and 0 <= stall <= took  # being written; the call blocked training no longer than it took
    assert engine.checkpointer.last_fence_seconds is None  # the snapshot copy not fenced yet
    train(engine, 2, 2)  # the weights move on while (or after) it is written
    assert engine.checkpointer.last_fence_seconds >= 0.0  # the next step fenced it: the rest of the save's stall
    engine.wait_checkpoint()
    assert engine.last_save()[0] is False
    fresh = make_engine(stage=stage, seed=9)  # the same layout: its optimizer state compares slot by slot
    assert fresh.load_checkpoint(save_dir, tag="first")[0] == path
    _assert_same(snapshot(fresh), at_save, "async snapshot")
    buffers = engine.checkpointer.buffers
    allocations, addresses, nbytes = buffers.allocations, buffers.addresses(), buffers.nbytes()
    trainable = sum(p.numel() * 4 for p in engine.module.parameters() if p.requires_grad)
    assert nbytes >= 3 * trainable  # at least the weights and AdamW's two moments, copied to the host
    at_second = snapshot(engine)
    engine.save_checkpoint(save_dir, tag="second")
    _join_writers()  # written; the next step() finds it done and collects it
    assert engine.last_save()[0]
    train(engine, 4, 1)
    assert engine.last_save()[0] is False
    assert (buffers.allocations, buffers.addresses(), buffers.nbytes()) == (allocations, addresses, nbytes)
    fresh.load_checkpoint(save_dir, tag="second")
    _assert_same(snapshot(fresh), at_second, "second async snapshot")
    engine.close()
    fresh.close()


def _fail_writes(monkeypatch, error: BaseException) -> None:
    import zerotrain.checkpoint.write as write

    def broken(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(write.SaveJob, "_write_in_place", broken)


def test_a_failed_background_write_names_its_error(tmp_path, world_of_one, monkeypatch):
    from zerotrain.checkpoint import CheckpointError
    from zerotrain.checkpoint.checkpointer import Checkpointer

    engine = make_engine(stage=2, async_save=True)
    train(engine, 0, 1)
    _fail_writes(monkeypatch, OSError("disk on fire (injected)"))
    engine.save_checkpoint(str(tmp_path), tag="a")
    with pytest.raises(CheckpointError) as caught:
        engine.wait_checkpoint()
    # the writer's own one line, as it was (not wrapped again)
    assert str(caught.value) == f"saving checkpoint {tmp_path / 'a'} failed on rank 0: OSError: disk on fire (injected)"
    monkeypatch.undo()

    def crashed(self, job):  # a writer (the subclass hook) failing with something other than a CheckpointError
        raise MemoryError("no room (injected)")

    monkeypatch.setattr(Checkpointer, "_write", crashed)
    engine.save_checkpoint(str(tmp_path), tag="b")
    _join_writers()
    with pytest.raises(CheckpointError) as caught:
        train(engine, 1, 1)  # the next step raises it
    assert str(caught.value) == "asynchronous checkpoint save failed: MemoryError: no room (injected)"
    monkeypatch.undo()
    engine.wait_checkpoint()  # raised once, not again
    engine.close()


def test_on_save_error_warn_logs_and_trains_on_warning_at_the_callers_line(tmp_path, world_of_one, monkeypatch,
                                                                          caplog):
    import zerotrain

    engine = make_engine(stage=2, on_save_error="warn")
    train(engine, 0, 1)
    _fail_writes(monkeypatch, OSError("disk on fire (injected)"))
    with caplog.at_level(logging.WARNING, logger="zerotrain"), \
            pytest.warns(RuntimeWarning, match="checkpoint save failed; training goes on: .*disk on fire") as said:
        line = sys._getframe().f_lineno + 1
        assert engine.save_checkpoint(str(tmp_path), tag="a") is None
    assert [(w.filename, w.lineno) for w in said] == [(__file__, line)]  # the caller's line, not zerotrain's
    assert any("on_save_error: warn" in record.getMessage() and "disk on fire" in record.getMessage()
               for record in caplog.records)
    # an asynchronous save's failure, warned at the next step(): at the first line outside zerotrain too
    engine.save_checkpoint(str(tmp_path), tag="b", async_save=True)
    _join_writers()
    with pytest.warns(RuntimeWarning, match="disk on fire") as said:
        train(engine, 1, 1)
    package = os.path.dirname(os.path.abspath(zerotrain.__file__))
    assert len(said) == 1 and not said[0].filename.startswith(package + os.sep), said[0].filename
    # a script beside the package whose directory name begins with the package's (zerotrain_runs/) is the caller
    script = package + "_runs" + os.sep + "train.py"
    code = compile("engine.save_checkpoint(save_dir, tag='c')\n", script, "exec")
    with pytest.warns(RuntimeWarning, match="disk on fire") as said:
        exec(code, {"engine": engine, "save_dir": str(tmp_path)})
    assert [(w.filename, w.lineno) for w in said] == [(script, 1)]
    monkeypatch.undo()
    train(engine, 2, 1)
    engine.close()


def test_the_directory_to_load_is_found_classified_and_its_files_listed(tmp_path, world_of_one):
    """checkpoint/source.py on a real save (bf16: a master file beside the model's) and a plain HF directory."""
    from safetensors.torch import save_file

    from zerotrain.checkpoint import source
    from zerotrain.checkpoint.format import CheckpointError

    save_dir = str(tmp_path / "ckpt")
    engine = make_engine(stage=1, precision="bf16")
    train(engine, 0, 1)
    engine.add_checkpoint_files({"config.json": b'{"model_type": "x"}'})  # as a Hugging Face model's save holds
    path = engine.save_checkpoint(save_dir, tag="t1")
    engine.close()
    assert source.resolve(save_dir, None) == path == source.resolve(save_dir, "t1")
    assert source.resolve(path, None) == path  # a tag directory itself (no `latest` in it)
    os.makedirs(tmp_path / "empty")
    assert source.resolve(str(tmp_path / "empty"), None) is None
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'ckpt' / 't9'} does not exist"):
        source.resolve(save_dir, "t9")
    with pytest.raises(CheckpointError, match=f"checkpoint directory {tmp_path / 'nowhere'} does not exist"):
        source.resolve(str(tmp_path / "nowhere"), None)
    with open(os.path.join(save_dir, "latest"), "w") as handle:
        handle.write("gone")
    with pytest.raises(CheckpointError, match="names 'gone', but .* does not exist"):
        source.resolve(save_dir, None)
    opened = source.open_source(path, load_module_only=False)
    assert opened.kind == source.ZEROTRAIN and opened.path == path and opened.manifest["format"]
    assert set(opened.maps) == {"model", "master_weights", "optimizer"}
    assert opened.trainer_state["global_steps"] == 1
    assert opened.optimizer_meta["optimizer"] == "AdamW"
    listed = set(opened.manifest["files"])
    full = source.needed_files(opened, load_optimizer_states=True, load_module_only=False)
    assert set(full) == listed - {"manifest.json"}  # a full resume reads every file
    no_optim = source.needed_files(opened, load_optimizer_states=False, load_module_only=False)
    assert set(full) - set(no_optim) == {"optimizer.safetensors.index.json"} | opened.files_of("optimizer")
    module_only = source.needed_files(opened, load_optimizer_states=True, load_module_only=True)
    assert set(module_only) == set(no_optim) - {"rng_state_0.json"}  # weights only, optimizer states asked or not
    assert "master_weights.safetensors.index.json" in module_only and opened.files_of("master_weights") <= set(
        module_only)
    assert "config.json" in module_only
    assert source.verify(opened, full, 0, 1, checksums=False) is None
    assert source.verify(opened, full, 0, 1, checksums=True)
    # a plain Hugging Face directory: one safetensors file, weights only
    hf = tmp_path / "hf"
    os.makedirs(hf)
    save_file({"w": torch.zeros(2)}, str(hf / "model.safetensors"))
    opened = source.open_source(str(hf), load_module_only=True)
    assert opened.kind == source.HUGGING_FACE and opened.maps == {"model": {"w": "model.safetensors"}}
    assert source.resolve(str(hf), None) == str(hf)
    with pytest.raises(CheckpointError, match="plain Hugging Face model directory .*load_module_only=True"):
        source.open_source(str(hf), load_module_only=False)
    os.remove(hf / "model.safetensors")
    (hf / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*\(only safetensors weights are read\)"):
        source.open_source(str(hf), load_module_only=True)
    # a temporary directory is never loaded, even named directly
    side = tmp_path / "ckpt" / "t2.zerotrain-tmp-abc"
    os.makedirs(side)
    (side / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="temporary directory of an unfinished or replaced save"):
        source.resolve(str(side), None)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        source.open_source(str(side), load_module_only=False)


def test_the_config_files_of_a_hugging_face_model_name_the_saved_dtype():
    """snapshot.hf_config_files: config.json (and generation_config.json) of the model, of a PEFT model's base, of a
    model carrying transformers' own adapter attribute (`peft_config`, no `get_base_model`), none for a plain one."""
    from types import SimpleNamespace

    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.checkpoint.snapshot import hf_config_files

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    files = hf_config_files(model, torch.bfloat16)
    assert files["config.json"]["dtype"] == "bfloat16" and "torch_dtype" not in files["config.json"]
    assert files["config.json"]["architectures"] == ["LlamaForCausalLM"]
    assert files["config.json"]["hidden_size"] == 8 and "generation_config.json" in files
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert hf_config_files(wrapped, torch.float32)["config.json"]["architectures"] == ["LlamaForCausalLM"]
    model.peft_config = {"default": None}  # what transformers' load_adapter leaves on the model itself
    assert hf_config_files(model, torch.float16)["config.json"]["dtype"] == "float16"
    assert hf_config_files(torch.nn.Linear(2, 2), torch.float32) == {}
    legacy = SimpleNamespace(model_type="custom", to_dict=lambda: {"model_type": "custom", "torch_dtype": "float32"})
    module = torch.nn.Linear(2, 2)
    module.config = legacy
    assert hf_config_files(module, torch.bfloat16)["config.json"]["torch_dtype"] == "bfloat16"  # the old spelling
    legacy.to_dict = lambda: {"model_type": "custom"}
    assert hf_config_files(module, torch.bfloat16) == {"config.json": {"model_type": "custom", "dtype": "bfloat16",
                                                                      "architectures": ["Linear"]}}


def test_a_directory_with_zerotrain_state_but_no_manifest_is_refused_and_null_metadata_is_empty(tmp_path,
                                                                                                  world_of_one):
    """checkpoint/source.py: any of zerotrain's own files (rank 0's RNG state included) without the manifest is an
    unfinished checkpoint, never a plain HF directory; an index whose metadata is null reads as no metadata."""
    from safetensors.torch import save_file

    from zerotrain.checkpoint import source
    from zerotrain.checkpoint.format import CheckpointError

    cut = tmp_path / "cut"
    os.makedirs(cut)
    save_file({"w": torch.zeros(2)}, str(cut / "model.safetensors"))
    (cut / "rng_state_0.json").write_text("{}")
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        source.open_source(str(cut), load_module_only=True)
    engine = make_engine(stage=1)
    train(engine, 0, 1)
    path = engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    engine.close()
    index_path = os.path.join(path, "optimizer.safetensors.index.json")
    index = json.load(open(index_path))
    index["metadata"] = None
    with open(index_path, "w") as handle:
        json.dump(index, handle)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    manifest["files"]["optimizer.safetensors.index.json"]["size"] = os.path.getsize(index_path)
    with open(os.path.join(path, "manifest.json"), "w") as handle:
        json.dump(manifest, handle)
    assert source.open_source(path, load_module_only=False).optimizer_meta == {}


def test_a_checkpoint_state_with_only_its_required_fields_saves_and_resumes_exactly(tmp_path, world_of_one, caplog):
    """checkpoint/slots.py: `CheckpointState`'s optional fields (`files`, `gradients_pending`, `aliases`) are
    optional: a view building it from the required ones only (as a custom engine's would) saves at a step's
    end with no mid-accumulation warning and no extra files, and a fresh engine viewed alike resumes exactly."""
    from dataclasses import MISSING, fields

    from zerotrain.checkpoint import CheckpointState

    def required_only(state: CheckpointState) -> CheckpointState:
        return CheckpointState(**{f.name: getattr(state, f.name) for f in fields(CheckpointState)
                                  if f.default is MISSING and f.default_factory is MISSING})

    save_dir = str(tmp_path / "ckpt")
    engine = make_engine(stage=2)
    engine.view_checkpoint_state(required_only)
    engine.add_checkpoint_files({"extra.txt": b"not through the view"})  # the engine's files: the view drops them
    train(engine, 0, 2)
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        path = engine.save_checkpoint(save_dir, tag="t")
    assert not [record.getMessage() for record in caplog.records]
    assert "extra.txt" not in os.listdir(path)
    at_save = snapshot(engine)
    fresh = make_engine(stage=1, seed=9)
    fresh.view_checkpoint_state(required_only)
    assert fresh.load_checkpoint(save_dir)[0] == path
    _assert_same(snapshot(fresh), at_save, "resumed through the view")
    engine.close()
    fresh.close()


def test_the_next_save_raises_a_pending_failure_and_a_refused_save_writes_nothing(tmp_path, world_of_one,
                                                                                 monkeypatch):
    """checkpoint/checkpointer.py: a save first waits for the pending background one and raises its failure (the
    new save is not written); a save whose state cannot be taken (a client_state that is not JSON) is one line
    without a rank at a world of one, writes nothing, and the next save and its resume work."""
    from zerotrain.checkpoint import CheckpointError

    save_dir = str(tmp_path / "ckpt")
    engine = make_engine(stage=2, async_save=True)
    train(engine, 0, 1)
    _fail_writes(monkeypatch, OSError("disk on fire (injected)"))
    engine.save_checkpoint(save_dir, tag="a")
    _join_writers()  # failed in the background (the patch is undone only after it ran)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"^saving checkpoint \S+a failed on rank 0: OSError: disk on fire"):
        engine.save_checkpoint(save_dir, tag="b")
    assert engine.last_save()[0] is False and sorted(os.listdir(save_dir)) == [LOCK]
    with pytest.raises(CheckpointError) as caught:
        engine.save_checkpoint(save_dir, tag="c", client_state={"sampler": object()})
    assert str(caught.value).startswith("cannot save checkpoint c: client_state['sampler']"), str(caught.value)
    assert engine.last_save()[0] is False and sorted(os.listdir(save_dir)) == [LOCK]
    train(engine, 1, 1)
    at_save = snapshot(engine)
    path = engine.save_checkpoint(save_dir, tag="d", client_state={"epoch": 1})
    engine.wait_checkpoint()
    fresh = make_engine(stage=2, seed=9)
    assert fresh.load_checkpoint(save_dir) == (path, {"epoch": 1})
    _assert_same(snapshot(fresh), at_save, "after the failures")
    engine.close()
    fresh.close()


def test_a_deepspeed_checkpoint_loads_through_a_temporary_import_that_is_removed(tmp_path, world_of_one, caplog):
    """checkpoint/load.py's DeepSpeed path at a world of one: a save exported as DeepSpeed's world-2 layout loads
    into a fresh engine exactly (the change of world size logged) (the path returned is DeepSpeed's tag directory, the client state DeepSpeed's); the
    converted copy beside it is gone afterwards; a DeepSpeed checkpoint that cannot be read is one line naming it,
    the engine untouched and nothing left beside it either."""
    pytest.importorskip("deepspeed")
    from zerotrain.checkpoint import CheckpointError, export_deepspeed

    engine = make_engine(stage=2)
    train(engine, 0, 2)
    saved = engine.save_checkpoint(str(tmp_path / "zt"), client_state={"epoch": 2})
    at_save = snapshot(engine)
    engine.close()
    ds = tmp_path / "ds"
    out = export_deepspeed(saved, str(ds), world_size=2)  # as a world-2 DeepSpeed job would resume it
    fresh = make_engine(stage=2, seed=9)
    before = snapshot(fresh)
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        assert fresh.load_checkpoint(str(ds)) == (out, {"epoch": 2})
    assert any(re.fullmatch(r"checkpoint \S+ was written by 2 ranks, loaded on 1: ranks without a saved RNG state "
                            r"keep their own", record.getMessage()) for record in caplog.records), caplog.records
    assert sorted(os.listdir(ds)) == ["global_step2", "latest"]  # the import's temporary directory removed
    _assert_same(snapshot(fresh), at_save, "imported from DeepSpeed")
    broken = tmp_path / "broken"
    os.makedirs(broken / "global_step2")
    for name in os.listdir(out):  # the model states without their optimizer files
        if name.endswith("model_states.pt"):
            os.link(os.path.join(out, name), broken / "global_step2" / name)
    (broken / "latest").write_text("global_step2")
    other = make_engine(stage=2, seed=9)
    with pytest.raises(CheckpointError, match=f"^cannot import DeepSpeed checkpoint {broken / 'global_step2'}: "):
        other.load_checkpoint(str(broken))
    assert sorted(os.listdir(broken)) == ["global_step2", "latest"]
    _assert_same(snapshot(other), before, "a refused import")
    fresh.close()
    other.close()


def test_a_resume_continues_the_random_streams_where_the_save_left_them(tmp_path, world_of_one):
    """checkpoint/write.py writes each rank's RNG state, load.py restores it: after a resume, python's, numpy's
    and torch's generators give what they gave right after the save."""
    import random

    import numpy as np

    engine = make_engine(stage=1)
    train(engine, 0, 1)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    want = (random.random(), float(np.random.rand()), torch.rand(3))
    fresh = make_engine(stage=1, seed=9)  # seeds torch again; python's and numpy's streams moved on above
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2]), (got, want)
    engine.close()
    fresh.close()


def test_load_checkpoint_called_with_its_defaults_restores_optimizer_and_schedule(tmp_path, world_of_one):
    """`zerotrain.checkpoint.load_checkpoint(state, load_dir)` (the public function, DeepSpeed's defaults:
    optimizer and scheduler states loaded, not the module only) restores everything the engine's method does."""
    from zerotrain.checkpoint import load_checkpoint

    engine = make_engine(stage=2)
    train(engine, 0, 2)
    path = engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 1})
    at_save = snapshot(engine)
    fresh = make_engine(stage=2, seed=9)
    untouched = snapshot(fresh)
    os.makedirs(tmp_path / "empty")  # nothing to resume: (None, None), as DeepSpeed's, and nothing changed
    assert load_checkpoint(fresh.checkpoint_state(), str(tmp_path / "empty")) == (None, None)
    _assert_same(snapshot(fresh), untouched, "nothing loaded")
    assert load_checkpoint(fresh.checkpoint_state(), str(tmp_path / "ckpt")) == (path, {"epoch": 1})
    _assert_same(snapshot(fresh), at_save, "loaded with the defaults")
    engine.close()
    fresh.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_an_adapters_only_checkpoint_restores_the_trained_parameters_and_leaves_the_frozen_ones(tmp_path,
                                                                                              world_of_one, stage):
    """checkpoint.adapters_only at a world of one (load.py reads the saved trainer state's flag): the save holds
    the trainable parameters and their states only; a fresh engine (other initial weights) loading it gets those
    exactly and keeps its own frozen layer and buffer, as a LoRA run keeps the base it loaded from its model."""
    engine = make_engine(stage=stage, adapters_only=True)
    train(engine, 0, 2)
    path = engine.save_checkpoint(str(tmp_path / "ckpt"))
    at_save = snapshot(engine)
    fresh = make_engine(stage=stage, seed=9, adapters_only=True)
    own = snapshot(fresh)
    assert fresh.load_checkpoint(str(tmp_path / "ckpt"))[0] == path
    got = snapshot(fresh)
    frozen = {"frozen.weight", "frozen.bias", "shift"}
    for name, tensor in got["module"].items():
        want = own["module"][name] if name in frozen else at_save["module"][name]
        assert torch.equal(tensor, want), name
    assert not torch.equal(own["module"]["frozen.weight"], at_save["module"]["frozen.weight"])  # seeds differ
    for mine, theirs in zip(got["optimizer"], at_save["optimizer"], strict=True):
        assert mine.keys() == theirs.keys() and all(torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(theirs[k]))
                                                    for k in theirs)
    assert got["counters"] == at_save["counters"] and got["scheduler"] == at_save["scheduler"]
    engine.close()
    fresh.close()
def test_a_save_makes_every_file_durable_before_its_directory_is_renamed_and_latest_moves(tmp_path, world_of_one,
                                                                                        monkeypatch):
    """Durability before `latest` moves (#50: the save's fsyncs are batched, so their order is checked here): every
    file of the committed directory, and the staged directory itself, was fsynced before the directory was renamed
    into place; the parent was fsynced after that rename and before `latest` was replaced; the replacing file was
    fsynced before it replaced `latest`, and the parent after. The real calls run (recorded once they return)."""
    save_dir = str(tmp_path / "ckpt")
    engine = make_engine(stage=3)
    train(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="t0")  # a committed checkpoint before: `latest` is replaced, not created
    events, lock = [], threading.Lock()
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        real_fsync(fd)
        with lock:
            events.append(("fsync", path))

    def move(real, kind):
        def wrapped(src, dst, *args, **kwargs):
            real(src, dst, *args, **kwargs)
            with lock:
                events.append((kind, os.path.abspath(src), os.path.abspath(dst)))
        return wrapped

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", move(real_rename, "rename"))
    monkeypatch.setattr(os, "replace", move(real_replace, "replace"))
    train(engine, 1, 1)
    final = engine.save_checkpoint(save_dir, tag="t1")
    monkeypatch.undo()
    parent = os.path.dirname(final)
    latest = os.path.join(parent, "latest")
    committed = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == final)
    staged = events[committed][1]
    synced_before = {e[1] for e in events[:committed] if e[0] == "fsync"}
    names = sorted(os.listdir(final))
    assert "manifest.json" in names and any(n.endswith(".safetensors") for n in names), names
    unsynced = [n for n in names if os.path.join(staged, n) not in synced_before]
    assert not unsynced, f"not fsynced before the commit's rename: {unsynced}"
    assert staged in synced_before, "the staged directory was not fsynced before its rename"
    replaced = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == latest)
    assert committed < replaced
    assert ("fsync", parent) in events[committed + 1:replaced], "the rename into place was not made durable first"
    assert ("fsync", events[replaced][1]) in events[:replaced], "latest's new file was not fsynced before the rename"
    assert ("fsync", parent) in events[replaced + 1:], "the replaced latest was not made durable"
    with open(latest) as handle:
        assert handle.read().strip() == "t1"
