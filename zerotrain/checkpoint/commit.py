"""Making a checkpoint visible atomically, naming the newest one, and deleting old ones.

A save writes into `<tag>.zerotrain-tmp-<id>` inside the save directory. Once every
file and the manifest are fsynced, one rank renames that directory to `<tag>`,
fsyncs the save directory, and replaces `latest` the same way (temp file, fsync,
rename, fsync the directory). A crash at any point leaves either the old state or the
new one: temporary directories are never loaded and never counted by rotation, and
`latest` only ever names a directory that was complete before it was written.

Saving again under an existing tag cannot be one rename (a directory is not replaced
by rename), so the committed `<tag>` is first moved aside to
`<tag>.zerotrain-replaced-<id>`, then the new one is renamed in. A crash between the
two renames leaves no `<tag>`; `recover_replaced`, run by every load (before `latest`
is resolved) and by every save (before it commits), renames the intact replaced copy
back, so `latest` always names a loadable, verified checkpoint.

Rotation (`checkpoint.keep_last`) runs only after a commit, counts only committed
checkpoints (a directory with a zerotrain manifest), orders them by commit time, and
never deletes the one `latest` names. A directory being deleted is first renamed to
`<name>.zerotrain-old-<id>` and loses its manifest before anything else, so a
half-deleted directory never looks committed and is never recovered.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import Callable, Iterable, Optional

from .directio import fsync_all
from .format import (FORMAT_NAME, LATEST, MANIFEST, OLD_MARK, REPLACED_MARK, TMP_MARK, CheckpointError,
                     is_side_name, read_json)

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
            or is_side_name(tag)):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: it must be a plain directory name "
                              f"(not {LATEST!r}, no path separators, no {TMP_MARK!r}, {REPLACED_MARK!r} "
                              f"or {OLD_MARK!r})")
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


def _delete_tree(path: str) -> None:
    """Delete a directory already renamed aside: its manifest first, so a partial delete never looks committed."""
    try:
        os.remove(os.path.join(path, MANIFEST))
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _remove(path: str) -> None:
    """Rename aside (atomic), then delete the contents."""
    doomed = f"{path}{OLD_MARK}{new_save_id()}"
    os.rename(path, doomed)
    _delete_tree(doomed)


class StagedDirectory:
    """A directory written under a temporary name beside its final place (`path`: `final` + TMP_MARK + save id)
    and put there at once (`commit`: renamed into place, then, with `latest`, the parent's `latest` naming it);
    removed when it fails (`discard`, or the `with` block raising before the commit). The one staged commit of
    every writer: the checkpoint save, the export and import tools, the merge."""

    def __init__(self, final: str, save_id: Optional[str] = None, *, create: bool = True) -> None:
        self.final = os.path.abspath(final)
        self.parent = os.path.dirname(self.final)
        self.save_id = save_id or new_save_id()
        self.path = tmp_dir(self.parent, os.path.basename(self.final), self.save_id)
        if create:
            os.makedirs(self.path, exist_ok=True)

    def commit(self, latest: bool = False, also: Iterable[str] = ()) -> str:
        """Rename the finished directory to `final` (`commit_directory`, which first fsyncs the files `also`
        names, written but not yet fsynced, together with the directory); with `latest`, then replace the
        parent's `latest` with a file naming it (atomically: its temporary file written and fsynced in that
        same batch, renamed over `latest` after the directory's rename is durable, the parent fsynced).
        Returns `final`."""
        pending = None
        if latest:
            pending = os.path.join(self.parent, f".{LATEST}{TMP_MARK}{self.save_id}")
            with open(pending, "w") as handle:
                handle.write(os.path.basename(self.final))
            also = [*also, pending]
        try:
            commit_directory(self.path, self.final, also)
            event("committed")
            if pending is not None:
                os.replace(pending, os.path.join(self.parent, LATEST))
                pending = None
                fsync_dir(self.parent)
                event("latest-written")
        finally:
            if pending is not None:  # not renamed over `latest`: it goes
                try:
                    os.remove(pending)
                except OSError:
                    pass
        return self.final

    def discard(self) -> None:
        """Remove the staged directory (nothing once committed)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "StagedDirectory":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.discard()
        return False


def commit_directory(temp: str, final: str, also: Iterable[str] = ()) -> None:
    """Rename the finished `temp` directory to `final` (replacing an older `final`) and fsync the parent.

    First `temp` itself and the files `also` names (written, not yet fsynced: the manifest) are fsynced
    at once (`directio.fsync_all`: one journal commit for all of them). An older `final` is moved aside to
    a `REPLACED_MARK` name first; a crash before the second rename is undone by `recover_replaced`.
    """
    parent = os.path.dirname(os.path.abspath(final))
    fsync_all([*also, temp])
    replaced = None
    if os.path.exists(final):
        replaced = f"{final}{REPLACED_MARK}{new_save_id()}"
        os.rename(final, replaced)
        fsync_dir(parent)
        event("replaced-aside")
    os.rename(temp, final)
    fsync_dir(parent)
    if replaced is not None:
        doomed = f"{final}{OLD_MARK}{new_save_id()}"
        os.rename(replaced, doomed)  # from here on it is garbage, never a recovery candidate
        _delete_tree(doomed)


def _intact(path: str) -> Optional[int]:
    """The commit time of a checkpoint directory whose manifest and every listed file (by size) are present."""
    try:
        manifest = read_json(os.path.join(path, MANIFEST))
        if manifest.get("format") != FORMAT_NAME:
            return None
        for name, entry in manifest.get("files", {}).items():
            if os.path.getsize(os.path.join(path, name)) != int(entry["size"]):
                return None
        return int(manifest.get("committed_at_ns", 0))
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return None


def recover_replaced(save_dir: str) -> list[str]:
    """Rename back every intact replaced checkpoint whose tag directory is missing; returns the tags recovered.

    Safe to run on every rank at once: each rename is atomic and only one succeeds.
    """
    candidates: dict[str, list[tuple[int, str]]] = {}
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return []
    for name in names:
        if REPLACED_MARK not in name or TMP_MARK in name or OLD_MARK in name:
            continue
        tag = name.split(REPLACED_MARK)[0]
        path = os.path.join(save_dir, name)
        if tag and not os.path.exists(os.path.join(save_dir, tag)):
            committed_at = _intact(path)
            if committed_at is not None:
                candidates.setdefault(tag, []).append((committed_at, path))
    recovered = []
    for tag, found in sorted(candidates.items()):
        _, path = max(found)
        final = os.path.join(save_dir, tag)
        try:
            os.rename(path, final)
        except OSError:
            if not os.path.isdir(final):  # another rank recovering at the same time wins the race
                raise
            continue
        fsync_dir(save_dir)
        logger.warning("checkpoint %s: a save replacing it was interrupted; the previous copy was restored", final)
        recovered.append(tag)
    return recovered


def is_committed(path: str) -> bool:
    name = os.path.basename(os.path.normpath(path))
    if is_side_name(name) or not os.path.isdir(path):
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
    """Delete leftovers of interrupted saves, replacements and deletions (side directories other than `keep`)."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if is_side_name(name) and os.path.abspath(path) != os.path.abspath(keep):
            if REPLACED_MARK in name and not os.path.exists(os.path.join(save_dir, name.split(REPLACED_MARK)[0])):
                continue  # the only copy of its tag: left for recover_replaced
            if os.path.isdir(path):
                _delete_tree(path)
            else:
                try:
                    os.remove(path)
                except OSError:
                    pass
