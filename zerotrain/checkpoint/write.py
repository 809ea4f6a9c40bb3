"""One save, executed: write pieces in place, agree, commit.

A `SaveJob` runs on every rank, inline (synchronous save) or in the checkpointer's
background thread (asynchronous save). All its collectives go through the
checkpointer's own gloo group, never the training group, so a background job and
the training step do not interfere. The steps:

1. all-gather a small header: rank 0's save id (naming the temporary directory) and
   every rank's scalar optimizer states;
2. tensor-parallel (and expert-parallel) split tensors only: for each round of the
   plan, one all-to-all of raw bytes carries every piece to the rank that writes the
   tensor, which joins the whole tensor from its slices (`split`) and writes it at its
   place;
3. every other byte is written in place by the rank that holds it, with no exchange: each
   file's header, hence every tensor's offset, follows from the plan (`format.FileLayout`),
   so every rank `pwrite`s its own pieces of every tensor at their offsets in the shared
   files (`directio.PlacedWriter`: whole blocks O_DIRECT, the partial blocks two ranks
   share through the page cache), a file's writer adds its header, the optimizer scalars
   and the tensors that are whole on every rank; the crc32 of each run is computed as it
   is written. Each rank first writes its small files: its RNG state (and its LoCo error
   buffers); rank 0 the indexes, trainer_state.json and the Hugging Face config. It fsyncs
   every file it wrote to, the small ones with them, in one batch (`PlacedWriter.close(also=...)`:
   all in flight at once, one journal commit rather than one per file);
4. all-gather each rank's outcome, small files and runs. A rank that failed keeps taking
   part in every collective (sending zeros) so that nobody waits for it; if any rank
   failed, every rank raises the same error and the temporary directory is removed;
5. rank 0 joins the runs of each file into its crc32 (`integrity.join_runs`:
   `crc32_combine`, and the runs must cover the file exactly once), restores any checkpoint
   whose re-save was interrupted (`commit.recover_replaced`), writes the manifest, fsyncs it with
   the directory and `latest`'s new file at once, renames the directory into place, replaces
   `latest`, rotates old checkpoints; its outcome is
   all-gathered so every rank agrees whether the checkpoint committed.

Durability is as before the in-place writes: every byte is fsynced by the rank that wrote it
before that rank reports success (step 4), and the manifest is written only after every rank did.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
from dataclasses import dataclass, field

import torch

from . import commit
from .directio import PlacedWriter
from .format import (MASTER, MODEL, OPTIMIZER, TRAINER_STATE, CheckpointError, FileLayout, as_bytes, crc32,
                     index_file, itemsize, rng_file, write_json)
from .integrity import crc32_combine, join_runs, manifest_entry, write_manifest
from .loco import loco_file, write_loco
from .plan import SavePlan
from .split import assemble_whole
from .snapshot import Sources

logger = logging.getLogger("zerotrain")

_FILE_KIND = {"model": MODEL, "master": MASTER}


@dataclass
class SaveJob:
    plan: SavePlan
    sources: Sources
    comm: object                     # the checkpointer's Comm (gloo)
    save_dir: str
    tag: str
    save_latest: bool
    keep_last: int | None
    trainer_state: dict              # rank 0's, JSON-ready
    rng_state: dict                  # this rank's, JSON-ready
    extra_files: dict = field(default_factory=dict)   # rank 0: {file name: JSON payload, or bytes as they are}
    optimizer_meta: dict = field(default_factory=dict)  # rank 0: optimizer type and group hyperparameters
    loco_state: dict | None = None   # this rank's LoCo error buffers (None: LoCo is off)

    def run(self) -> str:
        rank = self.comm.rank
        self._scratch: dict[str, torch.Tensor] = {}  # the exchange's send and receive bytes, reused by every round
        header = self.comm.all_gather_object({"save_id": commit.new_save_id() if rank == 0 else None,
                                              "scalars": self.sources.scalars})
        self._scalars = [entry["scalars"] for entry in header]
        self._save_id = header[0]["save_id"]
        final = os.path.join(self.save_dir, self.tag)
        staged = commit.StagedDirectory(final, self._save_id, create=False)  # made below, its failure agreed
        temp = staged.path
        error: BaseException | None = self.sources.error  # a failed deferred snapshot copy
        written: dict[str, dict] = {}
        runs: list[tuple] = []
        self._out: PlacedWriter | None = None
        try:
            os.makedirs(temp, exist_ok=True)
            self._temp = temp
            self._layouts = {spec.name: FileLayout.of(spec.entries, {"zerotrain": spec.kind}) for spec in self.plan.files}
            self._file_of = {(spec.kind, key): spec.name for spec in self.plan.files for key, _, _ in spec.entries}
            self._out = PlacedWriter(crc32, crc32_combine)
        except Exception as caught:  # noqa: BLE001 - reported to every rank below
            error = caught
        for index in range(len(self.plan.rounds)):  # split tensors only: the others need no exchange
            received, failed = self._exchange(index, ok=error is None)
            error = error or failed
            if error is None and received is not None:
                try:
                    self._write_round(index, received)
                    commit.event("round-written")
                except Exception as caught:  # noqa: BLE001
                    error = caught
        if error is None:
            try:
                # the small files first, not fsynced: their fsyncs go in the data files' one batch (`close`)
                self._write_small_files(temp, written)
                self._write_in_place()
                runs, self._out = self._out.close(also=[os.path.join(temp, name) for name in written]), None
                commit.event("files-written")
            except Exception as caught:  # noqa: BLE001
                error = caught
        if self._out is not None:
            self._out.abort()
        error = out_of_space(error, temp, self._needed_bytes())

        status = self.comm.all_gather_object({"error": describe_error(error), "files": written,
                                              "runs": [(os.path.basename(path), offset, length, crc)
                                                       for path, offset, length, crc in runs]})
        failures = [(r, entry["error"]) for r, entry in enumerate(status) if entry["error"]]
        if failures:
            if rank == 0:
                staged.discard()
            failed_rank, message = failures[0]
            raise CheckpointError(f"saving checkpoint {final} failed on rank {failed_rank}: {message}") from error

        outcome = None
        if rank == 0:
            files = {name: entry for s in status for name, entry in s["files"].items()}
            outcome = self._commit(staged, files, [run for s in status for run in s["runs"]])
        outcome = self.comm.all_gather_object(outcome)[0]
        if outcome:
            raise CheckpointError(f"committing checkpoint {final} failed on rank 0: {outcome}")
        return final

    def _needed_bytes(self) -> int:
        """About what the whole checkpoint takes on disk: its tensors (the small JSON files aside)."""
        return sum(self.plan.total_size(kind) for kind in {spec.kind for spec in self.plan.files})

    # --- exchange (split tensors) and in-place writes ---------------------------------------------
    def _exchange(self, index: int, ok: bool) -> tuple[dict | None, BaseException | None]:
        """Send this rank's pieces of round `index`'s split tensors to their writers.

        Returns ({(kind, piece): bytes received} (None when the round exchanges nothing: no split tensor),
        the error if this rank could not pack its pieces: it then sends zeros, so that the collective
        completes and the save fails everywhere).
        """
        rank, world = self.comm.rank, self.comm.size
        splits = self.plan.splits[index]
        if not any(self.plan.tensors[name].pieces and not self.plan.tensors[name].in_place
                   for names in self.plan.rounds[index].values() for name in names):
            return None, None
        if world == 1 or all(splits[s][r] == 0 for s in range(world) for r in range(world) if s != r):
            return {}, None
        input_splits = [0 if r == rank else splits[rank][r] for r in range(world)]
        output_splits = [0 if s == rank else splits[s][rank] for s in range(world)]
        chunks, failed = [], None
        if ok:
            try:
                for receiver in range(world):
                    if receiver != rank:
                        chunks += [self.sources.piece(piece, kind)
                                   for _, kind, piece, _ in self.plan.transfers(index, rank, receiver)]
                packed = sum(chunk.numel() for chunk in chunks)
                send = self._buffer("send", packed)
                if chunks:
                    torch.cat(chunks, out=send)
                if send.numel() != sum(input_splits):
                    raise CheckpointError(f"round {index}: packed {send.numel()} bytes, the plan says "
                                          f"{sum(input_splits)}")
            except Exception as caught:  # noqa: BLE001 - reported to every rank after the writes
                failed = caught
        if not ok or failed is not None:
            send = self._buffer("send", sum(input_splits)).zero_()
        received = self._buffer("receive", sum(output_splits))
        self.comm.all_to_all_bytes(received, send, output_splits, input_splits)
        pieces, offset = {}, 0
        for sender in range(world):
            if sender == rank:
                continue
            for _, kind, piece, nbytes in self.plan.transfers(index, sender, rank):
                pieces[(kind, piece)] = received[offset:offset + nbytes]
                offset += nbytes
        return pieces, failed

    def _buffer(self, which: str, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of this save's `which` exchange buffer, grown when a round needs more: memory is
        faulted in once per save, not once per round (a round's received pieces are written, copied into the
        writer's buffers, before the next round reuses it)."""
        buffer = self._scratch.get(which)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._scratch[which] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes]

    def _place(self, kind: str, key: str, skip: int, chunks: list) -> None:
        """Write `chunks` at byte `skip` of `key`'s data in its file (kind MODEL, MASTER or OPTIMIZER)."""
        name = self._file_of[(kind, key)]
        layout = self._layouts[name]
        offset, nbytes = layout.places[key]
        path = os.path.join(self._temp, name)
        self._out.open(path, layout.size)
        self._out.begin(path, offset + skip)
        written = 0
        for chunk in chunks:
            data = as_bytes(chunk) if torch.is_tensor(chunk) else memoryview(chunk)
            written += len(data)
            if skip + written > nbytes:
                raise CheckpointError(f"{path}: tensor {key!r} got more than its {nbytes} bytes")
            self._out.write(data)

    def _keyed(self, tensor, kind: str) -> tuple[str, str]:
        """(file kind, key) of one per-element tensor of `tensor` (source kind `kind`)."""
        if kind.startswith("state:"):
            return OPTIMIZER, f"{tensor.name}/{kind[len('state:'):]}"
        file_kind = _FILE_KIND[kind]
        return file_kind, tensor.model_key if file_kind == MODEL else tensor.name

    def _write_round(self, index: int, received: dict) -> None:
        """The split tensors this rank writes in round `index`, each joined whole from its slices."""
        rank = self.comm.rank
        for name in self.plan.rounds[index].get(rank, []):
            tensor = self.plan.tensors[name]
            if not tensor.pieces or tensor.in_place:
                continue
            for kind, dtype in tensor.kinds(self.plan.master_separate):
                chunks = [self.sources.piece(p, kind) if p.rank == rank else received[(kind, p)]
                          for p in tensor.pieces]
                whole = assemble_whole(tensor.shape, tensor.slices, tensor.pieces, chunks, dtype)
                self._place(*self._keyed(tensor, kind), 0, [whole])

    def _write_in_place(self) -> None:
        """Every byte this rank writes outside the exchange, at its place: the headers of the files it is
        the writer of, its own pieces of every in-place tensor, the scalars and whole tensors of the names
        it writes. File after file, in file order (one sequential pass over each file's share)."""
        rank = self.comm.rank
        todo: dict[str, list] = {spec.name: [] for spec in self.plan.files}  # file -> [(offset, key..., chunks)]

        def add(kind: str, key: str, skip: int, chunks: list) -> None:
            name = self._file_of[(kind, key)]
            todo[name].append((self._layouts[name].places[key][0] + skip, kind, key, skip, chunks))

        for tensor in self.plan.tensors.values():
            if not tensor.pieces:  # whole on every rank: its writer's
                if tensor.writer == rank:
                    add(MODEL, tensor.model_key, 0, [self.sources.extras[tensor.name]])
                continue
            if tensor.in_place:
                for kind, dtype in tensor.kinds(self.plan.master_separate):
                    size = itemsize(dtype)
                    for piece in tensor.pieces:
                        if piece.rank == rank:
                            add(*self._keyed(tensor, kind), piece.param_start * size,
                                [self.sources.piece(piece, kind)])
            if tensor.writer == rank and tensor.trainable:
                first = tensor.pieces[0]
                for key, dtype in sorted(tensor.scalars.items()):
                    value = self._scalars[first.rank][first.slot][key]
                    add(OPTIMIZER, f"{tensor.name}/{key}", 0, [torch.tensor(value, dtype=dtype).reshape(1)])
        for spec in self.plan.files:
            path = os.path.join(self._temp, spec.name)
            if spec.writer == rank:
                self._out.open(path, self._layouts[spec.name].size)
                self._out.begin(path, 0)
                self._out.write(self._layouts[spec.name].header)
            for _, kind, key, skip, chunks in sorted(todo[spec.name], key=lambda item: item[0]):
                self._place(kind, key, skip, chunks)
            commit.event("round-written")
        self._out.end()

    def _write_small_files(self, temp: str, written: dict) -> None:
        """This rank's JSON files (RNG state; rank 0: indexes, trainer state, extra files), not fsynced (the
        caller fsyncs every name put in `written`), and its LoCo buffers (fsynced by `write_loco`)."""
        def put(name: str, payload) -> None:
            size, crc = write_json(os.path.join(temp, name), payload, fsync=False)
            written[name] = manifest_entry(size, crc)

        put(rng_file(self.comm.rank), self.rng_state)
        if self.loco_state is not None:
            name = loco_file(self.comm.rank)
            written[name] = write_loco(os.path.join(temp, name), self.loco_state)
        if self.comm.rank != 0:
            return
        kinds = (MODEL, MASTER, OPTIMIZER) if self.plan.master_files else (MODEL, OPTIMIZER)
        for kind in kinds:
            metadata = {"total_size": self.plan.total_size(kind), "zerotrain": kind}
            if kind == OPTIMIZER:
                metadata.update(self.optimizer_meta)
            put(index_file(kind), {"metadata": metadata, "weight_map": self.plan.weight_map(kind)})
        for name, payload in self.extra_files.items():
            put(name, payload)
        put(TRAINER_STATE, self.trainer_state)

    # --- commit (rank 0) -----------------------------------------------------------------------
    def _commit(self, staged: "commit.StagedDirectory", files: dict, runs: list) -> str | None:
        temp, final = staged.path, os.path.join(self.save_dir, self.tag)
        try:
            sizes = {spec.name: self._layouts[spec.name].size for spec in self.plan.files}
            files.update({name: manifest_entry(sizes[name], crc) for name, crc in join_runs(temp, sizes, runs).items()})
            commit.recover_replaced(self.save_dir)  # an interrupted re-save of some tag: restore it first
            manifest = write_manifest(temp, files, {"tag": self.tag, "save_id": self._save_id,
                                                    "global_steps": self.trainer_state["global_steps"],
                                                    "world_size": self.comm.size}, fsync=False)
            commit.event("manifest-written")
            staged.commit(latest=self.save_latest, also=[manifest])  # fsynced with the directory, then renamed
        except Exception as error:  # noqa: BLE001 - every rank must learn it
            staged.discard()  # not committed: the partial directory goes, the previous checkpoint stays
            return describe_error(out_of_space(error, temp, self._needed_bytes()))
        try:
            deleted = commit.rotate(self.save_dir, self.keep_last, self.tag)
            if deleted:
                logger.info("checkpoint rotation (keep_last=%s) deleted %s", self.keep_last, deleted)
            commit.remove_stale(self.save_dir, keep=final)
        except Exception as error:  # noqa: BLE001 - the checkpoint is committed; cleanup can wait
            logger.warning("checkpoint %s committed, but cleaning up old checkpoints failed: %s", final, error)
        return None


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def out_of_space(error: BaseException | None, temp: str, needed: int) -> BaseException | None:
    """`error` as a CheckpointError naming the path and the bytes needed when the disk (or quota, or the
    file size limit) ran out; any other error unchanged."""
    cause = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in _NO_SPACE):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return error
    directory = os.path.dirname(temp)
    try:
        free = f"{shutil.disk_usage(directory).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    where = cause.filename or directory
    reason = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
              errno.EFBIG: "file too large for the file system or the process's file size limit"}[cause.errno]
    wrapped = CheckpointError(f"{reason} writing {where}: the checkpoint needs about {needed:,} bytes in "
                              f"{directory} ({free}); its partial directory is removed, the previous checkpoint "
                              f"is untouched")
    wrapped.__cause__ = error
    return wrapped


def describe_error(error: BaseException | None) -> str | None:
    if error is None:
        return None
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
