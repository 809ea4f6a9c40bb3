"""Making a checkpoint visible atomically, naming the newest one, and deleting old ones.

A save writes into `<tag>.zerotrain-tmp-<id>` inside the save directory. Once every
file and the manifest are fsynced, one rank renames that directory to `<tag>`,
fsyncs the save directory, and replaces `latest` the same way (temp file, fsync,
rename, fsync the directory). A crash at any point leaves either the old state or the
new one: temporary directories are never loaded and never counted by rotation, and
`latest` only ever names a directory that was complete before it was written.

Rotation (`checkpoint.keep_last`) runs only after a commit, counts only committed
checkpoints (a directory with a zerotrain manifest), orders them by commit time, and
never deletes the one `latest` names; a checkpoint is first renamed out of the way,
so a half-deleted directory can never look committed.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import Callable, Optional

from .format import FORMAT_NAME, LATEST, MANIFEST, OLD_MARK, TMP_MARK, CheckpointError, read_json

logger = logging.getLogger("zerotrain")

# Tests set this to a callable taking an event name, to kill the process at that point of a save.
fault_hook: Optional[Callable[[str], None]] = None


def event(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


def new_save_id() -> str:
    return uuid.uuid4().hex[:12]


def tmp_dir(save_dir: str, tag: str, save_id: str) -> str:
    return os.path.join(save_dir, f"{tag}{TMP_MARK}{save_id}")


def check_tag(tag: str) -> str:
    tag = str(tag)
    if (not tag or tag in (".", "..", LATEST) or os.sep in tag or (os.altsep and os.altsep in tag)
            or TMP_MARK in tag or OLD_MARK in tag):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: it must be a plain directory name "
                              f"(not {LATEST!r}, no path separators, no {TMP_MARK!r})")
    return tag


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Replace `path` with `text` atomically: temp file, fsync, rename, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    temp = os.path.join(directory, f".{os.path.basename(path)}{TMP_MARK}{new_save_id()}")
    with open(temp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    fsync_dir(directory)


def read_latest(save_dir: str) -> Optional[str]:
    path = os.path.join(save_dir, LATEST)
    try:
        with open(path) as handle:
            tag = handle.read().strip()
    except FileNotFoundError:
        return None
    return tag or None


def _remove(path: str) -> None:
    """Rename aside (atomic), then delete the contents."""
    doomed = f"{path}{OLD_MARK}{new_save_id()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def commit_directory(temp: str, final: str) -> None:
    """Rename the finished `temp` directory to `final` (replacing an older `final`) and fsync the parent."""
    parent = os.path.dirname(os.path.abspath(final))
    fsync_dir(temp)
    old = None
    if os.path.exists(final):
        old = f"{final}{OLD_MARK}{new_save_id()}"
        os.rename(final, old)
    os.rename(temp, final)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_committed(path: str) -> bool:
    name = os.path.basename(os.path.normpath(path))
    if TMP_MARK in name or OLD_MARK in name or not os.path.isdir(path):
        return False
    try:
        return read_json(os.path.join(path, MANIFEST)).get("format") == FORMAT_NAME
    except CheckpointError:
        return False


def committed_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """(commit time in ns, tag) of every committed checkpoint in `save_dir`, oldest first."""
    found = []
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if is_committed(path):
            manifest = read_json(os.path.join(path, MANIFEST))
            found.append((int(manifest.get("committed_at_ns", 0)), name))
    return sorted(found)


def rotate(save_dir: str, keep_last: Optional[int], just_committed: str) -> list[str]:
    """Delete committed checkpoints beyond the newest `keep_last`; returns the deleted tags."""
    if not keep_last:
        return []
    protected = {just_committed, read_latest(save_dir)}
    committed = [tag for _, tag in committed_checkpoints(save_dir)]
    doomed = [tag for tag in committed[:-keep_last] if tag not in protected]
    for tag in doomed:
        try:
            _remove(os.path.join(save_dir, tag))
        except OSError as error:
            logger.warning("checkpoint rotation could not delete %s: %s", tag, error)
    return doomed


def remove_stale(save_dir: str, keep: str) -> None:
    """Delete leftovers of interrupted saves and replacements (temporary directories other than `keep`)."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if (TMP_MARK in name or OLD_MARK in name) and os.path.abspath(path) != os.path.abspath(keep):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except OSError:
                    pass
