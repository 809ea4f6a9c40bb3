"""A damaged checkpoint is refused with an error naming the file or tensor, and nothing is loaded."""
from __future__ import annotations

import json
import os
import shutil
import zlib

import torch
from safetensors.torch import load_file, save_file

from ckpt_common import make_engine, optimizer_state, train
from distributed import run_distributed

CASES = ["no_manifest", "truncated", "flipped_byte", "missing_tensor", "wrong_shape", "temporary_dir",
         "latest_names_missing_dir", "deleted_file"]


def _restamp(tag_dir: str, name: str) -> None:
    """Make the manifest agree with a rewritten file, so only the tensor-level damage remains."""
    path = os.path.join(tag_dir, "manifest.json")
    manifest = json.load(open(path))
    data = open(os.path.join(tag_dir, name), "rb").read()
    manifest["files"][name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    json.dump(manifest, open(path, "w"))


def _file_of(tag_dir: str, tensor: str, kind: str = "model") -> str:
    return json.load(open(os.path.join(tag_dir, f"{kind}.safetensors.index.json")))["weight_map"][tensor]


def damage(root: str, good: str) -> dict:
    """One damaged copy of `good` per case; returns {case: (load_dir, tag)}."""
    targets = {}
    for case in CASES:
        save_dir = os.path.join(root, case)
        tag_dir = os.path.join(save_dir, "good")
        shutil.copytree(good, tag_dir)
        tag = "good"
        if case == "no_manifest":
            os.remove(os.path.join(tag_dir, "manifest.json"))
        elif case == "truncated":
            path = os.path.join(tag_dir, _file_of(tag_dir, "fc1.weight"))
            os.truncate(path, os.path.getsize(path) - 10)
        elif case == "flipped_byte":
            path = os.path.join(tag_dir, _file_of(tag_dir, "fc1.weight/exp_avg", "optimizer"))
            data = bytearray(open(path, "rb").read())
            data[-5] ^= 0x40
            open(path, "wb").write(bytes(data))
        elif case in ("missing_tensor", "wrong_shape"):
            name = _file_of(tag_dir, "fc2.bias")
            tensors = load_file(os.path.join(tag_dir, name))
            if case == "missing_tensor":
                del tensors["fc2.bias"]
            else:
                tensors["fc2.bias"] = torch.zeros(4)
            save_file(tensors, os.path.join(tag_dir, name), metadata={"format": "pt"})
            _restamp(tag_dir, name)
        elif case == "temporary_dir":
            tag = "good.zerotrain-tmp-0123456789ab"
            os.rename(tag_dir, os.path.join(save_dir, tag))
        elif case == "deleted_file":  # listed in the manifest, gone from the disk
            os.remove(os.path.join(tag_dir, _file_of(tag_dir, "fc2.weight/exp_avg", "optimizer")))
        elif case == "latest_names_missing_dir":
            open(os.path.join(save_dir, "latest"), "w").write("global_step999")
            tag = None
        targets[case] = (save_dir, tag)
    return targets


def save_then_try_damaged(root: str) -> dict:
    import torch.distributed as dist

    from zerotrain.checkpoint import CheckpointError

    engine = make_engine(stage=2)
    train(engine, 0, 2)
    good = engine.save_checkpoint(os.path.join(root, "saved"), tag="good")
    train(engine, 2, 1)  # the engine moves on: a load that touched anything would show
    before = (engine.full_state_dict(), {k: v.clone() for k, v in engine.module.state_dict().items()},
              optimizer_state(engine), engine.global_steps, engine.get_lr())
    targets = damage(root, good) if int(os.environ["RANK"]) == 0 else None
    holder = [targets]
    dist.broadcast_object_list(holder, src=0)
    errors = {}
    for case, (load_dir, tag) in holder[0].items():
        try:
            engine.load_checkpoint(load_dir, tag=tag)
            errors[case] = None
        except CheckpointError as error:
            errors[case] = str(error)
    after = (engine.full_state_dict(), dict(engine.module.state_dict()), optimizer_state(engine),
             engine.global_steps, engine.get_lr())
    same = _same(before, after)
    # And the intact checkpoint still loads.
    engine.load_checkpoint(os.path.join(root, "saved"))
    return {"errors": errors, "unchanged": same, "steps_after_good_load": engine.global_steps,
            "deleted_file": _file_of(good, "fc2.weight/exp_avg", "optimizer")}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def test_damaged_checkpoints_are_refused_and_nothing_is_loaded(tmp_path):
    results = run_distributed(save_then_try_damaged, 2, str(tmp_path))
    expected = {
        "no_manifest": "has no manifest.json",
        "truncated": "the manifest records",
        "flipped_byte": "checksum mismatch",
        "missing_tensor": "tensor 'fc2.bias' is missing from",
        "wrong_shape": "tensor 'fc2.bias' in",
        "temporary_dir": "temporary directory",
        "latest_names_missing_dir": "names 'global_step999'",
        "deleted_file": "file is missing",
    }
    for rank, result in enumerate(results):
        assert result["unchanged"], f"rank {rank}: a failed load changed the engine"
        assert result["steps_after_good_load"] == 2
        for case, fragment in expected.items():
            message = result["errors"][case]
            assert message is not None and fragment in message, f"rank {rank}, {case}: {message}"
        assert "model-0000" in result["errors"]["truncated"]
        assert "optimizer-0000" in result["errors"]["flipped_byte"]
        deleted = os.path.join(str(tmp_path), "deleted_file", "good", result["deleted_file"])
        assert deleted in result["errors"]["deleted_file"], result["errors"]["deleted_file"]
        assert "expects [3]" in result["errors"]["wrong_shape"] and "[4]" in result["errors"]["wrong_shape"]
    assert results[0]["errors"] == results[1]["errors"]  # every rank raises the same error
