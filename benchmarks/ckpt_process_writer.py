"""Benchmark-only: an asynchronous checkpoint writer in a separate process (issue #4, "thread or process").

zerotrain's asynchronous save writes from a background *thread* of the training process
(`zerotrain.checkpoint.checkpointer`). This module measures the alternative: the same
snapshot (the deferred copy of this rank's slots, run by a thread of the training process
before the next optimizer update, same fence) goes into host buffers in *shared memory*;
a writer process per rank then does everything else: the all-to-all of pieces between the
ranks' writers (over a gloo group of its own), the file writes, crc32, fsync and commit.
Only the handles of the shared buffers cross the pipe, not the bytes.

    ProcessWriterCheckpointer(engine.checkpoint_state())   # set as engine.checkpointer before the first save

Not a supported engine feature: no crash-test hooks, and the worker lives as long as the
training process (a daemon).
"""
from __future__ import annotations

import datetime
import multiprocessing
import socket
import time

import torch

from zerotrain.checkpoint.checkpointer import Checkpointer
from zerotrain.checkpoint.format import CheckpointError
from zerotrain.checkpoint.snapshot import HostBuffers
from zerotrain.checkpoint.write import SaveJob, describe_error


class SharedHostBuffers(HostBuffers):
    """Host buffers in shared memory, so that another process maps them instead of receiving a copy."""

    def get(self, key, numel: int, dtype: torch.dtype) -> torch.Tensor:
        before = self.allocations
        buffer = super().get(key, numel, dtype)
        if self.allocations != before:
            buffer.share_memory_()
        return buffer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _writer_main(connection, rank: int, world: int, port: int, timeout_seconds: float) -> None:
    """The writer process: join the writers' gloo group, then run every SaveJob it is sent."""
    import torch.distributed as dist

    from zerotrain.comm import Comm
    torch.set_num_threads(1)
    comm = Comm(None, 0, 1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_seconds))
        comm = Comm(dist.group.WORLD, rank, world)
    connection.send("ready")
    while True:
        job = connection.recv()
        if job is None:
            break
        job.comm = comm
        try:
            connection.send(("ok", job.run()))
        except BaseException as error:  # noqa: BLE001 - reported to the training process
            connection.send(("error", describe_error(error)))
        del job  # drop the mappings of the shared buffers before the next save
    if world > 1:
        dist.destroy_process_group()


class ProcessWriterCheckpointer(Checkpointer):
    """The engine's checkpointer with the write and commit of asynchronous saves moved to a writer process."""

    def __init__(self, state) -> None:
        super().__init__(state)
        self.buffers = SharedHostBuffers()
        self.last_send_seconds = 0.0
        port = self.comm.all_gather_object(_free_port() if self.comm.rank == 0 else None)[0]
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._process = context.Process(target=_writer_main, daemon=True, name=f"zerotrain-writer-{self.comm.rank}",
                                        args=(child_end, self.comm.rank, self.comm.size, port,
                                              state.topology.timeout_seconds or 1800.0))
        self._process.start()
        child_end.close()
        if self._connection.recv() != "ready":
            raise CheckpointError(f"rank {self.comm.rank}: the checkpoint writer process did not start")

    def _write(self, job: SaveJob) -> str:
        """Hand the job (its snapshot: shared-memory handles) to the writer process; wait for its outcome."""
        job.comm = None
        started = time.perf_counter()
        self._connection.send(job)
        self.last_send_seconds = time.perf_counter() - started  # pickling the job: buffer handles, not bytes
        status, value = self._connection.recv()
        if status != "ok":
            raise CheckpointError(value)
        return value

    def close(self) -> None:
        """Stop the writer process (after any pending save)."""
        self.wait()
        if self._process.is_alive():
            self._connection.send(None)
            self._process.join(timeout=60)

