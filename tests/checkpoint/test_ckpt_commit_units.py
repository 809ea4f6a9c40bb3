"""checkpoint/commit.py in-process (issue #48, round 4): tag names, the atomic `latest`, the staged directory's
commit and replacement, recovery of an interrupted replacement, rotation by commit time and the leftovers' cleanup.
The crash tests (test_ckpt_crash.py) kill real saves at world 2; these check the same rules in milliseconds."""
from __future__ import annotations

import json
import logging
import os

import pytest

from zerotrain.checkpoint import commit
from zerotrain.checkpoint.format import LATEST, MANIFEST, OLD_MARK, REPLACED_MARK, TMP_MARK, CheckpointError
from zerotrain.checkpoint.integrity import write_manifest


def _checkpoint(path, committed_at_ns: int, files: dict[str, bytes] | None = None) -> str:
    """A committed-looking checkpoint directory at `path`: its files and a manifest listing them by size."""
    os.makedirs(path, exist_ok=True)
    files = files or {"w.bin": b"1234"}
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as handle:
            handle.write(data)
    write_manifest(str(path), {name: {"size": len(data), "crc32": "00000000"} for name, data in files.items()},
                   {"committed_at_ns": committed_at_ns})
    return str(path)


@pytest.mark.parametrize("bad", ["", ".", "..", LATEST, "a/b", f"t1{TMP_MARK}x", f"t1{REPLACED_MARK}x",
                                 f"t1{OLD_MARK}x"])
def test_check_tag_refuses_names_that_are_not_a_plain_checkpoint_directory(bad):
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        commit.check_tag(bad)


def test_check_tag_keeps_a_plain_name_and_spells_numbers_as_text():
    assert commit.check_tag("global_step5") == "global_step5"
    assert commit.check_tag(7) == "7"


def test_atomic_write_text_replaces_the_file_and_leaves_no_temporary_behind(tmp_path):
    path = tmp_path / "latest"
    commit.atomic_write_text(str(path), "t1")
    commit.atomic_write_text(str(path), "t2")
    assert path.read_text() == "t2"
    assert os.listdir(tmp_path) == ["latest"]
    assert commit.read_latest(str(tmp_path)) == "t2"
    path.write_text("\n")  # an empty `latest` names nothing
    assert commit.read_latest(str(tmp_path)) is None
    assert commit.read_latest(str(tmp_path / "missing")) is None


def test_new_save_ids_are_twelve_hex_digits_and_differ():
    ids = {commit.new_save_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 12 and int(i, 16) >= 0 for i in ids)


def test_staged_directory_commits_into_place_writes_latest_and_replaces_an_older_copy(tmp_path):
    staged = commit.StagedDirectory(str(tmp_path / "t1"), "abc")
    assert staged.path == str(tmp_path / f"t1{TMP_MARK}abc") and os.path.isdir(staged.path)
    assert not os.path.exists(tmp_path / "t1")
    (tmp_path / f"t1{TMP_MARK}abc" / "a.txt").write_text("first")
    assert staged.commit() == str(tmp_path / "t1")
    assert (tmp_path / "t1" / "a.txt").read_text() == "first" and commit.read_latest(str(tmp_path)) is None
    # the same tag again: the older copy is replaced, and nothing is left beside it
    again = commit.StagedDirectory(str(tmp_path / "t1"))
    (tmp_path / os.path.basename(again.path) / "b.txt").write_text("second")
    assert again.commit(latest=True) == str(tmp_path / "t1")
    assert os.listdir(tmp_path / "t1") == ["b.txt"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "t1"]
    assert commit.read_latest(str(tmp_path)) == "t1"


def test_staged_directory_without_create_makes_nothing_and_a_failed_block_discards(tmp_path):
    staged = commit.StagedDirectory(str(tmp_path / "t1"), create=False)
    assert not os.path.exists(staged.path) and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with commit.StagedDirectory(str(tmp_path / "t2")) as failing:
            (tmp_path / os.path.basename(failing.path) / "x").write_text("partial")
            raise RuntimeError("writer failed")
    assert os.listdir(tmp_path) == []
    with commit.StagedDirectory(str(tmp_path / "t3")) as fine:  # a block that does not raise keeps its directory
        pass
    assert os.path.isdir(fine.path)


def test_recover_replaced_restores_the_newest_intact_copy_of_a_missing_tag(tmp_path, caplog):
    save_dir = str(tmp_path)
    _checkpoint(tmp_path / f"t1{REPLACED_MARK}old", 100, {"w.bin": b"old"})
    _checkpoint(tmp_path / f"t1{REPLACED_MARK}new", 200, {"w.bin": b"new"})
    broken = _checkpoint(tmp_path / f"t1{REPLACED_MARK}cut", 300, {"w.bin": b"cut"})
    os.truncate(os.path.join(broken, "w.bin"), 1)  # a file shorter than the manifest says: not intact
    _checkpoint(tmp_path / "t2", 50)
    _checkpoint(tmp_path / f"t2{REPLACED_MARK}x", 400)  # t2 exists: its replaced copy is not a candidate
    _checkpoint(tmp_path / f"t3{REPLACED_MARK}x{TMP_MARK}y", 500)  # a temporary: never recovered
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        assert commit.recover_replaced(save_dir) == ["t1"]
    assert (tmp_path / "t1" / "w.bin").read_bytes() == b"new"
    assert any(str(tmp_path / "t1") in record.getMessage() and "restored" in record.getMessage()
               for record in caplog.records)
    assert not os.path.exists(tmp_path / "t3")
    assert os.path.exists(tmp_path / f"t2{REPLACED_MARK}x")
    assert commit.recover_replaced(save_dir) == []  # nothing left to recover
    assert commit.recover_replaced(str(tmp_path / "missing")) == []


def test_recover_replaced_leaves_a_copy_alone_while_anything_holds_its_tag(tmp_path):
    """Only a missing tag is recovered: an empty directory under the tag's name (which a rename would silently
    replace) keeps it, and the intact replaced copy stays where it is."""
    (tmp_path / "t1").mkdir()
    _checkpoint(tmp_path / f"t1{REPLACED_MARK}x", 100)
    assert commit.recover_replaced(str(tmp_path)) == []
    assert os.listdir(tmp_path / "t1") == [] and os.path.isdir(tmp_path / f"t1{REPLACED_MARK}x")


def test_recover_replaced_refuses_a_copy_of_another_format(tmp_path):
    path = tmp_path / f"t1{REPLACED_MARK}x"
    _checkpoint(path, 100)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["format"] = "something-else"
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert commit.recover_replaced(str(tmp_path)) == []


def test_committed_checkpoints_and_rotation_go_by_commit_time_not_by_name(tmp_path):
    save_dir = str(tmp_path)
    for tag, at in (("a", 300), ("b", 100), ("c", 200), ("d", 400)):
        _checkpoint(tmp_path / tag, at)
    _checkpoint(tmp_path / f"e{TMP_MARK}x", 50)
    assert commit.committed_checkpoints(save_dir) == [(100, "b"), (200, "c"), (300, "a"), (400, "d")]
    assert commit.is_committed(str(tmp_path / "a")) and not commit.is_committed(str(tmp_path / f"e{TMP_MARK}x"))
    assert commit.rotate(save_dir, None, just_committed="d") == []
    assert commit.rotate(save_dir, 0, just_committed="d") == []
    assert commit.rotate(save_dir, 2, just_committed="d") == ["b", "c"]
    assert sorted(os.listdir(tmp_path)) == ["a", "d", f"e{TMP_MARK}x"]


def test_remove_stale_deletes_leftovers_but_the_kept_save_and_a_tag_s_only_copy(tmp_path):
    save_dir = str(tmp_path)
    _checkpoint(tmp_path / "t1", 100)
    _checkpoint(tmp_path / f"t1{REPLACED_MARK}x", 50)         # t1 exists: garbage
    _checkpoint(tmp_path / f"t2{REPLACED_MARK}x", 60)         # t2's only copy: kept for recover_replaced
    _checkpoint(tmp_path / f"t3{OLD_MARK}x", 70)              # a deletion cut short
    os.makedirs(tmp_path / f"t4{TMP_MARK}mine")                # this save's own staging directory
    os.makedirs(tmp_path / f"t5{TMP_MARK}crashed")
    (tmp_path / f".latest{TMP_MARK}z").write_text("t1")        # a `latest` never renamed in
    (tmp_path / "notes.txt").write_text("the user's")
    commit.remove_stale(save_dir, keep=str(tmp_path / f"t4{TMP_MARK}mine"))
    assert sorted(os.listdir(tmp_path)) == sorted(["t1", f"t2{REPLACED_MARK}x", f"t4{TMP_MARK}mine", "notes.txt"])


def test_a_failed_commit_with_latest_leaves_latest_alone_and_no_pending_file(tmp_path):
    """`latest`'s new file is written before the directory's rename (fsynced with the directory, #50); when that
    commit fails, `latest` still names the previous checkpoint and the pending file is gone."""
    first = commit.StagedDirectory(str(tmp_path / "t1"))
    first.commit(latest=True)
    second = commit.StagedDirectory(str(tmp_path / "t2"))
    os.rmdir(second.path)  # the staged directory vanished: its fsync fails, naming it
    with pytest.raises(OSError) as raised:
        second.commit(latest=True)
    assert raised.value.filename == second.path
    assert commit.read_latest(str(tmp_path)) == "t1"
    assert sorted(os.listdir(tmp_path)) == ["latest", "t1"]
    third = commit.StagedDirectory(str(tmp_path / "t3"))
    with open(os.path.join(third.path, "w.bin"), "wb") as handle:
        handle.write(b"x")
    third.commit(latest=True, also=[os.path.join(third.path, "w.bin")])
    assert commit.read_latest(str(tmp_path)) == "t3" and sorted(os.listdir(tmp_path)) == ["latest", "t1", "t3"]


def test_fsync_all_syncs_paths_and_descriptors_and_names_a_missing_path(tmp_path):
    from zerotrain.checkpoint.directio import fsync_all
    names = [str(tmp_path / f"f{i}") for i in range(5)]
    for name in names:
        with open(name, "wb") as handle:
            handle.write(b"abc")
    fd = os.open(names[0], os.O_RDONLY)
    try:
        fsync_all([(names[0], fd), *names[1:], str(tmp_path)])
        os.fstat(fd)  # a descriptor handed in stays open: it is the caller's
    finally:
        os.close(fd)
    missing = str(tmp_path / "missing")
    with pytest.raises(OSError) as raised:
        fsync_all([*names, missing])
    assert raised.value.filename == missing
