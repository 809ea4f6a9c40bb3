"""The NVMe offload step's pipeline (`nvme.py`): records streamed through the buffer pool, and kept between steps.

A step is bound by the disk: the Adam update of a 4M-element chunk takes a few milliseconds,
its record (fp32 master + exp_avg + exp_avg_sq, 48 MiB) a few tens to read and to write. So
the pipeline reads ahead as far as the pool allows (`pool.count` records in flight), updates a
chunk as soon as its read is done, and writes it behind while the next ones are read.

Kept records: after a committed step, the buffers of the last `pool.count - 1` chunks still hold
exactly what was just written as their chunks' current records. Instead of giving them back to the pool
(where they would only be overwritten), the step keeps them (`records.kept`), and the next step updates
those chunks first, without reading them: their reads vanish from the disk's work and the update
starts at once, while the reads of the other chunks are already in flight. One buffer always
stays free, so paging, publishing and rollback can still take one. It costs no memory (the pool
is allocated anyway). A kept record is dropped whenever its chunk's current record changes
outside a step (`records.drop_kept`: a master written from outside, records written back from memory)
and after a step that did not commit; a step that fails therefore reads everything from disk
again, exactly as before the kept records existed.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional

import torch

from .nvme_records import Chunk, GradientSpill, NvmeRecords

# update one chunk in its buffer: (chunk, buffer, the chunk's gradient, multiplier, scalars by bucket)
StepChunk = Callable[[Chunk, torch.Tensor, torch.Tensor, float, dict], None]


class NvmeStream:
    """The streaming step of `NvmeOffloadOptimizer` (its member `stream`) over its records."""

    def __init__(self, records: NvmeRecords):
        self.records = records

    def run(self, chunks: list[Chunk], grad_shards, multiplier: float, step_chunk: StepChunk, stepped: list[Chunk],
            keep: dict[Chunk, torch.Tensor], scalars: dict, pending: list[tuple[Chunk, int]],
            committed: list[Chunk], in_flight: Optional[dict[Chunk, Future]] = None, keep_tail: bool = True,
            wait: bool = True, spill: Optional[GradientSpill] = None) -> None:
        """Read, update with `step_chunk` (which publishes and fills `scalars`) and write `chunks` to free
        extents, appending each to `stepped` before it changes.

        Kept records go first and are not read. The written records are left in `pending` as (chunk,
        extent), for the caller to commit or abort; where a size class has no free extent, its oldest
        pending record is waited for and committed at once (appended to `committed`). The buffers of
        the last `pool.count - 1` chunks, written, go into `keep` (the caller keeps them only when the
        step commits) unless not `keep_tail`. `in_flight` (chunk -> its write) is shared by the runs of one
        step (gradients streamed bucket by bucket); without `wait` the writes are left in flight there. On
        failure every I/O of this run is waited for, every buffer goes back to the pool and the error is
        raised; the index holds the committed chunks only. The gradient of a chunk in `spill.ready` (clipping
        with the gradients spilled to disk during backward) is read from the spill file into its buffer's
        gradient region alongside the record; the others' come from `grad_shards`."""
        records, pool, io = self.records, self.records.pool, self.records.io
        held = {chunk: (records.kept.pop(chunk), None) for chunk in chunks if chunk in records.kept}
        held.update({chunk: records.prefetched.pop(chunk) for chunk in chunks if chunk in records.prefetched})
        records.drop_kept()  # records of chunks not stepped now: their buffers serve this step's reads
        order = [c for c in chunks if c in held] + [c for c in chunks if c not in held]
        fetched: dict[int, tuple[torch.Tensor, Optional[Future]]] = {
            position: held[chunk] for position, chunk in enumerate(order[:len(held)])}
        writes: list[Future] = []
        in_flight = {} if in_flight is None else in_flight  # the pending records' writes
        keeping: dict[Chunk, torch.Tensor] = {}  # the tail's buffers: not released when written
        keep_from = len(order) - (pool.count - 1) if keep_tail else len(order)
        holding, ahead = None, len(held)  # holding: (buffer, its read) of the chunk being updated
        spilled = spill.ready if spill is not None else set()
        grad_reads: dict[int, Future] = {}  # position -> the read of its spilled gradient
        for position, chunk in enumerate(order[:len(held)]):
            if chunk in spilled:
                grad_reads[position] = spill.read(chunk, fetched[position][0])
        try:
            for k, chunk in enumerate(order):
                while ahead < len(order) and ahead - k < pool.count:
                    buffer = pool.acquire(block=ahead == k)  # blocks only on writes behind: they free buffers
                    if buffer is None:
                        break
                    following = order[ahead]
                    fetched[ahead] = (buffer, io.read(records.fd, records.current(following),
                                                      records.record(following, buffer)))
                    if following in spilled:
                        grad_reads[ahead] = spill.read(following, buffer)
                    ahead += 1
                holding = fetched.pop(k)
                if holding[1] is not None:
                    holding[1].result()
                if k in grad_reads:
                    grad_reads.pop(k).result()
                    grad = spill.gradient(chunk, holding[0])
                else:
                    grad = grad_shards[chunk.bucket].narrow(0, chunk.start, chunk.numel)
                for future in writes:
                    if future.done() and future.exception() is not None:
                        raise future.exception()
                stepped.append(chunk)
                step_chunk(chunk, holding[0], grad, multiplier, scalars)
                buffer = holding[0]
                release = None if k >= keep_from else (lambda b=buffer: pool.release(b))
                extent = records.claim(chunk)
                while extent is None:  # the ring of this size is used up: commit its oldest pending record
                    position = next(i for i, (c, _) in enumerate(pending) if c.size_class == chunk.size_class)
                    early, early_extent = pending[position]
                    # pending until its write is done: a failed write leaves it there, for the caller to abort
                    # (its extent back to the ring), not committed
                    in_flight.pop(early).result()
                    pending.pop(position)
                    records.commit(early, early_extent)
                    committed.append(early)
                    extent = records.claim(chunk)
                pending.append((chunk, extent))
                writes.append(io.write(records.fd, records.extent_offsets[extent], records.record(chunk, buffer),
                                       done=release))
                in_flight[chunk] = writes[-1]
                if k >= keep_from:
                    keeping[chunk] = buffer
                holding = None
            for future in writes if wait else ():
                future.result()
        except BaseException:
            _quietly_wait(grad_reads.values())
            for buffer, future in list(fetched.values()) + ([holding] if holding is not None else []):
                if future is not None:
                    _quietly_wait([future])
                pool.release(buffer)
            _quietly_wait(writes)
            for buffer in keeping.values():
                pool.release(buffer)
            raise
        keep.update(keeping)


    def prefetch(self, chunks: list[Chunk]) -> None:
        """Start reading the current records of `chunks` (the next buckets a streamed step expects) into the
        buffers free now, in order, while the backward computes; `run` takes them as it takes kept records."""
        records = self.records
        for chunk in chunks:
            if chunk in records.prefetched or chunk in records.kept or chunk in records.resume:
                continue
            if records.pool.free_count() <= 1:  # one buffer stays free for the run that comes first
                return
            buffer = records.pool.acquire(block=False)
            if buffer is None:
                return
            records.prefetched[chunk] = (buffer, records.io.read(records.fd, records.current(chunk),
                                                                 records.record(chunk, buffer)))


def _quietly_wait(futures) -> None:
    for future in futures:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - the first error is the one raised
            pass
