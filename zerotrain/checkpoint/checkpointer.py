"""The engine's checkpointer: plans saves, snapshots state, runs writers in the background.

Created by the engine's first `save_checkpoint` (on every rank) from the engine's `CheckpointState`
(`slots`); the engine keeps it as `engine.checkpointer`.
It owns a gloo process group of its own (so a background writer never issues a
collective on the training group), the cached save plan, and the reusable host buffers.

Asynchronous saves run in one background thread per rank rather than a process: the
writer spends its time in memcpy, file writes, crc32 and gloo transfers, all of which
release the GIL, so training continues. Measured against a writer process fed the same
snapshot through shared memory (benchmarks/ckpt_process_writer.py, 70M GPT, world 2):
the process stalled training no less (0.02-0.04 s per save, but ~1 s on the first, which
moves fresh buffers into shared memory), slowed the next step as much (it does the same
CPU work on the same cores) and needs a spawned interpreter and a process group of its
own; so a thread (`_write` is where a subclass may move the work).

The save call itself returns after planning: the copy of this rank's slots into the
reused host buffers is the writer's first act, overlapping the next forward and
backward, and `fence()` (called by the next `engine.step()`) holds the optimizer update
until that copy is done; on the 70M GPT the copy is always done by then (fence 0.000 s,
whole stall 0.02-0.03 s; measured: benchmarks/RESULTS_checkpoint.md).
Code outside the engine that writes shards or masters waits on the engine's
`fence.SnapshotFences`, which it was handed. The training stall of an async save is
`last_stall_seconds` (the save call) plus `last_fence_seconds` (the first fence after it).

Errors: a failed background save is raised by the next `engine.step()` (every rank
raises at the same step: while a save is pending, `raise_if_failed` all-reduces one
status number on the training group), by `engine.wait_checkpoint()`, or by the next
save or load, and never swallowed.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..callsite import stacklevel_outside
from .commit import check_tag
from .fence import SnapshotFence
from .format import CheckpointError
from .lock import SaveDirLock
from .loco import capture_loco
from .optim_state import group_hyperparameters
from .plan import MAX_FILE_BYTES, ROUND_BYTES, SavePlan, build_plan, layout_digest, local_layout
from .slots import CheckpointState
from .snapshot import HostBuffers, capture, hf_config_files
from .state import capture_rng, capture_trainer_state
from .write import SaveJob, describe_error

logger = logging.getLogger("zerotrain")

_RUNNING, _DONE, _FAILED = 1, 0, 2


class Checkpointer:
    def __init__(self, state: CheckpointState):
        self.state = state
        self.world = state.world  # training backend, every rank: failure status of a background save
        self.comm = self.world.new_cpu_comm(state.topology.timeout_seconds)
        self.buffers = HostBuffers()
        self._plans: dict = {}
        self.max_file_bytes = MAX_FILE_BYTES  # largest safetensors file a writer starts (plan.build_plan)
        self.round_bytes = ROUND_BYTES        # about how much a writer receives per exchange round
        self.last_plan: Optional[SavePlan] = None  # the plan of the last save
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._result: Optional[str] = None
        self._fence: Optional[SnapshotFence] = None
        self.last_stall_seconds: Optional[float] = None  # how long the last save call blocked training
        # How long the first fence after the last save (normally the next step()) waited for its snapshot
        # copy: 0.0 after a synchronous save, None until an asynchronous save's copy has been fenced.
        self.last_fence_seconds: Optional[float] = None
        self._locks: dict[str, Optional[SaveDirLock]] = {}  # save dirs this job writes to (rank 0 holds the lock)

    # --- saving ----------------------------------------------------------------------------------
    def save(self, save_dir: str, tag: Optional[str], client_state: dict, save_latest: bool,
             async_save: Optional[bool]) -> str:
        """Save on every rank; returns the tag directory (committed, or being written when async)."""
        started = time.perf_counter()
        self.wait()
        state = self.state
        counters = state.counters.state_dict()
        tag = check_tag(tag if tag is not None else f"global_step{counters['global_steps']}")
        settings = state.config.checkpoint
        async_save = settings.async_save if async_save is None else bool(async_save)
        if state.gradients_pending():  # not micro_steps % accumulation: a forced boundary steps a short cycle
            logger.warning("saving checkpoint %s in the middle of a gradient accumulation cycle: accumulated "
                           "gradients are not saved, a resume restarts the cycle", tag)
        slots, plan = self._plan(state, tag)
        self.claim(save_dir)  # after the plan: a save refused while planning writes nothing, not even the lock
        job, error = None, None
        try:  # everything the save needs, taken now; ranks agree that it worked before anything is written
            sources = capture(state, slots, plan, self.comm.rank, self.buffers, copy=async_save,
                              defer=async_save and state.defer_copies)
            rank0 = self.comm.rank == 0
            trainer_state = capture_trainer_state(state, tag, client_state)  # every rank: same errors everywhere
            trainer_state["param_groups"] = plan.param_groups()
            optimizer_meta = {"optimizer": type(state.optimizer).__name__,
                              "param_groups": group_hyperparameters(state.optimizer)}
            job = SaveJob(plan=plan, sources=sources, comm=self.comm, save_dir=os.path.abspath(save_dir), tag=tag,
                          save_latest=save_latest, keep_last=settings.keep_last,
                          trainer_state=trainer_state if rank0 else {}, rng_state=capture_rng(),
                          extra_files={**state.files, **hf_config_files(state.module, state.dtype)} if rank0 else {},
                          optimizer_meta=optimizer_meta if rank0 else {}, loco_state=capture_loco(state.loco))
        except Exception as caught:  # noqa: BLE001
            error = caught
        self._agree([describe_error(error)], f"cannot save checkpoint {tag}", error)
        path = os.path.join(os.path.abspath(save_dir), tag)
        if not async_save:
            try:
                job.run()
            except CheckpointError as failed:
                self._fail(failed)
                return None
            self.last_stall_seconds, self.last_fence_seconds = time.perf_counter() - started, 0.0
            return path
        self._error, self._result = None, None
        self._fence, self.last_fence_seconds = self.state.fences.open(), None
        self._thread = threading.Thread(target=self._run, args=(job, self._fence),
                                        name=f"zerotrain-checkpoint-{tag}")
        self._thread.start()
        self.last_stall_seconds = time.perf_counter() - started
        return path

    def claim(self, save_dir: str) -> None:
        """Take the save directory's lock for this job (rank 0), once; every rank raises if it is held."""
        path = os.path.abspath(save_dir)
        if path in self._locks:
            return
        lock, error = None, None
        if self.comm.rank == 0:
            try:
                lock = SaveDirLock(path)
                lock.acquire()
            except Exception as caught:  # noqa: BLE001 - agreed below
                error = caught
        self._agree([describe_error(error)], f"cannot write checkpoints to {path}", error)
        self._locks[path] = lock

    def close(self) -> None:
        """Wait for a pending save, then release the save directories' locks."""
        try:
            self.wait()
        finally:
            for lock in self._locks.values():
                if lock is not None:
                    lock.release()
            self._locks.clear()

    def _write(self, job: SaveJob) -> str:
        """The background thread's write and commit, once the snapshot is taken (a subclass may move it)."""
        return job.run()

    def _plan(self, state: CheckpointState, tag: str):
        """This rank's slots and the save plan (rebuilt only when some rank's layout changed)."""
        slots, layout, error = None, None, None
        try:
            slots = state.slots()
            if state.config.checkpoint.adapters_only:  # the trainable parameters only: no frozen ones
                slots = [slot for slot in slots if slot.master is not None]
            layout = local_layout(state, slots, self.comm.rank)
        except Exception as caught:  # noqa: BLE001
            error = caught
        views = self._agree([tag, layout_digest(layout) if layout is not None else None, describe_error(error)],
                            f"cannot save checkpoint {tag}", error)
        tags = [view[0] for view in views]
        if len(set(tags)) > 1:
            raise CheckpointError(f"ranks asked for different checkpoint tags: {tags}")
        key = (tuple(view[1] for view in views), self.max_file_bytes, self.round_bytes)
        plan = self._plans.get(key)
        if plan is None:
            plan = build_plan(self.comm.all_gather_object(layout), self.max_file_bytes, self.round_bytes)
            self._plans = {key: plan}
        self.last_plan = plan
        return slots, plan

    def _agree(self, view: list, what: str, error: Optional[BaseException]) -> list:
        """All-gather `view` (its last item: this rank's error or None); raise everywhere if any rank failed."""
        views = self.comm.all_gather_object(view)
        failures = [(rank, v[-1]) for rank, v in enumerate(views) if v[-1]]
        if failures:
            rank, message = failures[0]
            where = f" (rank {rank})" if self.comm.size > 1 else ""
            raise CheckpointError(f"{what}{where}: {message}") from error
        return views

    def _run(self, job: SaveJob, fence: SnapshotFence) -> None:
        try:
            try:
                job.sources.complete()  # the snapshot, before the next optimizer update (see fence)
            finally:
                fence.done()
            self._result = self._write(job)
        except BaseException as error:  # noqa: BLE001 - kept for the training thread to raise
            self._error = error

    # --- waiting and errors ----------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        """Block until the pending asynchronous save has committed; raise its error if it failed."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        self._raise()

    def fence(self) -> None:
        """Block until the pending save's snapshot copies are done (before anything changes the slots).

        Records the first fence's wait in `last_fence_seconds` (training stalls that long too).
        """
        fence = self._fence
        if fence is None:
            return
        fence.wait()
        self.last_fence_seconds = fence.waited_seconds
        self._fence = None  # copied: later fences have nothing to wait for

    def raise_if_failed(self) -> None:
        """Called by every engine.step(): raise a failed background save's error, on every rank at once.

        First fences: the optimizer update that follows must not change what the snapshot reads.
        """
        if self._thread is None:
            return
        self.fence()
        code = _RUNNING if self._thread.is_alive() else (_FAILED if self._error is not None else _DONE)
        if self.world.size > 1:
            value = torch.tensor([float(code)], device=self.state.topology.device)
            self.world.all_reduce(value, op=dist.ReduceOp.MAX)
            code = int(value.item())
        if code == _RUNNING:
            return
        self.wait()  # done everywhere, or failed somewhere: then it failed everywhere (the outcome is agreed)

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                failure = CheckpointError(str(error))
            else:
                failure = CheckpointError(f"asynchronous checkpoint save failed: {type(error).__name__}: {error}")
            failure.__cause__ = error
            self._fail(failure)

    def _fail(self, error: CheckpointError) -> None:
        """Raise a failed save's error, or (checkpoint.on_save_error "warn") log it and let training go on."""
        if self.state.config.checkpoint.on_save_error == "warn":
            logger.warning("checkpoint save failed; training goes on (checkpoint.on_save_error: warn): %s", error)
            warnings.warn(f"checkpoint save failed; training goes on: {error}", RuntimeWarning,
                          stacklevel=stacklevel_outside())
            return
        raise error


def save_checkpoint(checkpointer: Checkpointer, save_dir: str, tag: Optional[str] = None,
                    client_state: Optional[dict] = None, save_latest: bool = True,
                    async_save: Optional[bool] = None) -> str:
    """Write a checkpoint of the state `checkpointer` was made for (call on every rank); see
    zerotrain.checkpoint for the format."""
    with checkpointer.state.resident(False):  # NVMe-offloaded states and parameters paged in, not written back
        return checkpointer.save(save_dir, tag, client_state or {}, save_latest, async_save)
