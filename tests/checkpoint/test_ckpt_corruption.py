"""A damaged checkpoint is refused with an error naming the file or tensor, and nothing is loaded: into a fresh
engine (a resume before the first step: the states read straight into new tensors with their crc32, dropped when
the verdict refuses), a trained one with room for a second copy of its states (read the same way, swapped in only
after the verdict) and a trained one without that room (`load_copy_bytes` 0: its states written in place after
the verdict)."""
from __future__ import annotations

import dataclasses
import functools
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

    from zerotrain.checkpoint import CheckpointError, load

    engine = make_engine(stage=2)
    train(engine, 0, 2)
    good = engine.save_checkpoint(os.path.join(root, "saved"), tag="good")
    saved = (engine.full_state_dict(), optimizer_state(engine))
    train(engine, 2, 1)  # the engine moves on: a load that touched anything would show
    # another checkpoint of other weights beside it (not `latest`): what a rank asking for another tag resolves
    engine.save_checkpoint(os.path.join(root, "saved"), tag="other", save_latest=False)
    # a resume before the first step (nothing trained: the optimizer has no state yet), the same damage
    fresh = make_engine(stage=2, seed=5)
    targets = damage(root, good) if int(os.environ["RANK"]) == 0 else None
    holder = [targets]
    dist.broadcast_object_list(holder, src=0)
    # ranks that resolve different checkpoints: refused as such everywhere, never judged as one damaged checkpoint
    holder[0]["different_tags"] = (os.path.join(root, "saved"), "good" if dist.get_rank() == 0 else "other")
    out = {"deleted_file": _file_of(good, "fc2.weight/exp_avg", "optimizer")}
    tight = dataclasses.replace(engine.checkpoint_state(), load_copy_bytes=lambda: 0)  # no room for a second copy
    loaders = {"trained": engine.load_checkpoint, "fresh": fresh.load_checkpoint,
               "tight": functools.partial(load.load_checkpoint, tight)}
    subjects = (("trained", engine, engine.checkpoint_state()), ("fresh", fresh, fresh.checkpoint_state()),
                ("tight", engine, tight))
    for who, subject, state in subjects:
        if who == "tight":
            train(engine, 3, 1)  # moved on again from the good load below
        before = (subject.full_state_dict(), {k: v.clone() for k, v in subject.module.state_dict().items()},
                  optimizer_state(subject), subject.global_steps, subject.get_lr())
        held = [value for states in subject.optimizer.state.values() for value in states.values()
                if torch.is_tensor(value) and value.dim() > 0]  # the objects themselves: no id reused after a free
        errors, leaked = {}, {}
        for case, (load_dir, tag) in holder[0].items():
            open_before = len(os.listdir("/proc/self/fd"))
            try:
                loaders[who](load_dir, tag=tag)
                errors[case] = None
            except CheckpointError as error:
                errors[case] = str(error)
            leaked[case] = len(os.listdir("/proc/self/fd")) - open_before  # a refused load closes its files
        after = (subject.full_state_dict(), dict(subject.module.state_dict()), optimizer_state(subject),
                 subject.global_steps, subject.get_lr())
        out[who] = {"errors": errors, "leaked": leaked, "unchanged": _same(before, after),
                    "no_state": all(not state for state in after[2]), "direct": _direct_reads(state, good)}
        # And the intact checkpoint still loads, exactly: into new state tensors or the optimizer's own.
        loaders[who](os.path.join(root, "saved"))
        out[who]["steps_after_good_load"] = subject.global_steps
        out[who]["exact"] = _same(saved, (subject.full_state_dict(), optimizer_state(subject)))
        now = [value for states in subject.optimizer.state.values() for value in states.values()]
        out[who]["states_kept"] = sum(any(value is old for value in now) for old in held)
    return out


def _direct_reads(state, path: str) -> tuple[int, int]:
    """(reads planned straight into fresh state tensors with their crc32, state reads left for after the verdict)
    of a load of `path` into the engine of CheckpointState `state` as it is now."""
    from zerotrain.checkpoint import load

    source, _ = load.open_checked(path, True, False)
    plan = load.prepare(state, source, set(), True, False)
    plan.files.close()
    return len(plan.direct), sum(len(reads) for slot in plan.slots for reads in (slot.states or {}).values())


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def test_damaged_checkpoints_are_refused_and_nothing_is_loaded(tmp_path):
    outcomes = run_distributed(save_then_try_damaged, 2, str(tmp_path))
    # the fresh engine's states and, with room for a second copy, the trained engine's are read straight into
    # new tensors with their crc32 (none left for after the verdict), dropped when refused, swapped in when
    # accepted; without that room the trained engine's are written in place after the verdict
    for rank, outcome in enumerate(outcomes):
        for who in ("trained", "fresh"):
            assert outcome[who]["direct"][0] > 0 and outcome[who]["direct"][1] == 0, (who, outcome[who])
        assert outcome["tight"]["direct"][0] == 0 and outcome["tight"]["direct"][1] > 0, outcome["tight"]
        assert outcome["fresh"]["no_state"], f"rank {rank}: a refused load left optimizer state in a fresh engine"
        assert outcome["trained"]["states_kept"] == 0, f"rank {rank}: the loaded states were not new tensors"
        assert outcome["tight"]["states_kept"] > 0, f"rank {rank}: a load without room replaced the states"
    results = [dict(outcome[who], deleted_file=outcome["deleted_file"]) for who in ("trained", "fresh", "tight")
               for outcome in outcomes]
    expected = {
        "no_manifest": "has no manifest.json",
        "truncated": "the manifest records",
        "flipped_byte": "checksum mismatch",
        "missing_tensor": "tensor 'fc2.bias' is missing from",
        "wrong_shape": "tensor 'fc2.bias' in",
        "temporary_dir": "temporary directory",
        "latest_names_missing_dir": "names 'global_step999'",
        "deleted_file": "file is missing",
        "different_tags": "ranks resolved different checkpoints in",
    }
    for rank, result in enumerate(results):  # trained rank 0, 1, then fresh rank 0, 1, then tight rank 0, 1
        assert result["unchanged"], f"rank {rank % 2}: a failed load changed the engine"
        assert not any(result["leaked"].values()), f"rank {rank % 2}: descriptors left open {result['leaked']}"
        assert result["steps_after_good_load"] == 2 and result["exact"], rank
        for case, fragment in expected.items():
            message = result["errors"][case]
            assert message is not None and fragment in message, f"rank {rank}, {case}: {message}"
        assert "model-0000" in result["errors"]["truncated"]
        assert "optimizer-0000" in result["errors"]["flipped_byte"]
        deleted = os.path.join(str(tmp_path), "deleted_file", "good", result["deleted_file"])
        assert deleted in result["errors"]["deleted_file"], result["errors"]["deleted_file"]
        assert "expects [3]" in result["errors"]["wrong_shape"] and "[4]" in result["errors"]["wrong_shape"]
        saved = os.path.join(str(tmp_path), "saved")
        assert result["errors"]["different_tags"] == (
            f"ranks resolved different checkpoints in {saved}: {[os.path.join(saved, 'good'), os.path.join(saved, 'other')]}")
    assert all(result["errors"] == results[0]["errors"] for result in results)
